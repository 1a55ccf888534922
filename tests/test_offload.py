"""Optimizer offload (``offload_optimizer: {device: cpu}``) at ZeRO-1, 2 and 3 against a DeepSpeed-eager
twin: the same seed, data and config (torch AdamW on the CPU partitions, gas 2, clipping, fp32 and
bf16 with fp32 accumulation), 3 optimizer steps; at every boundary each parameter's gradient as
DeepSpeed reports it, after every step the gradient norm, at the end the parameters. Parameter
offload is refused by name (NVMe offload too; not tested: DeepSpeed builds no NVMe engine without
its aio op).

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


def offload_scenario(stage: int, dtype: str, steps: int = 3, gas: int = 2) -> dict:
    rank, _ = rank_world()
    ds, gz, _ = twins(stage, dtype, lambda: nn.Sequential(mlp2(), nn.GELU(), nn.Linear(4, 4)),
                      offload_config(stage, dtype, gas))
    assert getattr(gz.optimizer, "offload_optimizer" if stage == 3 else "cpu_offload")
    step = compiled(square_loss, stage, dtype)
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


@pytest.mark.parametrize("stage,dtype", [(3, "fp32"), (3, "bf16"), (2, "fp32"), (2, "bf16"), (1, "fp32")])
def test_optimizer_offload_matches_deepspeed_eager(ranks, stage, dtype):
    results = ranks.run(offload_scenario, stage, dtype)
    assert results[0]["norm"] == results[1]["norm"]


def refused_scenario() -> list[str]:
    """Parameter offload, on a trained engine and on a frozen one (no optimizer)."""
    import deepspeed
    torch.manual_seed(0)
    messages = []
    for frozen in (False, True):
        cfg = ds_config(3)
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        if frozen:
            del cfg["optimizer"]
            eng, *_ = deepspeed.initialize(model=mlp(4, 8, 4).requires_grad_(False), config=cfg)
        else:
            eng = engine(mlp(4, 8, 4), cfg)
        with pytest.raises(graphzero.UnsupportedConfigError) as info:
            graphzero.attach(offloaded=eng)
        messages.append(str(info.value))
    dist.barrier()
    return messages


def test_parameter_offload_refused_by_name(ranks):
    for messages in ranks.run(refused_scenario):
        for message in messages:
            assert "'offloaded'" in message and "offload_param" in message
