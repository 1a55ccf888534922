"""What a forced recompile keeps: the GAN step at ZeRO-3 (or --stage 2), compiled anew after each
``torch._dynamo.reset()``, on 2 gloo ranks (docs/reliability.md, "ZeRO-3 with a new graph every
500 steps").

    python debug/recompile_memory.py --cycles 12 --steps 10
    TORCH_FR_BUFFER_SIZE=0 python debug/recompile_memory.py      # torch's Flight Recorder off
    python debug/recompile_memory.py --drop-graphzero-state       # graphzero's per-graph compile state freed
    python debug/recompile_memory.py --malloc-trim                # RSS also after glibc's malloc_trim(0)
    python debug/recompile_memory.py --release-torch-caches       # torch's own per-compile caches emptied at each reset
    python debug/recompile_memory.py --trace-allocations          # where the memory kept after the third cycle was allocated
    python debug/recompile_memory.py --plain-torch                # the same loss without DeepSpeed or graphzero

Rank 0 prints RSS after each cycle, the growth per cycle after the third, the number of Dynamo's
``__compiled_fn_*`` globals left in the step's module, and the transformed code objects of the
step that outlived the last reset with their references that Python's gc cannot see (a C-level
holder). ``--drop-graphzero-state`` clears what each compiled backward keeps to compile variants
later (the pristine graph, the tracing context), to measure graphzero's share. ``--malloc-trim``
also prints RSS after glibc's ``malloc_trim(0)`` each cycle: growth that the trim gives back is
free memory the allocator kept, not objects kept alive. ``--release-torch-caches`` calls
``graphzero_tools.compile_leftovers.release_compile_leftovers`` as each reset (ShapeEnv's method
caches, FX's generated-source cache and linecache, Dynamo's compilation metrics).
``--trace-allocations`` starts ``tracemalloc`` after the third cycle and prints the source lines
whose live Python allocations grew most by the end, with the gc-tracked object types that grew.
``--plain-torch`` compiles the same loss over plain modules with inductor and steps torch's Adam (no
DeepSpeed, no graphzero): what torch keeps of such a compile, to compare graphzero's against.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import faulthandler
import gc
import os
import socket
import sys
import tracemalloc

import torch


def run(rank: int, args: argparse.Namespace, port: int) -> None:
    faulthandler.enable(all_threads=True)   # a native crash prints every thread's Python stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", DS_ACCELERATOR="cpu")
    import deepspeed

    import graphzero  # noqa: F401  (registers the backend)
    from graphzero.runtime.backward import Backward
    from graphzero_tools.bench_metrics import rss_bytes
    from graphzero_tools.bench_models import build_workload, resolve_size
    from graphzero_tools.compile_leftovers import release_compile_leftovers
    from graphzero_tools.soak import _ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    size = resolve_size("gan", tiny=True, width=64)
    work = build_workload("gan", size, seed=0)
    if args.plain_torch:
        # the same loss on plain modules, torch's Adam and inductor: torch's own share, for comparison
        engines = work.parts
        optimizers = [torch.optim.Adam(p.parameters(), lr=1e-4) for p in engines.values()]
        step = torch.compile(work.loss, backend="inductor")
    else:
        engines = {n: deepspeed.initialize(model=p, config=_ds_config(args.stage, size.batch),
                                           model_parameters=p.parameters())[0] for n, p in work.parts.items()}
        optimizers = list(engines.values())
        step = torch.compile(work.loss, backend="graphzero", options={"engines": engines})
    gen = torch.Generator().manual_seed(1000 + rank)
    rss, trimmed = [], []
    for cycle in range(args.cycles):
        if cycle:
            if args.release_torch_caches:
                release_compile_leftovers()   # resets Dynamo too
            else:
                torch._dynamo.reset()
        for _ in range(args.steps):
            step(engines, *work.make_batch(gen)).backward()
            for opt in optimizers:
                opt.step()
                if args.plain_torch:
                    opt.zero_grad()
        if args.drop_graphzero_state:
            for obj in gc.get_objects():
                if type(obj) is Backward:
                    obj._compile_variant = obj._tracing = obj._compile = None
        gc.collect()
        if args.trace_allocations and cycle == 2:
            tracemalloc.start(8)
            types_before = collections.Counter(type(o).__name__ for o in gc.get_objects())
        rss.append(rss_bytes() / 2**20)
        if args.malloc_trim:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            trimmed.append(rss_bytes() / 2**20)
    torch._dynamo.reset()
    gc.collect()
    if rank == 0 and args.trace_allocations:
        grown = tracemalloc.take_snapshot().statistics("traceback")
        tracemalloc.stop()
        print(f"live Python allocations made after the third cycle: {sum(s.size for s in grown) / 2**20:.2f} MiB")
        for stat in grown[:8]:
            print(f"{stat.size / 2**10:8.1f} KiB {stat.count:6d} blocks")
            for line in stat.traceback.format()[-8:]:
                print("    ", line)
        types_after = collections.Counter(type(o).__name__ for o in gc.get_objects())
        print("gc-tracked objects that grew:", (types_after - types_before).most_common(12))
    if rank == 0:
        from torch._dynamo.utils import CleanupManager
        print("RSS after each cycle (MiB):", " ".join(f"{r:.1f}" for r in rss))
        print(f"growth per cycle after the third: {(rss[-1] - rss[2]) / (len(rss) - 3):.2f} MiB")
        if trimmed:
            print("RSS after malloc_trim(0) (MiB):", " ".join(f"{r:.1f}" for r in trimmed))
            print(f"trimmed growth per cycle after the third: {(trimmed[-1] - trimmed[2]) / (len(trimmed) - 3):.2f} MiB")
        print("compiled-function globals left:", sum(n.startswith("__compiled_fn_") for n in work.loss.__globals__))
        codes = [ref() for ref in CleanupManager.instance.refs.values()
                 if ref() is not None and ref().co_name == work.loss.__name__]
        # getrefcount counts its argument and the comprehension's variable; `codes` is a gc referrer
        print("transformed code objects alive after the reset:", len(codes),
              "references gc cannot see:", [sys.getrefcount(c) - 2 - len(gc.get_referrers(c)) for c in codes])
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=12)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per compile")
    p.add_argument("--stage", type=int, choices=(2, 3), default=3)
    p.add_argument("--drop-graphzero-state", action="store_true")
    p.add_argument("--malloc-trim", action="store_true")
    p.add_argument("--release-torch-caches", action="store_true")
    p.add_argument("--plain-torch", action="store_true",
                   help="no DeepSpeed, no graphzero: plain modules, torch's Adam, backend='inductor'")
    p.add_argument("--trace-allocations", action="store_true")
    args = p.parse_args()
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args, port), nprocs=2)


if __name__ == "__main__":
    main()
