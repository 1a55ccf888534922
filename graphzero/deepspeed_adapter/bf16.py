"""ZeRO-1 bf16 with fp32 gradient accumulation: ``BF16_Optimizer``.

Every rank keeps the FULL averaged fp32 gradient in ``fp32_groups_gradients_flat[i]`` (its norm
has no data-parallel reduction), and a parameter counts only when flagged in
``fp32_groups_has_gradients``. Its own ``step()`` zeroes those buffers.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ownership import FlatGroup
from .base import DeepSpeedBinding


class BF16Binding(DeepSpeedBinding):
    def _flat_groups(self, names: dict[int, str]) -> tuple[list[FlatGroup], torch.dtype]:
        opt = self.engine.optimizer
        groups = []
        for i, params in enumerate(opt.bf16_groups):
            # Offsets of DeepSpeed's own per-parameter views into its flat fp32 gradient buffer.
            flat = opt.fp32_groups_gradients_flat[i]
            offsets = [v.storage_offset() - flat.storage_offset() for v in opt.fp32_groups_gradients[i]]
            groups.append(FlatGroup(
                params=tuple(params), names=tuple(names.get(id(p), f"group{i}.param{k}") for k, p in enumerate(params)),
                offsets=tuple(offsets), numel=int(opt.bf16_groups_flat[i].numel()), sharded=False))
        return groups, opt.grad_acc_dtype

    def sinks(self) -> list[torch.Tensor]:
        return list(self.engine.optimizer.fp32_groups_gradients_flat)

    def mark_present(self, params: Sequence[torch.nn.Parameter]) -> None:
        opt = self.engine.optimizer
        for p in params:
            g, k = self.param_set.locate(p)
            opt.fp32_groups_has_gradients[g][k] = True
            p._hp_grad = opt.fp32_groups_gradients[g][k]
