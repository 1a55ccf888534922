"""ZeRO-3 forward gathers run only once every rank agrees on them: a rank-dependent graph is a
RankDisagreementError on every rank, raised before the first all-gather, never a hang.

As tests/test_rank_faults.py provokes disagreement: rank-dependent Python makes one rank compile a
graph that gathers another engine's parameters too.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scenario_utils import data, ds_config, engine, mlp, rank_world, two_engine_loss


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide.
    yield
    ranks.close()


def forward_disagreement_scenario(inner: str) -> str:
    import graphzero
    rank, _ = rank_world()
    torch.manual_seed(0)
    cfg = ds_config(3)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engines = {"actor": engine(mlp(8, 16, 4), cfg), "critic": engine(mlp(8, 16, 4), cfg)}
    graphzero.attach(**engines)
    step = torch.compile(two_engine_loss, backend="graphzero", options={"engines": engines, "inner": inner})
    (x,) = data(0, rank, (4, 8))
    step(engines, x, True).backward()   # a first step both ranks agree on
    for eng in engines.values():
        eng.step()
    try:
        step(engines, x, rank == 0)   # rank 0 also gathers the critic
    except graphzero.RankDisagreementError as err:
        message = str(err)
    else:
        raise AssertionError("the ranks ran different forward gathers and nothing noticed")
    dist.barrier()  # both ranks are here: nothing is stuck in a collective
    return message


@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_forward_gathers_that_disagree_raise_on_every_rank(ranks, inner):
    messages = ranks.run(forward_disagreement_scenario, inner, timeout=300)
    assert all("ranks disagree" in m and "forward" in m for m in messages), messages
