"""Per engine: the training forwards whose backward has not run yet, so that a backward knows
whether another graph of the same backward will still reach the engine.

A graph break between two calls of an engine (``D(G(z))``, a break, ``D(real)``) gives two
graphs, each with its own backward. Eager autograd sums a parameter's gradients from both calls
before DeepSpeed's hook reduces it once; graphzero's backward of the graph that runs first holds
its gradients instead (ZeRO-1/2: local_accumulation.py; ZeRO-3: held_gradients.py) when this
count says another one follows, and the last one reduces the sum.

Every training forward of a graph reaching the engine adds one, every backward takes one. Every
rank runs the same graphs in the same order, so every rank counts the same (and the variant each
backward picks is part of the collective plan the ranks compare before reducing). A count can be
wrong only in a way that costs time, never gradients: a forward whose backward never runs (an
output dropped) makes a later backward hold, and whatever is still held when a backward ends is
reduced then; every count starts again from zero when a backward ends.
"""
from __future__ import annotations

import torch


class PendingBackwards:
    """Training forwards of graphs reaching one engine whose backward has not run."""

    def __init__(self) -> None:
        self.forwards = 0
        self._callback_queued = False

    def forward_ran(self) -> None:
        self.forwards += 1

    def backward_started(self) -> bool:
        """Called once per backward of a graph reaching the engine, before it runs: whether another
        graph of this backward will still reach it."""
        self.forwards = max(self.forwards - 1, 0)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        return self.forwards > 0

    def _end(self) -> None:
        self._callback_queued = False
        self.forwards = 0


class CountForwards:
    """A compiled training forward that counts itself for each engine it reaches."""

    def __init__(self, compiled, counts: list[PendingBackwards]) -> None:
        # In the instance dict: dynamo's disable() wrapper copies __dict__, not class attributes.
        self._boxed_call = True
        self.compiled = compiled
        self.counts = counts

    def __call__(self, args: list) -> object:
        out = self.compiled(args)
        for c in self.counts:
            c.forward_ran()
        return out
