"""bf16 engines with fp32 gradient accumulation (``data_types.grad_accum_dtype: fp32``).

ZeRO-1 uses DeepSpeed's BF16_Optimizer (every rank holds the full fp32 gradient: all-reduce),
ZeRO-2 its DeepSpeedZeroOptimizer with an fp32 partition (reduce-scatter). Compared with an fp32
reference that starts from the same bf16-rounded weights: bf16 forward/backward and bf16
communication give about 1% relative error, so each gradient tensor must be within 3% relative L2
error, parameters within rtol 2e-2 / atol 2e-2, and the norm DeepSpeed clips with within 5%.
"""
from __future__ import annotations

import pytest
import torch

from scenario_utils import (
    ReductionCounter,
    Reference,
    assert_no_full_grads,
    assert_params_close,
    assert_rel_l2_close,
    data,
    ds_config,
    engine,
    full_grads,
    mlp,
    rank_world,
)


def gan_loss(models, z, real):
    return -models["disc"](models["gen"](z)).mean() + models["disc"](real).mean()


def bf16_scenario(stage: int, gas: int, steps: int = 2, bucket: int | None = None) -> dict:
    rank, world = rank_world()
    torch.manual_seed(2)
    G, D = mlp(8, 32, 8).to(torch.bfloat16), mlp(8, 32, 1).to(torch.bfloat16)
    ref = Reference({"gen": G, "disc": D}, dtype=torch.float32)
    cfg = ds_config(stage, gas=gas, dtype="bf16", bucket=bucket)
    gen, disc = engine(G, cfg), engine(D, cfg)
    kinds = {type(gen.optimizer).__name__}
    counter = ReductionCounter(gen, disc)
    step = torch.compile(gan_loss, backend="graphzero", options={"engines": {"gen": gen, "disc": disc}})
    for t in range(steps):
        for micro in range(gas):
            i = t * gas + micro
            z, real = data(i, rank, (8, 8), (8, 8), dtype=torch.bfloat16)
            step({"gen": gen, "disc": disc}, z, real).backward()
            assert_no_full_grads(gen, disc)
            ref.accumulate(gan_loss, [[a.float() for a in data(i, r, (8, 8), (8, 8), dtype=torch.bfloat16)]
                                      for r in range(world)], gas=gas)
            if micro == gas - 1:
                for name, eng in (("gen", gen), ("disc", disc)):
                    assert all(g.dtype == torch.float32 for g in full_grads(eng))
                    assert_rel_l2_close(full_grads(eng), ref.grads(name), tol=3e-2, what=f"step {t} {name}")
            gen.step()
            disc.step()
        ref.step()
        for name, eng in (("gen", gen), ("disc", disc)):
            assert_params_close(eng, ref.models[name], rtol=2e-2, atol=2e-2, what=f"step {t} {name}")
            torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name], rtol=5e-2, atol=1e-3)
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    return {"optimizer": sorted(kinds)}


@pytest.mark.parametrize("stage,optimizer,bucket", [(1, "BF16_Optimizer", None), (2, "DeepSpeedZeroOptimizer", None),
                                                    (1, "BF16_Optimizer", 100)])
def test_two_bf16_engines_fp32_accumulation(ranks, stage, optimizer, bucket):
    results = ranks.run(bf16_scenario, stage, 2, bucket=bucket)
    assert results[0]["optimizer"] == [optimizer]
