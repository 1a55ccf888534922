"""The inductor settings graphzero compiles its graphs with, per torch version.

graphzero's passes decide where every collective and every wait of its graphs goes (bucket order,
``schedule_overlap``, the ZeRO-3 gather/release passes); inductor's scheduler may move them again.
Its comm/compute overlap passes are switches in ``torch._inductor.config``:

- ``reorder_for_compute_comm_overlap`` with ``reorder_for_compute_comm_overlap_passes`` (every
  supported torch; off by default). graphzero turns it on itself, with ``sink_waits_iterative``
  only, for a ZeRO-1/2 backward with ``overlap``: otherwise inductor fuses the accumulation into
  unrelated earlier kernels and waits on each collective right after issuing it.
- ``reorder_for_peak_memory`` (on by default): reorders nodes to lower the estimated peak. Off
  for graphs with ZeRO-3 gathers (``inductor_patch``): it moved each gather next to its wait, so no
  gather overlapped compute; bucket_gathers already bounds what is live by DeepSpeed's knobs. Off
  for every backward too: it moved the matmuls that write_into_bucket points into a bucket after
  the rest of the backward, and the bucket's collective with them (nothing overlapped it).
- ``aten_distributed_optimizations.enable_simple_overlap`` (torch 2.14 and 2.15, on by default;
  pytorch #184235/#184240): moves collectives earlier and waits later by adjacent swaps. Its guard
  against reordering collectives sees only inductor's own collective kernels, and it hung ranks
  whose graphs held collectives it could not see (pytorch #189454).

tests/test_inductor_overlap.py compiles graphzero's ZeRO-2 (also with the deferred parameter
all-gather) and ZeRO-3 graphs with each switch on and off and checks the collective order on every
rank and the gradients. What it found unsafe for graphzero's graphs is pinned here (PINNED), on
every graph graphzero compiles with inductor; the user's global setting still applies to the rest of
their program. Both are pinned off: graphzero's passes order and place its collectives, and each
of these passes decides from per-rank runtime estimates (on 2.15.0 ``simple_overlap`` compiled the
same ZeRO-2 backward with its waits in different places on rank 0 and rank 1).
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
    """The ``torch._inductor.config.patch`` for one graph graphzero compiles.

    ``backward``: the backward graph; ``overlap``: graphzero's ``overlap`` option; ``gathers``: the
    graph holds ZeRO-3 parameter gathers."""
    patch = pinned()
    if (gathers or backward) and has_option(PEAK_MEMORY):
        # bucket_gathers issues each gather bucket before the previous one's wait, within what
        # DeepSpeed's stage3 knobs allow to be live; inductor's peak-memory reordering undid it (it
        # moved the next engine's gather after the first engine's wait, and that wait to right after
        # its gather: the ZeRO-3 mlp forward took 22 ms instead of 18, nothing overlapped). In a
        # backward it moved the in-place matmuls of write_into_bucket, which it sees as writes into
        # a buffer that is live anyway, after every other kernel, and the collectives with them.
        patch[PEAK_MEMORY] = False
    if backward and overlap and not gathers:
        # Not with ZeRO-3 gathers: their passes place every wait, and sinking the reduce-scatters'
        # waits to the end would keep every full-size gradient alive until then.
        patch.update({REORDER: True, REORDER_PASSES: ["sink_waits_iterative"]})
    return patch


def register_lowerings() -> None:
    """Give inductor an explicit lowering for the ATen ops graphzero's passes add after AOT autograd.

    ``aten.addmm_`` (write_into_bucket: a matmul written into its bucket) has no inductor lowering;
    inductor falls back to the ATen kernel on first sight, except where the environment variable
    ``CI`` is set: there its own check refuses an implicit fallback for an op that has a
    decomposition (addmm_ decomposes into addmm + copy_, the very copy the pass removes), and every
    ZeRO-1/2 backward failed to compile (GitHub Actions and most CI systems set ``CI=true``). This
    registers the fallback inductor would register itself, with the same layout constraint (inputs
    made contiguous, as for every implicit backward fallback); once per process, in inductor's own
    lowering table, as inductor's implicit fallback does."""
    from torch._inductor import lowering

    op = torch.ops.aten.addmm_.default
    if op not in lowering.lowerings:
        lowering.make_fallback(op, layout_constraint=lowering.require_contiguous, warn=False)


#: option -> the value graphzero compiles with, where this torch has the option.
PINNED: dict[str, Any] = {
    # torch 2.13-2.15: with the pass list inductor's config recommends, a ZeRO-3 backward's
    # reduce-scatters were reissued in another order, every gather hoisted to the top and every
    # wait sunk to the end (all full-size gathered parameters and gradients alive at once), by
    # estimated runtimes that can differ between ranks unless inductor aligns them with a
    # collective of its own (runtime_estimations_align_across_all_distributed_ranks). graphzero's
    # passes already order and place its collectives.
    REORDER: False,
    REORDER_PASSES: [],
    # torch 2.14-2.15 (on by default there): in the ZeRO-2 backward with the folded norm, rank 0 and
    # rank 1 got different wait placements for the same graph (tests/test_inductor_overlap.py, 2.15.0):
    # the issue order held, but a pass whose decisions differ by rank can also reorder issues, the
    # hang of pytorch #189454.
    SIMPLE_OVERLAP: False,
}
