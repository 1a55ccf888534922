"""DeepSpeed's own gathers of ZeRO-3 parameters, one collective per process group and dtype.

While graphzero owns an engine, its compiled graphs gather parameters themselves, but DeepSpeed
still gathers some outside them: ``step()`` ends by gathering every parameter it keeps resident
(``ds_persist``: below ``stage3_param_persistence_threshold``; ``_post_step`` calls
``persistent_parameters[0].all_gather(persistent_parameters)``), and ``GatheredParameters`` and
checkpoint saving gather lists of parameters. DeepSpeed's ``_allgather_params_coalesced`` launches
one all-gather per parameter; on gloo each is a round of its own (the benchmark mlp's 12 biases cost
about 10 ms of a 26 ms ``step()``, measured with tools/profile_step.py).

``coalesced_all_gather`` replaces a parameter's ``all_gather`` while attached: the shards of the
listed parameters that are not available yet are grouped by process group (ranks) and dtype, each
group is concatenated and gathered with one all-gather into a tensor, and each parameter gets its
own contiguous ``param.data`` (DeepSpeed assigns a view of a buffer per parameter) and status
AVAILABLE, as DeepSpeed's blocking path leaves them. What it does not cover goes to DeepSpeed's own
function: asynchronous (prefetch) calls, quantized shards, a group of one parameter, one rank.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..devices import all_gather_into
from ..shard_gather import split_gathered


def _status():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return ZeroParamStatus


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
        params = [param] if param_list is None else list(param_list)
        status = _status()
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
