"""Correctness smoke before any timing (tools/gpu_bench.sh runs it first): graphzero on the real
device and backend against a single-process reference.

A small GAN (generator and discriminator, two DeepSpeed engines, the discriminator called twice in
one loss) at ZeRO-2 and at ZeRO-3, compiled with ``backend="graphzero"``, 3 optimizer steps. After
each backward every engine's full averaged gradients (``safe_get_full_grad``) are compared with a
single-process PyTorch reference of the same models on the same device (mean of every rank's loss,
per-engine clip, AdamW), and after each step the engines' gradient norms and parameters. Prints a
line per check and ``GPU SMOKE: PASS`` or ``GPU SMOKE: FAIL``; exits non-zero on failure.

    python -m graphzero_tools.gpu_smoke --device cuda --world-size 1   # NCCL, one GPU per rank
    python -m graphzero_tools.gpu_smoke --device cpu --world-size 2    # gloo on CPU (a check here)

Without a launcher the script starts ``--world-size`` processes itself; under torchrun it uses the
launcher's ranks. TF32 is off so that fp32 is fp32; tolerances are relative L2 errors per tensor.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import socket
import sys
import traceback

GRAD_TOL = 1e-4    # relative L2 per tensor: reduction order and inductor's fusions, fp32
PARAM_TOL = 1e-4
NORM_RTOL = 1e-4
LR = 1e-2
STEPS = 3


def _mlp(width_in: int, hidden: int, width_out: int):
    from torch import nn
    return nn.Sequential(nn.Linear(width_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, width_out))


def gan_loss(models, z, real):
    gen, disc = models["gen"], models["disc"]
    return -disc(gen(z)).mean() + disc(real).mean()


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


def _data(step: int, rank: int, device):
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(4, 16, generator=g).to(device) for _ in range(2)]


def _rel_l2(a, e) -> float:
    a, e = a.detach().float(), e.detach().float()
    return float((a - e).norm() / e.norm().clamp_min(1e-12))


class _Checks:
    def __init__(self, rank: int) -> None:
        self.rank, self.failures, self.count = rank, [], 0

    def close(self, what: str, err: float, tol: float) -> None:
        self.count += 1
        if not err <= tol:   # NaN fails too
            self.failures.append(f"{what}: {err:.3g} > {tol}")


def _full_params(eng):
    import deepspeed
    params = list(eng.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=eng.zero_optimization_stage() == 3):
        return [p.detach().clone() for p in params]


def run_stage(stage: int, device, checks: _Checks) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    models = {"gen": _mlp(16, 32, 16), "disc": _mlp(16, 32, 1)}
    ref = {k: copy.deepcopy(m).to(device) for k, m in models.items()}
    ref_opt = {k: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0) for k, m in ref.items()}
    engines = {k: deepspeed.initialize(model=m, config=_config(stage), model_parameters=list(m.parameters()))[0]
               for k, m in models.items()}
    step = torch.compile(gan_loss, backend="graphzero", options={"engines": engines})
    for t in range(STEPS):
        step(engines, *_data(t, rank, device)).backward()
        for r in range(world):
            (gan_loss(ref, *_data(t, r, device)) / world).backward()
        for name, eng in engines.items():
            grads = [safe_get_full_grad(p) for p in eng.module.parameters()]
            for (pname, p), g in zip(ref[name].named_parameters(), grads):
                err = float("inf") if g is None else _rel_l2(g, p.grad)
                checks.close(f"ZeRO-{stage} step {t} {name}.{pname} gradient", err, GRAD_TOL)
        norms = {k: float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)) for k, m in ref.items()}
        for k in ref:
            ref_opt[k].step()
            ref_opt[k].zero_grad(set_to_none=True)
        for name, eng in engines.items():
            eng.step()
            norm = float(eng.get_global_grad_norm())
            checks.close(f"ZeRO-{stage} step {t} {name} gradient norm", abs(norm - norms[name]) / norms[name], NORM_RTOL)
            for (pname, q), p in zip(ref[name].named_parameters(), _full_params(eng)):
                checks.close(f"ZeRO-{stage} step {t} {name}.{pname} parameter", _rel_l2(p, q), PARAM_TOL)
    for eng in engines.values():
        import graphzero
        graphzero.detach(eng)


def rank_main(rank: int, world: int, device_kind: str, stages: list[int], port: int | None) -> int:
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
    if device_kind == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    import graphzero  # noqa: F401  (registers the backend)
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    deepspeed.init_distributed(dist_backend="nccl" if device_kind == "cuda" else "gloo",
                               timeout=datetime.timedelta(seconds=300))
    checks = _Checks(dist.get_rank())
    backend = dist.get_backend()
    try:
        for stage in stages:
            run_stage(stage, device, checks)
    except Exception:   # noqa: BLE001 (a crash is a failure with its traceback, reported by this rank)
        checks.failures.append("exception:\n" + traceback.format_exc())
    ok = torch.tensor([0 if checks.failures else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    for line in checks.failures[:20]:
        print(f"[rank {checks.rank}] FAIL {line}", flush=True)
    if dist.get_rank() == 0:
        verdict = "PASS" if int(ok) == 1 else "FAIL"
        print(f"GPU SMOKE: {verdict} (device {device.type}, backend {backend}, world size {dist.get_world_size()}, "
              f"ZeRO stages {stages}, {STEPS} steps, {checks.count} checks on rank 0)", flush=True)
    dist.destroy_process_group()
    return 0 if int(ok) == 1 else 1


def _spawned(rank: int, world: int, device_kind: str, stages: list[int], port: int) -> None:
    sys.exit(rank_main(rank, world, device_kind, stages, port))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages (default 2,3)")
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # under torchrun / the deepspeed launcher
        return rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.device, stages, None)
    import torch
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        print(f"GPU SMOKE: FAIL (need {args.world_size} CUDA devices, found {torch.cuda.device_count()})")
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(r, args.world_size, args.device, stages, port))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        if all(c == 0 or c == 1 for c in codes):
            return 1
        print(f"GPU SMOKE: FAIL (rank exit codes {codes})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
