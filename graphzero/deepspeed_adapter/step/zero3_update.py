"""ZeRO-3: DeepSpeed's ``step()`` stays, with graphzero's pieces in it (installed by __init__.py).

- `Zero3FusedUpdate` replaces ``unscale_and_clip_grads`` and ``_optimizer_step``: torch's fused
  Adam (adam.py) divides by the clip divisor (norm.clip_divisor) as it reads each gradient;
- `read_folded_norm`: ``_get_norm_groups`` returns the norm folded into the compiled backward
  (runtime/norm.py), not one blocking all-reduce per param group;
- `coalesce_gathers`: DeepSpeed's own gathers outside graphzero's graphs (``ds_persist`` parameters
  in ``step()``, ``GatheredParameters``, checkpoints) run one all-gather per parameter (on gloo a
  round each: 10 ms of a 26 ms ``step()`` for the mlp's 12 biases, tools/profile_step.py). These
  gather the pending shards in one collective per process group and dtype, each parameter getting
  its own ``param.data``; prefetch, quantized shards, and single-parameter or single-rank groups
  go to DeepSpeed's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ...devices import all_gather_into
from ...shard_gather import split_gathered
from ..ds_internals import ds_attr
from ..ledger import PatchLedger
from . import adam
from .norm import clip_divisor, root


def unsupported_reason(opt) -> str | None:
    """Why `Zero3FusedUpdate` cannot stand in for this ZeRO-3 optimizer's update; None if it can."""
    checks = (
        (ds_attr(opt, "offload_optimizer") or ds_attr(opt, "swap_optimizer"), "optimizer offload"),
        (ds_attr(opt, "zenflow"), "ZenFlow"),
        (ds_attr(opt, "torch_autocast_gradscaler") is not None, "torch autocast"),
        (ds_attr(opt, "use_muon"), "Muon"),
        (any(f.dtype != torch.float32 for f in ds_attr(opt, "fp32_partitioned_groups_flat")), "non-fp32 master weights"),
    )
    return next((what for bad, what in checks if bad), None) or adam.base_unsupported_reason(opt.optimizer)


class Zero3FusedUpdate:
    """``unscale_and_clip_grads`` and ``_optimizer_step`` of one ``DeepSpeedZeroOptimizer_Stage3``."""

    def __init__(self, opt) -> None:
        self.opt = opt
        self._divisors: dict[int, torch.Tensor] = {}

    def unscale_and_clip_grads(self, sub_group_id: int, total_norm) -> None:
        device = self.opt.fp32_partitioned_groups_flat[sub_group_id].device
        divisor = clip_divisor(self.opt, total_norm, device)
        if divisor is not None:
            self._divisors[sub_group_id] = divisor

    def optimizer_step(self, sub_group_id: int) -> None:
        opt = self.opt
        fp32 = opt.fp32_partitioned_groups_flat[sub_group_id]
        divisor = self._divisors.pop(sub_group_id, None)
        adam.update(opt.optimizer, opt.sub_group_to_group_id[sub_group_id], fp32, fp32.grad, divisor)


def read_folded_norm(binding, ledger: PatchLedger) -> bool:
    """``_get_norm_groups`` reads the binding's folded norm (``state.norm``, made by the binding
    when this returns True; not with Muon, whose update is normed, not the gradient)."""
    opt, state = binding.engine.optimizer, binding.state
    if ds_attr(opt, "use_muon"):
        return False
    own = opt._get_norm_groups

    def norm_groups() -> list[torch.Tensor]:
        squares = state.norm.take() if state.norm is not None else None
        if squares is None or binding.frozen_listed:
            # DeepSpeed norms the listed zeros of a frozen parameter, not its shard
            return own()
        return list(root(squares).unbind())   # get_grad_norm_direct's result per group

    ledger.set_attr(opt, "_get_norm_groups", norm_groups)
    return True


def coalesce_gathers(module: torch.nn.Module, ledger: PatchLedger) -> None:
    """Every ZeRO-3 parameter's ``all_gather`` through `coalesced_all_gather`."""
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):
            ledger.set_attr(p, "all_gather", coalesced_all_gather(p.all_gather, p))


def _gather_group(params: list[torch.nn.Parameter], group) -> None:
    world = dist.get_world_size(group=group)
    sizes = [int(p.ds_tensor.ds_numel) for p in params]
    flat = torch.cat([p.ds_tensor.reshape(-1) for p in params])
    gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather_into(gathered, flat, group=group)
    # the compiled graphs' unpacking: each parameter's shards in rank order, in storage of its own,
    # as DeepSpeed gives each gathered parameter its own buffer
    for p, full in zip(params, split_gathered(gathered, world, sizes)):
        p.data = full.narrow(0, 0, p.ds_numel).view(p.ds_shape)


def coalesced_all_gather(original: Callable, param: torch.nn.Parameter) -> Callable:
    """``param.all_gather`` (DeepSpeed's signature) with one collective per group of parameters."""

    @torch.no_grad()
    def all_gather(param_list=None, async_op=False, hierarchy=0):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as status
        params = [param] if param_list is None else list(param_list)
        pending = [p for p in params if p.ds_status == status.NOT_AVAILABLE]
        by_group: dict[tuple, list] = {}
        for p in pending:
            ranks = tuple(dist.get_process_group_ranks(p.ds_process_group))
            by_group.setdefault((ranks, p.ds_tensor.dtype), []).append(p)
        coalescable = (not async_op and hierarchy == 0 and len(by_group) > 0
                       and all(len(ps) > 1 and len(ranks) > 1 for (ranks, _), ps in by_group.items())
                       and not any(hasattr(p.ds_tensor, "ds_quant_scale") for p in pending))
        if not coalescable:
            return original(param_list=param_list, async_op=async_op, hierarchy=hierarchy)
        for group_params in by_group.values():
            _gather_group(group_params, group_params[0].ds_process_group)
        for p in pending:
            p.ds_status = status.AVAILABLE
        return None

    return all_gather
