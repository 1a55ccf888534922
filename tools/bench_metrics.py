"""What ``graphzero-compare`` measures on one rank: resident memory (RSS and its high-water mark),
bytes of live gradient and optimizer-state tensors, the peak of gathered (unsharded) parameters,
the time of each phase of a step, collectives from ``torch.profiler`` events, Dynamo's graph and
graph-break counters, and how far a runner's final parameters are from the reference's. Each function is a probe; the round loop (bench_worker.py) decides when to call it.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphzero.deepspeed_adapter.step.lean import PARAM_GATHER

from .bench_runner import Runner


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


def retain_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS: a trim threshold
    above any step's transient memory and the largest mmap threshold (32 MiB), both fixed (no
    dynamic adjustment). By default glibc gives back a freed multi-MiB buffer, and a step that
    allocates it again page-faults in every page; jemalloc and tcmalloc (what PyTorch's CPU launcher
    ``torch.backends.xeon.run_cpu`` preloads) keep such memory. True when glibc took both."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20))


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


class PhaseTimer:
    """Times the phases of one step (``with timer("forward"): ...``; the runner brackets "forward",
    "backward" and "step"). On CUDA it records events and reads them in :meth:`totals` (after the
    caller's synchronize), so timing adds no synchronization; on CPU it reads the wall clock.
    ``current`` is the phase being run (read by :class:`GatheredParamProbe`)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.current: str | None = None
        self._spans: list[tuple[str, Any, Any]] = []

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.current = name
        start = self._mark()
        try:
            yield
        finally:
            self._spans.append((name, start, self._mark()))
            self.current = None

    def totals(self) -> dict[str, float]:
        """Seconds per phase, summed over the step's micro-batches."""
        out: dict[str, float] = {}
        for name, start, end in self._spans:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            out[name] = out.get(name, 0.0) + seconds
        return out


class GatheredParamProbe(TorchDispatchMode):
    """The peak bytes of parameters held in full at once, per phase, for runners that gather
    sharded parameters in eager code (DeepSpeed ZeRO-3, FSDP2): before every aten op it sums the
    distinct storages of ``runner.gathered_params()``. Costly: only for the measurement step."""

    def __init__(self, runner: Runner, timer: PhaseTimer):
        super().__init__()
        self.runner, self.timer = runner, timer
        self.peak: dict[str, int] = {}

    def sample(self) -> None:
        phase = self.timer.current
        if phase not in ("forward", "backward"):
            return
        total, _ = storage_bytes(self.runner.gathered_params() or [])
        self.peak[phase] = max(self.peak.get(phase, 0), total)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sample()
        return func(*args, **(kwargs or {}))


COLLECTIVE_EVENT = re.compile(r"^(gloo|nccl|mpi|ucc|xccl|hccl):(\w+)$")
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "long": 8,
                "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
                "c10::complex<float>": 8, "c10::complex<double>": 16}


def summarize_collectives(events: Iterable[Any], world_size: int) -> dict[str, Any]:
    """Count process-group backend events (``gloo:all_reduce``, ``nccl:reduce_scatter``, ...) from
    ``torch.profiler`` events (``name``, ``input_shapes``, ``input_dtypes``, ``time_range``).

    An all-to-all is graphzero's reduce-scatter on gloo (passes/lower_reduce_scatter.py), except one
    that starts inside the lean step's ``graphzero.param_all_gather`` range (deepspeed_adapter/step/lean.py: the
    parameter all-gather of a gloo pair), which is counted as the all-gather it stands for."""
    events = list(events)
    gathers = [e.time_range for e in events if getattr(e, "name", "") == PARAM_GATHER]
    by_op: dict[str, dict[str, int]] = {}
    reduced = gathered = reductions = 0
    for e in events:
        m = COLLECTIVE_EVENT.match(getattr(e, "name", "") or "")
        if not m:
            continue
        op = m.group(2)
        if op == "all_to_all" and any(r.start <= e.time_range.start <= r.end for r in gathers):
            op = "all_gather"
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
        if "reduce" in op or op == "all_to_all":
            reduced += nbytes
            reductions += 1
        elif "gather" in op:
            gathered += nbytes * world_size
    return {"count": sum(v["count"] for v in by_op.values()), "by_op": by_op,
            "bytes_reduced": reduced, "reductions": reductions, "bytes_gathered": gathered}


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
