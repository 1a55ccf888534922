"""Which device a tensor graphzero hands to a collective must live on.

NCCL takes CUDA tensors only (a device-less tensor works under the tests' gloo, fails under NCCL),
so every tensor made for a collective asks `collective_device`, and engine buffers live on
``ParamSet.device``. Unknown backends fall back to ``_device_types``, as torch's object collectives do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_device_types(process_group: object | None) -> tuple[str, ...]:
    """The device types the group's backend(s) accept, in the order the backend lists them."""
    backend = str(dist.get_backend(process_group)).lower()
    if ":" in backend:   # init_process_group(backend="cpu:gloo,cuda:nccl")
        return tuple(pair.split(":", 1)[0].strip() for pair in backend.split(",") if ":" in pair)
    known = dist.Backend.backend_capability.get(backend)
    if known:
        return tuple(known)
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    return tuple(d.type for d in getattr(group, "_device_types", ())) or ("cpu",)


def current_device(device_type: str) -> torch.device:
    """This process's current device of an accelerator type (``cuda:<current>`` for CUDA)."""
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else None
    return torch.device(device_type, index) if index is not None else torch.device(device_type)


def collective_device(process_group: object | None, fallback_device: torch.device | str | None = None
                      ) -> torch.device:
    """The device for tensors handed to ``process_group``'s collectives: ``fallback_device`` (an
    engine's device) when the group accepts its type (gloo on a GPU machine reduces CUDA gradients
    where they are), else the CPU if accepted, else the group accelerator's current device."""
    types = group_device_types(process_group)
    if fallback_device is not None:
        fallback = torch.device(fallback_device)
        if fallback.type in types:
            return fallback
    if "cpu" in types:
        return torch.device("cpu")
    return current_device(types[0])


def engine_device(engine_device_attr: torch.device | str | None, params) -> torch.device:
    """DeepSpeed's ``engine.device``, or where the parameters live when unset (CPU, no local rank)."""
    if engine_device_attr is not None:
        return torch.device(engine_device_attr)
    for p in params:
        return p.device
    return torch.device("cpu")


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: object | None = None, async_op: bool = False):
    """``dist.all_gather_single`` (2.13's name) or ``all_gather_into_tensor``; per call, so patchable."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)
