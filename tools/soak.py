"""``graphzero-soak``: a long GAN or PPO run under graphzero that watches memory and recompiles.

    graphzero-soak --steps 2000 --json soak.json        # 2 gloo ranks, GAN workload, ZeRO-2
    graphzero-soak --steps 5000 --stage 3 --recompile-every 500
    graphzero-soak --workload rlhf --steps 2000 --stage 3
    torchrun --nproc-per-node 2 -m graphzero_tools.soak --steps 500 --stage 1

Each rank trains the ``gan`` workload (the discriminator is called twice in one loss), or with
``--workload rlhf`` graphzero-compare's PPO loss (a GPT-2 actor and critic trained, the reference
and reward models frozen ZeRO-3 engines called inside the step), with every engine owned by
graphzero, samples its resident memory every ``--sample-every`` steps and reads
Dynamo's counters (graphs compiled, graph breaks, recompiles). With ``--recompile-every N`` the
step is compiled anew every N steps (``torch._dynamo.reset()``, as a notebook or a long job that
changes shapes would), so a leak per compile shows; ``--release-torch-caches`` then also empties
what torch itself keeps of each compile (``graphzero_tools.compile_leftovers``), so that what is
left is graphzero's. After the warm-up (``--warmup`` steps) a
healthy run shows no RSS growth beyond noise and no compiles but the forced ones. At the end one
more backward is checked against a single-process reference from the engines' current weights
(every parameter's reduced gradient within 1e-5 of that tensor's largest element). Rank 0 prints a table and writes
JSON; the exit code is 1 when a check fails (``--max-growth-pct``, ``--max-growth-mib`` when given,
compiles, the gradient check), and the verdict names each failed check.
"""
from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import logging
import os
import socket
import sys
import time

import torch

log = logging.getLogger("graphzero.soak")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphzero-soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    p.add_argument("--sample-every", type=int, default=100, help="RSS/counter sample interval in steps")
    p.add_argument("--warmup", type=int, default=200, help="steps before growth is measured")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage of both engines")
    p.add_argument("--recompile-every", type=int, default=0,
                   help="compile the step anew every N steps (torch._dynamo.reset()); 0: never")
    p.add_argument("--release-torch-caches", action="store_true",
                   help="with each forced reset, empty torch's own per-compile caches (compile_leftovers)")
    p.add_argument("--one-gloo-thread", action="store_true",
                   help="every gloo group with one worker thread (graphzero_tools.gloo_threads: the "
                        "workaround for torch's gloo heap corruption); default: torch's two")
    p.add_argument("--inner", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--no-overlap", action="store_true",
                   help="option overlap=False: each collective waited for right after it is issued")
    p.add_argument("--deepspeed-step", action="store_true",
                   help="DeepSpeed's own optimizer step (option lean_step=False): graphzero's fused update out")
    p.add_argument("--collective", choices=("auto", "reduce_scatter", "all_to_all", "all_reduce"), default="auto",
                   help="graphzero's option of that name (how a gradient bucket is reduced)")
    p.add_argument("--workload", choices=("gan", "rlhf"), default="gan",
                   help="gan: two trained engines, the discriminator called twice per loss; rlhf: the PPO "
                        "loss, actor and critic trained, reference and reward frozen ZeRO-3 engines inside the step")
    p.add_argument("--width", type=int, default=64, help="hidden width of the models")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under a launcher)")
    p.add_argument("--max-growth-pct", type=float, default=5.0,
                   help="fail when RSS after warm-up grows by more than this percentage (default 5)")
    p.add_argument("--max-growth-mib", type=float, default=None,
                   help="also fail when RSS grows more than this many MiB after warm-up (default: no "
                        "absolute limit, --max-growth-pct decides)")
    p.add_argument("--json", help="write the samples and verdict here (rank 0)")
    return p


def _ds_config(stage: int, batch: int, frozen: bool = False) -> dict:
    # frozen: no optimizer, a ZeRO-3 inference engine (examples/rlhf_ppo.py's reference and reward)
    zero = {"stage": 3 if frozen else stage}
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0   # every parameter partitioned and gathered
    if frozen:
        return {"train_micro_batch_size_per_gpu": batch, "zero_optimization": zero,
                "timers": {"throughput": {"enabled": False}}, "steps_per_print": 10**9}
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": zero, "gradient_clipping": 1.0,
            "timers": {"throughput": {"enabled": False}}, "steps_per_print": 10**9}


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters
    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(counters["recompiles"].values()))}


