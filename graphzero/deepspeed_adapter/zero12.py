"""ZeRO-1/2 with ``DeepSpeedZeroOptimizer`` (fp32, and bf16 ZeRO-2 with fp32 accumulation).

Layout: per param group, the flat order ``round_robin_bit16_groups[i]`` at
``round_robin_bit16_offsets[i]`` of a padded buffer of ``bit16_groups_flat[i].numel()`` elements,
split into one contiguous partition per data-parallel rank. ``step()`` reads this rank's
partition from ``averaged_gradients[i]``; with optimizer offload, from the CPU fp32 gradient, which
is then the partition buffer itself where dtype and device allow (``_direct_target``: graphzero's
graphs reduce into it), else filled by the boundary copy (``_copy_to_offloaded``).
"""
from __future__ import annotations

import weakref

import torch

from ..ownership import FlatGroup
from . import offload
from .base import DeepSpeedBinding
from .ledger import PatchLedger


class ZeroBinding(DeepSpeedBinding):
    def __init__(self, engine, name: str) -> None:
        # weak: a group step() consumed must not be kept alive until the next backward
        self._installed_groups: dict[int, weakref.ref] = {}
        super().__init__(engine, name)

    def _flat_groups(self, names: dict[int, str]) -> tuple[list[FlatGroup], torch.dtype]:
        opt = self.engine.optimizer
        groups = []
        for i, params in enumerate(opt.round_robin_bit16_groups):
            groups.append(FlatGroup(
                params=tuple(params), names=tuple(names.get(id(p), f"group{i}.param{k}") for k, p in enumerate(params)),
                offsets=tuple(int(o) for o in opt.round_robin_bit16_offsets[i]),
                numel=int(opt.bit16_groups_flat[i].numel()), sharded=True))
        return groups, opt.gradient_accumulation_dtype

    def sinks(self) -> list[torch.Tensor]:
        """Per group, the flat partition of a compact grad-partition buffer installed in
        ``averaged_gradients[i]`` (the same dict object: params' ``_hp_mapping`` reference it).
        ``step()`` clips it in place and then drops it (sets the entry to None), so a missing or
        replaced entry means "a step consumed it": install a fresh zeroed one.
        """
        opt = self.engine.optimizer
        out = []
        for i in range(len(self.param_set.groups)):
            group = opt.averaged_gradients.get(i)
            if group is None or group is not self._installed(i):
                group = opt._build_compact_grad_partition_buffer(i)
                target = self._direct_target(i, group.flat_partition)
                if target is not None:
                    target.zero_()
                    group.flat_partition = target
                    group.move_flat_partition(target.device)   # DeepSpeed re-makes the views on it
                opt.averaged_gradients[i] = group
                self._installed_groups[i] = weakref.ref(group)
            out.append(group.flat_partition)
        return out

    def _installed(self, i: int):
        ref = self._installed_groups.get(i)
        return ref() if ref is not None else None

    def drop_sinks(self) -> None:
        opt = self.engine.optimizer
        for i in list(self._installed_groups):
            if opt.averaged_gradients.get(i) is self._installed(i):
                opt.averaged_gradients[i] = None
        self._installed_groups.clear()

    # -- optimizer offload (offload_optimizer: cpu) ------------------------------------------------
    def _install(self, ledger: PatchLedger) -> None:
        super()._install(ledger)
        if self.engine.optimizer.cpu_offload:
            offload.install(self, ledger, self._copy_to_offloaded)

    def _direct_target(self, i: int, flat_partition: torch.Tensor) -> torch.Tensor | None:
        """With optimizer offload, the CPU optimizer's fp32 gradient of group ``i`` where it can stand
        in for the partition buffer (same size, dtype and device, contiguous): DeepSpeed's views of it
        (``offload_gradient_dict``, which ``safe_get_full_grad`` reads) then see graphzero's writes."""
        opt = self.engine.optimizer
        if not opt.cpu_offload:
            return None
        grad = opt.single_partition_of_fp32_groups[i].grad
        if (grad is None or not grad.is_contiguous() or grad.dtype != flat_partition.dtype
                or grad.device != flat_partition.device or grad.numel() != flat_partition.numel()):
            return None
        return grad.view(-1)

    @torch.no_grad()
    def _copy_to_offloaded(self) -> None:
        """DeepSpeed's boundary copy under offload (``copy_grads_in_partition``): each parameter's part
        of this rank's partition (graphzero's sink) into the CPU optimizer's fp32 gradient (nothing to
        copy where the sink is that gradient), and its norm into ``norm_for_param_grads``, which the
        offloaded step's norm reads."""
        from deepspeed.runtime.zero.utils import get_norm_dtype
        opt = self.engine.optimizer
        for i, sink in enumerate(self.sinks()):
            partition = self.param_set.rank
            fp32_grad = opt.single_partition_of_fp32_groups[i].grad.view(-1)
            direct = sink.data_ptr() == fp32_grad.data_ptr()
            for param in opt.params_in_partition[i]:
                pid = opt.get_param_id(param)
                _, _, dest, n = opt.grad_position[pid]
                source = sink.narrow(0, int(opt.grad_partition_insertion_offset[i][partition][pid]), int(n))
                opt.norm_for_param_grads[pid] = source.to(get_norm_dtype()).norm(2)
                if not direct:
                    fp32_grad.narrow(0, dest, n).copy_(source.to(fp32_grad.dtype))
