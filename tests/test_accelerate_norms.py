"""``accelerator.clip_grad_norm_`` under ``graphzero.accelerate``, and Accelerate with bf16 and ZeRO-3.

Accelerate's DeepSpeed path returns the first engine's cached ``get_global_grad_norm()``; under
graphzero (whose backward does not step) that was the previous step's norm (``[None, 0.9483,
0.6596]`` where the reference is ``[0.9483, 0.6596, 0.6379]``). Now ``clip_grad_norm_`` after
``accelerator.backward`` returns the current step's: per engine the pre-clip global norm that its
``step()`` then reports, and for parameters of several engines ``sqrt(sum of squares)``, the norm
of all their gradients viewed as one vector, as Accelerate documents it.

The GAN (gen and disc, disc called twice) at ZeRO-2 + ZeRO-1, ZeRO-3 + ZeRO-3 and bf16 (ZeRO-2 +
ZeRO-1 bf16, ZeRO-3 bf16), gas 1 and 2, 3 optimizer steps, against the single-process reference:
the returned norms, every gradient at the boundary, ``get_global_grad_norm()`` and the parameters
after each step. Tolerances: fp32 as test_accelerate.py; bf16 as test_bf16.py (3% relative L2 per
gradient, 5% on norms, 2e-2 on parameters), the norm compared also with the step's own
``get_global_grad_norm()`` to 1e-6 (the same function on the same buffers).
"""
from __future__ import annotations

import pytest
import torch
from suite_sample import sample
from test_accelerate import fresh_accelerate, make_accelerator, plugin_config, prepare

import graphzero
from scenario_utils import (
    GRAD_TOL,
    PARAM_TOL,
    Reference,
    assert_grads_close,
    assert_params_close,
    assert_rel_l2_close,
    data,
    full_grads,
    gan_loss,
    mlp,
    rank_world,
)


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide: later test modules
    # get fresh ranks (as in test_zero3.py).
    yield
    ranks.close()


def ref_norm(ref: Reference, name: str) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref.grads(name)])))


def norm_scenario(stages: tuple[int, int], dtype: str = "fp32", gas: int = 1, steps: int = 3) -> dict:
    rank, world = rank_world()
    bf16 = dtype == "bf16"
    wdtype = torch.bfloat16 if bf16 else torch.float32
    with fresh_accelerate():
        torch.manual_seed(5)
        G, D = mlp(8, 16, 8).to(wdtype), mlp(8, 16, 1).to(wdtype)
        ref = Reference({"gen": G, "disc": D})
        configs = {}
        for name, stage in zip(("gen", "disc"), stages):
            cfg = plugin_config(stage, gas=gas)
            if bf16:
                cfg["bf16"] = {"enabled": True}
                cfg["data_types"] = {"grad_accum_dtype": "fp32"}
            configs[name] = cfg
        acc = make_accelerator(configs, gas=gas)
        gen, opt_g = prepare(acc, "gen", G)
        disc, opt_d = prepare(acc, "disc", D)
        graphzero.accelerate.enable(acc)
        engines = {"gen": gen, "disc": disc}
        kinds = sorted({type(e.optimizer).__name__ for e in engines.values()})
        step = torch.compile(gan_loss, backend="graphzero")
        returned, expected = [], []
        for t in range(steps):
            for micro in range(gas):
                i = t * gas + micro
                z, real = data(i, rank, (4, 8), (4, 8), dtype=wdtype)
                with acc.accumulate(gen, disc):
                    acc.backward(step(engines, z, real))
                    ref.accumulate(gan_loss, [[a.float() for a in data(i, r, (4, 8), (4, 8), dtype=wdtype)]
                                              for r in range(world)], gas=gas)
                    if not acc.sync_gradients:
                        # inside the window: the last step's norm, no collective (Accelerate's behaviour)
                        last = acc.clip_grad_norm_(gen.parameters(), 1.0)
                        assert last == (float(gen.get_global_grad_norm()) if t else 0.0), (t, last)
                    else:
                        norms = {k: acc.clip_grad_norm_(e.parameters(), 1.0) for k, e in engines.items()}
                        both = acc.clip_grad_norm_(list(gen.parameters()) + list(disc.parameters()), 1.0)
                        want = {k: ref_norm(ref, k) for k in engines}
                        returned.append(both)
                        expected.append((want["gen"] ** 2 + want["disc"] ** 2) ** 0.5)
                        for k, e in engines.items():
                            if bf16:
                                assert_rel_l2_close(full_grads(e), ref.grads(k), tol=3e-2, what=f"step {t} {k}")
                                torch.testing.assert_close(norms[k], want[k], rtol=5e-2, atol=1e-3)
                            else:
                                assert_grads_close(full_grads(e), ref.grads(k), **GRAD_TOL, what=f"step {t} {k}")
                                torch.testing.assert_close(norms[k], want[k], rtol=1e-4, atol=1e-6)
                        torch.testing.assert_close(both, (norms["gen"] ** 2 + norms["disc"] ** 2) ** 0.5,
                                                   rtol=1e-6, atol=1e-7)
                    opt_g.step()
                    opt_d.step()
                    opt_g.zero_grad()
                    opt_d.zero_grad()
                    if acc.sync_gradients:
                        # the norm returned before step() is the one the step computed
                        for k, e in engines.items():
                            torch.testing.assert_close(float(e.get_global_grad_norm()), norms[k],
                                                       rtol=1e-6, atol=1e-7)
            ref.step()
            for k, e in engines.items():
                tol = {"rtol": 2e-2, "atol": 2e-2} if bf16 else PARAM_TOL
                assert_params_close(e, ref.models[k], **tol, what=f"step {t} {k}")
        assert gen.global_steps == disc.global_steps == steps
        graphzero.accelerate.disable(acc)
        return {"returned": returned, "expected": expected, "kinds": kinds}


CASES = {
    "zero2+zero1": ((2, 1), "fp32", 1),
    "zero2+zero1-gas2": ((2, 1), "fp32", 2),
    "zero3": ((3, 3), "fp32", 1),
    "bf16-zero2+zero1": ((2, 1), "bf16", 1),
    "bf16-zero3-gas2": ((3, 3), "bf16", 2),
}
KINDS = {
    "zero2+zero1": ["DeepSpeedZeroOptimizer"],
    "zero2+zero1-gas2": ["DeepSpeedZeroOptimizer"],
    "zero3": ["DeepSpeedZeroOptimizer_Stage3"],
    "bf16-zero2+zero1": ["BF16_Optimizer", "DeepSpeedZeroOptimizer"],
    "bf16-zero3-gas2": ["DeepSpeedZeroOptimizer_Stage3"],
}


@pytest.mark.parametrize("case", sample(CASES, default=["zero2+zero1-gas2", "zero3", "bf16-zero3-gas2"]))
def test_clip_grad_norm_returns_the_current_step(ranks, case):
    stages, dtype, gas = CASES[case]
    results = ranks.run(norm_scenario, stages, dtype, gas)
    r0 = results[0]
    assert r0["kinds"] == KINDS[case], r0["kinds"]
    assert r0["returned"] == results[1]["returned"], "ranks returned different norms"
    assert len(r0["returned"]) == 3 and None not in r0["returned"]
    rtol = 5e-2 if dtype == "bf16" else 1e-4
    torch.testing.assert_close(r0["returned"], r0["expected"], rtol=rtol, atol=1e-6)