def run_rank(args: argparse.Namespace) -> dict | None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.one_gloo_thread:
        from .gloo_threads import one_worker_thread_per_gloo_group
        one_worker_thread_per_gloo_group()
    import deepspeed
    import torch.distributed as dist

    import graphzero  # noqa: F401  (registers the backend)

    from .bench_metrics import rss_bytes
    from .bench_models import build_workload, resolve_size
    from .compile_leftovers import release_compile_leftovers

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank()
    size = resolve_size(args.workload, tiny=True, width=args.width)
    work = build_workload(args.workload, size, seed=0)
    reference = copy.deepcopy(work.parts)   # before ZeRO-3 partitions the parts
    engines = {name: deepspeed.initialize(model=part, config=_ds_config(args.stage, size.batch, name in work.frozen),
                                          model_parameters=part.parameters())[0]
               for name, part in work.parts.items()}
    trained = [engines[name] for name in work.trained]
    step = torch.compile(work.loss, backend="graphzero", options={"engines": engines, "inner": args.inner,
                                                                   "collective": args.collective,
                                                                   "lean_step": not args.deepspeed_step,
                                                                   "overlap": not args.no_overlap})
    gen = torch.Generator().manual_seed(1000 + rank)
    samples, start = [], time.perf_counter()
    for t in range(1, args.steps + 1):
        if args.recompile_every and t > 1 and (t - 1) % args.recompile_every == 0:
            if args.release_torch_caches:
                release_compile_leftovers()   # resets Dynamo too
            else:
                torch._dynamo.reset()
        step(engines, *work.make_batch(gen)).backward()
        for eng in trained:
            eng.step()
        if t % args.sample_every == 0 or t == args.steps:
            sample = {"step": t, "rss_mib": rss_bytes() / 2**20, "seconds": time.perf_counter() - start,
                      **_counters()}
            samples.append(sample)
            if rank == 0:
                log.info("step %d/%d: rss %.1f MiB, %d graphs, %d recompiles, %.1f s", t, args.steps,
                         sample["rss_mib"], sample["graphs"], sample["recompiles"], sample["seconds"])
    exact = _gradients_exact(step, work, engines, reference)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (samples, exact))
    dist.destroy_process_group()
    return _verdict(args, everyone) if rank == 0 else None


