"""The gradient norm folded into the compiled backward (graphzero/runtime/norm.py, passes/fold_norm.py).

One engine, three copies with the same seed and data: DeepSpeed eager (``engine.backward``),
graphzero with its lean step (ZeRO-1/2) or DeepSpeed's own step (ZeRO-3) (the norm's squares
computed in the compiled backward and all-reduced after it), and a single-process reference (full
batch over the ranks, ``clip_grad_norm_``). Over 3 optimizer steps,
``engine.get_global_grad_norm()`` under graphzero equals DeepSpeed eager's (rtol 1e-5: eager reduces
in another order) and the reference's (rtol 1e-4), and the parameters stay close. With
``safety_net`` part of the loss runs eagerly through the engine, so gradients reach its shards
through the eager safety net too: the norm is still the final gradient's (taken from the backward
when the safety net wrote before it, otherwise computed in step()). The folded path must actually be
taken where nothing writes after the compiled backward.
"""
from __future__ import annotations

import copy

import pytest
import torch
from suite_sample import sample

from scenario_utils import Reference, data, ds_config, engine, full_params, mlp, rank_world

CLIP = 0.05


def _loss(models, x):
    return 10 * models["m"](x).square().mean()


def folded_norm_scenario(stage: int, gas: int, dtype: str, safety_net: bool, steps: int = 3) -> None:
    from graphzero.deepspeed_adapter import binding_of
    rank, world = rank_world()
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    cfg = ds_config(stage, gas=gas, dtype=dtype, clip=CLIP)
    torch.manual_seed(11)
    model = mlp(8, 32, 8, depth=3).to(tdtype)
    ref = Reference({"m": model}, clip=CLIP, dtype=torch.float32)
    eager = {"m": engine(copy.deepcopy(model), cfg)}
    gz = {"m": engine(copy.deepcopy(model), cfg)}
    compiled = torch.compile(_loss, backend="graphzero", options={"engines": gz, "lean_step": True})

    def both_parts(models, x, y, loss_fn=_loss):
        return loss_fn(models, x) + (0.5 * models["m"](y).square().mean() if safety_net else 0)

    for t in range(steps):
        for micro in range(gas):
            batches = [data(t * gas + micro, r, (4, 8), (4, 8), dtype=tdtype) for r in range(world)]
            x, y = batches[rank]
            eager["m"].backward(both_parts(eager, x, y))
            loss = compiled(gz, x)
            if safety_net:
                loss = loss + 0.5 * gz["m"](y).square().mean()   # eager: reaches the shards via the safety net
            loss.backward()
            ref.accumulate(lambda ms, a, b: both_parts(ms, a.float(), b.float()), batches, gas=gas)
            eager["m"].step()
            gz["m"].step()
        ref.step()
        norm_gz, norm_eager = float(gz["m"].get_global_grad_norm()), float(eager["m"].get_global_grad_norm())
        what = f"step {t}"
        tol = 2e-2 if dtype == "bf16" else 1e-4
        torch.testing.assert_close(norm_gz, norm_eager, rtol=1e-5 if dtype == "fp32" else 1e-2, atol=0, msg=what)
        torch.testing.assert_close(norm_gz, ref.norms["m"], rtol=tol, atol=0, msg=what)
        if t == 0:
            assert norm_gz > CLIP, f"norm {norm_gz} does not exceed the clip: clipping untested"
        for pa, pb in zip(full_params(gz["m"]), full_params(eager["m"])):   # ZeRO-3: gathered
            torch.testing.assert_close(pa, pb, rtol=tol, atol=1e-5 if dtype == "fp32" else 1e-2, msg=what)
    fold = binding_of(gz["m"]).state.norm
    assert fold is not None and fold.folded + fold.blocking == steps, (fold.folded, fold.blocking)
    if not safety_net:
        assert fold.folded == steps and fold.blocking == 0, (fold.folded, fold.blocking)


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide (as in test_zero3.py)
    yield
    ranks.close()


# ZeRO-3 last: its engines patch the ranks' torch (above). ZeRO-3 keeps DeepSpeed's own step, which
# reads the folded norm through _get_norm_groups (deepspeed_adapter/zero3.py).
@pytest.mark.parametrize("stage,gas,dtype,safety_net", sample(
    [(2, 1, "fp32", False), (2, 2, "fp32", False), (1, 2, "fp32", False), (2, 1, "bf16", False),
     (2, 2, "fp32", True), (3, 1, "fp32", False), (3, 2, "fp32", False), (3, 1, "bf16", False),
     (3, 1, "fp32", True)],
    default=[(2, 2, "fp32", False), (1, 2, "fp32", False), (2, 1, "bf16", False), (2, 2, "fp32", True),
             (3, 2, "fp32", False), (3, 1, "bf16", False), (3, 1, "fp32", True)]))
def test_folded_norm_matches_deepspeed_and_reference(ranks, stage, gas, dtype, safety_net):
    ranks.run(folded_norm_scenario, stage, gas, dtype, safety_net)
