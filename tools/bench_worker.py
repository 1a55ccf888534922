"""What each rank of ``graphzero-compare`` runs: set every runner up, play the rounds (warm-up,
one measurement round, timed rounds) with the runners' order rotated each round, agree on failures
across ranks after every runner step, compare final parameters with the reference, and have rank 0
write the report. A runner that raises is reported with its error; the others continue.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import logging
import os
import re
import sys
import time
import traceback
from typing import Any

import torch

from .bench_control import ControlGroup
from .bench_metrics import (
    GatheredParamProbe,
    PhaseTimer,
    dynamo_counts,
    hwm_bytes,
    malloc_trim,
    memory_bytes,
    param_diff,
    reset_hwm,
    retain_freed_memory,
    rss_bytes,
    summarize_collectives,
)
from .bench_models import batch_generator, bf16_round_, build_workload, size_from_args
from .bench_overlap import plot_timelines, step_overlap
from .bench_report import DEFAULT_TOL, build_result, format_table, write_json, write_plot
from .bench_runners import RUNNERS, Hyper, RunContext, Runner, RunnerSkipped

log = logging.getLogger("graphzero.compare")

REFERENCE_FALLBACKS = ("ddp", "ds-plain-backward", "ds-engine-backward", "fsdp2")


def _format_error(e: BaseException, limit: int = 600) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        self.phase_s: list[dict[str, float]] = []  # per timed step: forward / backward / step seconds
        self.losses: list[float] = []
        self.grad_bytes: int | None = None
        self.optim_bytes: int | None = None
        self.peak_rss = 0
        self.rss_growth = 0
        self.peak_device: int | None = None
        self.collectives: dict[str, Any] | None = None
        self.overlap: dict[str, Any] | None = None  # collective time hidden under compute (bench_overlap)
        self.gathered_peak: dict[str, int] | None = None  # bytes per phase (ZeRO-3, FSDP2)
        self.gathered_source: str | None = None  # "measured" or "compiled schedule"
        self.safety_net: int | None = None  # graphzero: eager safety-net calls in the measurement step
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


def worker(args: argparse.Namespace) -> None:
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
    # inductor's C++ kernels as profiler ranges: the compute that collectives overlap with (bench_overlap)
    import torch._inductor.config as inductor_config
    inductor_config.cpp.enable_kernel_profile = True
    if args.malloc == "retain" and not retain_freed_memory():
        log.warning("--malloc retain: glibc's mallopt refused; running with the default allocator policy")

    import torch.distributed as dist

    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=args.timeout))
    ctrl = ControlGroup(args.timeout)
    try:
        _run(args, rank, world, device, backend, threads, ctrl)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _run(args, rank, world, device, backend, threads, ctrl: ControlGroup) -> None:
    size = size_from_args(args)
    workload = build_workload(args.model, size, seed=args.seed)
    if args.dtype == "bf16":
        for part in workload.parts.values():
            bf16_round_(part)
    ctx = RunContext(workload=workload, stage=args.stage, bf16=args.dtype == "bf16", gas=args.gas,
                     rank=rank, world_size=world, device=device, hyper=Hyper(lr=args.lr),
                     graphzero_call=args.graphzero_call, reduce_bucket_size=args.reduce_bucket_size,
                     prefetch_bucket_size=args.prefetch_bucket_size, max_live_parameters=args.max_live_parameters,
                     max_reuse_distance=args.max_reuse_distance,
                     persistence_threshold=args.persistence_threshold, frozen_stage=args.frozen_stage)
    if any(issubclass(RUNNERS[n], _ds_base()) for n in args.runners):
        _init_deepspeed(backend, args.timeout, args.verbose)
    ctrl.barrier()

    trackers = {n: _Tracker(n) for n in args.runners}
    runners: dict[str, Runner] = {}
    total_rounds = args.warmup + 2 + args.steps
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
        phase = ("warmup" if rnd < args.warmup else "measure" if rnd == args.warmup
                 else "memory" if rnd == args.warmup + 1 else "timed")
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
                write_json(result, args.json)
            print(format_table(result), flush=True)
            if args.plot:
                write_plot(result, args.plot)
            if args.timeline and not plot_timelines(result, args.timeline):
                log.warning("--timeline: no timeline drawn (matplotlib missing, or no runner has one)")
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


def _one_step(runner: Runner, tr: _Tracker, micro, phase: str, rnd: int, device, ctrl: ControlGroup,
              world: int) -> tuple[str, str] | None:
    graphs0, breaks0 = dynamo_counts()
    extra: dict[str, Any] = {}

    def count_grads() -> None:
        extra["grad_bytes"] = _metric(lambda: memory_bytes(runner)[0], "gradient bytes", runner.name)

    if phase == "memory":
        # Its own round: the trim returns freed heap to the OS so the high-water mark starts from
        # what is live, and a step after a trim page-faults in all it allocates. A training loop
        # never trims, so the timed rounds do not either (they once did: every runner 15-30%
        # slower, the ones allocating fresh buffers each step most).
        malloc_trim()
        have_hwm = reset_hwm()
        rss0 = rss_bytes()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    timer = PhaseTimer(device)
    ctrl.barrier()
    _sync(device)
    t0 = time.perf_counter()
    if phase == "measure":
        from torch.profiler import ProfilerActivity, profile

        counts_eager = hasattr(runner, "eager_grads_seen")  # graphzero runners: the safety net
        eager0 = _metric(runner.eager_grads_seen, "eager gradients", runner.name) if counts_eager else None
        sharded = _metric(runner.gathered_params, "gathered parameters", runner.name) is not None
        probe = GatheredParamProbe(runner, timer) if sharded else None
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            with probe if probe is not None else contextlib.nullcontext():
                loss, outcome = _run_guarded(runner.step, micro, before_optimizer=count_grads, phases=timer)
            _sync(device)
    else:
        loss, outcome = _run_guarded(runner.step, micro, phases=timer)
        _sync(device)
    elapsed = time.perf_counter() - t0
    graphs1, breaks1 = dynamo_counts()
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
        tr.phase_s.append(timer.totals())
    elif phase == "memory":
        hwm = hwm_bytes()
        tr.peak_rss = max(tr.peak_rss, hwm)
        if have_hwm:
            tr.rss_growth = max(tr.rss_growth, hwm - rss0)
        if device.type == "cuda":
            tr.peak_device = max(tr.peak_device or 0, torch.cuda.max_memory_allocated(device))
    elif phase == "measure":
        events = prof.events()
        tr.collectives = summarize_collectives(events, world)
        if device.type == "cpu":   # NCCL's time is on the device, which these host events do not time
            tr.overlap = _metric(lambda: step_overlap(events), "collective overlap", runner.name)
        tr.grad_bytes = extra.get("grad_bytes")
        tr.optim_bytes = _metric(lambda: memory_bytes(runner)[1], "optimizer bytes", runner.name)
        if eager0 is not None:
            tr.safety_net = _metric(lambda: runner.eager_grads_seen() - eager0, "eager gradients", runner.name)
        if probe is not None:
            tr.gathered_peak, tr.gathered_source = probe.peak, "measured"
        elif hasattr(runner, "graph_stats"):
            tr.gathered_peak = _metric(runner.graph_stats, "gathered-parameter peak", runner.name)
            tr.gathered_source = "compiled schedule" if tr.gathered_peak is not None else None
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
