"""How much of a step's collective time runs under compute, from torch.profiler's events of the
measurement round, and the figure of those timelines.

On CPU (gloo) a collective runs on one of the process group's worker threads; its profiler range
(``gloo:all_to_all``, ...) spans the transfer. The step's compute is the step thread's innermost
profiler ranges: operators and, with ``torch._inductor.config.cpp.enable_kernel_profile`` (which
graphzero-compare sets), inductor's C++ kernels; waits (``wait_tensor``) and collective launches
are not compute. Per rank:

- collective: the union of the collectives' ranges;
- hidden: the part of it during compute;
- exposed: the rest, where the step thread waits, or runs Python between operators (DeepSpeed's
  and FSDP2's eager bookkeeping shows up there, not as waiting).

On 2 CPU cores a gloo transfer and compute share the cores, so "hidden" says the timeline
overlaps, not that the transfer was free. On CUDA the collectives are NCCL kernels on the device,
which these CPU events do not time: the report says n/a there.
"""
from __future__ import annotations

import collections
import re
from collections.abc import Iterable
from typing import Any

from .bench_metrics import COLLECTIVE_EVENT

_NOT_COMPUTE = re.compile(r"wait|^c10d::|^_c10d_functional::|^record_param_comms$|^ProfilerStep")

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time as ``intervals``."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _step_thread(events: list[Any]) -> Any:
    """The thread that launched the collectives (c10d's ops), else the one with most events."""
    launches = collections.Counter(e.thread for e in events if e.name.startswith(("c10d::", "_c10d_functional::")))
    counts = launches or collections.Counter(e.thread for e in events)
    return counts.most_common(1)[0][0]


def step_overlap(events: Iterable[Any], max_intervals: int = 4000) -> dict[str, Any] | None:
    """Collective, hidden and exposed milliseconds of one profiled step, with its timeline (µs from
    the first event: ``compute`` and ``collectives`` as merged intervals). None without events."""
    events = [e for e in events if getattr(e, "time_range", None) is not None and getattr(e, "name", None)]
    if not events:
        return None
    step_thread = _step_thread(events)
    collective = union((e.time_range.start, e.time_range.end) for e in events if COLLECTIVE_EVENT.match(e.name))
    compute = union((e.time_range.start, e.time_range.end) for e in events
                    if e.thread == step_thread and not e.cpu_children and not _NOT_COMPUTE.search(e.name))
    hidden = length(intersect(collective, compute))
    total = length(collective)
    origin = min(e.time_range.start for e in events)
    end = max(e.time_range.end for e in events)

    def rel(intervals: list[Interval]) -> list[list[float]]:
        return [[round(s - origin, 1), round(e - origin, 1)] for s, e in intervals[:max_intervals]]

    return {"collective_ms": round(total / 1e3, 3), "hidden_ms": round(hidden / 1e3, 3),
            "exposed_ms": round((total - hidden) / 1e3, 3), "compute_ms": round(length(compute) / 1e3, 3),
            "span_ms": round((end - origin) / 1e3, 3),
            "hidden_fraction": round(hidden / total, 3) if total else None,
            "timeline": {"compute": rel(compute), "collectives": rel(collective)}}


def plot_timelines(result: dict[str, Any], path: str) -> bool:
    """One panel per runner, two to a row in ``--runners`` order: each rank's compute and collective
    lanes over the measured step. False (with nothing written) when matplotlib or every timeline is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n, e in result["runners"].items() if e.get("overlap_per_rank")]
    if not names:
        return False
    cols = min(2, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 2.4 * rows + 0.4), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        per_rank = result["runners"][name]["overlap_per_rank"]
        labels = []
        for rank, ov in enumerate(per_rank):
            if not ov:
                continue
            base = 2 * (len(per_rank) - 1 - rank)
            for lane, key, color in ((base + 1, "compute", "tab:blue"), (base, "collectives", "tab:orange")):
                spans = [(s / 1e3, (e - s) / 1e3) for s, e in ov["timeline"][key]]
                ax.broken_barh(spans, (lane + 0.1, 0.8), color=color)
            labels += [(base + 1.5, f"rank {rank} compute"), (base + 0.5, f"rank {rank} collectives")]
        ax.set_yticks([y for y, _ in labels], [t for _, t in labels])
        hidden = [ov["hidden_fraction"] for ov in per_rank if ov and ov["hidden_fraction"] is not None]
        title = f"{name}: step {max(ov['span_ms'] for ov in per_rank if ov):.1f} ms"
        if hidden:
            title += f", {100 * min(hidden):.0f}-{100 * max(hidden):.0f}% of collective time hidden"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms from the step's first event")
    workload = result["workload"]
    fig.suptitle(f"{workload['model']} ZeRO-{workload['stage']} {workload['dtype']}, {workload['world_size']} "
                 f"{workload['backend']} ranks: one profiled step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
