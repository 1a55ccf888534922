"""Inductor config switches that keep graphzero's graphs correct on torch versions with a known
inductor miscompile (docs/inductor-unet-miscompile.md).

torch 2.13 (and 2.14, not measured: same scheduler code) CPU inductor computes wrong gradients for
a diffusers UNet's backward (an up block's residual + nearest-upsample + conv: the gradient entering
the block is entirely wrong), with or without graphzero. It is a scheduler fusion fault: no narrower switch measured avoids it
(pattern_matcher, cpp.simdlen=1, split_reductions, loop_ordering_after_fusion,
loop_reindexing_after_fusion, inplace_buffers, allow_buffer_reuse, cpp.max_horizontal_fusion_size
all still wrong); ``max_fusion_size=1`` (no fusion) is exact. graphzero sets it for the backward
graphs it compiles on CPU under torch < 2.15 (the forward is exact; CUDA not measured: not
guarded). Cost: unfused pointwise kernels in those backward graphs. A user's own ``torch.compile``
of other code is not changed.

The versions helper's ``inductor_config.py`` holds the overlap-pass pins per version; this module
holds only correctness guards, one function.
"""
from __future__ import annotations

import torch

# (first fixed version, device types, {config key: value}): applied while torch is older than that
# version, to graphs on those devices.
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
