"""graphzero under transformers' ``Trainer`` and the TRL trainers built on it, in one line:

    trainer = DPOTrainer(model, ref_model, args=DPOConfig(deepspeed=ds_config, ...), ...)
    graphzero.hf.enable(trainer)        # before train()
    trainer.train()

The Trainer builds its DeepSpeed engine inside ``train()`` (``accelerator.prepare``), so ``enable``
registers a callback; at ``on_train_begin`` (after prepare) it

- attaches the trained engine through :func:`graphzero.accelerate.enable` (the Trainer's
  ``accelerator.backward(loss, scale_wrt_gas=False)`` becomes a plain backward, its
  ``optimizer.step()`` the engine's step at the accumulation boundary, ``clip_grad_norm_`` the
  engine's pre-clip norm, which the Trainer logs as ``grad_norm``);
- attaches every other DeepSpeed engine the trainer holds (TRL's ``ref_model``, ``teacher_model``,
  reward models in ``reward_funcs``...: engines TRL built itself) frozen, named after the attribute;
- compiles the trainer's ``compute_loss`` with graphzero's backend bound to all of them, so the
  trained and the frozen models run in its graphs. Evaluation and prediction (no grad, eval mode)
  call the trainer's own ``compute_loss``.

At ``on_train_end`` everything is given back: the instance's ``compute_loss``, the Accelerator's
DeepSpeed wrappers, the engines (detached). The Trainer's logs, checkpoints, scheduler and
``max_grad_norm`` are the Trainer's and DeepSpeed's own.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from . import accelerate as graphzero_accelerate
from . import deepspeed_adapter
from .accelerate_checks import is_engine
from .bound_backend import backend
from .deepspeed_adapter.frozen import is_frozen
from .errors import AccelerateError

log = logging.getLogger("graphzero")


def enable(trainer: Any, **options: Any) -> Any:
    """Train ``trainer``'s models under graphzero from its next ``train()``; ``options`` are graphzero's
    backend options (``inner``, ``bucket_size``, ``dump_dir``...). Returns the callback added."""
    from transformers import TrainerCallback

    class GraphZeroCallback(TrainerCallback):
        """Attaches at the start of training, gives everything back at its end."""

        def __init__(self) -> None:
            self.engines: dict[str, Any] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.engines = _attach(trainer, options)

        def on_train_end(self, args, state, control, **kwargs):
            _detach(trainer, self.engines)
            self.engines = {}

    if getattr(trainer, "accelerator", None) is None:
        raise AccelerateError(f"graphzero.hf.enable({type(trainer).__name__}): not a transformers Trainer")
    if not getattr(trainer, "is_deepspeed_enabled", False):
        raise AccelerateError(
            f"graphzero.hf.enable({type(trainer).__name__}): the trainer runs without DeepSpeed; pass a DeepSpeed "
            "config (TrainingArguments(deepspeed=...)) or an accelerate launch config with a DeepSpeed plugin")
    callback = GraphZeroCallback()
    trainer.add_callback(callback)
    return callback


def other_engines(trainer: Any, trained: Any) -> dict[str, Any]:
    """The DeepSpeed engines the trainer holds besides the trained one, named after their attribute
    (``ref_model``, ``teacher_model``, ``reward_funcs0``...)."""
    found: dict[str, Any] = {}
    for attr, value in vars(trainer).items():
        values = [(attr, value)] if not isinstance(value, (list, tuple)) else [
            (f"{attr}{i}", v) for i, v in enumerate(value)]
        for name, candidate in values:
            if (is_engine(candidate) and candidate is not trained
                    and all(candidate is not e for e in found.values())):
                found[name] = candidate
    return found


def _attach(trainer: Any, options: dict) -> dict[str, Any]:
    trained = trainer.model_wrapped
    if not is_engine(trained):
        raise AccelerateError(
            f"graphzero.hf: after the Trainer prepared its model, {type(trained).__name__} is not a DeepSpeed "
            "engine (is DeepSpeed enabled in TrainingArguments?)")
    named = graphzero_accelerate.enable(trainer.accelerator)
    trained_name = next(name for name, engine in named.items() if engine is trained)
    extras = other_engines(trainer, trained)
    trained_extras = [name for name, engine in extras.items() if not is_frozen(engine)]
    if trained_extras:
        raise AccelerateError(
            f"graphzero.hf: the trainer holds DeepSpeed engine(s) {trained_extras} with an optimizer that the "
            "Trainer does not step; graphzero.hf attaches the trainer's other engines frozen only")
    engines = {trained_name: trained, **extras}
    bound = backend(**engines, **options)   # attaches the frozen ones
    original = trainer.compute_loss
    compiled = torch.compile(original, backend=bound)

    def compute_loss(model, inputs, *args, **kwargs):
        if torch.is_grad_enabled() and model.training:
            return compiled(model, inputs, *args, **kwargs)
        return original(model, inputs, *args, **kwargs)   # evaluation, prediction

    trainer.compute_loss = compute_loss
    for engine in engines.values():
        _checkpointing_switches_eager(engine.module)
    log.info("graphzero.hf: %s trains %r under graphzero%s", type(trainer).__name__, trained_name,
             f", with {sorted(extras)} attached frozen" if extras else "")
    return engines


# transformers' deprecated aliases, which TRL calls inside compute_loss (disable_gradient_checkpointing
# around a no-grad reference forward; every TRL config defaults to gradient_checkpointing=True)
_CHECKPOINTING_SWITCHES = ("gradient_checkpointing_disable", "gradient_checkpointing_enable")
_EAGER_ATTR = "_graphzero_eager_switches"


def _checkpointing_switches_eager(module: Any) -> None:
    """Run the model's gradient-checkpointing switches eagerly, never traced: under Dynamo,
    transformers' ``_is_overridden`` check (a bound method's ``__func__`` against the class's) is
    re-evaluated in the resume function after the switch's FutureWarning breaks the graph, and the
    two aliases call each other until RecursionError (transformers 5.25, torch 2.13). Instance
    attributes, removed at the end of training; as instance wrappers transformers' own check takes
    the non-recursive branch."""
    if getattr(module, _EAGER_ATTR, None) is not None:
        return
    added = []
    for name in _CHECKPOINTING_SWITCHES:
        if callable(getattr(module, name, None)) and name not in vars(module):
            setattr(module, name, torch.compiler.disable(getattr(module, name)))
            added.append(name)
    setattr(module, _EAGER_ATTR, added)


def _checkpointing_switches_restored(module: Any) -> None:
    for name in vars(module).pop(_EAGER_ATTR, []):
        vars(module).pop(name, None)


def _detach(trainer: Any, engines: dict[str, Any]) -> None:
    trainer.__dict__.pop("compute_loss", None)
    for engine in engines.values():
        _checkpointing_switches_restored(engine.module)
    graphzero_accelerate.disable(trainer.accelerator)
    for engine in engines.values():
        deepspeed_adapter.detach(engine)


__all__ = ["enable", "other_engines"]
