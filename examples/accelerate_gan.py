"""A generator and a discriminator, each its own DeepSpeed engine, trained through HF Accelerate
against one loss with a plain ``accelerator.backward(loss)``: graphzero's one added line is
``graphzero.accelerate.enable(accelerator)``.

    accelerate launch --config_file examples/accelerate_zero2.yaml examples/accelerate_gan.py
    accelerate launch --config_file examples/accelerate_zero2.yaml examples/accelerate_gan.py --disc-zero-stage 1

The generator takes the ZeRO stage of the launch config (``zero_stage``), the discriminator the
same or ``--disc-zero-stage`` (ZeRO-2 + ZeRO-1 mixed). Gradient accumulation is Accelerate's
(``--gas``, through ``accelerator.accumulate``). The discriminator runs twice in the loss:

    loss = softplus(-D(G(z))).mean()  +  softplus(D(real)).mean()
           "gen loss" (G and D)          "disc loss" (D only)

Both models minimise this one loss, so both printed terms go down; without
``graphzero.accelerate`` Accelerate steps only the first prepared model (the discriminator would
never change). Each rank builds its own data from the RANK environment variable: on CPU,
Accelerate reports num_processes=1 under its DeepSpeed launch, so the script checks the world
size torch.distributed actually has.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch.distributed as dist
from torch import nn

import graphzero
import graphzero.accelerate


def mlp(width_in: int, hidden: int, width_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(width_in, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, width_out),
    )


def plugin(stage: int, micro_batch: int, gas: int):
    from accelerate.utils import DeepSpeedPlugin

    # Keyword arguments, not a config dict: under `accelerate launch` a DeepSpeed section in the
    # launch config and a plugin's own hf_ds_config exclude each other.
    p = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=gas, gradient_clipping=1.0)
    p.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch
    p.deepspeed_config.pop("train_batch_size", None)  # DeepSpeed derives it from its real world size
    p.deepspeed_config["timers"] = {"throughput": {"enabled": False}}
    return p


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    parser.add_argument(
        "--gas",
        type=int,
        default=int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")),
        help="Accelerate gradient accumulation steps (default: the launch config's)",
    )
    parser.add_argument(
        "--disc-zero-stage",
        type=int,
        default=None,
        help="the discriminator's ZeRO stage (default: the launch config's zero_stage)",
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ.get("RANK", rank)), "RANK and torch.distributed disagree"

    from accelerate import Accelerator

    gen_stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
    disc_stage = gen_stage if args.disc_zero_stage is None else args.disc_zero_stage
    micro_batch, latent, features = 16, 16, 32
    plugins = {
        "gen": plugin(gen_stage, micro_batch, args.gas),
        "disc": plugin(disc_stage, micro_batch, args.gas),
    }
    accelerator = Accelerator(deepspeed_plugins=plugins, gradient_accumulation_steps=args.gas)
    if rank == 0:
        print(
            f"world size {world} (Accelerate reports num_processes={accelerator.num_processes}), "
            f"gen ZeRO-{gen_stage}, disc ZeRO-{disc_stage}, gradient accumulation {args.gas}",
            flush=True,
        )

    torch.manual_seed(0)
    G, D = mlp(latent, 64, features), mlp(features, 64, 1)
    opt_g = torch.optim.AdamW(G.parameters(), lr=args.lr, betas=(0.5, 0.999), weight_decay=0.0)
    opt_d = torch.optim.AdamW(D.parameters(), lr=args.lr, betas=(0.5, 0.999), weight_decay=0.0)
    accelerator.state.select_deepspeed_plugin("gen")
    gen, opt_g = accelerator.prepare(G, opt_g)  # Accelerate + DeepSpeed: one model per prepare()
    accelerator.state.select_deepspeed_plugin("disc")
    disc, opt_d = accelerator.prepare(D, opt_d)

    graphzero.accelerate.enable(accelerator)  # the one added line

    def gan_loss(z, real):
        gen_term = nn.functional.softplus(-disc(gen(z))).mean()
        disc_term = nn.functional.softplus(disc(real)).mean()
        return gen_term + disc_term, gen_term.detach(), disc_term.detach()

    step = torch.compile(gan_loss, backend="graphzero")

    g = torch.Generator().manual_seed(1234 + rank)  # each rank its own data
    real_mean = torch.linspace(-1, 1, features)
    device = accelerator.device
    history = []
    for t in range(args.steps):
        terms = torch.zeros(2)
        for _ in range(args.gas):
            z = torch.randn(micro_batch, latent, generator=g).to(device)
            real = (real_mean + 0.1 * torch.randn(micro_batch, features, generator=g)).to(device)
            with accelerator.accumulate(gen, disc):
                loss, gen_term, disc_term = step(z, real)
                accelerator.backward(loss)  # one plain backward; graphzero reduces both engines
                opt_g.step()
                opt_d.step()  # each steps its own engine, once per accumulation window
                opt_g.zero_grad()
                opt_d.zero_grad()
            terms += torch.stack([gen_term, disc_term]).cpu() / args.gas
        dist.all_reduce(terms)
        terms /= world
        history.append(terms)
        if rank == 0:
            print(
                f"step {t}: gen loss {terms[0]:.4f}  disc loss {terms[1]:.4f}  "
                f"|grad| gen {float(gen.get_global_grad_norm()):.4f} disc {float(disc.get_global_grad_norm()):.4f}",
                flush=True,
            )
    if rank == 0:
        first, last = history[0], history[-1]
        ok = bool((last < first).all())
        print(
            f"gen loss {first[0]:.4f} -> {last[0]:.4f}, disc loss {first[1]:.4f} -> {last[1]:.4f}: "
            f"{'both decreased' if ok else 'NOT both decreased'}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
