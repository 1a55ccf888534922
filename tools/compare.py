"""``graphzero-compare``: run every runner on the same work, interleaved round by round in the same
processes, and report step time, compile time, memory, collectives and parameter agreement.

    graphzero-compare --model mlp --stage 2                 # 2 ranks, all runners
    graphzero-compare --model gan --tiny --runners ddp,ds-plain-backward --steps 2 --warmup 1
    python -m graphzero_tools.compare --model transformer --dtype bf16 --gas 2 --json out.json --plot out.png
    torchrun --nproc-per-node 2 -m graphzero_tools.compare --model chain3   # any launcher works too

Without a launcher it starts itself on ``--world-size`` ranks (``torch.multiprocessing.spawn``),
gloo on CPU (``DS_ACCELERATOR=cpu``), nccl with CUDA. Rounds: ``--warmup`` untimed rounds (the
first includes compilation), one measurement round (profiler: collectives; live tensors: memory),
then ``--steps`` timed rounds. In each round every live runner does one optimizer step (``--gas``
micro-batches) on the same data, in an order rotated by one each round; a barrier precedes each
timed step, and the step time is the slowest rank's. After every runner step all ranks agree on
failure (an all-reduce on a separate gloo group), so a runner that raises is reported failed with
its error and the others continue. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import logging
import math
import os
import platform
import re
import shlex
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch

from .bench_models import MODELS, batch_generator, bf16_round_, build_workload, resolve_size
from .bench_runners import RUNNERS, Hyper, RunContext, Runner, RunnerSkipped

log = logging.getLogger("graphzero.compare")

RUNNER_NAMES = tuple(RUNNERS)
REFERENCE_FALLBACKS = ("ddp", "ds-plain-backward", "ds-engine-backward", "fsdp2")
#: Tolerance on max |param - reference param| for "params match", per dtype. fp32: reduction order
#: differs between runners (and Adam magnifies differences on near-zero gradients); bf16: the
#: torch runners compute under autocast / FSDP2 mixed precision, not in pure bf16 like DeepSpeed.
DEFAULT_TOL = {"fp32": 1e-4, "bf16": 5e-2}
#: Keys every runner entry of the JSON has (None where not applicable or failed).
RUNNER_KEYS = (
    "status", "error", "failed_at", "setup_s", "step_ms", "ratio_vs_ddp", "ratio_vs_ds_plain_backward",
    "compile_s", "first_step_ms", "grad_bytes", "optim_bytes", "grad_bytes_per_rank",
    "optim_bytes_per_rank", "peak_rss_mib", "step_rss_growth_mib", "peak_device_mib", "collectives_per_step",
    "bytes_reduced_per_step", "bytes_gathered_per_step", "collectives_by_op", "max_abs_param_diff",
    "params_match", "final_loss", "losses", "graphs", "graph_breaks", "timed_graphs",
)
NOTES = [
    ("step ms: wall time of one optimizer step (gas micro-batches + optimizer), slowest rank, after a "
     "barrier; median [min, max] over the timed rounds. Ratios divide medians from this same run."),
    ("compile s: first step minus median step (includes compilation for compiled runners, first-step "
     "allocation for the others)."),
    ("grad / optim: bytes per rank (max over ranks) of live tensors, deduplicated by storage, parameter "
     "storages excluded. grad is counted after the last backward, before the optimizer; optim after it "
     "(DeepSpeed: the ZeRO optimizer's tensors, fp32 master partitions included in optim; torch: p.grad "
     "and optimizer.state). Tensors held only inside C++ (e.g. DDP's reducer beyond the bucket views) "
     "are not seen."),
    ("peak RSS: the process's high-water mark during this runner's timed steps (reset before each step "
     "via /proc/self/clear_refs, after malloc_trim); it includes every other runner's resident memory "
     "in the same process. +step: that peak minus the RSS at the step's start. With CUDA the JSON also "
     "has peak_device_mib (torch.cuda.max_memory_allocated over the timed steps)."),
    ("collectives/step and reduced/step: from torch.profiler over the measurement round, counting the "
     "process-group backend's events (gloo:* / nccl:*), which eager, DeepSpeed, DDP, FSDP2 and compiled "
     "(_c10d_functional) collectives all reach; reduced = input bytes of all_reduce / reduce_scatter / "
     "reduce. Collectives that bypass the process group (e.g. DeepSpeed's shm ops) are not counted."),
    ("max abs dparam: max abs difference of the final full fp32 parameters from the reference runner "
     "(same initial weights and data); 'ok' when within the stated tolerance."),
]


# ---------------------------------------------------------------------------------------- arguments


def _runner_list(text: str) -> list[str]:
    names = list(RUNNER_NAMES) if text in ("all", "") else [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNNERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown runner(s) {bad}; choose from {', '.join(RUNNER_NAMES)}")
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphzero-compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="mlp")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage (default 2)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: DeepSpeed bf16 with data_types.grad_accum_dtype fp32")
    p.add_argument("--gas", type=int, default=1, help="gradient accumulation steps (micro-batches per step)")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under a launcher)")
    p.add_argument("--steps", type=int, default=20, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds before measuring (>= 1)")
    p.add_argument("--runners", type=_runner_list, default=list(RUNNER_NAMES),
                   help=f"comma-separated subset of: {', '.join(RUNNER_NAMES)} (default: all)")
    p.add_argument("--reference", default="ddp", help="runner whose final parameters the others are "
                   "compared with (falls back to the first of ddp, ds-plain-backward, ... that succeeded)")
    p.add_argument("--tol", type=float, default=None,
                   help=f"tolerance on max|dparam| (default {DEFAULT_TOL['fp32']} fp32, {DEFAULT_TOL['bf16']} bf16)")
    size = p.add_argument_group("workload size (defaults per model; --tiny for tests)")
    size.add_argument("--tiny", action="store_true", help="tiny sizes, for smoke tests")
    for opt in ("width", "depth", "batch", "seq", "vocab", "heads"):
        size.add_argument(f"--{opt}", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=Hyper.lr)
    p.add_argument("--graphzero-call", choices=("engine", "module"), default="engine",
                   help="graphzero runners call each part as engine(x) (default) or engine.module(x)")
    p.add_argument("--reduce-bucket-size", type=int, default=None, metavar="ELEMENTS",
                   help="DeepSpeed zero_optimization.reduce_bucket_size (default: DeepSpeed's, 5e8; "
                   "ZeRO-3 allocates a bucket that size up front)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds: bounds a collective that a failed rank never joins")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: CPU count // ranks per node)")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="bar chart of step time and memory (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="DeepSpeed's INFO logs and tracebacks")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first round includes compilation)")
    if args.steps < 1 or args.gas < 1 or args.world_size < 1:
        parser.error("--steps, --gas and --world-size must be >= 1")
    try:
        resolve_size(args.model, args.tiny, **_size_overrides(args))
    except ValueError as e:
        parser.error(str(e))
    args.argv = list(sys.argv if argv is None else [sys.argv[0], *argv])
    return args


def _command_line(argv: list[str]) -> str:
    """The command as a user would retype it (``python -m graphzero_tools.compare`` for ``-m``)."""
    prog = os.path.basename(argv[0]) if argv else "graphzero-compare"
    head = "python -m graphzero_tools.compare" if prog in ("compare.py", "__main__.py", "-c") else prog
    return " ".join([head, *(shlex.quote(a) for a in argv[1:])])


def _size_overrides(args: argparse.Namespace) -> dict[str, int | None]:
    return {k: getattr(args, k) for k in ("width", "depth", "batch", "seq", "vocab", "heads")}


# ------------------------------------------------------------------------------- process plumbing


def _under_launcher() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(args.world_size))
    _worker(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if _under_launcher():
        _worker(args)
        return 0
    import torch.multiprocessing as mp

    try:
        mp.spawn(_spawn_entry, args=(args, _free_port()), nprocs=args.world_size, join=True)
    except Exception as e:  # noqa: BLE001  (a rank died outside any runner: report and fail)
        print(f"graphzero-compare: a rank failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------ measurement


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _hwm_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _storage_key(t: torch.Tensor) -> tuple | None:
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
        key = _storage_key(t)
        if key is None or key in seen or key in exclude:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total, seen


def memory_bytes(runner: Runner) -> tuple[int, int]:
    """(gradient bytes, optimizer-state bytes) of the runner's live tensors on this rank."""
    grads, state, params = runner.memory_tensors()
    param_keys = {k for k in map(_storage_key, params) if k is not None}
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


