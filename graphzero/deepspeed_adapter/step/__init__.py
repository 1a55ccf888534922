"""An attached engine's optimizer step. `install` (called by base.py at attach) picks the step for
the engine's `Settings` (`StepInstall.choose`, again when an attach changes them), logs why where
DeepSpeed's own stays, and records every change in ledgers that detach undoes:

- ZeRO-1/2: the lean step (lean.py) where the config allows and the mirrored DeepSpeed functions are
  unchanged (gate.py); with ``defer_param_gather`` its all-gather stays in flight and every reader of
  the parameters waits for it (deferred.py, installed either way);
- ZeRO-3: DeepSpeed's step with graphzero's fused update, folded norm and coalesced gathers
  (zero3_update.py); BF16_Optimizer: DeepSpeed's step.

`Settings` belong to the engine: the first attach or compile that gives a value sets it, a different
value later is an OptionError, leaving one out changes nothing (`settle`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ...errors import OptionError
from ..ds_internals import _deepspeed_version
from ..ledger import PatchLedger
from . import gate, lean, zero3_update
from .deferred import ParamSync
from .norm import current_grad_norm

log = logging.getLogger("graphzero")

__all__ = ["Settings", "StepInstall", "current_grad_norm", "install", "settle"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """An engine's step options (options.Options documents them) and which of them were given."""

    lean_step: bool = True
    defer_param_gather: bool = False
    given: frozenset[str] = dataclasses.field(default=frozenset(), compare=False, repr=False)


def settle(current: Settings, engine: str, **given: bool | None) -> Settings:
    """An engine's settings after an attach or compile that gives ``given`` (None: not given)."""
    given = {k: v for k, v in given.items() if v is not None}
    for option, value in given.items():
        if option in current.given and value != getattr(current, option):
            raise OptionError(
                f"engine {engine!r} has option {option!r}={getattr(current, option)!r}, given when it was attached "
                f"or compiled before, and this attach or compile gives {option}={value!r}: an engine's optimizer "
                "step is set once. Give the same value or leave it out, or call graphzero.detach(engine) and "
                "attach it again with the new one")
    return dataclasses.replace(current, **given, given=current.given | given.keys())


@dataclasses.dataclass
class StepInstall:
    """What `install` put in place for one engine (its binding's ``step``); the chosen step has a
    ledger of its own."""

    binding: Any
    ledger: PatchLedger
    sync: ParamSync | None = None   # ZeRO-1/2: the waits for a deferred parameter all-gather
    reads_norm: bool = False   # ZeRO-3: step() reads the folded norm
    reason: str | None = None   # why DeepSpeed's own step runs unchanged; None: graphzero's
    lean_step: lean.LeanStep | None = None   # ZeRO-1/2
    fused_update: zero3_update.Zero3FusedUpdate | None = None   # ZeRO-3

    @property
    def folds_norm(self) -> bool:
        """The step reads the norm folded into the backward (the binding makes it)."""
        return self.reads_norm or self.lean_step is not None

    def choose(self, settings: Settings) -> None:
        """Undo the step chosen last, and choose and install the one for ``settings``."""
        self.ledger.undo()
        self.lean_step = self.fused_update = None
        binding, opt = self.binding, self.binding.engine.optimizer
        reason, level = _deepspeeds(binding, settings)
        if reason is not None and reason != self.reason:   # logged once, not again for the same reason
            log.log(level, "engine %r: DeepSpeed's own optimizer step (%s)", binding.name, reason)
        self.reason = reason
        if reason is not None:
            return
        if binding.kind == "zero3":
            self.fused_update = update = zero3_update.Zero3FusedUpdate(opt)
            self.ledger.set_attr(opt, "unscale_and_clip_grads", update.unscale_and_clip_grads)
            self.ledger.set_attr(opt, "_optimizer_step", update.optimizer_step)
            return
        step = lean.LeanStep(opt, binding.state, self.sync if settings.defer_param_gather else None)
        self.ledger.set_attr(opt, "step", step)
        lean.alias_masters(opt, step.rank, self.ledger)
        # undone first: a deferred all-gather still writes the parameters
        self.ledger.on_undo(self.sync.wait, "wait for a deferred parameter all-gather")
        self.lean_step = step


def install(binding, ledger: PatchLedger, settings: Settings) -> StepInstall:
    """At attach: what stays until detach (through ``ledger``), then the step for ``settings``."""
    step = StepInstall(binding, PatchLedger(f"engine {binding.name!r} optimizer step"))
    ledger.on_undo(step.ledger.undo, "the optimizer step")
    engine = binding.engine
    if binding.kind == "zero":
        step.sync = ParamSync(engine, [p for g in binding.param_set.groups for p in g.params])
        step.sync.install(ledger)
    elif binding.kind == "zero3":
        zero3_update.coalesce_gathers(engine.module, ledger)
        step.reads_norm = zero3_update.read_folded_norm(binding, ledger)
    step.choose(settings)
    return step


def _deepspeeds(binding, settings: Settings) -> tuple[str | None, int]:
    """Why the engine keeps DeepSpeed's own step and how loudly to say so; None where graphzero's runs."""
    opt, kind = binding.engine.optimizer, binding.kind
    what = {"zero": "lean step", "zero3": "fused update"}.get(kind)
    if what is None:
        return f"graphzero has no step of its own for {type(opt).__name__}", logging.INFO
    if not settings.lean_step:
        return "option lean_step=False", logging.INFO
    uncovered = lean.unsupported_reason(binding.engine) if kind == "zero" else zero3_update.unsupported_reason(opt)
    if uncovered is not None:
        return f"graphzero's {what} does not cover {uncovered}", logging.INFO
    changed = gate.changed_mirrors(gate.MIRRORED if kind == "zero" else gate.ZERO3_MIRRORED)
    if not changed:
        return None, logging.INFO
    reason = (f"the DeepSpeed functions graphzero's {what} re-implements are not the ones it was written against "
              f"(DeepSpeed 0.19.8); changed: {', '.join(changed)} (installed DeepSpeed {_deepspeed_version()})")
    return reason, logging.WARNING