def _gradients_exact(step, work, engines: dict, reference: dict) -> str | None:
    """One more backward on a fixed batch, against a single-process reference holding the engines'
    current weights: None when every reduced gradient matches, else what differs."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    rank, world = dist.get_rank(), dist.get_world_size()
    for name, eng in engines.items():
        params = list(eng.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=eng.zero_optimization_stage() == 3), torch.no_grad():
            for p, q in zip(params, reference[name].parameters()):
                q.copy_(p)
        if name in work.trained:
            eng.zero_grad()
    batches = [work.make_batch(torch.Generator().manual_seed(10**6 + r)) for r in range(world)]
    step(engines, *batches[rank]).backward()
    for batch in batches:
        (work.loss(reference, *batch) / world).backward()
    for name in work.trained:
        eng = engines[name]
        for (pname, p), q in zip(eng.module.named_parameters(), reference[name].parameters()):
            got, want = safe_get_full_grad(p).float(), q.grad.float()
            # relative to the tensor's scale: a long GAN run's gradients reach 1e2, where fp32
            # rounding of a different reduction order is 1e-5 on every element
            if not torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()) + 1e-6):
                return (f"{name}.{pname}: max |difference| {float((got - q.grad).abs().max()):.3g} "
                        f"(reference max {float(q.grad.abs().max()):.3g})")
        eng.zero_grad()
    return None


def _verdict(args: argparse.Namespace, per_rank: list[tuple[list[dict], str | None]]) -> dict:
    # the forced compiles: after each reset, the step's graph once
    forced = (args.steps - 1) // args.recompile_every if args.recompile_every else 0
    ranks = []
    for rank, (samples, inexact) in enumerate(per_rank):
        after = [s for s in samples if s["step"] >= args.warmup] or samples[-1:]
        growth = after[-1]["rss_mib"] - after[0]["rss_mib"]
        # the second half of the measured run: a leak per step or per compile keeps growing there,
        # a working set that reached its high-water mark early does not
        late = after[-1]["rss_mib"] - after[len(after) // 2]["rss_mib"]
        r = {"rank": rank, "rss_growth_mib": growth, "rss_growth_pct": 100.0 * growth / after[0]["rss_mib"],
             "rss_growth_second_half_mib": late, "compiles_after_warmup": after[-1]["graphs"] - after[0]["graphs"],
             "recompiles": samples[-1]["recompiles"], "graph_breaks": samples[-1]["graph_breaks"],
             "graphs": samples[-1]["graphs"], "gradients": inexact or "exact", "samples": samples}
        r["failures"] = _failures(args, r, expected_graphs=1 + forced)
        ranks.append(r)
    return {"steps": args.steps, "warmup": args.warmup, "stage": args.stage, "inner": args.inner,
            "workload": args.workload, "release_torch_caches": args.release_torch_caches,
            "one_gloo_thread": args.one_gloo_thread,
            "flight_recorder_entries": os.environ.get("TORCH_FR_BUFFER_SIZE", "default"),
            "width": args.width, "recompile_every": args.recompile_every, "max_growth_mib": args.max_growth_mib,
            "max_growth_pct": args.max_growth_pct,
            "ok": not any(r["failures"] for r in ranks), "ranks": ranks}


def _failures(args: argparse.Namespace, r: dict, expected_graphs: int) -> list[str]:
    """Each check one rank's run fails, in words (empty when it passes)."""
    failed = []
    if r["rss_growth_pct"] > args.max_growth_pct:
        failed.append(f"RSS grew {r['rss_growth_pct']:+.1f}% after warm-up (limit {args.max_growth_pct:g}%)")
    if args.max_growth_mib is not None and r["rss_growth_mib"] > args.max_growth_mib:
        failed.append(f"RSS grew {r['rss_growth_mib']:+.1f} MiB after warm-up (limit {args.max_growth_mib:g} MiB)")
    if r["graphs"] != expected_graphs:
        failed.append(f"{r['graphs']} graphs compiled where {expected_graphs} were expected")
    if r["recompiles"]:
        failed.append(f"{r['recompiles']} recompiles")
    if r["gradients"] != "exact":
        failed.append(f"final gradients differ: {r['gradients']}")
    return failed


def format_table(result: dict) -> str:
    from tabulate import tabulate
    rows = []
    for r in result["ranks"]:
        for s in r["samples"]:
            rows.append([r["rank"], s["step"], f"{s['rss_mib']:.1f}", s["graphs"], s["recompiles"],
                         s["graph_breaks"], f"{s['seconds']:.1f}"])
    table = tabulate(rows, headers=["rank", "step", "RSS MiB", "graphs", "recompiles", "breaks", "seconds"])
    summary = "; ".join(f"rank {r['rank']}: RSS growth after warm-up {r['rss_growth_mib']:+.1f} MiB "
                        f"({r['rss_growth_pct']:+.1f}%; {r['rss_growth_second_half_mib']:+.1f} MiB in its second half), "
                        f"{r['graphs']} graphs compiled ({r['compiles_after_warmup']} after warm-up), "
                        f"{r['recompiles']} recompiles, final gradients {r['gradients']}"
                        for r in result["ranks"])
    failures = "; ".join(f"rank {r['rank']}: {', '.join(r['failures'])}" for r in result["ranks"] if r["failures"])
    return f"{table}\n\n{summary}\nverdict: {'ok' if result['ok'] else 'FAILED (' + failures + ')'}"


def _report(args: argparse.Namespace, result: dict | None) -> int:
    if result is None:
        return 0
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


def _spawn_entry(rank: int, args: argparse.Namespace, port: int) -> None:
    # a native crash (SIGSEGV, glibc's abort) prints every thread's Python stack to stderr
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.world_size), LOCAL_WORLD_SIZE=str(args.world_size))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    code = _report(args, run_rank(args))
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        return _report(args, run_rank(args))
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_spawn_entry, args=(args, port), nprocs=args.world_size, join=True)
    except Exception as e:  # noqa: BLE001  (a rank failed or a check failed: say so, exit 1)
        print(f"graphzero-soak: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
