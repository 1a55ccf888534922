"""ZeRO-1/2 gradients kept locally: the sum of a ZeRO-1 accumulation window until the boundary
micro-step reduces it once, or of graphs of one backward until the last one reaching them.

DeepSpeed eager ZeRO-1 lets each micro-step's gradient accumulate in the full-size ``.grad`` and
reduces only at the gradient-accumulation boundary (``engine.allreduce_gradients``); ZeRO-2
partitions gradients and reduces every micro-step. graphzero follows the same rule: a graph that
uses a ZeRO-1 engine with gas > 1 is compiled in variants (``graphzero/variants.py``); on a
non-boundary micro-step its backward adds ``gradient x factor`` into this buffer instead of
reducing, and at the boundary it reduces ``buffer + gradient x factor`` and writes the shard the
optimizer reads.

The same buffer serves ZeRO-1 and ZeRO-2 engines that two graphs of one backward reach (a graph
break between two calls of the engine): the backward of the graph that runs first adds into it,
the last one reduces the sum, as DeepSpeed eager reduces the ``.grad`` autograd summed over both
calls once (pending_backwards.py counts which backward is the last); whatever is still in it when
a backward ends (``at_boundary``: always, but for a ZeRO-1 window) is reduced then.

Memory: one full-size buffer (the flat group, in the accumulation dtype) per param group, held
only during a window. DeepSpeed eager ZeRO-1 keeps a full-size ``.grad`` for the same window, and
graphzero keeps no ``.grad`` for owned parameters, so for fp32 ZeRO-1 it costs the same (between
the graphs of one backward, eager autograd holds a full gradient of each parameter both reach in
its input buffer). Nothing here
knows about DeepSpeed: the adapter creates one per engine and says when a window ends.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch

from .ownership import FlatGroup


class LocalAccumulator:
    """Per engine: the flat, full-size local gradient sum, and which parameters it holds.

    ``pending`` holds (group, position) of parameters added since their last reduction: the
    boundary (or last) graph reduces those it has a gradient for; the adapter reduces any others
    when the backward ends or before the optimizer step (a parameter no such graph reached).
    """

    def __init__(self, groups: tuple[FlatGroup, ...], dtype: torch.dtype,
                 on_accumulate: Callable[[], None] = lambda: None, flush: Callable[[], None] = lambda: None,
                 at_boundary: Callable[[], bool] = lambda: True) -> None:
        self.groups = groups
        self.dtype = dtype
        self.on_accumulate = on_accumulate
        # reduces every pending sum into the shards (the adapter: a collective)
        self.flush = flush
        self.at_boundary = at_boundary
        self.order = next(_ORDER)   # the same on every rank: engines are attached in the same order
        self.pending: set[tuple[int, int]] = set()
        self._buffers: list[torch.Tensor] | None = None

    def buffers(self, device: torch.device) -> list[torch.Tensor]:
        """Per param group, the window's buffer (zeros at the start of a window)."""
        if self._buffers is None:
            self._buffers = [torch.zeros(g.numel, dtype=self.dtype, device=device) for g in self.groups]
        return self._buffers

    def scratch(self, device: torch.device) -> list[torch.Tensor]:
        """Zeroed buffers shaped like buffers(), for a backward whose result must not be kept."""
        return [torch.zeros(g.numel, dtype=self.dtype, device=device) for g in self.groups]

    def accumulated(self, positions: Iterable[tuple[int, int]]) -> None:
        self.pending.update(positions)
        _WITH_PENDING.add(self)
        self.on_accumulate()

    @torch.no_grad()
    def reduced(self, positions: Iterable[tuple[int, int]]) -> None:
        """These parameters' sums were reduced into the shards: they start again from zero."""
        positions = set(positions)
        self.pending -= positions
        if not self.pending:
            _WITH_PENDING.discard(self)
        if self._buffers is None:
            return
        if not self.pending:
            # the window is over: give the memory back until the next one starts
            self._buffers = None
            return
        for g, k in positions:
            start = self.groups[g].offsets[k]
            self._buffers[g][start:start + self.groups[g].params[k].numel()].zero_()

    def clear(self) -> None:
        """Forget the window (``zero_grad``, detach)."""
        self.pending.clear()
        _WITH_PENDING.discard(self)
        self._buffers = None


_ORDER = itertools.count()
# Accumulators with sums not yet reduced. Strong references, removed when a window ends (reduced,
# clear): with weak ones an engine dropped mid-window would vanish on one rank's garbage collection
# and not another's, and only some ranks would run its flush's collectives (a hang).
_WITH_PENDING: set[LocalAccumulator] = set()


def flush_at_boundary() -> None:
    """End of a backward: reduce the pending sums of every engine at its boundary (ZeRO-2 and
    ZeRO-1 without accumulation: always) that no graph of the backward reduced (an engine the
    boundary micro-step's loss did not reach, a graph kept its gradients for one that never ran), so
    that its gradients are complete when the backward returns, as after DeepSpeed's backward.
    Every rank runs the same backwards, so the same flushes in the same order."""
    for acc in sorted(_WITH_PENDING, key=lambda a: a.order):
        if acc.pending and acc.at_boundary():
            acc.flush()


def flush_after_this_backward() -> None:
    """Queue `flush_at_boundary` to run when the current autograd backward finishes."""
    if _WITH_PENDING:
        torch.autograd.Variable._execution_engine.queue_callback(flush_at_boundary)
