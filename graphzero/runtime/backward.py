"""The compiled forward and backward as the run time calls them.

A collective cannot be skipped at run time, so a backward whose engines may keep their gradients
(runtime/state.py) is compiled in variants, one per combination of its engines' modes, each when
first needed. `Backward` picks the variant per call; `GraphBackward` calls it with each engine's
run-time inputs (fetched per call: an optimizer step replaces or zeroes them) and tells each
engine's state afterwards. The variant is part of its collective plan, which the ranks compare
before running it: where they differ, the backward goes on with the variant that keeps every
engine's gradients locally (scope.py). A lazily compiled variant runs under the tracing and
compile contexts AOT autograd saved, as AOT does for its own lazy backward compile.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import rank_agreement
from ..autograd_semantics import AccumulationProbe
from ..errors import GraphZeroError
from ..ownership import ParamSet
from ..passes import Mode, PassContext
from . import scope
from .state import EngineState, Position

Modes = dict[ParamSet, Mode]


def label(modes: Modes) -> str:
    """The variant's name in logs and dumps. ZeRO-1/2: "accumulate", "boundary", or
    "boundary-<engines>" when only some engines reduce their partial sums; ZeRO-3 engines add
    "hold-<engines>" / "release-<engines>"; "reduce" when nothing differs from the plain backward."""
    flat = {ps: m for ps, m in modes.items() if m is not Mode.REDUCE and not any(g.presharded for g in ps.groups)}
    parts = []
    if flat:
        flushing = [ps.name for ps, mode in flat.items() if mode is Mode.REDUCE_PARTIAL]
        parts.append("accumulate" if not flushing else "boundary" if len(flushing) == len(flat)
                     else "boundary-" + "-".join(flushing))
    for mode, word in ((Mode.KEEP, "hold"), (Mode.REDUCE_PARTIAL, "release")):
        names = [ps.name for ps, m in modes.items() if m is mode and ps not in flat]
        if names:
            parts.append(word + "-" + "-".join(names))
    return "_".join(parts) or "reduce"


class CountForwards:
    """A compiled training forward that counts itself for each engine's parameters it reaches."""

    def __init__(self, compiled, positions: dict[EngineState, tuple[Position, ...]]) -> None:
        # In the instance dict: dynamo's disable() wrapper copies __dict__, not class attributes.
        self._boxed_call = True
        self.compiled = compiled
        self.positions = positions

    def __call__(self, args: list) -> object:
        out = self.compiled(args)
        for state, positions in self.positions.items():
            scope.forward_ran(state, positions)
        return out


class Backward:
    """A boxed backward that dispatches on the mode of each of its engines."""

    def __init__(self, positions: dict[EngineState, tuple[Position, ...]], layouts: dict[EngineState, ParamSet],
                 compile_variant: Callable[[Modes], Callable], compiled: dict[tuple[Mode, ...], Callable]) -> None:
        self._boxed_call = True   # in the instance dict: dynamo's disable() wrapper copies __dict__
        self.positions = dict(positions)   # engine -> the positions of its parameters this graph reaches
        # engine -> the layout this graph was compiled with: a later attach renames the engine and
        # gives its state a new layout object, which the graph's passes would not recognise
        self.layouts = dict(layouts)
        self._compile_variant = compile_variant
        self.compiled = dict(compiled)
        self._tracing = torch._guards.TracingContext.try_get()
        self._compile = torch._guards.CompileContext.try_get()

    def variant(self, key: tuple[Mode, ...]) -> Callable:
        fn = self.compiled.get(key)
        if fn is None:
            modes = {self.layouts[state]: mode for state, mode in zip(self.positions, key)}
            with torch._guards.tracing(self._tracing), torch._guards.compile_context(self._compile):
                fn = self.compiled[key] = self._compile_variant(modes)
        return fn

    def __call__(self, args: list[Any]) -> Any:
        backward = scope.current()   # opens this backward's scope (and abandons one whose backward raised)
        for state, positions in self.positions.items():
            state.backward_reaches(positions)
        fn = self.variant(tuple(state.mode(positions) for state, positions in self.positions.items()))
        fn.check()
        if fn.agree(backward):
            return fn.run(args, backward)
        # the ranks ran different graphs: keep every engine's gradients locally, the scope's end reduces them
        return self.variant((Mode.KEEP,) * len(self.positions)).run(args, backward)


