"""The rank pool's handling of failures (own 2-rank pools). A native crash (a rank killed by a
signal) fails the scenario, quoting the rank's faulthandler stacks; nothing reruns it. A rank that
raises while its peer waits for it in a collective with a long timeout: the failure comes soon
after the pool's own timeout, and the next scenario gets a fresh pool. Its gloo groups run one
worker thread each (the workaround for torch's heap corruption, docs/reliability.md)."""
from __future__ import annotations

import datetime
import os
import pathlib
import signal
import time

import pytest
import torch
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


def test_a_native_crash_fails_the_scenario(tmp_path):
    pool = RankPool(pg_timeout_s=10)
    try:
        with pytest.raises(ScenarioFailed) as failure:
            pool.run(crash_scenario, str(tmp_path), 1, timeout=240)
        # the next scenario gets a fresh pool, and the crash is not rerun
        assert pool.run(crash_scenario, str(tmp_path), 0, timeout=240) == ["ok", "ok"]
    finally:
        pool.close(force=True)
    message = str(failure.value)
    assert "killed by signal 11" in message and "Segmentation fault" in message, message
    assert "in crash_scenario" in message, message  # faulthandler's stack names the Python frame
    assert len(list(tmp_path.iterdir())) == 2   # the crashed run and the next one: no rerun


def gloo_threads_scenario() -> list[int]:
    """Worker threads of the default group and of one DeepSpeed-style new group."""
    group = dist.new_group()
    return [dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._threads,
            group._get_backend(torch.device("cpu")).options._threads]


def test_gloo_groups_run_one_worker_thread(ranks):
    assert ranks.run(gloo_threads_scenario) == [[1, 1], [1, 1]]


def one_rank_fails_scenario() -> int:
    """Rank 1 raises; rank 0 waits for it in a barrier on a group that waits 30 minutes (as the
    groups that DeepSpeed makes do)."""
    rank, _ = rank_world()
    group = dist.new_group(timeout=datetime.timedelta(minutes=30))
    if rank == 1:
        raise AssertionError("rank 1 fails on purpose")
    dist.barrier(group=group)
    return rank


def test_a_rank_failure_does_not_leave_its_peer_stuck():
    pool = RankPool(pg_timeout_s=10, failed_peer_grace_s=5)
    try:
        start = time.monotonic()
        with pytest.raises(ScenarioFailed) as failure:
            pool.run(one_rank_fails_scenario, timeout=240)
        waited = time.monotonic() - start
        assert pool.run(rank_world) == [(0, 2), (1, 2)]  # a fresh pool, not the stuck one
    finally:
        pool.close(force=True)
    message = str(failure.value)
    assert "rank 1 fails on purpose" in message and "of a peer's failure" in message, message
    assert waited < 120, f"the failure took {waited:.0f} s"
