"""fp32_accumulate: add each rank's reduced shard into the buffer its engine's optimizer reads.

Per (engine, param group) it appends a placeholder for the "sink" (the optimizer's fp32 gradient
partition or buffer), per engine one for the averaging factor (normally 1/(world*gas)), and
before the output inserts:

  cat(reduced chunks, zeros where no bucket landed) -> accumulation dtype -> x factor -> add to the
  sink -> ``aten.copy_`` into the sink.

ZeRO-3 groups are accumulated per parameter right after its bucket's wait, into the sink's slice,
so no reduced shard outlives its bucket (as DeepSpeed adds each bucket when it completes). A flushed
local sum (local_accumulate) is not scaled again. The owned gradients are removed from the graph's
outputs, so autograd keeps no full-size ``.grad``.
"""
from __future__ import annotations

import torch
from torch import fx

from ..ownership import ParamSet
from ._graph import (
    Inserter,
    Mode,
    PassContext,
    RuntimeInput,
    Slot,
    drop_outputs,
    output_node,
    placeholder_target,
)
from .contract import pass_contract

PASS = "fp32_accumulate"
aten = torch.ops.aten


def _bucket_pieces(ins: Inserter, ctx: PassContext, ps: ParamSet, g: int, shard: int,
                   device: torch.device) -> list[fx.Node]:
    """This rank's reduced chunks of the group's buckets in shard order, zeros where none landed."""
    chunks = sorted(((ctx.buckets[b].lo, ctx.buckets[b].hi, node) for b, node in ctx.reduced.items()
                     if ctx.buckets[b].param_set is ps and ctx.buckets[b].group == g), key=lambda t: t[0])
    pieces, cursor = [], 0
    for lo, hi, node in chunks:
        if lo > cursor:
            pieces.append(ins.zeros(lo - cursor, ps.comm_dtype, device, engine=ps.name, why="no bucket here"))
        pieces.append(node)
        cursor = hi
    if cursor < shard:
        pieces.append(ins.zeros(shard - cursor, ps.comm_dtype, device, engine=ps.name, why="no bucket here"))
    return pieces


def _add_into(ins: Inserter, ps: ParamSet, target: fx.Node, delta: fx.Node, scale: fx.Node | None,
              what: str) -> fx.Node:
    """Add ``delta`` (upcast, scaled unless already) to ``target`` (the sink or a slice of it) and
    write it back; returns a node reading ``target`` as written, for fold_norm. The whole sink is
    written with ``_foreach_copy_``, which inductor lowers straight into the sink; its ``copy_``
    lowering would materialise the sum first (a write and a read of the shard more)."""
    if ps.comm_dtype != ps.accum_dtype:
        delta = ins.call(torch.ops.prims.convert_element_type.default, (delta, ps.accum_dtype), engine=ps.name,
                         why=f"upcast reduced shard to {ps.accum_dtype}")
    if scale is not None:
        delta = ins.call(aten.mul.Tensor, (delta, scale), engine=ps.name,
                         why=f"average: 1/(world {ps.world_size} x gas)")
    total = ins.call(aten.add.Tensor, (target, delta), engine=ps.name, why=f"accumulate into {what}")
    why = f"write {what}, which step() reads"
    if target.op != "placeholder":
        return ins.call(aten.copy_.default, (target, total), engine=ps.name, why=why)
    ins.call(aten._foreach_copy_.default, ([target], [total]), engine=ps.name, why=why)
    return ins.call(aten.alias.default, (target,), engine=ps.name, why=f"{what} as written")


