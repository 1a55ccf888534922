"""What ``graphzero-compare`` measures on one rank: resident memory (RSS and its high-water mark),
bytes of live gradient and optimizer-state tensors, collectives from ``torch.profiler`` events,
Dynamo's graph and graph-break counters, and how far a runner's final parameters are from the
reference's. Each function is a probe; the round loop (bench_worker.py) decides when to call it.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
from collections.abc import Iterable
from typing import Any

import torch

from .bench_runners import Runner


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def hwm_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def malloc_trim() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def storage_key(t: torch.Tensor) -> tuple | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001  (tensor subclasses without a storage)
        return None
    return (t.device.type, t.device.index, ptr) if ptr else None


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set | None = None) -> tuple[int, set]:
    """Bytes of the distinct storages behind ``tensors`` (storages in ``exclude`` skipped)."""
    exclude = exclude or set()
    seen: set = set()
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key is None or key in seen or key in exclude:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total, seen


def memory_bytes(runner: Runner) -> tuple[int, int]:
    """(gradient bytes, optimizer-state bytes) of the runner's live tensors on this rank."""
    grads, state, params = runner.memory_tensors()
    param_keys = {k for k in map(storage_key, params) if k is not None}
    grad_bytes, grad_keys = storage_bytes((t for _, t in grads), param_keys)
    optim_bytes, _ = storage_bytes((t for _, t in state), param_keys | grad_keys)
    return grad_bytes, optim_bytes


_COLLECTIVE_EVENT = re.compile(r"^(gloo|nccl|mpi|ucc|xccl|hccl):(\w+)$")
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "long": 8,
                "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
                "c10::complex<float>": 8, "c10::complex<double>": 16}


def summarize_collectives(events: Iterable[Any], world_size: int) -> dict[str, Any]:
    """Count process-group backend events (``gloo:all_reduce``, ``nccl:reduce_scatter``, ...) from
    ``torch.profiler`` events (``name``, ``input_shapes``, ``input_dtypes``)."""
    by_op: dict[str, dict[str, int]] = {}
    reduced = gathered = 0
    for e in events:
        m = _COLLECTIVE_EVENT.match(getattr(e, "name", "") or "")
        if not m:
            continue
        op = m.group(2)
        shapes = list(getattr(e, "input_shapes", None) or [])
        dtypes = list(getattr(e, "input_dtypes", None) or [])
        nbytes = 0
        for i, shape in enumerate(shapes):
            numel = 1
            for d in shape or []:
                numel *= int(d)
            nbytes += numel * _DTYPE_BYTES.get(dtypes[i] if i < len(dtypes) else "float", 4)
        entry = by_op.setdefault(op, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
        if "reduce" in op:
            reduced += nbytes
        elif "gather" in op:
            gathered += nbytes * world_size
    return {"count": sum(v["count"] for v in by_op.values()), "by_op": by_op,
            "bytes_reduced": reduced, "bytes_gathered": gathered}


def dynamo_counts() -> tuple[int, int]:
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001  (dynamo unavailable: no counts)
        return 0, 0
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def param_diff(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """Max abs difference over all parameters; inf when names or shapes differ or a value is NaN."""
    if set(ref) != set(other):
        return float("inf")
    worst = 0.0
    for k, v in ref.items():
        if v.shape != other[k].shape:
            return float("inf")
        if v.numel():
            d = (v - other[k]).abs().max().item()
            worst = max(worst, float("inf") if math.isnan(d) else d)
    return worst