def _dynamo_counts() -> tuple[int, int]:
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001  (dynamo unavailable: no counts)
        return 0, 0
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def _format_error(e: BaseException, limit: int = 600) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------- worker


class _Group:
    """Control collectives on a separate gloo group: failure agreement, barriers, gathering results.
    Its timeout is longer than the runners' so that a runner collective times out first."""

    def __init__(self, timeout_s: float):
        import torch.distributed as dist

        self.dist = dist
        self.pg = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=2 * timeout_s + 60))
        self.world = dist.get_world_size()

    def barrier(self) -> None:
        self.dist.barrier(group=self.pg)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.pg)
        return out

    def agree(self, outcome: tuple[str, str] | None) -> tuple[str, str] | None:
        """``outcome`` is None (fine) or (kind, message), kind 'failed' or 'skipped'. Returns the
        outcome all ranks agree on: failed if any rank failed, else skipped if any skipped."""
        flag = torch.tensor([0 if outcome is None else 1], dtype=torch.int32)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.pg)
        if not flag.item():
            return None
        outcomes = self.gather(outcome)
        for kind in ("failed", "skipped"):
            msgs = [(r, o[1]) for r, o in enumerate(outcomes) if o is not None and o[0] == kind]
            if msgs:
                distinct = list(dict.fromkeys(m for _, m in msgs))
                if len(distinct) == 1:
                    return kind, distinct[0] if len(msgs) == self.world else f"{distinct[0]} (rank {msgs[0][0]})"
                return kind, "; ".join(f"rank {r}: {m}" for r, m in msgs)
        return None


