"""Ranks agree on what they reduce before they reduce it, and collective failures get a clear name.

Before each reduction the ranks exchange an int64 fingerprint of the plan (and whether they could go
on without collectives), so a rank that reached a different graph never joins mismatched
collectives: the backward then goes on without collectives where every rank can (`same`;
runtime/scope.py), else raises `RankDisagreementError` everywhere. A failed collective (peer
raised, died, hangs) becomes a `RankFaultError`.
"""
from __future__ import annotations

import contextlib
import datetime
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .devices import all_gather_into, collective_device
from .errors import RankDisagreementError, RankFaultError


def fingerprint(plan: object) -> int:
    """A stable 63-bit fingerprint of a plan's repr (the same on every rank for the same plan)."""
    text = repr(plan).encode()
    return (zlib.crc32(text) << 31) ^ zlib.adler32(text)


def exchange(values: list[int], process_group: object, what: str, timeout_s: float | None = None) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), in group rank order."""
    world = dist.get_world_size(process_group)
    if world == 1:
        return [list(values)]
    # On the group's device (NCCL takes CUDA tensors only): filled run by run, not torch.tensor (a
    # host-to-device copy waits for the stream). Reading the result (tolist) is a host sync.
    device = collective_device(process_group)
    mine = torch.zeros(len(values), dtype=torch.int64, device=device)
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            if values[start]:
                mine[start:i].fill_(values[start])
            start = i
    every = torch.empty(world * len(values), dtype=torch.int64, device=device)
    with collective_failures(what):
        work = all_gather_into(every, mine, group=process_group, async_op=True)
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    flat = every.tolist()
    return [flat[r * len(values):(r + 1) * len(values)] for r in range(world)]


def agree(value: int, process_group: object, what: str, timeout_s: float | None = None) -> None:
    """Raise on every rank unless all hold the same ``value`` (a missing peer: RankFaultError)."""
    every = exchange([value], process_group, what, timeout_s)
    if len({v for v, in every}) > 1:
        raise disagreement(process_group, every, what)


def same(value: int, local_ok: bool, process_group: object, what: str, timeout_s: float | None = None) -> bool:
    """Whether every rank holds ``value``. Where they differ and every rank can go on without
    collectives (``local_ok``: runtime/scope.py keeps the gradients locally), False on every rank;
    otherwise RankDisagreementError on every rank."""
    every = exchange([value, int(local_ok)], process_group, what, timeout_s)
    if len({v for v, _ in every}) == 1:
        return True
    if all(ok for _, ok in every):
        return False
    raise disagreement(process_group, [[v] for v, _ in every], what,
                       " and a graph of one of them gathers ZeRO-3 parameters in its backward")


def disagreement(process_group: object, every: list[list[int]], what: str, why: str = "") -> RankDisagreementError:
    ranks = dist.get_process_group_ranks(process_group)
    groups: dict[tuple, list[int]] = {}
    for rank, v in zip(ranks, every):
        groups.setdefault(tuple(v), []).append(rank)
    return RankDisagreementError(
        f"ranks disagree on what to reduce for {what}: rank groups {sorted(groups.values())} run different "
        f"graphzero plans{why} (a rank-dependent recompile, a frame one rank ran eagerly, or a different "
        "graph). Every rank must run the same compiled step here; check for rank-dependent Python in the step")


@contextlib.contextmanager
def collective_failures(what: str) -> Iterator[None]:
    """Re-raise a failed collective (peer raised, died or timed out) as a RankFaultError."""
    try:
        yield
    except RankDisagreementError:
        raise
    except (RuntimeError, dist.DistError) as err:
        if not _is_collective_failure(err):
            raise
        raise RankFaultError(
            f"a collective for {what} failed: a peer rank raised, died or did not reach it within the process "
            f"group's timeout. Look at the other ranks' errors first. ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})") from err


_MARKERS = ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "collective", "c10d", "socket", "closed")


def _is_collective_failure(err: BaseException) -> bool:
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return any(marker in text for marker in _MARKERS)
