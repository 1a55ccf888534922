"""What the passes share: the pass context and one helper that inserts FX nodes, each with its fake
value in ``meta["val"]`` and ``meta["graphzero"] = {"pass", "engine", "why"}`` for the dump.
"""
from __future__ import annotations

import dataclasses
import enum
import keyword
import re
from collections import defaultdict
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map

from ..ownership import OwnedInput, Ownership, ParamSet

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


class Mode(enum.Enum):
    """How one graph's backward treats one engine's gradients (chosen per call: runtime/state.py)."""

    REDUCE = "reduce"                  # reduce them (the plain backward)
    KEEP = "keep"                      # add them into the engine's partial sums, reduce nothing
    REDUCE_PARTIAL = "reduce_partial"  # reduce them together with their partial sums


class Slot(enum.Enum):
    """What the run time passes for a placeholder a pass appended to the backward graph."""

    SINK = "sink"        # key: param group; the shard buffer the optimizer reads
    SCALE = "scale"      # key: None; the 0-d fp32 averaging factor of this call
    PARTIAL = "partial"  # key: param group (ZeRO-1/2, flat) or (group, position) (ZeRO-3); a partial sum
    NORM = "norm"        # key: None; one fp32 squared norm per param group (fold_norm)


@dataclasses.dataclass(frozen=True, eq=False)
class RuntimeInput:
    """One appended placeholder: its kind, engine and key."""

    kind: Slot
    param_set: ParamSet
    key: Any = None


@dataclasses.dataclass
class GradOutput:
    """An owned parameter's gradient among the backward graph's outputs."""

    slot: int
    node: fx.Node
    owned: OwnedInput


@dataclasses.dataclass
class Bucket:
    """One collective: for every shard s of a flat group, the range [s*S + lo, s*S + hi)."""

    param_set: ParamSet
    group: int
    lo: int
    hi: int
    members: list[GradOutput]

    @property
    def chunk_numel(self) -> int:
        return self.hi - self.lo


@dataclasses.dataclass
class PassContext:
    """Everything a pass may read or extend; passes never reach outside it."""

    ownership: Ownership
    fake_mode: Any
    overlap: bool = True
    collective: str = "auto"
    bucket_size: int | None = None   # elements per collective; None: each engine's own setting
    grads: list[GradOutput] = dataclasses.field(default_factory=list)
    buckets: list[Bucket] = dataclasses.field(default_factory=list)
    # bucket index -> node holding this rank's reduced chunk of that bucket
    reduced: dict[int, fx.Node] = dataclasses.field(default_factory=dict)
    # placeholders appended to the backward graph, in order (the run time supplies each per call)
    runtime_inputs: list[RuntimeInput] = dataclasses.field(default_factory=list)
    # the variant being compiled: engines whose gradients are kept or reduced with partial sums
    modes: dict[ParamSet, Mode] = dataclasses.field(default_factory=dict)
    # per engine with a mode, the owned inputs whose gradients went into or came with a partial sum
    partial_grads: dict[ParamSet, list[OwnedInput]] = dataclasses.field(default_factory=dict)
    # engines whose optimizer step reads the squared gradient norm folded into the backward (fold_norm)
    folds_norm: frozenset[ParamSet] = frozenset()
    # per ParamSet (by identity: two engines may share a name): counters the dump reports
    stats: dict[ParamSet, dict[str, Any]] = dataclasses.field(default_factory=lambda: defaultdict(dict))
    # ZeRO-3 collectives in graph order ("fwd"/"bwd" gathers, "grad" reduce-scatters):
    # (side, engine, group, world, ((param, shard numel), ...)); nothing rank-specific
    zero3_plan: list[tuple] = dataclasses.field(default_factory=list)
    # (param set, group) -> that group's accumulated shard (fp32_accumulate), for fold_norm
    accumulated: dict[tuple[ParamSet, int], fx.Node] = dataclasses.field(default_factory=dict)
    # ZeRO-3: the same per parameter, in group order; only when every parameter has a gradient here
    accumulated_pieces: dict[tuple[ParamSet, int], list[fx.Node]] = dataclasses.field(default_factory=dict)

    @property
    def collective_plan(self) -> list[tuple]:
        """What this graph reduces, in order, with nothing rank-specific: ranks compare it before
        reducing (rank_agreement.py)."""
        # The variant is part of the plan: ranks that disagree on the boundary raise, not hang.
        # So are the parameters a variant keeps or reduces with their sums: ranks keeping different
        # ones hold different sums (runtime/scope.py then reduces their union).
        return [(b.param_set.name, b.group, b.lo, b.hi, str(b.param_set.comm_dtype), self.collective)
                for b in self.buckets] + list(self.zero3_plan) + [
                    ("partial", ps.name, mode.value, tuple(sorted({(o.group, o.position)
                                                                   for o in self.partial_grads.get(ps, [])})))
                    for ps, mode in self.modes.items()]

    def count(self, param_set: ParamSet, key: str, amount: int = 1) -> None:
        self.stats[param_set][key] = self.stats[param_set].get(key, 0) + amount

    def grads_of(self, param_set: ParamSet, group: int) -> list[GradOutput]:
        return [g for g in self.grads if g.owned.param_set is param_set and g.owned.group == group]


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(iter(gm.graph.find_nodes(op="output")))


