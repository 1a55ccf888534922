"""One compiled backward per mode of a graph's engines whose reduction depends on run time.

Every rank runs the same graph, so a collective cannot be skipped at run time; instead the
backward is compiled in variants, and each call picks one:

- ZeRO-1/2 (local_accumulation.py, passes/local_accumulate.py): ``"accumulate"`` (add into the
  engine's full-size local buffer, reduce nothing) on a ZeRO-1 non-boundary micro-step (gas > 1),
  or when this graph reaches every parameter of the engine and another graph of this backward will
  reach them all again; ``"flush"`` (reduce the local sum with this graph's gradients) at the
  boundary or when some of this graph's parameters have a local sum; ``"reduce"`` otherwise;
- ZeRO-3 (held_gradients.py, passes/hold_shard_grads.py): ``"hold"`` when another graph of this
  backward will reach every parameter of the engine this graph reaches, ``"release"`` when some of
  them are held, ``"reduce"`` otherwise.

Whether another graph will reach a parameter is counted per parameter (pending_backwards.py).

Which variant a backward needs is known only when it runs, so `BackwardVariants` picks it per
call and compiles each the first time it is needed (one for a graph that shares no parameter with
another graph of its backward, without gradient accumulation; usually two otherwise). The variant
is part of each variant's collective plan, so ranks that disagree raise a RankDisagreementError
instead of hanging.

A lazily compiled variant runs under the tracing and compile contexts saved when AOT autograd
compiled the backward, as AOT does for its own lazy backward compile.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .ownership import ParamSet

Modes = dict[ParamSet, str]


def label(modes: Modes) -> str:
    """The variant's name in logs and dumps. ZeRO-1: "accumulate", "boundary", or
    "boundary-<engines>" when only some engines are at their boundary; ZeRO-3 engines add
    "hold-<engines>" / "release-<engines>"; "reduce" when nothing differs from the plain backward."""
    local = {ps: m for ps, m in modes.items() if m in ("flush", "accumulate")}
    parts = []
    if local:
        flushing = [ps.name for ps, mode in local.items() if mode == "flush"]
        parts.append("accumulate" if not flushing else "boundary" if len(flushing) == len(local)
                     else "boundary-" + "-".join(flushing))
    for mode in ("hold", "release"):
        names = [ps.name for ps, m in modes.items() if m == mode]
        if names:
            parts.append(mode + "-" + "-".join(names))
    return "_".join(parts) or "reduce"


def mode_of(ps: ParamSet, positions: tuple[tuple[int, int], ...]) -> str:
    """This backward's mode of an engine whose parameters at ``positions`` the graph reaches (called
    once per backward of the graph: it counts)."""
    again = ps.backwards.reached_again(positions)
    if ps.held is not None:
        ps.held.drop_stale()
        if again:
            return "hold"
        return "release" if ps.held.pending.intersection(positions) else "reduce"
    if ps.local is None:
        return "reduce"
    # the local buffer is the engine's whole flat gradient: keep it for a graph reaching all of it
    if not ps.at_boundary() or (again and len(positions) == ps.num_params):
        return "accumulate"
    return "flush" if ps.local.pending.intersection(positions) or ps.defers_reduction() else "reduce"


class BackwardVariants:
    """A boxed backward that dispatches on `mode_of` each of its varying engines."""

    def __init__(self, varying: dict[ParamSet, tuple[tuple[int, int], ...]],
                 compile_variant: Callable[[Modes], Callable],
                 compiled: dict[tuple[str, ...], Callable] | None = None) -> None:
        self._boxed_call = True   # in the instance dict: dynamo's disable() wrapper copies __dict__
        self.varying = dict(varying)   # engine -> the positions of its parameters this graph reaches
        self._compile_variant = compile_variant
        self.compiled: dict[tuple[str, ...], Callable] = dict(compiled or {})
        self._tracing = torch._guards.TracingContext.try_get()
        self._compile = torch._guards.CompileContext.try_get()

    def modes(self, key: tuple[str, ...]) -> Modes:
        return dict(zip(self.varying, key))

    def variant(self, key: tuple[str, ...]) -> Callable:
        fn = self.compiled.get(key)
        if fn is None:
            with torch._guards.tracing(self._tracing), torch._guards.compile_context(self._compile):
                fn = self.compiled[key] = self._compile_variant(self.modes(key))
        return fn

    def __call__(self, args: list[Any]) -> Any:
        return self.variant(tuple(mode_of(ps, positions) for ps, positions in self.varying.items()))(args)
