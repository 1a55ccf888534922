"""``graphzero-compare``: run every runner on the same work, interleaved round by round in the same
processes, and report step time, compile time, memory, collectives and parameter agreement.

    graphzero-compare --model mlp --stage 2                 # 2 ranks, all runners
    graphzero-compare --model gan --tiny --runners ddp,ds-plain-backward --steps 2 --warmup 1
    python -m graphzero_tools.compare --model transformer --dtype bf16 --gas 2 --json out.json --plot out.png
    torchrun --nproc-per-node 2 -m graphzero_tools.compare --model chain3   # any launcher works too

Without a launcher it starts itself on ``--world-size`` ranks (``torch.multiprocessing.spawn``),
gloo on CPU (``DS_ACCELERATOR=cpu``), nccl with CUDA. Rounds: ``--warmup`` untimed rounds (the
first includes compilation), one measurement round (profiler: collectives; live tensors: memory),
one memory round (peak RSS after a malloc_trim), then ``--steps`` timed rounds. In each round every live runner does one optimizer step (``--gas``
micro-batches) on the same data, in an order rotated by one each round; a barrier precedes each
timed step, and the step time is the slowest rank's. After every runner step all ranks agree on
failure (an all-reduce on a separate gloo group), so a runner that raises is reported failed with
its error and the others continue. See docs/benchmarks.md.

This module is the command line and the process start-up. Each rank's round loop is
bench_worker.py (its control collectives bench_control.py), the probes bench_metrics.py, the
JSON/table/plot report bench_report.py, the runners bench_runner.py (interface),
bench_runners_deepspeed.py and bench_runners_torch.py (registry: bench_runners.py), and the
workloads bench_models.py.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from .bench_models import MODELS, SIZE_FIELDS, size_from_args
from .bench_report import DEFAULT_TOL
from .bench_runners import RUNNERS, Hyper
from .bench_worker import worker

RUNNER_NAMES = tuple(RUNNERS)
DEFAULT_RUNNERS = tuple(n for n, cls in RUNNERS.items() if not cls.opt_in)


# ---------------------------------------------------------------------------------------- arguments


def _runner_list(text: str) -> list[str]:
    names = list(DEFAULT_RUNNERS) if text in ("all", "") else [n.strip() for n in text.split(",") if n.strip()]
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
    p.add_argument("--runners", type=_runner_list, default=list(DEFAULT_RUNNERS),
                   help=f"comma-separated subset of: {', '.join(RUNNER_NAMES)} (default, or 'all': every one but the "
                        f"opt-in {', '.join(n for n in RUNNER_NAMES if n not in DEFAULT_RUNNERS)})")
    p.add_argument("--reference", default="ddp", help="runner whose final parameters the others are "
                   "compared with (falls back to the first of ddp, ds-plain-backward, ... that succeeded)")
    p.add_argument("--tol", type=float, default=None,
                   help=f"tolerance on max|dparam| (default {DEFAULT_TOL['fp32']} fp32, {DEFAULT_TOL['bf16']} bf16)")
    size = p.add_argument_group("workload size (defaults per model; --tiny for tests)")
    size.add_argument("--tiny", action="store_true", help="tiny sizes, for smoke tests")
    for opt in SIZE_FIELDS:
        size.add_argument(f"--{opt}", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=Hyper.lr)
    p.add_argument("--graphzero-call", choices=("engine", "module"), default="engine",
                   help="graphzero runners call each part as engine(x) (default) or engine.module(x)")
    p.add_argument("--reduce-bucket-size", type=int, default=None, metavar="ELEMENTS",
                   help="DeepSpeed zero_optimization.reduce_bucket_size (default: DeepSpeed's, 5e8; "
                   "ZeRO-3 allocates a bucket that size up front)")
    p.add_argument("--prefetch-bucket-size", type=int, default=None, metavar="ELEMENTS",
                   help="ZeRO-3: DeepSpeed zero_optimization.stage3_prefetch_bucket_size (default DeepSpeed's, "
                   "5e7: it bounds how far DeepSpeed eager gathers ahead; graphzero prefetches one gather)")
    p.add_argument("--max-live-parameters", type=int, default=None, metavar="ELEMENTS",
                   help="ZeRO-3: DeepSpeed zero_optimization.stage3_max_live_parameters (default DeepSpeed's, 1e9)")
    p.add_argument("--max-reuse-distance", type=int, default=None, metavar="ELEMENTS",
                   help="ZeRO-3: DeepSpeed zero_optimization.stage3_max_reuse_distance (default DeepSpeed's, 1e9: "
                   "a parameter used again within that many elements, e.g. in the backward, stays gathered)")
    p.add_argument("--persistence-threshold", type=int, default=0, metavar="ELEMENTS",
                   help="ZeRO-3: DeepSpeed zero_optimization.stage3_param_persistence_threshold (default 0: "
                   "every parameter partitioned, as FSDP2 does; DeepSpeed's own default is 1e5: smaller "
                   "parameters stay gathered and step() gathers them again)")
    p.add_argument("--frozen-stage", type=int, choices=(0, 3), default=3,
                   help="ZeRO stage of the frozen parts' DeepSpeed engines (rlhf's reference and reward; default 3, "
                   "as examples/rlhf_ppo.py; 0 keeps them replicated, as DDP and the ideal have them)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds: bounds a collective that a failed rank never joins")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: CPU count // ranks per node)")
    p.add_argument("--malloc", choices=("default", "retain"), default="default",
                   help="CPU memory allocator policy of every rank (all runners alike): 'default' is glibc's, "
                        "which returns freed multi-MiB buffers to the OS so each step page-faults them in "
                        "again; 'retain' makes glibc keep them for reuse, as jemalloc/tcmalloc do")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="bar chart of step time and memory (matplotlib)")
    p.add_argument("--timeline", metavar="PATH.png",
                   help="each runner's profiled step, compute and collectives per rank, side by side (matplotlib)")
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
        size_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    args.argv = list(sys.argv if argv is None else [sys.argv[0], *argv])
    return args


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
    worker(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if _under_launcher():
        worker(args)
        return 0
    import torch.multiprocessing as mp

    try:
        mp.spawn(_spawn_entry, args=(args, _free_port()), nprocs=args.world_size, join=True)
    except Exception as e:  # noqa: BLE001  (a rank died outside any runner: report and fail)
        print(f"graphzero-compare: a rank failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
