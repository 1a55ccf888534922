"""ZeRO-3: an engine reached by several compiled graphs of one backward reduces each parameter's
summed gradient once, as eager autograd sums a leaf's gradients before DeepSpeed's hook reduces it.

Within one graph, bucket_shard_grads already sums a parameter's gradients over its calls and
reduce-scatters once. A graph break between two calls of an engine (``D(G(z))``, a break,
``D(real)``) gives two graphs, each with its own backward and its own reduce-scatter: twice the
bytes DeepSpeed sends. So the backward of such a graph is compiled in variants (variants.py,
passes/hold_shard_grads.py), one per mode of each ZeRO-3 engine in it:

- ``"reduce"``: as before (the only variant a graph ever needs when no other graph of the same
  backward reaches its engines);
- ``"hold"``: another graph of this backward will still reach the engine, so each padded full
  gradient is added into this engine's held buffer instead of being reduce-scattered;
- ``"release"``: this is the last graph of the backward that reaches the engine, and gradients are
  held: each one it reduces is ``gradient + held``, so it is reduced once, with every contribution.

Which graph is the last is counted at run time (pending_backwards.py). Whatever is still held
when a backward ends (a forward whose backward never ran made one hold) is reduced then by the
adapter's eager ``flush``.

Memory: the held buffer is the engine's full padded size, for the span of one backward. Eager
autograd holds the same: a leaf's first gradient waits in the autograd engine's input buffer until
the last one arrives. Nothing here knows about DeepSpeed.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .local_accumulation import GroupBuffers
from .ownership import FlatGroup


class HeldGradients(GroupBuffers):
    """Per ZeRO-3 engine: the full-size gradient sums held for the last graph of this backward
    (laid out as the concatenation of each parameter's padded full gradient, i.e. ``world x`` the
    shard offsets)."""

    def __init__(self, groups: tuple[FlatGroup, ...], world_size: int, dtype: torch.dtype,
                 flush: Callable[[], None] = lambda: None) -> None:
        super().__init__(groups, dtype)
        self.world_size = world_size
        # reduces every held sum into the shards (the adapter: collectives)
        self.flush = flush
        self._callback_queued = False
        self.scale = 1.0

    def full_range(self, g: int, k: int) -> tuple[int, int]:
        """Parameter (g, k)'s padded full gradient within its group's held buffer."""
        group = self.groups[g]
        start = self.world_size * group.offsets[k]
        return start, start + self.world_size * group.shard_numel_of(k)

    def held(self, positions: Iterable[tuple[int, int]], scale: float) -> None:
        """A backward added these parameters' gradients; the graph that reduces them would have
        scaled them by ``scale`` (the eager flush uses it)."""
        self.pending.update(positions)
        self.scale = scale

    @torch.no_grad()
    def released(self, positions: Iterable[tuple[int, int]]) -> None:
        """These parameters' held sums were reduced: they start again from zero."""
        positions = set(positions) & self.pending
        self.pending -= positions
        if self._buffers is None:
            return
        if not self.pending:
            self._buffers = None   # give the memory back until a backward holds again
            return
        for g, k in positions:
            a, b = self.full_range(g, k)
            self._buffers[g][a:b].zero_()

    def clear(self) -> None:
        """Forget everything held (``zero_grad``, detach)."""
        self.pending.clear()
        self._buffers = None

    # -- end of a backward -----------------------------------------------------------------------
    def end_after_this_backward(self) -> None:
        """Queue `_end` to run when the current autograd backward finishes (once per backward)."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._callback_queued = False
        if self.pending:
            self.flush()
