"""Per engine and parameter: the training forwards whose backward has not run yet, so that a
backward knows whether another graph of the same backward will still reach its parameters.

A graph break between two calls of an engine (``D(G(z))``, a break, ``D(real)``) gives two
graphs, each with its own backward. Eager autograd sums a parameter's gradients from both calls
before DeepSpeed's hook reduces it once; graphzero's backward of the graph that runs first keeps
its gradients instead (ZeRO-1/2: local_accumulation.py; ZeRO-3: held_gradients.py) when every
parameter of the engine it reaches will be reached again, and the last one reduces the sum.
Counting per parameter, not per engine, keeps a model split by a graph break (layers 0..k in one
graph, k+1..n in the next: no parameter in both) on the plain path.

Every training forward of a graph adds one per owned parameter it reaches, every backward of it
takes one. Every rank runs the same graphs in the same order, so every rank counts the same (and
the variant each backward picks is part of the collective plan the ranks compare before reducing).
A count can be wrong only in a way that costs time, never gradients: a forward whose backward never
runs (an output dropped, a GAN critic step through a detached generator output) makes a later
backward keep gradients it could have reduced, and whatever is still kept when a backward ends is
reduced then. When any graphzero backward ends, every count starts again from zero; so does a
backward after one that raised (its end never ran).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection

import torch

Position = tuple[int, int]   # (param group, position in group)


class OncePerBackward:
    """Queues ``fn`` to run when the current autograd backward ends, once per backward. Keyed by
    the autograd graph task: a backward that raised never ran its callbacks, and the next one
    queues again."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self._task: int | None = None

    def queue(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self._task = None
        self.fn()


class PendingBackwards:
    """Training forwards of graphs reaching one engine whose backward has not run, per parameter."""

    def __init__(self) -> None:
        self.counts: Counter[Position] = Counter()

    def forward_ran(self, positions: Collection[Position]) -> None:
        self.counts.update(positions)
        _COUNTING.add(self)

    def reached_again(self, positions: Collection[Position]) -> bool:
        """Called once per backward of a graph whose gradients reach ``positions``, before it runs:
        takes that graph's forward off the count; whether another graph of this backward will
        reach every one of them again."""
        for p in positions:
            if self.counts[p] > 0:
                self.counts[p] -= 1
        _RESET.queue()
        return bool(positions) and all(self.counts[p] > 0 for p in positions)


def _reset_all() -> None:
    for pending in _COUNTING:
        pending.counts.clear()
    _COUNTING.clear()


# Engines with forwards counted since the last backward ended: any graphzero backward's end resets
# them all (a count no backward reaches, e.g. a generator's during a GAN's critic steps, must not
# make the next backward that reaches it hold). Strong references, dropped at every reset.
_COUNTING: set[PendingBackwards] = set()
_RESET = OncePerBackward(_reset_all)


class CountForwards:
    """A compiled training forward that counts itself for each engine's parameters it reaches."""

    def __init__(self, compiled, positions: dict) -> None:
        # In the instance dict: dynamo's disable() wrapper copies __dict__, not class attributes.
        self._boxed_call = True
        self.compiled = compiled
        self.positions = positions   # ParamSet -> tuple of Position

    def __call__(self, args: list) -> object:
        out = self.compiled(args)
        for ps, positions in self.positions.items():
            ps.backwards.forward_ran(positions)
        return out
