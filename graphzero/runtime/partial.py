"""Partial gradient sums: gradients kept on this rank now and reduced once later, together with
whatever a later graph adds. One concept serves three cases:

- a ZeRO-1 accumulation window (gas > 1): DeepSpeed eager reduces only at the boundary;
- ZeRO-1/2 engines two graphs of one backward reach (a graph break): the last graph reduces the
  sum, as eager autograd sums a leaf's gradients before DeepSpeed's hook reduces them once;
- ZeRO-3 engines two graphs of one backward reach: the same, per parameter (padded full gradient).

ZeRO-1/2 keep one flat buffer per param group (key: group index), scaled as added (a window's
micro-steps may be launched differently); ZeRO-3 one buffer per parameter (key: ``(group,
position)``), scaled when reduced. Memory: what eager autograd would hold for the same span.
Nothing here knows about DeepSpeed or process groups.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ..ownership import ParamSet

Position = tuple[int, int]   # (param group, position in group)


class PartialSums:
    """Per engine: the partial sums and which parameters (positions) have one pending."""

    def __init__(self, layout: ParamSet) -> None:
        self.layout = layout
        self.per_param = any(g.presharded for g in layout.groups)
        self.dtype = layout.partial_dtype
        self.pending: set[Position] = set()
        self.scale = 1.0   # per-parameter sums: the factor their reduction applies
        self._buffers: dict[object, torch.Tensor] = {}

    def numel(self, key: object) -> int:
        if self.per_param:
            g, k = key
            return self.layout.world_size * self.layout.groups[g].shard_numel_of(k)
        return self.layout.groups[key].numel

    def buffer(self, key: object) -> torch.Tensor:
        """The sum for ``key`` (zeros when nothing is pending in it)."""
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(self.numel(key), dtype=self.dtype, device=self.layout.device)
        return self._buffers[key]

    def scratch(self, key: object) -> torch.Tensor:
        """A zeroed buffer like buffer(key), for a backward whose result must not be kept."""
        return torch.zeros(self.numel(key), dtype=self.dtype, device=self.layout.device)

    def keeping(self, positions: Iterable[Position], scale: float = 1.0) -> None:
        """Before a backward adds these parameters' gradients (pending even if it fails half way: a
        partly written sum is then dropped or reduced, never lost silently)."""
        self.pending.update(positions)
        self.scale = scale

    @torch.no_grad()
    def reduced(self, positions: Iterable[Position]) -> None:
        """These parameters' sums were reduced into the shards: they start again from zero."""
        positions = set(positions)
        self.pending -= positions
        if not self.pending:
            self._buffers.clear()   # nothing pending: give the memory back
        elif self.per_param:
            for p in positions:
                self._buffers.pop(p, None)
        else:
            for g, k in positions:
                if g in self._buffers:
                    start = self.layout.groups[g].offsets[k]
                    self._buffers[g][start:start + self.layout.groups[g].params[k].numel()].zero_()

    def clear(self) -> None:
        """Forget every sum (``zero_grad``, detach, a backward that did not finish)."""
        self.pending.clear()
        self._buffers.clear()
