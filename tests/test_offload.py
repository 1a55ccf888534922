"""Optimizer offload (``offload_optimizer: {device: cpu}``) at ZeRO-3 against a DeepSpeed-eager twin:
the same seed, data and config (torch AdamW on the CPU partitions, gas 2, clipping, fp32 and bf16
with fp32 accumulation), 3 optimizer steps; at every boundary each parameter's gradient as
DeepSpeed reports it, after every step the gradient norm, at the end the parameters. Also: ZeRO-1/2
offload, NVMe offload and parameter offload are refused by name.

Tolerances as tests/test_deepspeed_parity_zero.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_deepspeed_parity_zero import (assert_same, assert_same_norm, assert_same_params, compiled, config, mlp2,
                                        reported_grads, square_loss, tensor_dtype, twins)
from torch import nn

import graphzero
from scenario_utils import data, ds_config, engine, mlp, rank_world


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


def offload_scenario(dtype: str, steps: int = 3, gas: int = 2) -> dict:
    rank, _ = rank_world()
    ds, gz, _ = twins(3, dtype, lambda: nn.Sequential(mlp2(), nn.GELU(), nn.Linear(4, 4)),
                      offload_config(3, dtype, gas))
    assert gz.optimizer.offload_optimizer and gz.optimizer.grad_partitions_flat_buffer.device.type == "cpu"
    step = compiled(square_loss, 3, dtype)
    tdtype = tensor_dtype(dtype)
    for t in range(steps):
        for m in range(gas):
            (x,) = data(gas * t + m, rank, (4, 4), dtype=tdtype)
            ds.backward(square_loss(ds, x))
            step(gz, x).backward()
            if m == gas - 1:
                assert_same(reported_grads(gz), reported_grads(ds), dtype, f"step {t} gradients")
            ds.step()
            gz.step()
        assert_same_norm(gz, ds, dtype, f"step {t}")
    assert_same_params(gz, ds, dtype, "after training")
    graphzero.detach(gz)
    return {"norm": float(gz.get_global_grad_norm())}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero3_optimizer_offload_matches_deepspeed_eager(ranks, dtype):
    results = ranks.run(offload_scenario, dtype)
    assert results[0]["norm"] == results[1]["norm"]


def refused_scenario() -> list[str]:
    torch.manual_seed(0)
    messages = []
    for stage, offload in ((2, {"offload_optimizer": {"device": "cpu"}}), (3, {"offload_param": {"device": "cpu"}})):
        cfg = ds_config(stage)
        cfg["zero_optimization"].update(offload)
        eng = engine(mlp(4, 8, 4), cfg)
        with pytest.raises(graphzero.UnsupportedConfigError) as info:
            graphzero.attach(offloaded=eng)
        messages.append(str(info.value))
    dist.barrier()
    return messages


def test_other_offloads_refused_by_name(ranks):
    for zero2, param in ranks.run(refused_scenario):
        assert "'offloaded'" in zero2 and "offload_optimizer" in zero2 and "ZeRO-2" in zero2
        assert "'offloaded'" in param and "offload_param" in param
