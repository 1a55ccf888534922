"""Optimizer offload (``offload_optimizer: {device: cpu}``) at ZeRO-1, 2 and 3 against a DeepSpeed-eager
twin: the same seed, data and config (torch AdamW on the CPU partitions, gas 2, clipping, fp32 and
bf16 with fp32 accumulation), 3 optimizer steps; at every boundary each parameter's gradient as
DeepSpeed reports it, after every step the gradient norm, at the end the parameters; ZeRO-3 with
the parameters offloaded too. (NVMe offload and offload on a CUDA engine are refused by name; not
tested here: DeepSpeed builds no NVMe engine without its aio op, and there is no GPU.)

Tolerances as tests/test_deepspeed_parity_zero.py.
"""
from __future__ import annotations

import pytest
from test_deepspeed_parity_zero import (
    assert_same,
    assert_same_norm,
    assert_same_params,
    compiled,
    config,
    mlp2,
    reported_grads,
    square_loss,
    tensor_dtype,
    twins,
)
from torch import nn

import graphzero
from graphzero.deepspeed_adapter import binding_of
from scenario_utils import data, rank_world


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide (test_zero3.py).
    yield
    ranks.close()


def offload_config(stage: int, dtype: str, gas: int) -> dict:
    cfg = config(stage, dtype, gas=gas)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}
    return cfg


def train_twins(stage: int, dtype: str, cfg: dict, steps: int = 3) -> dict:
    """The DeepSpeed-eager twin and graphzero's engine trained side by side, compared at every
    boundary (gradients), after every step (norm) and at the end (parameters)."""
    rank, _ = rank_world()
    gas = cfg["gradient_accumulation_steps"]
    ds, gz, _ = twins(stage, dtype, lambda: nn.Sequential(mlp2(), nn.GELU(), nn.Linear(4, 4)), cfg)
    step = compiled(square_loss, stage, dtype)
    tdtype = tensor_dtype(dtype)
    for t in range(steps):
        for m in range(gas):
            (x,) = data(gas * t + m, rank, (4, 4), dtype=tdtype)
            ds.backward(square_loss(ds, x))
            step(gz, x).backward()
            if m == gas - 1:
                assert_same(reported_grads(gz), reported_grads(ds), dtype, f"step {t} gradients")
                if stage < 3:
                    assert _reduces_into_cpu_grad(gz), f"step {t}: the shards are not the CPU optimizer's fp32 gradient"
            ds.step()
            gz.step()
        assert_same_norm(gz, ds, dtype, f"step {t}")
    assert_same_params(gz, ds, dtype, "after training")
    offloaded = (gz.zero_offload_optimizer() is not None, gz.zero_offload_param() is not None)
    # one boundary copy per optimizer step: the one at step() is skipped when nothing wrote since the backward's
    copies = binding_of(gz).offload_copy.made
    assert copies == steps, f"{copies} boundary copies in {steps} steps"
    graphzero.detach(gz)
    return {"norm": float(gz.get_global_grad_norm()), "offloaded": offloaded}


def _reduces_into_cpu_grad(engine) -> bool:
    """ZeRO-1/2: each group's partition buffer is the CPU optimizer's fp32 gradient (no boundary copy)."""
    opt = engine.optimizer
    return all(opt.averaged_gradients[i].flat_partition.data_ptr() == fp32.grad.data_ptr()
               for i, fp32 in enumerate(opt.single_partition_of_fp32_groups))


def offload_scenario(stage: int, dtype: str) -> dict:
    return train_twins(stage, dtype, offload_config(stage, dtype, gas=2))


@pytest.mark.parametrize("stage,dtype", [(3, "fp32"), (3, "bf16"), (2, "fp32"), (2, "bf16"), (1, "fp32")])
def test_optimizer_offload_matches_deepspeed_eager(ranks, stage, dtype):
    results = ranks.run(offload_scenario, stage, dtype)
    assert results[0]["norm"] == results[1]["norm"] and results[0]["offloaded"] == (True, False)


def param_offload_scenario(dtype: str) -> dict:
    """ZeRO-3 with the parameters (``offload_param``) and the optimizer offloaded to the CPU."""
    cfg = offload_config(3, dtype, gas=2)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return train_twins(3, dtype, cfg)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero3_parameter_offload_matches_deepspeed_eager(ranks, dtype):
    results = ranks.run(param_offload_scenario, dtype)
    assert results[0]["norm"] == results[1]["norm"] and results[0]["offloaded"] == (True, True)