class GraphBackward:
    """One compiled backward variant, called with each engine's run-time inputs appended."""

    def __init__(self, compiled, ctx: PassContext, states: dict[ParamSet, EngineState], graph_id: str,
                 fault_timeout_s: float | None) -> None:
        self._boxed_call = True
        self.compiled = compiled
        self.slots = list(ctx.runtime_inputs)
        layouts = list(dict.fromkeys(s.param_set for s in self.slots))
        self.states = {ps: states[ps] for ps in layouts}
        self.modes = {ps: ctx.modes.get(ps, Mode.REDUCE) for ps in layouts}
        self.present = {ps: [g.owned.param for g in ctx.grads if g.owned.param_set is ps] for ps in layouts}
        partial = {ps: ctx.partial_grads.get(ps, []) for ps in layouts}
        self.positions = {ps: tuple((o.group, o.position) for o in partial[ps]) for ps in layouts}
        # The tensor hooks each owned parameter had when this graph was compiled: a hook added or
        # removed since would be dropped or run wrongly.
        self.hooks_compiled = [(g.owned.param, g.owned.qualname, _hook_ids(g.owned.param)) for g in ctx.grads]
        # the leaves autograd would accumulate into: the reduced ones, and those kept for later
        reached = {ps: list({id(o): o for o in [g.owned for g in ctx.grads if g.owned.param_set is ps]
                             + (partial[ps] if self.modes[ps] is Mode.KEEP else [])}.values()) for ps in layouts}
        self.probe = AccumulationProbe({ps: [(o.leaf if o.leaf is not None else o.param, o.qualname) for o in owned]
                                        for ps, owned in reached.items()})
        self.what = f"graph {graph_id} (engines {[ps.name for ps in layouts]})"
        # One exchange per data-parallel group (usually all engines share one).
        self.groups = list({ps.group_name: ps.process_group for ps in layouts}.items())
        self.fingerprint = rank_agreement.fingerprint(ctx.collective_plan)
        # ZeRO-3 gathers in the backward: collectives in every variant (no local fallback)
        self.gathers = any(entry[0] == "bwd" for entry in ctx.zero3_plan)
        self.fault_timeout_s = fault_timeout_s

    def check(self) -> None:
        """Refuse to run a graph whose engines or parameter hooks changed since it was compiled."""
        detached = [state.name for state in self.states.values() if state.detached]
        if detached:
            raise GraphZeroError(f"engine(s) {detached} were detached from graphzero after this graph was compiled; "
                                 "call torch._dynamo.reset() or compile the step again")
        changed = [name for param, name, ids in self.hooks_compiled if _hook_ids(param) != ids]
        if changed:
            raise GraphZeroError(
                f"the tensor hooks (register_hook) of parameter(s) {changed} changed after {self.what} was "
                "compiled, and the graph reduces their gradients where no new hook can run; register parameter "
                "hooks before the first call of the compiled step, or call torch._dynamo.reset() to compile it "
                "again")

    def agree(self, backward: scope.BackwardScope) -> bool:
        """Whether every rank runs this variant now (False: the backward keeps its gradients locally)."""
        return backward.agree(self.fingerprint, not self.gathers, self.groups, self.what, self.fault_timeout_s)

    def __call__(self, args: list[Any]) -> Any:
        """A graph without variants (no trained engine: it reduces nothing, so it also runs where the
        ranks ran different graphs, unless it gathers)."""
        backward = scope.current()
        self.check()
        self.agree(backward)
        return self.run(args, backward)

    def run(self, args: list[Any], backward: scope.BackwardScope) -> Any:
        if backward.diverged is not None and self.gathers:
            backward.abort(self.what)
        accumulating = self.probe.accumulating()
        calls = {ps: state.before_graph([s for s in self.slots if s.param_set is ps], self.modes[ps],
                                        self.positions[ps], self.present[ps], accumulating[ps])
                 for ps, state in self.states.items()}
        args.extend(calls[slot.param_set].tensor(slot) for slot in self.slots)
        with rank_agreement.collective_failures(self.what):
            out = self.compiled(args)
        for ps, state in self.states.items():
            state.after_graph(calls[ps])
            backward.reach(state)
        return out


class ForwardWithAgreement:
    """A compiled forward that gathers ZeRO-3 parameters, after the ranks agree on the gather plan
    (a recompute inside a backward in which the ranks ran different graphs cannot gather: it raises
    on every rank, scope.py)."""

    def __init__(self, compiled, plan: list[tuple], groups: list[tuple[str, object]], what: str,
                 timeout_s: float | None) -> None:
        # In the instance dict: dynamo's disable() wrapper copies __dict__, not class attributes.
        self._boxed_call = True
        self.compiled = compiled
        self.fingerprint = rank_agreement.fingerprint(plan)
        self.groups = groups
        self.what = what
        self.timeout_s = timeout_s

    def __call__(self, args: list) -> object:
        backward = scope.running()
        if backward is not None and backward.diverged is not None:
            backward.abort(self.what)
        for _, group in self.groups:
            rank_agreement.agree(self.fingerprint, group, self.what, self.timeout_s)
        with rank_agreement.collective_failures(self.what):
            return self.compiled(args)


def _hook_ids(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param._backward_hooks or ())