def _accumulate_presharded(gm: fx.GraphModule, ctx: PassContext, ps: ParamSet, g: int, sink: fx.Node,
                           scale: fx.Node | None) -> None:
    """ZeRO-3: add each parameter's reduce-scattered shard gradient into its slice of the sink, right
    where it becomes available (the reduced shard dies with its bucket); parameters without a
    gradient in this graph are left as they are. The sums written are fold_norm's pieces."""
    group = ps.groups[g]
    written: dict[int, fx.Node] = {}
    for grad in ctx.grads_of(ps, g):
        k = grad.owned.position
        after = grad.node
        if after.op == "placeholder":
            # computed in the forward graph (torch 2.11's partitioner does this for ZeRO-3 reduced
            # shards): add it after every input, the sink included
            after = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        ins = Inserter(gm, ctx, PASS, after=after)
        x = grad.node
        if x.meta["val"].dtype != ps.comm_dtype:
            x = ins.call(torch.ops.prims.convert_element_type.default, (x, ps.comm_dtype), engine=ps.name,
                         why=f"cast shard grad of {grad.owned.qualname} to {ps.comm_dtype}")
        lo = group.offsets[k]
        view = ins.call(aten.slice.Tensor, (sink, 0, lo, lo + group.shard_numel_of(k)), engine=ps.name,
                        why=f"{group.names[k]}'s piece of the {ps.accum_dtype} partition")
        written[k] = _add_into(ins, ps, view, x, scale, f"{group.names[k]}'s piece of the partition")
    if len(written) == len(group.params):
        ctx.accumulated_pieces[(ps, g)] = [written[k] for k in range(len(group.params))]


@pass_contract(requires={"grads", "flat partial sums", "reduced"},
               provides={"accumulated", "owned grads out of outputs"})
def fp32_accumulate(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    out = output_node(gm)
    placeholders = list(graph.find_nodes(op="placeholder"))
    anchor = placeholders[-1]
    targets = []
    for bucket in ctx.buckets:
        key = (bucket.param_set, bucket.group)
        if key not in targets:
            targets.append(key)
    for grad in ctx.grads:
        key = (grad.owned.param_set, grad.owned.group)
        if grad.owned.param_set.groups[grad.owned.group].presharded and key not in targets:
            targets.append(key)
    ins = Inserter(gm, ctx, PASS, after=out.prev)
    scales: dict[ParamSet, fx.Node] = {}

    def placeholder(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, kind: Slot,
                    ps: ParamSet, g: int | None, why: str) -> fx.Node:
        nonlocal anchor
        with graph.inserting_after(anchor):
            node = graph.placeholder(placeholder_target(graph, name))
        anchor = node
        with ctx.fake_mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
        node.meta["graphzero"] = {"pass": PASS, "engine": ps.name, "why": why}
        ctx.runtime_inputs.append(RuntimeInput(kind, ps, g))
        return node

    for ps, g in targets:
        group = ps.groups[g]
        shard = group.shard_numel(ps.world_size)
        device = ctx.grads_of(ps, g)[0].node.meta["val"].device
        sink = placeholder(f"graphzero_sink_{ps.name}_{g}", (shard,), ps.accum_dtype, device, Slot.SINK, ps, g,
                           f"{ps.accum_dtype} gradient shard of param group {g} ({shard} elements)")
        # local_accumulate already applied the factor to each micro-step's gradient
        prescaled = ctx.modes.get(ps) is Mode.REDUCE_PARTIAL and not group.presharded
        if ps not in scales and not prescaled:
            scales[ps] = placeholder(f"graphzero_scale_{ps.name}", (), torch.float32, device, Slot.SCALE, ps, None,
                                     f"averaging factor, normally 1/(world {ps.world_size} x gas)")
        scale = None if prescaled else scales[ps]
        if group.presharded:
            _accumulate_presharded(gm, ctx, ps, g, sink, scale)
        else:
            pieces = _bucket_pieces(ins, ctx, ps, g, shard, device)
            why = f"group {g}: shard of {len(ctx.grads_of(ps, g))} gradients"
            delta = pieces[0] if len(pieces) == 1 else ins.call(aten.cat.default, (pieces,), engine=ps.name, why=why)
            ctx.accumulated[(ps, g)] = _add_into(ins, ps, sink, delta, scale, f"the {ps.accum_dtype} shard")
        ctx.count(ps, "fp32_accumulate", len(ctx.grads_of(ps, g)))
    drop_outputs(gm, [grad.slot for grad in ctx.grads])
    # the shards as written have no reader until fold_norm: keep them
    readers = set(ctx.accumulated.values())
    graph.eliminate_dead_code(is_impure_node=lambda n: n in readers or n.is_impure())
    gm.recompile()
    return gm