def drop_outputs(gm: fx.GraphModule, slots: list[int]) -> None:
    """Return None in place of the graph outputs at ``slots``, and unmark them as user visible
    (``user_visible_output_idxs``): on a GPU inductor's padding pass reads every marked output as a
    node, and a marked None crashed the first compile."""
    out = output_node(gm)
    values = list(out.args[0])
    for slot in slots:
        values[slot] = None
    out.args = (tuple(values),) + tuple(out.args[1:])
    if "user_visible_output_idxs" in out.meta:
        out.meta["user_visible_output_idxs"] = [
            i for i in out.meta["user_visible_output_idxs"] if i < len(values) and isinstance(values[i], fx.Node)]


class Inserter:
    """Appends nodes after a moving cursor, giving each its fake value and graphzero metadata."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, pass_name: str, after: fx.Node) -> None:
        self.graph = gm.graph
        self.ctx = ctx
        self.pass_name = pass_name
        self.cursor = after

    def call(self, target, args: tuple, kwargs: dict | None = None, *, engine: str, why: str) -> fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_after(self.cursor):
            node = self.graph.call_function(target, args, kwargs)
        self.cursor = node
        vals, kvals = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (args, kwargs))
        with self.ctx.fake_mode:
            node.meta["val"] = target(*vals, **kvals)
        node.meta["graphzero"] = {"pass": self.pass_name, "engine": engine, "why": why}
        return node

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device, *, engine: str, why: str) -> fx.Node:
        return self.call(torch.ops.aten.full.default, ([numel], 0.0),
                         {"dtype": dtype, "device": device, "pin_memory": False}, engine=engine, why=why)


def placeholder_target(graph: fx.Graph, name: str) -> str:
    """``name`` as a placeholder target FX accepts: an identifier unique in the graph (other
    characters become ``_``, a taken name gets ``_1``, ``_2``, ...)."""
    ident = re.sub(r"\W", "_", name, flags=re.ASCII)
    if not ident.isidentifier() or keyword.iskeyword(ident):
        ident = "_" + ident
    taken = {n.name for n in graph.nodes} | {n.target for n in graph.find_nodes(op="placeholder")}
    target, k = ident, 0
    while target in taken:
        k += 1
        target = f"{ident}_{k}"
    return target


def append_placeholder(gm: fx.GraphModule, ctx: PassContext, pass_name: str, name: str, val: torch.Tensor,
                       kind: Slot, ps: ParamSet, key: Any, why: str) -> fx.Node:
    """A new last placeholder whose real tensor the runtime supplies on every call (recorded in
    ``ctx.runtime_inputs``); ``val`` is its fake value."""
    last = list(gm.graph.find_nodes(op="placeholder"))[-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(placeholder_target(gm.graph, name))
    node.meta["val"] = val
    node.meta["graphzero"] = {"pass": pass_name, "engine": ps.name, "why": why}
    ctx.runtime_inputs.append(RuntimeInput(kind, ps, key))
    return node


def shard_grad_reductions(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[fx.Node, fx.Node, object]]:
    """(reduce_scatter, wait, owned input) of every ZeRO-3 shard gradient among the outputs, in
    graph order of the reduce-scatters."""
    out = output_node(gm)
    descs = out.meta.get("desc") or ()
    found = []
    for value, desc in zip(out.args[0], descs):
        idx = getattr(getattr(desc, "grad_of", None), "idx", None)
        owned = ctx.ownership.inputs.get(idx) if idx is not None else None
        if owned is None or not owned.shard or not isinstance(value, fx.Node):
            continue
        if value.target is not c10d.wait_tensor.default or len(value.users) != 1:
            continue
        rs = value.args[0]
        if rs.target is c10d.reduce_scatter_tensor.default and len(rs.users) == 1:
            found.append((rs, value, owned))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(found, key=lambda t: order[t[0]])


_HOISTABLE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.constant_pad_nd.default,
              aten.clone.default, torch.ops.prims.convert_element_type.default}


def hoist(gm: fx.GraphModule, node: fx.Node) -> None:
    """Move ``node`` (and the single-use views/pads feeding it) up to just after its inputs: AOT
    places the gathers' reduce-scatters and their flattening views at the end of the backward,
    which would keep every full-size gradient alive until then."""
    for a in node.all_input_nodes:
        if a.op == "call_function" and a.target in _HOISTABLE and len(a.users) == 1:
            hoist(gm, a)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inputs = node.all_input_nodes
    if inputs:
        latest = max(inputs, key=order.__getitem__)
        if latest.op != "placeholder" and order[latest] + 1 < order[node]:
            latest.append(node)


def last_in_order(gm: fx.GraphModule, nodes: list[fx.Node]) -> fx.Node:
    """The node among `nodes` that comes last in the graph (insertion point after all of them)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return max(nodes, key=order.__getitem__)
