"""Optimizer offload (``offload_optimizer: {device: cpu}``) of an attached engine.

DeepSpeed's offloaded ``step()`` reads the CPU optimizer's fp32 gradient and the per-parameter norms
its own epilogue records at the boundary; each binding supplies that boundary copy (zero12.py,
zero3.py). Where the engine's shard buffer can be that fp32 gradient itself (ZeRO-1/2 with fp32
accumulation on the CPU), graphzero's graphs reduce straight into it and the "copy" only records
the norms. It is made at the end of a boundary backward (``backward_ended``: ``safe_get_full_grad``
reads it) and again at the start of ``step()`` only if the shards were written or dropped since (the
eager safety net may write after the backward ended).
"""
from __future__ import annotations

from collections.abc import Callable

from ..errors import UnsupportedConfigError
from .ledger import PatchLedger


class BoundaryCopy:
    """The binding's boundary copy, made once per change of its engine's shards
    (``EngineState.sink_writes``)."""

    def __init__(self, binding, copy: Callable[[], None]) -> None:
        self._binding = binding
        self._copy = copy
        self._made_at: int | None = None
        self.made = 0   # copies made (tests)

    def __call__(self) -> None:
        writes = self._binding.state.sink_writes
        if self._made_at != writes:
            self._copy()
            self._made_at = writes
            self.made += 1


def install(binding, ledger: PatchLedger, copy: Callable[[], None],
            after_step: Callable[[], None] | None = None) -> None:
    """Through ``ledger``: ``optimizer.step()`` makes the boundary copy first if the shards changed
    since it was last made (then ``after_step``), and the binding's ``offload_copy`` is that copy
    until detach."""
    if binding.param_set.device.type != "cpu":
        raise UnsupportedConfigError(
            f"engine {binding.name!r}: optimizer offload of an engine on {binding.param_set.device}: graphzero "
            "copies gradients into DeepSpeed's CPU buffers only where the engine runs on the CPU so far")
    opt = binding.engine.optimizer
    original = opt.step
    boundary_copy = BoundaryCopy(binding, copy)

    def step(closure=None):
        boundary_copy()
        try:
            return original(closure)
        finally:
            if after_step is not None:
                after_step()

    ledger.set_attr(opt, "step", step)
    ledger.set_attr(binding, "offload_copy", boundary_copy)
