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

Rank-dependent graphs (a task head per rank, a graph break or an eager frame on one rank): every
graph's backward first compares its collective plan across ranks (`agree`), and so does the end of
every backward that compared anything (a rank with more graphs meets its peers' end). Once two ranks differ
the scope is diverged: from then on every graph keeps its gradients locally (no collective runs),
and the end compares which engines each rank reached (`_settle`), then reduces the union of the
ranks' partial sums once per engine in attach order: the gradient DDP's ``find_unused_parameters``
gives. A graph that must gather ZeRO-3 parameters in its backward cannot go on alone: it ends the
scope on every rank with a RankDisagreementError (`abort`). Not handled: one backward over engines
of different process groups whose members differ; a rank that diverged on one group skips the
later exchanges on another.
"""
from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist

from .. import rank_agreement
from ..errors import RankDisagreementError
from .state import EngineState, Position

Groups = list[tuple[str, object]]   # (name, process group)
_END = rank_agreement.fingerprint("the end of a backward")


class BackwardScope:
    def __init__(self) -> None:
        self.task: int | None = None
        self.reached: dict[EngineState, None] = {}   # ordered sets
        self.counted: dict[EngineState, None] = {}
        # the process groups whose ranks ran different plans in this backward (None: they agree)
        self.diverged: Groups | None = None
        # every group an exchange of this backward used: its end exchanges once more on each
        self.groups: dict[str, object] = {}

    def reach(self, state: EngineState) -> None:
        self.reached.setdefault(state)

    def agree(self, fingerprint: int, local_ok: bool, groups: Groups, what: str,
              timeout_s: float | None = None) -> bool:
        """Whether the ranks run the plan with this fingerprint together (True), or the backward
        goes on locally (False). ``local_ok``: the caller can keep its gradients without any
        collective; if not, and the ranks differ, RankDisagreementError on every rank."""
        self.groups.update(groups)
        if self.diverged is None:
            for _, group in groups:
                if not rank_agreement.same(fingerprint, local_ok, group, what, timeout_s):
                    self.diverged = list(groups)
                    break
        if self.diverged is not None and not local_ok:
            self.abort(what)
        return self.diverged is None

    def abort(self, what: str) -> None:
        """A diverged backward reached something that needs collectives: raise, on every rank."""
        self._settle(what, ok=False)

    def _settle(self, what: str, ok: bool = True) -> None:
        """The ranks of a diverged backward compare the engines each reached and whether each
        ends its accumulation window now; the end reduces their partial sums only if all match."""
        ordered = sorted(self.reached, key=lambda s: s.attach_order)
        mine = (ok, [(s.name, s.flushes_at_end()) for s in ordered])
        for _, group in self.diverged:
            every: list = [None] * dist.get_world_size(group)
            with rank_agreement.collective_failures(what):
                dist.all_gather_object(every, mine, group=group)
            if all(ok for ok, _ in every) and all(e == mine for e in every):
                continue
            for state in ordered:
                state.backward_abandoned(diverged=True)
            ranks = dist.get_process_group_ranks(group)
            failed = [r for r, (ok, _) in zip(ranks, every) if not ok]
            why = (f"rank(s) {failed} reached {what}, which needs collectives (ZeRO-3 gathers in its backward)"
                   if failed else "per rank, the engines reached (and whether each ends its accumulation window): "
                   + ", ".join(f"rank {r}: {engines}" for r, (_, engines) in zip(ranks, every)))
            raise RankDisagreementError(
                f"ranks disagree on what to reduce: the ranks ran different graphs in one backward and cannot "
                f"finish it together: {why}. graphzero reduces rank-dependent graphs only when every rank reaches "
                "the same engines and none gathers ZeRO-3 parameters after the graphs differ; the partial gradients "
                "of this backward are dropped")

    def _end(self) -> None:
        global _scope
        if _scope is self:
            _scope = BackwardScope()
        for state in self.counted:
            state.forwards.clear()
        if self.diverged is None and self.groups:
            # A rank with more graphs (or eager reductions) in this backward than its peers meets
            # their end here, and the backward diverges instead of pairing with their next one.
            self.agree(_END, True, list(self.groups.items()), "the end of a backward")
        if self.diverged is not None:
            self._settle("the end of a backward in which the ranks ran different graphs")
            for state in self.reached:
                state.ran_apart()
        for state in sorted(self.reached, key=lambda s: s.attach_order):
            state.end_backward(every_rank=self.diverged is not None)



_scope = BackwardScope()


def forward_ran(state: EngineState, positions: Collection[Position]) -> None:
    """A training forward reaching these parameters of the engine ran: its backward is pending."""
    state.forward_ran(positions)
    _scope.counted.setdefault(state)


def running() -> BackwardScope | None:
    """The scope of the running autograd backward if one is open, without opening one."""
    task = torch._C._current_graph_task_id()
    return _scope if task != -1 and _scope.task == task else None


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
