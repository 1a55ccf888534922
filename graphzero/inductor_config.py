"""The inductor settings graphzero compiles its graphs with, per torch version.

Inductor's overlap and peak-memory passes may move graphzero's collectives and waits again; what
tests/test_inductor_overlap.py found unsafe is pinned (PINNED) on graphzero's graphs only.
"""
from __future__ import annotations

from typing import Any

import torch

SIMPLE_OVERLAP = "aten_distributed_optimizations.enable_simple_overlap"
REORDER = "reorder_for_compute_comm_overlap"
REORDER_PASSES = "reorder_for_compute_comm_overlap_passes"
PEAK_MEMORY = "reorder_for_peak_memory"


def has_option(name: str) -> bool:
    """Whether this torch's inductor config has ``name`` (dotted for nested sections)."""
    owner: Any = torch._inductor.config
    for part in name.split("."):
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True


def pinned() -> dict[str, Any]:
    """Switches graphzero fixes for every graph it compiles, whatever the user's global config says."""
    return {name: value for name, value in PINNED.items() if has_option(name)}


def inductor_patch(*, backward: bool, overlap: bool, gathers: bool) -> dict[str, Any]:
    """The ``torch._inductor.config.patch`` for one graph (``gathers``: it holds ZeRO-3 gathers)."""
    patch = pinned()
    if (gathers or backward) and has_option(PEAK_MEMORY):
        # It moved each gather next to its wait (ZeRO-3 mlp forward: 22 ms instead of 18, nothing
        # overlapped; bucket_gathers already bounds what is live), and in a backward moved
        # write_into_bucket's in-place matmuls, and their collectives, after every other kernel.
        patch[PEAK_MEMORY] = False
    if backward and overlap and not gathers:
        # Without it inductor fuses the accumulation into unrelated earlier kernels and waits on each
        # collective right after issuing it. Not with ZeRO-3 gathers: their passes place every
        # wait, and sinking the reduce-scatters' waits would keep every full-size gradient alive.
        patch.update({REORDER: True, REORDER_PASSES: ["sink_waits_iterative"]})
    return patch


def register_lowerings() -> None:
    """Register the ATen fallback inductor would register itself for ``aten.addmm_``
    (write_into_bucket), which has no lowering.

    With ``CI`` set (GitHub Actions and most CI systems) inductor refuses an implicit fallback for
    an op with a decomposition (addmm_ -> addmm + copy_, the copy the pass removes), and every
    ZeRO-1/2 backward failed to compile."""
    from torch._inductor import lowering

    op = torch.ops.aten.addmm_.default
    if op not in lowering.lowerings:
        lowering.make_fallback(op, layout_constraint=lowering.require_contiguous, warn=False)


#: option -> the value graphzero compiles with, where this torch has the option.
PINNED: dict[str, Any] = {
    # torch 2.13-2.15, with inductor's recommended passes: a ZeRO-3 backward's reduce-scatters were
    # reordered, every gather hoisted and every wait sunk (everything full-size alive at once), by
    # runtime estimates that can differ between ranks.
    REORDER: False,
    REORDER_PASSES: [],
    # torch 2.14-2.15 (on by default; pytorch #184235/#184240): on 2.15.0 rank 0 and rank 1 got
    # different wait placements for the same ZeRO-2 backward; its guard sees only inductor's own
    # collectives, and it hung ranks whose graphs held others (pytorch #189454).
    SIMPLE_OVERLAP: False,
}
