"""What DeepSpeed's process-wide ``torch.nn.functional.linear`` replacement costs.

DeepSpeed's ZeRO-3 initialisation replaces ``torch.nn.functional.linear`` with its
``zero3_linear_wrap`` (an autograd function) for the whole process. This times one forward and
backward of an MLP (``--depth`` Linear+GELU layers of ``--width``, batch ``--batch``) with torch's
linear and with DeepSpeed's, in eager mode (the user's other models: DDP, evaluation) and compiled
by inductor (what a graph traced through it gets; graphzero's graphs use torch's while a ZeRO-3
engine is attached), interleaved round by round, and prints the medians and ratios::

    python -m graphzero_tools.linear_cost --json linear_cost.json

One process, no process group; ``DS_ACCELERATOR=cpu`` is set when there is no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _mlp(width: int, depth: int) -> torch.nn.Module:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per variant (interleaved)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    torch_linear = torch._C._nn.linear
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _mlp(args.width, args.depth).to(device)
    x = torch.randn(args.batch, args.width, device=device)
    variants = {}
    for linear_name, linear in (("torch", torch_linear), ("deepspeed", zero3_linear_wrap)):
        torch.nn.functional.linear = linear
        variants[f"eager/{linear_name}"] = (linear, lambda: _step(model, x))
        compiled = torch.compile(lambda m, inp: m(inp).square().mean(), backend="inductor", dynamic=False)
        # traced now, with this linear: the compiled code keeps it
        compiled(model, x).backward()

        def run(compiled=compiled) -> None:
            compiled(model, x).backward()
            model.zero_grad(set_to_none=True)
        variants[f"compiled/{linear_name}"] = (linear, run)
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for r in range(args.rounds + 2):
            for name, (linear, fn) in variants.items():
                torch.nn.functional.linear = linear
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if r >= 2:   # two warm-up rounds
                    times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        torch.nn.functional.linear = torch_linear
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = []
    for mode in ("eager", "compiled"):
        t, d = med[f"{mode}/torch"], med[f"{mode}/deepspeed"]
        rows.append({"mode": mode, "torch_linear_ms": round(t, 3), "deepspeed_linear_ms": round(d, 3),
                     "deepspeed_over_torch": round(d / t, 3)})
    print(f"linear_cost: MLP {args.depth} x Linear({args.width}, {args.width}) + GELU, batch {args.batch}, "
          f"{device}, torch {torch.__version__}, forward + backward, median of {args.rounds} interleaved rounds")
    print("| mode | torch's linear ms | DeepSpeed's linear ms | DeepSpeed / torch |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['mode']} | {row['torch_linear_ms']:.3f} | {row['deepspeed_linear_ms']:.3f} | "
              f"{row['deepspeed_over_torch']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"width": args.width, "depth": args.depth, "batch": args.batch, "rounds": args.rounds,
                       "device": str(device), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