class _Tracker:
    """Everything one rank records about one runner."""

    def __init__(self, name: str):
        self.name = name
        self.status = "pending"
        self.error: str | None = None
        self.failed_at: str | None = None
        self.setup_s: float | None = None
        self.first_step_s: float | None = None
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self.grad_bytes: int | None = None
        self.optim_bytes: int | None = None
        self.peak_rss = 0
        self.rss_growth = 0
        self.peak_device: int | None = None
        self.collectives: dict[str, Any] | None = None
        self.graphs = 0
        self.graph_breaks = 0
        self.timed_graphs = 0  # graphs compiled during timed steps: recompiles in the steady state

    def local(self) -> dict[str, Any]:
        return dict(vars(self))


#: A failure that timed out or closed a connection of the runners' (default) process group: with gloo
#: the group's pairs are closed, so later runners on that group fail too (their errors say so).
_COLLECTIVE_BROKEN = re.compile(r"[Tt]imed out|[Tt]imeout|Connection closed|pair closure")


_TRACEBACKS = False  # set from --verbose in each rank


def _run_guarded(fn, *a, **kw) -> tuple[Any, tuple[str, str] | None]:
    try:
        return fn(*a, **kw), None
    except RunnerSkipped as e:
        return None, ("skipped", str(e))
    except Exception as e:  # noqa: BLE001  (any runner error is a result: reported, not raised)
        if _TRACEBACKS:  # --verbose: the full traceback, on every rank
            traceback.print_exc()
        return None, ("failed", _format_error(e))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _setup_logging(rank: int, verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", force=True)
    if not verbose:
        for name in ("DeepSpeed", "deepspeed", "torch._dynamo", "torch._inductor", "torch.distributed"):
            logging.getLogger(name).setLevel(logging.WARNING)
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")


def _worker(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # silence kineto's USDT lines
    _setup_logging(rank, args.verbose)
    global _TRACEBACKS
    _TRACEBACKS = args.verbose
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(threads)

    import torch.distributed as dist

    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=args.timeout))
    ctrl = _Group(args.timeout)
    try:
        _run(args, rank, world, device, backend, threads, ctrl)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _run(args, rank, world, device, backend, threads, ctrl: _Group) -> None:
    size = resolve_size(args.model, args.tiny, **_size_overrides(args))
    workload = build_workload(args.model, size, seed=args.seed)
    if args.dtype == "bf16":
        for part in workload.parts.values():
            bf16_round_(part)
    ctx = RunContext(workload=workload, stage=args.stage, bf16=args.dtype == "bf16", gas=args.gas,
                     rank=rank, world_size=world, device=device, hyper=Hyper(lr=args.lr),
                     graphzero_call=args.graphzero_call, reduce_bucket_size=args.reduce_bucket_size)
    if any(issubclass(RUNNERS[n], _ds_base()) for n in args.runners):
        _init_deepspeed(backend, args.timeout, args.verbose)
    ctrl.barrier()

    trackers = {n: _Tracker(n) for n in args.runners}
    runners: dict[str, Runner] = {}
    total_rounds = args.warmup + 1 + args.steps
    log.info("model %s (%s), ZeRO-%d, %s, gas %d, %d ranks (%s, %d threads each), %d rounds "
             "(%d warm-up, 1 measurement, %d timed)", args.model, workload.description, args.stage,
             args.dtype, args.gas, world, backend, threads, total_rounds, args.warmup, args.steps)

    broken_by: list[str] = []  # runners whose failure timed out a collective on the shared group

    def fail(name: str, outcome: tuple[str, str], where: str) -> None:
        tr = trackers[name]
        message = outcome[1]
        if broken_by:
            message += f" [after {broken_by[0]}'s collective timed out: the default process group may be broken]"
        elif _COLLECTIVE_BROKEN.search(message):
            broken_by.append(name)
        tr.status, tr.error, tr.failed_at = outcome[0], message, where
        if rank == 0:
            log.warning("%s %s at %s: %s", name, outcome[0], where, message)
        r = runners.pop(name, None)
        if r is not None:
            with contextlib.suppress(Exception):
                r.close()

    for name in args.runners:
        runner = RUNNERS[name](ctx)
        t0 = time.perf_counter()
        _, outcome = _run_guarded(runner.setup)
        trackers[name].setup_s = time.perf_counter() - t0
        outcome = ctrl.agree(outcome)
        runners[name] = runner
        if outcome:
            fail(name, outcome, "setup")
        else:
            trackers[name].status = "ok"
            log.info("%s: set up in %.1f s", name, trackers[name].setup_s)

    pbar = _progress(total_rounds, rank == 0 and not args.no_progress, f"{args.model} ZeRO-{args.stage}")
    for rnd in range(total_rounds):
        phase = "warmup" if rnd < args.warmup else "measure" if rnd == args.warmup else "timed"
        micro = [workload.make_batch(batch_generator(args.seed, rank, rnd, k)) for k in range(args.gas)]
        live = list(runners)
        order = live[rnd % len(live):] + live[: rnd % len(live)] if live else []
        for name in order:
            outcome = _one_step(runners[name], trackers[name], micro, phase, rnd, device, ctrl, world)
            outcome = ctrl.agree(outcome)
            if outcome:
                fail(name, outcome, f"step {rnd} ({phase})")
        if pbar is not None:
            pbar.set_postfix_str(f"{phase}, {len(runners)} live")
            pbar.update(1)
    if pbar is not None:
        pbar.close()

    # final parameters: reference first, then every other live runner, compared on rank 0
    ref_name = _pick_reference(args.reference, runners)
    tol = args.tol if args.tol is not None else DEFAULT_TOL[args.dtype]
    diffs: dict[str, float | None] = {}
    ref_params = None
    if ref_name is not None:
        ref_params, outcome = _run_guarded(runners[ref_name].full_params)
        outcome = ctrl.agree(outcome)
        if outcome:
            log.warning("could not gather %s's parameters: %s", ref_name, outcome[1])
            ref_params, ref_name = None, None
        else:
            diffs[ref_name] = 0.0
    for name in list(runners):
        if ref_params is None or name == ref_name:
            continue
        params, outcome = _run_guarded(runners[name].full_params)
        outcome = ctrl.agree(outcome)
        if outcome:
            log.warning("could not gather %s's parameters: %s", name, outcome[1])
            diffs[name] = None
        elif rank == 0:
            diffs[name] = param_diff(ref_params, params)

    locals_ = ctrl.gather({n: t.local() for n, t in trackers.items()})
    report_error = None
    if rank == 0:
        try:
            result = build_result(args, workload, world, backend, device, threads, locals_, diffs, ref_name, tol)
            if args.json:
                _write_json(result, args.json)
            print(format_table(result), flush=True)
            if args.plot:
                write_plot(result, args.plot)
        except Exception as e:  # noqa: BLE001  (keep the other ranks from waiting on a dead peer)
            traceback.print_exc()
            report_error = e
    ctrl.barrier()
    for r in runners.values():
        with contextlib.suppress(Exception):
            r.close()
    if report_error is not None:
        raise RuntimeError(f"could not write the report: {_format_error(report_error)}") from report_error


