"""Where one graphzero step's time goes, next to DDP (run under torchrun, 2 ranks).

    torchrun --standalone --nproc-per-node 2 tools/profile_step.py phases    # forward/backward/step ms, graphzero vs DDP
    torchrun --standalone --nproc-per-node 2 tools/profile_step.py profile   # torch.profiler table (rank 0)
    torchrun --standalone --nproc-per-node 2 tools/profile_step.py runtime   # graphzero's host-side costs, per rank
    TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0 \\
        torchrun --standalone --nproc-per-node 2 tools/profile_step.py compile --mode plain|attach|options

Workload: the `mlp` of graphzero-compare (two engines of 6 x (Linear(512,512) + GELU), batch 64),
fp32, ZeRO-2 (``--stage`` picks another).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import graphzero
from graphzero.options import COLLECTIVES

CONFIG = {"train_micro_batch_size_per_gpu": 64, "gradient_clipping": 1.0, "steps_per_print": 10**9,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 2}, "timers": {"throughput": {"enabled": False}}}


def _deepspeed():
    """DeepSpeed, imported on first use rather than at import: its import is slow and reads
    DS_ACCELERATOR, which this script sets (CPU) when there is no CUDA."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


def mlp() -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(512, 512), nn.GELU())])


def synced() -> float:
    dist.barrier()
    return time.perf_counter()


def graphzero_step(a_model, b_model, how: str, collective: str, stage: int = 2):
    deepspeed = _deepspeed()
    config = {**CONFIG, "zero_optimization": {"stage": stage}}
    a = deepspeed.initialize(model=a_model, config=config)[0]
    b = deepspeed.initialize(model=b_model, config=config)[0]
    options = {"collective": collective}
    if how == "attach":
        graphzero.attach(a=a, b=b)
    else:
        options["engines"] = {"a": a, "b": b}
    step = torch.compile(lambda x, y: (b(a(x)) - y).square().mean(), backend="graphzero", options=options)
    return step, (a, b)


def phases(args, x, y) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    A, B = mlp(), mlp()
    step, engines = graphzero_step(copy.deepcopy(A), copy.deepcopy(B), "attach", args.collective, args.stage)
    da, db = DDP(A), DDP(B)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (da, db)]
    times: dict[str, list[tuple[float, float, float]]] = {"graphzero": [], "ddp": []}
    for _ in range(args.steps + 4):
        t0 = synced(); loss = step(x, y); t1 = synced(); loss.backward(); t2 = synced()
        for e in engines:
            e.step()
        times["graphzero"].append((t1 - t0, t2 - t1, synced() - t2))
        t0 = synced(); loss = (db(da(x)) - y).square().mean(); t1 = synced(); loss.backward(); t2 = synced()
        for m, o in zip((da, db), opts):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            o.zero_grad()
        times["ddp"].append((t1 - t0, t2 - t1, synced() - t2))
    if dist.get_rank() == 0:
        for name, rows in times.items():
            med = [1000 * statistics.median(r[i] for r in rows[4:]) for i in range(3)]
            print(f"{name:10s} forward {med[0]:.1f} ms  backward {med[1]:.1f} ms  step {med[2]:.1f} ms")


def profile(args, x, y) -> None:
    from torch.profiler import ProfilerActivity, record_function
    step, engines = graphzero_step(mlp(), mlp(), "attach", args.collective, args.stage)
    for _ in range(4):
        step(x, y).backward()
        for e in engines:
            e.step()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with record_function("graphzero.forward"):
                loss = step(x, y)
            with record_function("graphzero.backward"):
                loss.backward()
            with record_function("deepspeed.step"):
                for e in engines:
                    e.step()
    if dist.get_rank() == 0:
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


def runtime(args, x, y) -> None:
    """Per rank, the median and mean ms per step of graphzero's backward runtime around the compiled
    graph: the rank agreement, the engines' sinks, the compiled backward itself, and the wrapper."""
    from unittest import mock

    from graphzero import compiler, rank_agreement
    from graphzero.deepspeed_adapter import binding_of
    step, engines = graphzero_step(mlp(), mlp(), "attach", args.collective, args.stage)
    spent: dict[str, list[float]] = {}

    def timed(name: str, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - t)
        return call

    binding = type(binding_of(engines[0]))
    wrapper = compiler.BackwardWithRuntimeInputs.__call__

    def wrapped(self, boxed):
        if not getattr(self, "_timed", False):
            self.compiled, self._timed = timed("compiled backward", self.compiled), True
        return wrapper(self, boxed)

    with mock.patch.object(rank_agreement, "agree", timed("rank agreement", rank_agreement.agree)), \
            mock.patch.object(binding, "sinks", timed("sinks", binding.sinks)), \
            mock.patch.object(compiler.BackwardWithRuntimeInputs, "__call__", timed("backward runtime", wrapped)):
        for i in range(args.steps + 4):
            if i == 4:
                spent.clear()
            loss = step(x, y)
            timed("backward", loss.backward)()
            for e in engines:
                e.step()
    rows = [f"rank {dist.get_rank()}: " + ", ".join(
        f"{name} {1000 * statistics.median(v) * len(v) / args.steps:.2f} / {1000 * sum(v) / args.steps:.2f}"
        for name, v in spent.items())]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        print("ms per step, median x calls per step / mean:")
        print("\n".join(r for rank_rows in every for r in rank_rows))


def compile_time(args, x, y) -> None:
    torch.manual_seed(0)
    if args.mode == "plain":
        a, b = mlp(), mlp()
        step, engines = torch.compile(lambda x, y: (b(a(x)) - y).square().mean()), ()
    else:
        step, engines = graphzero_step(mlp(), mlp(), args.mode, args.collective, args.stage)
    times = []
    for _ in range(4):
        t0 = synced()
        step(x, y).backward()
        for e in engines:
            e.step()
        times.append(synced() - t0)
    if dist.get_rank() == 0:
        print(f"{args.mode}: first two steps {times[0] + times[1]:.2f} s, steady {times[-1]:.3f} s, "
              f"compile {times[0] + times[1] - 2 * times[-1]:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["phases", "profile", "runtime", "compile"])
    parser.add_argument("--mode", choices=["plain", "attach", "options"], default="attach",
                        help="compile: plain inductor, graphzero after graphzero.attach(), or engines in options")
    parser.add_argument("--collective", default="auto", choices=COLLECTIVES)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage of both engines")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _deepspeed().init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.set_default_device(device)
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    {"phases": phases, "profile": profile, "runtime": runtime, "compile": compile_time}[args.what](args, x, y)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
