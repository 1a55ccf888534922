"""Two DeepSpeed engines (ZeRO-2 generator, ZeRO-1 discriminator) trained against one GAN loss.

The discriminator is called twice in one loss, which DeepSpeed eager cannot reduce
(``engine.step()`` raises ``KeyError: 0``). Under graphzero a plain ``loss.backward()`` leaves each
engine with its reduced fp32 gradient shard.

    torchrun --standalone --nproc-per-node 2 examples/gan_demo.py --steps 5 --dump-dir demo_dump
"""
from __future__ import annotations

import argparse
import logging
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch.distributed as dist
from torch import nn

import graphzero


def mlp(width_in: int, hidden: int, width_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, width_out))


def config(stage: int, lr: float) -> dict:
    return {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": lr, "betas": [0.5, 0.999], "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
            "timers": {"throughput": {"enabled": False}}, "steps_per_print": 10**9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--dump-dir", default=None, help="write graphzero's graph dump here")
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    latent, features = 16, 32
    gen, *_ = deepspeed.initialize(model=mlp(latent, 64, features), config=config(2, 2e-4))
    disc, *_ = deepspeed.initialize(model=mlp(features, 64, 1), config=config(1, 2e-4))
    device = gen.device

    def step(z, real):
        # One loss across two engines; the discriminator runs twice.
        return nn.functional.softplus(-disc(gen(z))).mean() + nn.functional.softplus(disc(real)).mean()

    # graphzero.backend(...) attaches both engines now; graphzero's graph reduces them from the first call.
    step = torch.compile(step, backend=graphzero.backend(gen=gen, disc=disc, inner=args.inner, dump_dir=args.dump_dir))

    g = torch.Generator().manual_seed(1234 + rank)
    real_mean = torch.linspace(-1, 1, features)
    for t in range(args.steps):
        z = torch.randn(16, latent, generator=g).to(device)
        real = (real_mean + 0.1 * torch.randn(16, features, generator=g)).to(device)
        loss = step(z, real)
        loss.backward()                  # plain backward: graphzero's graph reduces both engines
        gen.step()
        disc.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {t}: loss {mean_loss.item() / dist.get_world_size():.4f}  "
                  f"|grad| gen {float(gen.get_global_grad_norm()):.4f} disc {float(disc.get_global_grad_norm()):.4f}",
                  flush=True)
    if rank == 0 and args.dump_dir:
        print(f"graph dump written to {args.dump_dir} (inspect with: graphzero-dump {args.dump_dir})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
