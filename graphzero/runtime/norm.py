"""The gradient norm folded into the compiled backward (ZeRO-1/2 with graphzero's lean step, and
ZeRO-3 through ``_get_norm_groups``).

DeepSpeed's ``step()`` starts with a blocking all-reduce of every param group's squared gradient
norm. The compiled backward already computes the final shard (fp32_accumulate), so the fold_norm
pass takes the squares in the same fused pass, and right after the backward the runtime issues one
asynchronous all-reduce of those scalars, long finished when ``step()`` reads them.

The norm must be that of the *final* gradient at the optimizer boundary, so every writer of the
shard bumps ``writes`` (`EngineState.write_sinks`), a folded norm records the count it was computed
at, and the step uses it only if nothing wrote since; otherwise it falls back to DeepSpeed's
blocking all-reduce. The decision is the same on every rank: the writes are the same
collective-issuing code paths everywhere (the rank-agreement exchange checks them).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class FoldedNorm:
    """Per engine: the write counter of its gradient shards and the norm in flight, if any."""

    def __init__(self, num_groups: int, process_group: object, at_boundary: Callable[[], bool]) -> None:
        self.num_groups = num_groups
        self.process_group = process_group
        self.at_boundary = at_boundary
        self.writes = 0
        # (writes when computed, squares per group (summed over ranks once work is done), work)
        self._pending: tuple[int, torch.Tensor, object] | None = None
        self.folded = 0   # counters for tests and benchmarks: norms folded / computed in step()
        self.blocking = 0

    def wrote(self) -> None:
        """A gradient shard of this engine was (or is about to be) written."""
        self.writes += 1

    def buffer(self, device: torch.device) -> torch.Tensor:
        """What the compiled backward writes its squares into (one fp32 scalar per param group)."""
        return torch.zeros(self.num_groups, dtype=torch.float32, device=device)

    def issue(self, writes: int, squares: torch.Tensor) -> None:
        """After a compiled backward that wrote every group's shard at write count ``writes`` and
        their squares into ``squares``: start summing them over the ranks (only at the accumulation
        boundary: a later micro-step would make them stale anyway)."""
        self._drain()
        if writes != self.writes or not self.at_boundary():
            return
        work = None
        if dist.get_world_size(self.process_group) > 1:
            work = dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
            if torch._C._autograd._profiler_enabled():
                # A gloo collective launched in a torch.profiler session and finished after it
                # stops crashes the process (torch 2.13): finish it inside the session.
                work.wait()
        self._pending = (writes, squares, work)

    def take(self) -> torch.Tensor | None:
        """In ``step()``: the squares summed over ranks, if they are of the current shards; else None
        (the caller computes the norm the blocking way)."""
        pending, self._pending = self._pending, None
        if pending is None:
            self.blocking += 1
            return None
        writes, squares, work = pending
        if work is not None:
            work.wait()
        if writes != self.writes:
            self.blocking += 1
            return None
        self.folded += 1
        return squares

    def forget(self) -> None:
        """zero_grad / detach: the shards are gone, and so is their norm."""
        self._drain()

    def _drain(self) -> None:
        # a superseded norm's all-reduce is still waited for: every rank issued it, none abandons it
        pending, self._pending = self._pending, None
        if pending is not None and pending[2] is not None:
            pending[2].wait()