def _ds_base():
    from .bench_runners import DeepSpeedPlainBackward

    return DeepSpeedPlainBackward


def _init_deepspeed(backend: str, timeout: float, verbose: bool) -> None:
    """Import DeepSpeed and attach it to the existing process group (the first import JIT-builds
    DeepSpeed's CPU comm op). A failure here shows up as every DeepSpeed runner failing in setup."""
    try:
        import deepspeed

        if not verbose:  # DeepSpeed sets its logger to INFO when imported
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend=backend, timeout=dt.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001  (reported by every DeepSpeed runner's setup)
        log.warning("deepspeed unavailable: %s", _format_error(e))


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="round", file=sys.stderr, dynamic_ncols=True)


def _one_step(runner: Runner, tr: _Tracker, micro, phase: str, rnd: int, device, ctrl: _Group,
              world: int) -> tuple[str, str] | None:
    graphs0, breaks0 = _dynamo_counts()
    extra: dict[str, Any] = {}

    def count_grads() -> None:
        extra["grad_bytes"] = _metric(lambda: memory_bytes(runner)[0], "gradient bytes", runner.name)

    if phase == "timed":
        _malloc_trim()
        have_hwm = _reset_hwm()
        rss0 = _rss_bytes()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    ctrl.barrier()
    _sync(device)
    t0 = time.perf_counter()
    if phase == "measure":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            loss, outcome = _run_guarded(runner.step, micro, before_optimizer=count_grads)
            _sync(device)
    else:
        loss, outcome = _run_guarded(runner.step, micro)
        _sync(device)
    elapsed = time.perf_counter() - t0
    graphs1, breaks1 = _dynamo_counts()
    tr.graphs += graphs1 - graphs0
    tr.graph_breaks += breaks1 - breaks0
    if phase == "timed":
        tr.timed_graphs += graphs1 - graphs0
    if outcome:
        return outcome
    tr.losses.append(float(loss))
    if rnd == 0:
        tr.first_step_s = elapsed
    if phase == "timed":
        tr.step_s.append(elapsed)
        hwm = _hwm_bytes()
        tr.peak_rss = max(tr.peak_rss, hwm)
        if have_hwm:
            tr.rss_growth = max(tr.rss_growth, hwm - rss0)
        if device.type == "cuda":
            tr.peak_device = max(tr.peak_device or 0, torch.cuda.max_memory_allocated(device))
    elif phase == "measure":
        tr.collectives = summarize_collectives(prof.events(), world)
        tr.grad_bytes = extra.get("grad_bytes")
        tr.optim_bytes = _metric(lambda: memory_bytes(runner)[1], "optimizer bytes", runner.name)
    return None


