"""A persistent pool of 2 gloo ranks that runs test scenarios.

Spawning ranks and initialising DeepSpeed is slow, so one pool serves the whole session: a test
sends a module-level function; every rank runs it and sends back its result or traceback. A
scenario that fails or times out restarts the pool, since its ranks may be stuck in a collective;
the peers of a rank that failed are waited for only a little longer than the pool's process-group
timeout, since groups that DeepSpeed makes wait 30 minutes. A rank that crashes natively fails the
scenario with its faulthandler stacks.

Every gloo process group of a rank runs one worker thread (`one_worker_thread_per_gloo_group`):
with gloo's default two, collectives in flight together corrupt the heap now and then in plain
torch (docs/reliability.md, "the crash, found"; reproducer debug/functional_alltoall_soak.py).
"""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pathlib
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

WORLD_SIZE = 2
RENDEZVOUS_S = 300  # seconds for every rank to reach the process-group rendezvous
#: A scenario's default time limit: under pytest-timeout's 600 s, so that the pool restarts first.
SCENARIO_TIMEOUT_S = 540


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn, pg_timeout_s: float, fault_log: str) -> None:
    faulthandler.enable(file=open(fault_log, "w"), all_threads=True)  # noqa: SIM115 - open for the process's life
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    import torch
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    from graphzero_tools.gloo_threads import one_worker_thread_per_gloo_group
    one_worker_thread_per_gloo_group()
    # The rendezvous gets its own, generous timeout: a pool with a short process-group timeout (one
    # that waits for a failed peer) must not fail because one rank imported DeepSpeed more slowly.
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=max(pg_timeout_s, RENDEZVOUS_S)))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the test process
            conn.send(("error", traceback.format_exc()))
        finally:
            torch._dynamo.reset()
            # reset() keeps Dynamo's counters: a scenario's graph breaks must not show in the next one's dump
            torch._dynamo.utils.counters.clear()
            # reset() clears Dynamo's compile-start callbacks but keeps graphzero's early attach:
            # every scenario after the first runs right after a reset, as a notebook would. A scenario
            # that fails on purpose can leave partial sums pending on one rank only: they are its
            # engines' (runtime/state.py), and no later scenario's backward reaches them.
    dist.destroy_process_group()


class ScenarioFailed(AssertionError):
    pass


class RankPool:
    def __init__(self, world_size: int = WORLD_SIZE, pg_timeout_s: float = 90, failed_peer_grace_s: float = 60) -> None:
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        # how long the peers of a failed rank get beyond the process-group timeout to answer
        self.failed_peer_wait_s = pg_timeout_s + failed_peer_grace_s
        self._procs: list = []
        self._conns: list = []
        self._fault_logs: list[pathlib.Path] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        logs = pathlib.Path(tempfile.mkdtemp(prefix="graphzero-rankpool-"))
        self._fault_logs = [logs / f"rank{rank}.faulthandler.log" for rank in range(self.world_size)]
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, daemon=True,
                            args=(rank, self.world_size, port, child, self.pg_timeout_s, str(self._fault_logs[rank])))
            p.start()
            self._procs.append(p)
            self._conns.append(parent)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = SCENARIO_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results or raise with tracebacks."""
        outcomes = self.run_each(fn, *args, timeout=timeout, **kwargs)
        if any(status != "ok" for status, _ in outcomes):
            self.close(force=True)
            raise ScenarioFailed(f"{fn.__qualname__} failed:\n" + _describe(outcomes))
        return [value for _, value in outcomes]

    def run_each(self, fn: Callable[..., Any], *args: Any, timeout: float = SCENARIO_TIMEOUT_S, **kwargs: Any) -> list[tuple]:
        """Like run, but return each rank's ``(status, value)``: "ok", "error" (a traceback), "died"
        (exited), "crashed" (killed by a signal: its faulthandler log) or "timeout" (a message); for
        scenarios in which a rank fails on purpose."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        outcomes: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        # Once a rank has failed, its peers are most likely stuck in a collective with it (the
        # process group of a DeepSpeed engine waits 30 minutes): wait for them for one pool timeout
        # and a margin, not until the deadline, so that the pool is restarted before pytest-timeout
        # ends the test and leaves the next test a stuck pool.
        failed_at: float | None = None
        while len(outcomes) < len(self._conns):
            limit = deadline if failed_at is None else min(deadline, failed_at + self.failed_peer_wait_s)
            waiting = {conn: rank for rank, conn in enumerate(self._conns) if rank not in outcomes}
            ready = mp_connection.wait(list(waiting), timeout=max(limit - time.monotonic(), 0))
            if not ready:
                why = (f"no answer within {timeout} s" if failed_at is None else
                       f"no answer within {self.failed_peer_wait_s:.0f} s of a peer's failure "
                       "(probably waiting for it in a collective)")
                outcomes.update({rank: ("timeout", why) for rank in waiting.values()})
                break
            for conn in ready:
                rank = waiting[conn]
                outcomes[rank] = self._receive(rank, conn)
                if outcomes[rank][0] != "ok" and failed_at is None:
                    failed_at = time.monotonic()
        return [outcomes[rank] for rank in range(len(self._conns))]

    def _receive(self, rank: int, conn) -> tuple:
        try:
            return conn.recv()
        except EOFError:
            self._procs[rank].join(timeout=5)
            code = self._procs[rank].exitcode
            if code is not None and code < 0:
                log = _tail(self._fault_logs[rank])
                return ("crashed", f"worker killed by signal {-code}; its faulthandler log:\n{log}")
            return ("died", f"worker died (exit code {code})")

    def close(self, force: bool = False) -> None:
        for conn in self._conns:
            try:
                if not force:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=0 if force else 20)
            if p.is_alive():
                p.kill()
                p.join()
        if self._fault_logs:
            shutil.rmtree(self._fault_logs[0].parent, ignore_errors=True)
        self._procs, self._conns, self._fault_logs = [], [], []


def _describe(outcomes: list[tuple]) -> str:
    return "\n".join(f"rank {rank}:\n{value}" if status in ("error", "crashed") else f"rank {rank}: {value}"
                     for rank, (status, value) in enumerate(outcomes) if status != "ok")


def _tail(path: pathlib.Path, lines: int = 80) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"(unreadable: {err})"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"
