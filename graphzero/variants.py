"""One compiled backward per boundary state of a graph's ZeRO-1 engines with gradient accumulation.

Every rank runs the same graph, so a collective cannot be skipped at run time; instead the
backward is compiled in variants (passes/local_accumulate.py): for a non-boundary micro-step of
an engine, its gradients are added into a local buffer and nothing is reduced; at the boundary,
the window's sum is reduced once. Which variant a backward needs is known only when it runs (the
engine's micro-step counter advances in ``engine.step()``), so `BoundaryVariants` picks it per
call and compiles each variant the first time it is needed (at most 2^k for k such engines in one
graph; usually two: "accumulate" and "boundary"). The variant is part of each variant's collective
plan, so ranks that disagree on the boundary raise a RankDisagreementError instead of hanging.

A lazily compiled variant runs under the tracing and compile contexts saved when AOT autograd
compiled the backward, as AOT does for its own lazy backward compile.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .ownership import ParamSet

Modes = dict[ParamSet, str]


def label(modes: Modes) -> str:
    """The variant's name in logs and dumps: "accumulate", "boundary", or "boundary-<engines>"
    when only some engines are at their boundary."""
    flushing = [ps.name for ps, mode in modes.items() if mode == "flush"]
    if not flushing:
        return "accumulate"
    if len(flushing) == len(modes):
        return "boundary"
    return "boundary-" + "-".join(flushing)


class BoundaryVariants:
    """A boxed backward that dispatches on ``ps.at_boundary()`` of each deferring engine."""

    def __init__(self, deferred: Sequence[ParamSet], compile_variant: Callable[[Modes], Callable]) -> None:
        self._boxed_call = True   # in the instance dict: dynamo's disable() wrapper copies __dict__
        self.deferred = list(deferred)
        self._compile_variant = compile_variant
        self.compiled: dict[tuple[bool, ...], Callable] = {}
        self._tracing = torch._guards.TracingContext.try_get()
        self._compile = torch._guards.CompileContext.try_get()

    def modes(self, key: tuple[bool, ...]) -> Modes:
        return {ps: "flush" if boundary else "accumulate" for ps, boundary in zip(self.deferred, key)}

    def variant(self, key: tuple[bool, ...]) -> Callable:
        fn = self.compiled.get(key)
        if fn is None:
            with torch._guards.tracing(self._tracing), torch._guards.compile_context(self._compile):
                fn = self.compiled[key] = self._compile_variant(self.modes(key))
        return fn

    def __call__(self, args: list[Any]) -> Any:
        key = tuple(bool(ps.at_boundary()) for ps in self.deferred)
        return self.variant(key)(args)
