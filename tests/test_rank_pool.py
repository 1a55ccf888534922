"""The rank pool's handling of a native crash (a rank killed by a signal): the failure quotes the
rank's faulthandler stacks, the scenario is rerun once on a fresh pool, and a crash the rerun gets
past is recorded and warned about, while one that comes back fails the test (own 2-rank pool)."""
from __future__ import annotations

import os
import pathlib
import signal

import pytest
import torch.distributed as dist

from rankpool import RankPool, ScenarioFailed
from scenario_utils import rank_world


def crash_scenario(marker_dir: str, crashes: int) -> str:
    """Rank 0 segfaults on the first ``crashes`` runs (counted by files in marker_dir)."""
    rank, _ = rank_world()
    if rank == 0:
        runs = pathlib.Path(marker_dir)
        done = len(list(runs.iterdir()))
        (runs / f"run{done}").touch()
        if done < crashes:
            os.kill(os.getpid(), signal.SIGSEGV)
    try:
        dist.barrier()
    except RuntimeError:
        return "peer gone"
    return "ok"


def test_a_native_crash_is_rerun_once_and_recorded(tmp_path):
    pool = RankPool(pg_timeout_s=10)
    try:
        with pytest.warns(RuntimeWarning, match="crashed natively in crash_scenario"):
            results = pool.run(crash_scenario, str(tmp_path), 1, timeout=240)
    finally:
        pool.close(force=True)
    assert results == ["ok", "ok"]
    assert len(list(tmp_path.iterdir())) == 2
    ((scenario, report),) = pool.native_crashes
    assert scenario == "crash_scenario"
    assert "killed by signal 11" in report and "Segmentation fault" in report, report
    assert "in crash_scenario" in report, report  # faulthandler's stack names the Python frame


def test_a_native_crash_that_comes_back_fails(tmp_path):
    pool = RankPool(pg_timeout_s=10)
    try:
        with pytest.raises(ScenarioFailed) as failure:
            pool.run(crash_scenario, str(tmp_path), 2, timeout=240)
    finally:
        pool.close(force=True)
    message = str(failure.value)
    assert "killed by signal 11" in message and "a rerun on a fresh pool failed too" in message, message
    assert pool.native_crashes == []
