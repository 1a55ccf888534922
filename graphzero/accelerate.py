"""graphzero for HF Accelerate: several DeepSpeed models, one loss, the ordinary Accelerate loop.

    accelerator.state.select_deepspeed_plugin("gen");  gen, opt_g = accelerator.prepare(gen, opt_g)
    accelerator.state.select_deepspeed_plugin("disc"); disc, opt_d = accelerator.prepare(disc, opt_d)
    graphzero.accelerate.enable(accelerator)                 # the one added line
    step = torch.compile(gan_loss, backend="graphzero")
    for z, real in loader:
        with accelerator.accumulate(gen, disc):
            accelerator.backward(step(z, real))
            opt_g.step(); opt_d.step(); opt_g.zero_grad(); opt_d.zero_grad()

Without it (accelerate 1.16) only the first prepared engine is ever stepped. ``enable`` makes
**the optimizer step its engine**: each engine prepared with an optimizer is attached (one
prepared without, a teacher, is attached frozen: its ZeRO-3 gathers run in graphzero's graphs);
``accelerator.backward`` is a plain ``loss.backward()``; ``optimizer.step()`` is ``engine.step()``
every micro-batch with Accelerate's ``sync_gradients`` as the boundary, ``zero_grad()`` the
engine's on a sync step. (Stepping in ``accelerator.backward`` would step D twice in a GAN whose
G-loss also reaches D.) ``clip_grad_norm_`` returns the current step's pre-clip norm (a collective
at a sync step; ``max_norm`` is ignored, engines clip by their ``gradient_clipping``), and
``accumulate`` never calls ``no_sync()`` on an attached engine. Where the loop cannot be made
right, a :class:`graphzero.AccelerateError` names the model. Models are named after their plugin;
checks and model discovery are in accelerate_checks.py.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from . import deepspeed_adapter
from .accelerate_checks import (
    MAX_VERSION_EXCLUSIVE,
    MIN_VERSION,
    check_accelerator,
    check_gas,
    check_version,
    deepspeed_models,
    describe,
    is_engine,
)
from .deepspeed_adapter.frozen import is_frozen
from .deepspeed_adapter.step import current_grad_norm
from .errors import AccelerateError

log = logging.getLogger("graphzero")

_ATTR = "_graphzero_accelerate"


@dataclass(eq=False)
class _Model:
    """One attached engine as Accelerate prepared it."""

    name: str
    engine: Any
    # A boundary backward left gradients: step() or zero_grad() must consume them before the next.
    awaiting_step: bool = False
    optimizers: list = field(default_factory=list)


def _registry(accelerator: Any) -> dict:
    """``{engine: _Model}`` of this Accelerate session, kept in the shared GradientState singleton
    (so one-Accelerator-per-model works, and ``GradientState._reset_state()`` forgets it)."""
    return accelerator.gradient_state.__dict__.setdefault("_graphzero_models", {})


def enable(*accelerators: Any) -> dict[str, Any]:
    """Attach every DeepSpeed engine these accelerators prepared (call after the last ``prepare``);
    returns ``{name: engine}``. Idempotent."""
    if not accelerators:
        raise AccelerateError("graphzero.accelerate.enable() needs the Accelerator(s) whose models it should train")
    check_version()
    found: list[tuple[str, Any, list]] = []
    for accelerator in accelerators:
        check_accelerator(accelerator)
        known = {engine: record.name for engine, record in _registry(accelerator).items()}
        found += deepspeed_models(accelerator, known)
    for name, engine, optimizers in found:
        if optimizers is not None:
            check_gas(accelerators[0], name, engine)
    # Validates every engine (config, ownership, world size) before changing any of them.
    deepspeed_adapter.attach([(name, engine) for name, engine, _ in found])
    registry = _registry(accelerators[0])
    for name, engine, optimizers in found:
        if optimizers is None:
            continue   # frozen: no gradient for Accelerate's backward or clip to route
        record = registry.get(engine)
        if record is None:
            record = registry[engine] = _Model(name, engine)
        for opt in optimizers:
            if opt not in record.optimizers:
                _patch_optimizer(opt, record)
                record.optimizers.append(opt)
    for accelerator in accelerators:
        _patch_accelerator(accelerator)
    for name, engine, optimizers in found:
        if optimizers == []:
            log.warning("graphzero.accelerate: model %r has no prepared optimizer; call engine.step() yourself", name)
    log.info("graphzero.accelerate: attached %s", [name for name, _, _ in found])
    return {name: engine for name, engine, _ in found}


def disable(*accelerators: Any) -> None:
    """Undo :func:`enable`: detach the engines and give Accelerate back its own behaviour."""
    for accelerator in accelerators:
        state = getattr(accelerator, _ATTR, None)
        if state is None:
            continue
        registry = _registry(accelerator)
        for engine in accelerator._models:
            record = registry.pop(engine, None) if is_engine(engine) else None
            if record is not None:
                for opt in record.optimizers:
                    for attr in ("step", "zero_grad"):
                        opt.__dict__.pop(attr, None)
                deepspeed_adapter.detach(engine)
        accelerator.deepspeed_engine_wrapped = state["wrapped"]
        accelerator.__dict__.pop("no_sync", None)
        accelerator.__dict__.pop("clip_grad_norm_", None)
        delattr(accelerator, _ATTR)


def _has_gradients(engine: Any) -> bool:
    """Whether the engine holds reduced gradients its next boundary step() would consume."""
    binding = deepspeed_adapter.binding_of(engine)
    if binding is None:  # given back to DeepSpeed (graphzero.detach)
        return False
    opt = engine.optimizer
    if binding.state.partial.pending:   # ZeRO-1: kept locally, reduced by the boundary step()
        return True
    if binding.kind == "bf16":
        return any(any(flags) for flags in opt.fp32_groups_has_gradients)
    return any(opt.averaged_gradients.get(i) is not None for i in range(len(binding.param_set.groups)))


def _patch_optimizer(opt: Any, record: _Model) -> None:
    engine = record.engine

    def step(closure: Any = None) -> None:
        if closure is not None:
            raise AccelerateError(f"model {record.name!r}: optimizer.step(closure) is not supported by DeepSpeed engines")
        sync = opt.gradient_state.sync_gradients
        if sync and not _has_gradients(engine):
            raise AccelerateError(
                f"model {record.name!r}: optimizer.step() at an accumulation boundary, but the model received no "
                "gradient since its last step (a second step() without a backward in between, or a loss that does "
                "not reach this model)")
        # DeepSpeed's managed accumulation: engine.step() every micro-batch; Accelerate decides the boundary.
        engine.set_gradient_accumulation_boundary(sync)
        engine.step()

    def zero_grad(set_to_none: bool | None = None) -> None:
        if opt.gradient_state.sync_gradients:
            engine.zero_grad()  # drops graphzero's accumulated shards too (adapter)

    opt.step = step
    opt.zero_grad = zero_grad


class _PlainBackward:
    """Replaces ``DeepSpeedEngineWrapper``: one plain ``loss.backward()``, no stepping."""

    def __init__(self, accelerator: Any, wrapped: Any) -> None:
        self._accelerator = accelerator
        self.wrapped = wrapped
        # Accelerate reads .engine (free_memory) and get_global_grad_norm() of the first engine.
        self.engine = getattr(wrapped, "engine", None)

    def get_global_grad_norm(self) -> Any:
        return self.wrapped.get_global_grad_norm() if self.wrapped is not None else None

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, scale_wrt_gas: bool = True,
                 **kwargs: Any) -> None:
        """``scale_wrt_gas=False`` (transformers' Trainer under DeepSpeed): the loss was divided by
        gas already; graphzero's graphs divide every engine's gradient by it, so it is undone here
        (every engine has the Accelerator's gas: check_gas)."""
        accelerator = self._accelerator
        registry = _registry(accelerator)
        records = list(registry.values())
        grad_fn = loss.grad_fn
        if grad_fn is not None and grad_fn.metadata.get("graphzero_reduced"):
            raise AccelerateError(
                f"accelerator.backward() of a loss whose graph was already reduced by graphzero (models "
                f"{sorted(r.name for r in records)}): a second backward would add every engine's reduced "
                "gradient again. Call accelerator.backward() once per loss (sum the losses first)")
        unattached = [m for m in accelerator._models if is_engine(m) and (
            deepspeed_adapter.binding_of(m) is None if is_frozen(m) else m not in registry)]
        if unattached:
            raise AccelerateError(
                f"model ({describe(unattached[0])}) was prepared after graphzero.accelerate.enable(): call "
                "enable(accelerator) again after the last accelerator.prepare()")
        for record in records:
            check_gas(accelerator, record.name, record.engine)
        stale = [r.name for r in records if r.awaiting_step and _has_gradients(r.engine)]
        if stale:
            raise AccelerateError(
                f"model(s) {stale} still hold gradients from the last accumulation boundary that neither "
                "optimizer.step() nor optimizer.zero_grad() consumed; under graphzero.accelerate, "
                "accelerator.backward() does not step engines: call each prepared optimizer's step() (and zero_grad())")
        for record in records:
            record.awaiting_step = False
            # ZeRO-1 with gas > 1 reduces only at the boundary: not the flag its last step() left.
            record.engine.set_gradient_accumulation_boundary(sync_gradients)
        if not scale_wrt_gas:
            loss = loss * accelerator.gradient_accumulation_steps
        loss.backward(**kwargs)
        if grad_fn is not None:
            grad_fn.metadata["graphzero_reduced"] = True
        if sync_gradients:
            for record in records:
                record.awaiting_step = _has_gradients(record.engine)


def _patch_accelerator(accelerator: Any) -> None:
    if getattr(accelerator, _ATTR, None) is not None:
        return
    wrapped = accelerator.deepspeed_engine_wrapped
    setattr(accelerator, _ATTR, {"wrapped": wrapped})
    accelerator.deepspeed_engine_wrapped = _PlainBackward(accelerator, wrapped)
    original_no_sync = accelerator.no_sync

    @contextlib.contextmanager
    def no_sync(model: Any):
        # DeepSpeed's no_sync refuses ZeRO-2 (Accelerate picks it by the last selected plugin).
        if deepspeed_adapter.binding_of(model) is not None:
            yield
        else:
            with original_no_sync(model):
                yield

    accelerator.no_sync = no_sync
    original_clip = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        parameters = list(parameters)
        records = _owning_records(accelerator, parameters)
        if not records:  # no attached engine's parameters: Accelerate's own behaviour
            return original_clip(parameters, max_norm, norm_type=norm_type)
        if norm_type != 2:
            raise AccelerateError(
                f"accelerator.clip_grad_norm_(norm_type={norm_type}) on models {[r.name for r in records]}: "
                "DeepSpeed engines compute the L2 norm only")
        return _combined_norm(records, accelerator.sync_gradients)

    accelerator.clip_grad_norm_ = clip_grad_norm_


def _owning_records(accelerator: Any, parameters: list) -> list[_Model]:
    """The attached models owning any of ``parameters``, in registry order."""
    ids = {id(p) for p in parameters}
    return [
        record
        for record in _registry(accelerator).values()
        if deepspeed_adapter.binding_of(record.engine) is not None
        and any(id(p) in ids for p in record.engine.module.parameters())
    ]


def _combined_norm(records: list[_Model], sync: bool) -> float | None:
    """sqrt(sum of squares) of the engines' norms: at a sync step the current one (collective on
    every engine's data-parallel group, in the same order on every rank), else the last step's."""
    squares = 0.0
    for record in records:
        if sync and _has_gradients(record.engine):
            norm = current_grad_norm(record.engine)
        else:
            norm = record.engine.get_global_grad_norm()
            if norm is None:
                continue
            norm = float(norm)
        squares += norm * norm
    return squares**0.5


__all__ = ["MAX_VERSION_EXCLUSIVE", "MIN_VERSION", "disable", "enable"]