def _metric(fn, what: str, name: str):
    """A metric that cannot be taken is reported as n/a, never as a runner failure."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (a metric is best effort)
        log.warning("%s: could not count %s: %s", name, what, _format_error(e))
        return None


def _pick_reference(wanted: str, runners: dict[str, Runner]) -> str | None:
    for name in (wanted, *REFERENCE_FALLBACKS, *runners):
        if name in runners:
            return name
    return None


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


# ---------------------------------------------------------------------------------------- results


def machine_info(device: torch.device | None = None) -> dict[str, Any]:
    from importlib import metadata

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    cpu_model = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "torch": torch.__version__,
        "deepspeed": version("deepspeed"),
        "graphzero": version("graphzero"),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None,
    }
    return info


def _median_ms(entry: dict[str, Any]) -> float | None:
    return (entry.get("step_ms") or {}).get("median")


def build_result(args, workload, world, backend, device, threads, per_rank: list[dict[str, dict]],
                 diffs: dict[str, float | None], ref_name: str | None, tol: float) -> dict[str, Any]:
    runners: dict[str, dict[str, Any]] = {}
    for name in args.runners:
        ranks = [r[name] for r in per_rank]
        r0 = ranks[0]
        status = next((r["status"] for r in ranks if r["status"] != "ok"), r0["status"])
        entry = {k: None for k in RUNNER_KEYS}
        entry.update(status=status, error=r0["error"], failed_at=r0["failed_at"],
                     setup_s=_round(max((r["setup_s"] or 0.0) for r in ranks), 3),
                     losses=r0["losses"], final_loss=r0["losses"][-1] if r0["losses"] else None,
                     graphs=r0["graphs"] if RUNNERS[name].compiled else None,
                     graph_breaks=r0["graph_breaks"] if RUNNERS[name].compiled else None,
                     timed_graphs=r0["timed_graphs"] if RUNNERS[name].compiled else None)
        if status == "ok":
            steps = [max(vals) * 1e3 for vals in zip(*(r["step_s"] for r in ranks))]
            median = statistics.median(steps)
            first = max(r["first_step_s"] for r in ranks) * 1e3
            coll = r0["collectives"] or {}
            entry.update(
                step_ms={"median": _round(median, 3), "min": _round(min(steps), 3),
                         "max": _round(max(steps), 3), "all": [_round(s, 3) for s in steps]},
                first_step_ms=_round(first, 3), compile_s=_round(max(0.0, first - median) / 1e3, 3),
                grad_bytes_per_rank=[r["grad_bytes"] for r in ranks],
                optim_bytes_per_rank=[r["optim_bytes"] for r in ranks],
                peak_rss_mib=_round(max(r["peak_rss"] for r in ranks) / 2**20, 1),
                step_rss_growth_mib=_round(max(r["rss_growth"] for r in ranks) / 2**20, 1),
                peak_device_mib=(_round(max(r["peak_device"] or 0 for r in ranks) / 2**20, 1)
                                 if r0["peak_device"] is not None else None),
                collectives_per_step=max((r["collectives"] or {}).get("count", 0) for r in ranks),
                bytes_reduced_per_step=max((r["collectives"] or {}).get("bytes_reduced", 0) for r in ranks),
                bytes_gathered_per_step=max((r["collectives"] or {}).get("bytes_gathered", 0) for r in ranks),
                collectives_by_op=coll.get("by_op"),
                max_abs_param_diff=diffs.get(name),
                params_match=None if diffs.get(name) is None else bool(diffs[name] <= tol),
            )
            gb = [b for b in entry["grad_bytes_per_rank"] if b is not None]
            ob = [b for b in entry["optim_bytes_per_rank"] if b is not None]
            entry["grad_bytes"] = max(gb) if gb else None
            entry["optim_bytes"] = max(ob) if ob else None
        runners[name] = entry
    for name, entry in runners.items():
        for base, key in (("ddp", "ratio_vs_ddp"), ("ds-plain-backward", "ratio_vs_ds_plain_backward")):
            mine, theirs = _median_ms(entry), _median_ms(runners.get(base, {}))
            entry[key] = _round(mine / theirs, 3) if mine and theirs else None
    return {
        "schema": 1,
        "command": _command_line(args.argv),
        "argv": args.argv,
        "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "workload": {"model": args.model, "description": workload.description, "size": asdict(workload.size),
                     "parts": workload.numel(), "stage": args.stage, "dtype": args.dtype, "gas": args.gas,
                     "world_size": world, "backend": backend, "device": device.type,
                     "threads_per_rank": threads, "warmup": args.warmup, "steps": args.steps,
                     "rounds": args.warmup + 1 + args.steps, "seed": args.seed, "lr": args.lr},
        "reference": ref_name,
        "tolerance": tol,
        "notes": NOTES,
        "runners": runners,
    }


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(float(x), nd)


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def format_table(result: dict[str, Any]) -> str:
    """The rank-0 report: a tabulate table, then the failures and the notes."""
    from tabulate import tabulate

    ref = result.get("reference")
    headers = ["runner", "status", "step ms med [min, max]", "x ddp", "x ds-plain", "compile s",
               "grad", "optim", "peak RSS MiB", "+step MiB", "colls/step", "reduced/step",
               "graphs/breaks (timed)", f"max abs dparam vs {ref or 'n/a'}"]
    rows, failures = [], []
    for name, e in result["runners"].items():
        status = e["status"]
        if status != "ok":
            failures.append(f"[{len(failures) + 1}] {name}: {status}"
                            f"{' at ' + e['failed_at'] if e.get('failed_at') and status == 'failed' else ''}: "
                            f"{e['error']}")
            rows.append([name, f"{status} [{len(failures)}]"] + ["-"] * (len(headers) - 2))
            continue
        s = e["step_ms"]
        diff = e["max_abs_param_diff"]
        diff_s = "ref" if name == ref else "n/a" if diff is None else (
            f"{diff:.1e} {'ok' if e['params_match'] else 'DIFFERS'}")
        gb = "-" if e["graphs"] is None else f"{e['graphs']}/{e['graph_breaks']} ({e['timed_graphs']})"
        rows.append([name, "ok", f"{s['median']:.1f} [{s['min']:.1f}, {s['max']:.1f}]",
                     _num(e["ratio_vs_ddp"], ".2f"), _num(e["ratio_vs_ds_plain_backward"], ".2f"),
                     _num(e["compile_s"], ".1f"), _bytes(e["grad_bytes"]), _bytes(e["optim_bytes"]),
                     _num(e["peak_rss_mib"], ".0f"), _num(e["step_rss_growth_mib"], ".1f"),
                     e["collectives_per_step"], _bytes(e["bytes_reduced_per_step"]), gb, diff_s])
    w = result["workload"]
    title = (f"graphzero-compare: {w['model']} ({w['description']}), ZeRO-{w['stage']}, {w['dtype']}, "
             f"gas {w['gas']}, {w['world_size']} ranks {w['backend']}/{w['device']}, "
             f"{w['steps']} timed steps after {w['warmup']} warm-up + 1 measurement")
    lines = [title, tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)]
    if failures:
        lines += ["", "not run / failed:"] + failures
    lines += ["", f"tolerance for 'ok' params: {result['tolerance']:g}"]
    lines += [f"- {n}" for n in result["notes"]]
    return "\n".join(lines)


def _write_json(result: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")
    log.info("wrote %s", path)


def write_plot(result: dict[str, Any], path: str) -> bool:
    """Bar chart per runner: step time (median, min-max whiskers), gradient + optimizer-state bytes per
    rank, and RSS growth within a step (peak RSS is process-wide, so nearly equal for all)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    names = list(result["runners"])
    ents = [result["runners"][n] for n in names]
    ok = [e["status"] == "ok" for e in ents]
    x = list(range(len(names)))
    fig, axes = plt.subplots(1, 3, figsize=(max(9, 1.6 * len(names) * 1.5), 4.2))
    med = [e["step_ms"]["median"] if k else 0 for e, k in zip(ents, ok)]
    lo = [e["step_ms"]["median"] - e["step_ms"]["min"] if k else 0 for e, k in zip(ents, ok)]
    hi = [e["step_ms"]["max"] - e["step_ms"]["median"] if k else 0 for e, k in zip(ents, ok)]
    axes[0].bar(x, med, yerr=[lo, hi], capsize=3, color="tab:blue")
    axes[0].set_ylabel("step time, ms (median, min-max)")
    mib = 2**20
    grad = [(e["grad_bytes"] or 0) / mib if k else 0 for e, k in zip(ents, ok)]
    opt = [(e["optim_bytes"] or 0) / mib if k else 0 for e, k in zip(ents, ok)]
    axes[1].bar(x, grad, label="gradients", color="tab:orange")
    axes[1].bar(x, opt, bottom=grad, label="optimizer state", color="tab:green")
    axes[1].set_ylabel("MiB per rank")
    axes[1].legend(fontsize=8)
    axes[2].bar(x, [(e["step_rss_growth_mib"] or 0) if k else 0 for e, k in zip(ents, ok)], color="tab:gray")
    axes[2].set_ylabel("RSS growth within a step, MiB")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        for i, k in enumerate(ok):
            if not k:
                ax.text(i, 0, ents[i]["status"], rotation=90, ha="center", va="bottom", fontsize=8, color="red")
    w = result["workload"]
    fig.suptitle(f"{w['model']} ZeRO-{w['stage']} {w['dtype']} gas {w['gas']}, {w['world_size']} ranks "
                 f"{w['backend']} ({result['date'][:10]})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote %s", path)
    return True


if __name__ == "__main__":
    sys.exit(main())
