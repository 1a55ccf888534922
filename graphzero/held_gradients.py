"""ZeRO-3: an engine reached by several compiled graphs of one backward reduces each parameter's
summed gradient once, as eager autograd sums a leaf's gradients before DeepSpeed's hook reduces it.

Within one graph, sum_shard_grads already sums a parameter's gradients over its calls and
reduce-scatters once. A graph break between two calls of an engine (``D(G(z))``, a break,
``D(real)``) gives two graphs, each with its own backward and its own reduce-scatter: twice the
bytes DeepSpeed sends. So the backward of such a graph is compiled in variants (variants.py,
passes/hold_shard_grads.py), one per mode of each ZeRO-3 engine in it:

- ``"reduce"``: as before (the only variant a graph ever needs when no other graph of the same
  backward reaches its parameters);
- ``"hold"``: another graph of this backward will reach every parameter of the engine this graph
  reaches (pending_backwards.py), so each padded full gradient is added into that parameter's held
  buffer instead of being reduce-scattered;
- ``"release"``: some of this graph's parameters are held: each of its reduce-scatters carries
  ``gradient + held``, so every contribution is reduced once.

Whatever is still held when a backward ends (a forward whose backward never ran made one hold) is
reduced then by the adapter's eager ``flush``; what a backward that raised held is dropped when
the next backward starts (its ``.grad`` would be as incomplete under eager autograd).

Memory: one padded full gradient per held parameter, for the span of one backward; eager autograd
holds the same, a leaf's first gradient waiting in the autograd engine's input buffer for the last.
Nothing here knows about DeepSpeed.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from .ownership import FlatGroup
from .pending_backwards import OncePerBackward, Position

log = logging.getLogger("graphzero")


class HeldGradients:
    """Per ZeRO-3 engine: per held parameter, the sum of its padded full gradients (``world x``
    its shard) that graphs of this backward added, for the graph that reduces it."""

    def __init__(self, groups: tuple[FlatGroup, ...], world_size: int, dtype: torch.dtype,
                 flush: Callable[[], None] = lambda: None) -> None:
        self.groups = groups
        self.world_size = world_size
        self.dtype = dtype
        # reduces every held sum into the shards (the adapter: collectives)
        self.flush = flush
        self.pending: set[Position] = set()
        self.scale = 1.0
        self._buffers: dict[Position, torch.Tensor] = {}
        self._task: int | None = None   # the autograd backward that holds them
        self._end = OncePerBackward(self._flush_if_pending)

    def numel(self, g: int, k: int) -> int:
        """Elements of parameter (g, k)'s padded full gradient."""
        return self.world_size * self.groups[g].shard_numel_of(k)

    def buffer(self, g: int, k: int, device: torch.device) -> torch.Tensor:
        if (g, k) not in self._buffers:
            self._buffers[(g, k)] = torch.zeros(self.numel(g, k), dtype=self.dtype, device=device)
        return self._buffers[(g, k)]

    def scratch(self, g: int, k: int, device: torch.device) -> torch.Tensor:
        """A zeroed buffer like buffer(), for a backward whose result must not be kept."""
        return torch.zeros(self.numel(g, k), dtype=self.dtype, device=device)

    def drop_stale(self) -> None:
        """At a backward's start: sums held by an earlier backward that raised (its end never ran)."""
        if self.pending and self._task != torch._C._current_graph_task_id():
            log.warning("dropping %d ZeRO-3 parameter gradient(s) held by a backward that did not finish",
                        len(self.pending))
            self.clear()

    def holding(self, positions: Iterable[Position], scale: float) -> None:
        """Before a backward adds these parameters' gradients (pending even if it fails half way, so
        that a partly written buffer is dropped, never added in); the graph that reduces them
        scales them by ``scale`` (the eager flush uses it)."""
        self.pending.update(positions)
        self.scale = scale
        self._task = torch._C._current_graph_task_id()
        self._end.queue()

    def released(self, positions: Iterable[Position]) -> None:
        """These parameters' held sums were reduced: they start again from zero."""
        for p in positions:
            self.pending.discard(p)
            self._buffers.pop(p, None)

    def clear(self) -> None:
        """Forget everything held (``zero_grad``, detach, a failed backward)."""
        self.pending.clear()
        self._buffers.clear()

    def _flush_if_pending(self) -> None:
        if self.pending:
            self.flush()
