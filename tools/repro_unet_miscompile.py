"""Repro: torch 2.13 CPU inductor miscompiles the backward of a tiny diffusers UNet2DConditionModel.

    DS_ACCELERATOR=cpu python tools/repro_unet_miscompile.py            # the full UNet, default inductor
    python tools/repro_unet_miscompile.py --config freezing=True        # try an inductor config switch
    python tools/repro_unet_miscompile.py --minimal                     # the reduced repro (docs/inductor-unet-miscompile.md)

One process, no graphzero, no DeepSpeed: ``torch.compile(loss, backend="inductor")``, one backward,
each parameter's gradient compared with an fp64 eager reference (relative L2 error). Prints the
worst parameters and exits 1 when any gradient is off by more than --tol (default 1e-3); eager fp32
is within ~1e-6.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch


def tiny_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=4,
        attention_head_dim=2,
    )


def unet_case(seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_unet()
    x = torch.randn(2, 4, 8, 8)
    t = torch.tensor([3, 700])
    ctx = torch.randn(2, 5, 16)
    target = torch.randn(2, 4, 8, 8)

    def loss(m, x, t, ctx, target):
        return (m(x, t, encoder_hidden_states=ctx).sample - target).square().mean()

    return model, loss, (x, t, ctx, target)


class UpPath(torch.nn.Module):
    """The UNet's two up blocks alone: UpBlock2D (4x4, resnets + nearest-2x upsample + conv), then
    CrossAttnUpBlock2D (8x8). Compiled together their backward is wrong; each alone is exact."""

    def __init__(self, unet) -> None:
        super().__init__()
        self.up0, self.up1 = unet.up_blocks[0], unet.up_blocks[1]

    def forward(self, hidden, res0, res1, temb, skip0, skip1, enc):
        hidden = self.up0(hidden, (res0, res1), temb)
        return self.up1(hidden, (skip0, skip1), temb, encoder_hidden_states=enc)


def minimal_case(seed: int = 0):
    """The reduced repro: the up path with the inputs the full UNet gives it."""
    model, _, (x, t, ctx, _) = unet_case(seed)
    seen = {}
    hooks = [model.up_blocks[i].register_forward_hook(lambda m, a, kw, out, i=i: seen.update({i: kw}),
                                                      with_kwargs=True) for i in (0, 1)]
    with torch.no_grad():
        model(x, t, encoder_hidden_states=ctx)
    for h in hooks:
        h.remove()
    inputs = (seen[0]["hidden_states"], *seen[0]["res_hidden_states_tuple"], seen[0]["temb"],
              *seen[1]["res_hidden_states_tuple"], seen[1]["encoder_hidden_states"])
    target = torch.randn(2, 8, 8, 8, generator=torch.Generator().manual_seed(1))

    def loss(m, *args):
        *inputs, target = args
        return (m(*inputs) * target).sum()

    return UpPath(model), loss, (*inputs, target)


def grads(model, loss, args, compiled: bool, dtype=torch.float32, grad_inputs: bool = False):
    """Every parameter's gradient (and, with ``grad_inputs``, every floating input's but the last,
    the target): the reduced repro needs its inputs to require grad, as in the UNet."""
    m = copy.deepcopy(model).to(dtype)
    args = [a.detach().to(dtype) if a.is_floating_point() else a for a in args]
    leaves = [a.requires_grad_() for a in args[:-1] if a.is_floating_point()] if grad_inputs else []
    fn = torch.compile(loss, backend="inductor") if compiled else loss
    fn(m, *args).backward()
    out = {f"input{i}": a.grad.detach().double().clone() for i, a in enumerate(leaves)}
    out.update({n: p.grad.detach().double().clone() for n, p in m.named_parameters() if p.grad is not None})
    return out


def rel_errors(got: dict, ref: dict) -> dict:
    out = {}
    for name, r in ref.items():
        g = got.get(name)
        out[name] = 1.0 if g is None else float((g - r).norm() / r.norm().clamp_min(1e-30))
    return out


def apply_config(items: list[str]) -> None:
    import torch._inductor.config as cfg

    for item in items:
        key, _, value = item.partition("=")
        target = cfg
        *path, leaf = key.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, eval(value))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=[], help="inductor config KEY=VALUE (repeatable)")
    parser.add_argument("--minimal", action="store_true", help="the reduced repro instead of the UNet")
    parser.add_argument("--tol", type=float, default=1e-3)
    parser.add_argument("--show", type=int, default=6)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    apply_config(args.config)
    model, loss, inputs = minimal_case() if args.minimal else unet_case()
    gi = args.minimal
    ref = grads(model, loss, inputs, compiled=False, dtype=torch.float64, grad_inputs=gi)
    eager = rel_errors(grads(model, loss, inputs, compiled=False, grad_inputs=gi), ref)
    comp = rel_errors(grads(model, loss, inputs, compiled=True, grad_inputs=gi), ref)
    worst = sorted(comp, key=comp.get, reverse=True)
    print(f"torch {torch.__version__}  config {args.config or 'default'}")
    print(f"eager fp32 max rel err {max(eager.values()):.2e}; inductor max rel err {comp[worst[0]]:.2e}")
    for name in worst[: args.show]:
        print(f"  {comp[name]:.2e}  {name}")
    bad = [n for n in worst if comp[n] > args.tol]
    print(f"{'MISCOMPILED' if bad else 'OK'}: {len(bad)} of {len(comp)} gradients off by more than {args.tol}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
