"""Optimizer offload (``offload_optimizer: {device: cpu}``) of an attached engine.

graphzero's graphs reduce into the engine's gradient partition as without offload. DeepSpeed's
offloaded ``step()`` reads the CPU optimizer's fp32 gradient and the per-parameter norms its own
epilogue records at the boundary; each binding supplies that boundary copy (zero12.py, zero3.py).
It runs at the end of a boundary backward (``backward_ended``: ``safe_get_full_grad`` reads the
copy) and again at the start of ``step()`` (idempotent: a step may follow gradients the eager
safety net wrote after the backward ended).
"""
from __future__ import annotations

from collections.abc import Callable

from ..errors import UnsupportedConfigError
from .ledger import PatchLedger


def install(binding, ledger: PatchLedger, copy: Callable[[], None],
            after_step: Callable[[], None] | None = None) -> None:
    """Through ``ledger``: ``optimizer.step()`` makes ``copy`` first (then ``after_step``), and the
    binding's ``offload_copy`` is ``copy`` until detach."""
    if binding.param_set.device.type != "cpu":
        raise UnsupportedConfigError(
            f"engine {binding.name!r}: optimizer offload of an engine on {binding.param_set.device}: graphzero "
            "copies gradients into DeepSpeed's CPU buffers only where the engine runs on the CPU so far")
    opt = binding.engine.optimizer
    original = opt.step

    def step(closure=None):
        copy()
        try:
            return original(closure)
        finally:
            if after_step is not None:
                after_step()

    ledger.set_attr(opt, "step", step)
    ledger.set_attr(binding, "offload_copy", copy)
