"""graphzero's inductor correctness guards (graphzero/inductor_guards.py,
docs/inductor-unet-miscompile.md): which switches each torch version gets, and (opt-in,
GRAPHZERO_MATRIX=full: two inductor compiles of the reduced UNet repro, minutes on CPU) that the
switch makes the miscompiled backward exact while the default is wrong on this torch."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from suite_sample import FULL

from graphzero.inductor_guards import backward_patches


def test_patches_per_version():
    assert backward_patches("2.13.0+cpu") == {"max_fusion_size": 1}
    assert backward_patches("2.14.1") == {"max_fusion_size": 1}
    assert backward_patches("2.15.0") == {}
    assert backward_patches("2.16.0.dev20261201") == {}
    assert backward_patches("2.13.0", device_type="cuda") == {}  # measured on CPU only


def test_every_switch_exists_in_this_torch():
    from torch._inductor import config

    for key in backward_patches("2.13.0"):
        assert hasattr(config, key), key


@pytest.mark.skipif(not FULL, reason="GRAPHZERO_MATRIX=full (slow compiles)")
def test_guard_fixes_the_reduced_unet_repro():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
    import repro_unet_miscompile as repro

    patches = backward_patches()
    if not patches:
        pytest.skip(f"no guard on torch {torch.__version__}")
    torch._dynamo.reset()
    with torch._inductor.config.patch(patches):
        assert repro.main(["--minimal"]) == 0
    torch._dynamo.reset()
    assert repro.main(["--minimal"]) == 1, "the reduced repro no longer fails on this torch: revisit the guard"
