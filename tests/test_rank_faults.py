"""Ranks that cannot agree, and ranks that fail, end cleanly: a named GraphZeroError on every
surviving rank, never a hang or a mixed reduction.

- rank agreement: one rank compiles a graph reaching an engine the other rank's graph does not
  (rank-dependent Python); ranks whose graphs differ but reach the same engines train
  (tests/test_rank_dependent.py);
- faults (own 2-rank pool, option fault_timeout_s=10): a rank that raises before backward, a rank
  whose compile fails, a rank killed mid-step.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from rankpool import RankPool
from scenario_utils import data, ds_config, engine, mlp, rank_world, two_engine_loss


def disagreement_scenario() -> str:
    import graphzero
    rank, _ = rank_world()
    torch.manual_seed(0)
    engines = {"actor": engine(mlp(8, 16, 4), ds_config(2)), "critic": engine(mlp(8, 16, 4), ds_config(1))}
    step = torch.compile(two_engine_loss, backend="graphzero", options={"engines": engines, "inner": "eager"})
    (x,) = data(0, rank, (4, 8))
    step(engines, x, True).backward()   # a first step both ranks agree on
    for eng in engines.values():
        eng.step()
    try:
        step(engines, x, rank == 0).backward()   # the critic on rank 0 only
    except graphzero.RankDisagreementError as err:
        message = str(err)
    else:
        raise AssertionError("the ranks ran different reductions and nothing noticed")
    dist.barrier()  # both ranks are here: nothing is stuck in a collective
    return message


def test_ranks_reaching_different_engines_raise_on_every_rank(ranks):
    messages = ranks.run(disagreement_scenario, timeout=180)
    assert all("ranks disagree" in m and "'critic'" in m for m in messages), messages


def fault_scenario(kind: str) -> dict:
    import graphzero
    rank, _ = rank_world()
    torch.manual_seed(0)
    eng = engine(mlp(8, 16, 4), ds_config(2))
    options = {"engines": {"net": eng}, "inner": "eager", "fault_timeout_s": 10}
    if kind == "compile_fails" and rank == 1:
        options["bucket_size"] = -1  # this rank's compile fails (OptionError)
    step = torch.compile(lambda m, x: m(x).square().mean(), backend="graphzero", options=options)
    (x,) = data(0, rank, (4, 8))
    if rank == 1:
        if kind == "killed":
            os._exit(3)
        try:
            if kind == "raises":
                raise RuntimeError("user code failed on rank 1")
            step(eng, x).backward()
        except (RuntimeError, graphzero.GraphZeroError) as err:
            return {"error": type(err).__name__}
        raise AssertionError("rank 1 was meant to fail")
    start = time.monotonic()
    try:
        step(eng, x).backward()
    except graphzero.RankFaultError as err:
        return {"error": "RankFaultError", "message": str(err), "seconds": time.monotonic() - start}
    raise AssertionError("rank 0 finished a reduction its peer never joined")


@pytest.mark.parametrize("kind", ["raises", "compile_fails", "killed"])
def test_a_failing_rank_ends_the_others_cleanly(kind):
    pool = RankPool(pg_timeout_s=10)
    try:
        outcomes = pool.run_each(fault_scenario, kind, timeout=240)
    finally:
        pool.close(force=True)
    status, result = outcomes[0]
    assert status == "ok", outcomes
    assert result["error"] == "RankFaultError" and "graph" in result["message"], result
    assert result["seconds"] < 60, result
    if kind == "killed":
        assert outcomes[1][0] == "died", outcomes
    else:
        assert outcomes[1] == ("ok", {"error": "OptionError" if kind == "compile_fails" else "RuntimeError"})
