"""Ranks agree on what they reduce before they reduce it, and collective failures get a clear name.

Before each reduction the ranks exchange one int64 fingerprint of the plan, so a rank that reached
a different graph raises `RankDisagreementError` everywhere instead of hanging in mismatched
collectives; a failed collective (peer raised, died, hangs) becomes a `RankFaultError`.
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


def agree(value: int, process_group: object, what: str, timeout_s: float | None = None) -> None:
    """Raise on every rank unless all hold the same ``value`` (a missing peer: RankFaultError)."""
    world = dist.get_world_size(process_group)
    if world == 1:
        return
    # On the group's device (NCCL takes CUDA tensors only); a fill, not torch.tensor (a host-to-device
    # copy waits for the stream). Reading the result (tolist) is a host sync.
    device = collective_device(process_group)
    mine = torch.full((1,), value, dtype=torch.int64, device=device)
    every = torch.empty(world, dtype=torch.int64, device=device)
    with collective_failures(what):
        work = all_gather_into(every, mine, group=process_group, async_op=True)
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    values = every.tolist()
    if len(set(values)) > 1:
        ranks = dist.get_process_group_ranks(process_group)
        groups: dict[int, list[int]] = {}
        for rank, v in zip(ranks, values):
            groups.setdefault(v, []).append(rank)
        raise RankDisagreementError(
            f"ranks disagree on what to reduce for {what}: rank groups {sorted(groups.values())} run different "
            "graphzero plans (a rank-dependent recompile, a frame one rank ran eagerly, or a different graph). "
            "Every rank must run the same compiled step; check for rank-dependent Python in the step")


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


class ForwardWithAgreement:
    """A compiled forward that gathers ZeRO-3 parameters, after the ranks agree on the gather plan."""

    def __init__(self, compiled, plan: list[tuple], groups: list[tuple[str, object]], what: str,
                 timeout_s: float | None) -> None:
        # In the instance dict: dynamo's disable() wrapper copies __dict__, not class attributes.
        self._boxed_call = True
        self.compiled = compiled
        self.fingerprint = fingerprint(plan)
        self.groups = groups
        self.what = what
        self.timeout_s = timeout_s

    def __call__(self, args: list) -> object:
        for _, group in self.groups:
            agree(self.fingerprint, group, self.what, self.timeout_s)
        with collective_failures(self.what):
            return self.compiled(args)
