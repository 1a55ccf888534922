"""Inductor config switches that keep graphzero's graphs correct on torch versions with a known
inductor miscompile (docs/inductor-unet-miscompile.md).

torch 2.13 (and 2.14: same scheduler code) CPU inductor computes wrong gradients for a diffusers
UNet's backward, with or without graphzero: a scheduler fusion fault no narrower switch measured
avoids; ``max_fusion_size=1`` (no fusion) is exact. So graphzero sets it for the backward graphs it
compiles on CPU under torch < 2.15 (the forward is exact; CUDA not measured: not guarded).
"""
from __future__ import annotations

import torch

# (first fixed version, device types, {config key: value})
_GUARDS = (((2, 15), ("cpu",), {"max_fusion_size": 1}),)


def _version(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def backward_patches(version: str | None = None, device_type: str = "cpu") -> dict:
    """``torch._inductor.config.patch`` arguments for a graphzero backward graph on ``device_type``
    under torch ``version`` (default: this torch)."""
    current = _version(version or torch.__version__)
    patches: dict = {}
    for fixed_in, devices, switches in _GUARDS:
        if current < fixed_in and device_type in devices:
            patches.update(switches)
    return patches


def device_type_of(example_inputs) -> str:
    """The device type a graph computes on: "cuda" if any example input is on CUDA, else the first
    tensor's (graphzero's graphs are single-device)."""
    types = [t.device.type for t in example_inputs if isinstance(t, torch.Tensor)]
    return "cuda" if "cuda" in types else (types[0] if types else "cpu")
