"""The scope of one autograd backward: which engines it reached, and one callback that ends them.

A graph break between two calls of an engine gives two graphs, each with its own backward; eager
autograd sums a parameter's gradients from both before DeepSpeed's hook reduces them once. So every
training forward counts itself per parameter it reaches (`forward_ran`), every backward takes one
off (`EngineState.backward_reaches`), and a graph that is not the last keeps its gradients as
partial sums (runtime/partial.py).

`BackwardScope`: the first compiled backward (or safety-net reduction) of an autograd graph task
opens it and queues one callback for the task's end, which ends every engine the task reached in
attach order (the same flush collectives on every rank) and clears the forward counts since the
last backward (a count no backward reaches, e.g. a generator's during a GAN's critic steps, must
not make the next backward keep its gradients). A wrong count costs time, never gradients. A
backward that raised never runs its callback: the next task abandons the scope
(`EngineState.backward_abandoned`).
"""
from __future__ import annotations

from collections.abc import Collection

import torch

from .state import EngineState, Position


class BackwardScope:
    def __init__(self) -> None:
        self.task: int | None = None
        self.reached: dict[EngineState, None] = {}   # ordered sets
        self.counted: dict[EngineState, None] = {}

    def reach(self, state: EngineState) -> None:
        self.reached.setdefault(state)

    def _end(self) -> None:
        global _scope
        if _scope is self:
            _scope = BackwardScope()
        for state in self.counted:
            state.forwards.clear()
        for state in sorted(self.reached, key=lambda s: s.attach_order):
            state.end_backward()



_scope = BackwardScope()


def forward_ran(state: EngineState, positions: Collection[Position]) -> None:
    """A training forward reaching these parameters of the engine ran: its backward is pending."""
    state.forward_ran(positions)
    _scope.counted.setdefault(state)


def current() -> BackwardScope:
    """The scope of the running autograd backward (call only from inside one)."""
    global _scope
    task = torch._C._current_graph_task_id()
    if _scope.task is not None and _scope.task != task:
        stale, _scope = _scope, BackwardScope()
        _scope.counted = stale.counted   # forwards since then belong to this backward
        for state in stale.reached:
            state.backward_abandoned()
    if _scope.task is None:
        _scope.task = task
        torch.autograd.Variable._execution_engine.queue_callback(_scope._end)
    return _scope
