"""The control collectives of ``graphzero-compare``'s ranks, on a gloo group of their own (not the
runners' default group): barriers before timed steps, agreeing on a runner's failure after every
runner step, and gathering each rank's records for the report."""

from __future__ import annotations

import datetime as dt
from typing import Any

import torch


class ControlGroup:
    """Control collectives on a separate gloo group: failure agreement, barriers, gathering results.
    Its timeout is longer than the runners' so that a runner collective times out first."""

    def __init__(self, timeout_s: float):
        import torch.distributed as dist

        self.dist = dist
        self.pg = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=2 * timeout_s + 60))
        self.world = dist.get_world_size()

    def barrier(self) -> None:
        self.dist.barrier(group=self.pg)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.pg)
        return out

    def agree(self, outcome: tuple[str, str] | None) -> tuple[str, str] | None:
        """``outcome`` is None (fine) or (kind, message), kind 'failed' or 'skipped'. Returns the
        outcome all ranks agree on: failed if any rank failed, else skipped if any skipped."""
        flag = torch.tensor([0 if outcome is None else 1], dtype=torch.int32)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.pg)
        if not flag.item():
            return None
        outcomes = self.gather(outcome)
        for kind in ("failed", "skipped"):
            msgs = [(r, o[1]) for r, o in enumerate(outcomes) if o is not None and o[0] == kind]
            if msgs:
                distinct = list(dict.fromkeys(m for _, m in msgs))
                if len(distinct) == 1:
                    return kind, distinct[0] if len(msgs) == self.world else f"{distinct[0]} (rank {msgs[0][0]})"
                return kind, "; ".join(f"rank {r}: {m}" for r, m in msgs)
        return None
