"""graphzero for HF Accelerate: several DeepSpeed models, one loss, the ordinary Accelerate loop.

    accelerator.state.select_deepspeed_plugin("gen");  gen, opt_g = accelerator.prepare(gen, opt_g)
    accelerator.state.select_deepspeed_plugin("disc"); disc, opt_d = accelerator.prepare(disc, opt_d)
    graphzero.accelerate.enable(accelerator)                 # the one added line
    step = torch.compile(gan_loss, backend="graphzero")
    for z, real in loader:
        with accelerator.accumulate(gen, disc):
            accelerator.backward(step(z, real))
            opt_g.step(); opt_d.step(); opt_g.zero_grad(); opt_d.zero_grad()

What Accelerate does without it (accelerate 1.16, read in ``Accelerator._prepare_deepspeed`` and
``utils/deepspeed.py``): only the first prepared engine is wrapped, ``accelerator.backward(loss)``
runs that engine's ``engine.backward(loss)`` and ``engine.step()``, and every prepared optimizer's
``step()`` / ``zero_grad()`` is a no-op. Every other model is silently never stepped.

What ``enable`` changes (design choice: **the optimizer steps its engine**):

- every DeepSpeed engine the accelerator prepared with an optimizer is attached to graphzero
  (``graphzero.attach``): its gradients are reduced in the compiled backward graph, scaled by
  1/(world x its own gas);
- ``accelerator.backward(loss)`` is one plain ``loss.backward()``: no ``engine.backward``, no
  ``engine.step()`` (Accelerate's ``DeepSpeedEngineWrapper`` is replaced);
- each prepared optimizer's ``step()`` is its engine's ``engine.step()``, called every micro-batch
  as DeepSpeed's managed gradient accumulation expects, with the engine's accumulation boundary set
  to Accelerate's ``sync_gradients``: the engine updates exactly once per Accelerate
  accumulation window, when the user's loop says so; ``zero_grad()`` is the engine's (drops the
  accumulated shards) on a sync step and does nothing inside an accumulation window, like
  Accelerate's own ``AcceleratedOptimizer``.

Stepping in ``accelerator.backward`` (Accelerate's DeepSpeed behaviour) was rejected: with several
models it would step every model reached by a loss, so a two-phase GAN (D-step, then a G-step
whose loss also reaches D) would step D twice, on the generator's loss. Driving the engines from
their optimizers gives each model exactly the step the loop asks for, as in plain PyTorch.

- ``accelerator.accumulate(...)`` never calls ``no_sync()`` on an attached engine (graphzero reduces
  in-graph: ZeRO-2 every micro-batch, ZeRO-1 at the boundary, which ``accelerator.backward`` sets
  from ``sync_gradients`` before the backward; DeepSpeed's ``no_sync`` refuses ZeRO-2, and Accelerate picks
  ``no_sync`` from whichever plugin was selected last).

Where the loop cannot be made right, a :class:`graphzero.AccelerateError` names the model: an
Accelerate version or object layout this module does not know, a model or optimizer prepared
without DeepSpeed next to DeepSpeed engines, a model prepared after ``enable``, Accelerate's
``gradient_accumulation_steps`` differing from an engine's, a second ``accelerator.backward`` of a
loss already reduced, an engine ``step()``-ed at a boundary with no gradient (a double step), and
gradients from an accumulation boundary that neither ``step()`` nor ``zero_grad()`` consumed
before the next backward (a loop that relies on Accelerate stepping engines in ``backward``).

Both forms work: one ``Accelerator(deepspeed_plugins={name: plugin, ...})`` with
``select_deepspeed_plugin(name)`` before each ``prepare``, and one ``Accelerator`` per model (in
Accelerate's design the first one holds every plugin and later ones are created without one);
call ``enable(acc_a, acc_b)`` (or ``enable`` on each). Models are named after their plugin.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from . import deepspeed_adapter
from .errors import AccelerateError

log = logging.getLogger("graphzero")

# Tested: accelerate 1.16.0 (with transformers 5.24.0 and deepspeed 0.19.8). The lower bound is
# where multi-plugin DeepSpeed and this object layout were checked; 2.x is unknown.
MIN_VERSION = "1.16"
MAX_VERSION_EXCLUSIVE = "2"

_ATTR = "_graphzero_accelerate"


@dataclass(eq=False)
class _Model:
    """One attached engine as Accelerate prepared it."""

    name: str
    engine: Any
    # Set by a sync (boundary) backward that left gradients in the engine: they must be consumed
    # (step) or dropped (zero_grad) before the next backward.
    awaiting_step: bool = False
    optimizers: list = field(default_factory=list)


def _registry(accelerator: Any) -> dict:
    """``{engine: _Model}`` of the engines enabled in this Accelerate session.

    Kept in Accelerate's GradientState, the process singleton every Accelerator of a session shares
    (it holds ``sync_gradients``): one registry serves the one-Accelerator-per-model form, and
    resetting Accelerate's state (``GradientState._reset_state()``) forgets it.
    """
    gradient_state = accelerator.gradient_state
    registry = gradient_state.__dict__.get("_graphzero_models")
    if registry is None:
        registry = gradient_state.__dict__["_graphzero_models"] = {}
    return registry


def enable(*accelerators: Any) -> dict[str, Any]:
    """Attach every DeepSpeed engine these accelerators prepared and make their loop right.

    Call after the last ``accelerator.prepare(...)``; returns ``{name: engine}`` of the attached
    engines (named after their DeepSpeed plugin). Idempotent.
    """
    if not accelerators:
        raise AccelerateError(
            "graphzero.accelerate.enable() needs the Accelerator(s) whose models it should train"
        )
    _check_version()
    found: list[tuple[str, Any, list]] = []
    for accelerator in accelerators:
        _check_accelerator(accelerator)
        found += _deepspeed_models(accelerator)
    for name, engine, _ in found:
        _check_gas(accelerators[0], _Model(name, engine))
    # Validates every engine (config, ownership, world size) before changing any of them.
    deepspeed_adapter.attach([(name, engine) for name, engine, _ in found])
    registry = _registry(accelerators[0])
    for name, engine, optimizers in found:
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
        if not optimizers:
            log.warning(
                "graphzero.accelerate: model %r has no prepared optimizer; call engine.step() yourself", name
            )
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
            record = registry.pop(engine, None) if _is_engine(engine) else None
            if record is not None:
                for opt in record.optimizers:
                    for attr in ("step", "zero_grad"):
                        opt.__dict__.pop(attr, None)
                deepspeed_adapter.detach(engine)
        accelerator.deepspeed_engine_wrapped = state["wrapped"]
        accelerator.__dict__.pop("no_sync", None)
        delattr(accelerator, _ATTR)


# -- checks ---------------------------------------------------------------------------------------


def _check_version() -> None:
    try:
        import accelerate
        from accelerate import Accelerator
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper  # noqa: F401
    except ImportError as exc:
        raise AccelerateError(
            f"graphzero.accelerate needs HF Accelerate (pip install 'graphzero[accelerate]'): {exc}"
        )
    from packaging.version import Version

    version = Version(accelerate.__version__)
    if not Version(MIN_VERSION) <= version < Version(MAX_VERSION_EXCLUSIVE):
        raise AccelerateError(
            f"accelerate {accelerate.__version__} is not a version graphzero.accelerate understands "
            f"(tested: >={MIN_VERSION},<{MAX_VERSION_EXCLUSIVE}); it replaces Accelerate's DeepSpeed backward and "
            "optimizer wrappers and cannot tell whether they still work the way it assumes"
        )
    # The one code path replaced: Accelerator.backward must reach DeepSpeed through
    # deepspeed_engine_wrapped.backward(loss, sync_gradients=...), or that replacement is bypassed.
    try:
        source = inspect.getsource(Accelerator.backward)
    except (OSError, TypeError):
        source = None
    if source is not None and "deepspeed_engine_wrapped.backward" not in source:
        raise AccelerateError(
            f"accelerate {accelerate.__version__}: Accelerator.backward no longer calls "
            "deepspeed_engine_wrapped.backward, which graphzero.accelerate replaces with a plain loss.backward()"
        )


def _check_accelerator(accelerator: Any) -> None:
    from accelerate.utils import DistributedType

    for attr in ("_models", "_optimizers", "gradient_state", "deepspeed_engine_wrapped", "no_sync", "state"):
        if not hasattr(accelerator, attr):
            raise AccelerateError(
                f"{type(accelerator).__name__} has no {attr!r}: not an Accelerator this version of "
                "graphzero.accelerate understands"
            )
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise AccelerateError(
            f"the Accelerator uses {accelerator.distributed_type}, not DeepSpeed: graphzero.accelerate trains "
            "models prepared with a DeepSpeed plugin (Accelerator(deepspeed_plugins={...}))"
        )


def _is_engine(obj: Any) -> bool:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return isinstance(obj, DeepSpeedEngine)


def _describe(model: Any) -> str:
    module = getattr(model, "module", model)
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _deepspeed_models(accelerator: Any) -> list[tuple[str, Any, list]]:
    """``(name, engine, [prepared optimizer wrappers])`` of each trainable DeepSpeed model; refuses
    models and optimizers that Accelerate prepared without DeepSpeed."""
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

    raw = getattr(accelerator.state, "deepspeed_plugins", None)
    plugins = dict(raw) if isinstance(raw, dict) else ({"model": raw} if raw is not None else {})
    found = []
    engines = [m for m in accelerator._models if _is_engine(m)]
    for i, model in enumerate(accelerator._models):
        if _is_engine(model):
            continue
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        if trainable and engines:
            raise AccelerateError(
                f"model {i} ({_describe(model)}) was prepared without DeepSpeed next to DeepSpeed engines: its "
                f"gradients (e.g. {trainable[0]!r}) would be neither averaged over ranks nor stepped by any engine. "
                "Prepare it through accelerator.prepare() with its own DeepSpeed plugin, or freeze it"
            )
    for opt in accelerator._optimizers:
        if not isinstance(opt, DeepSpeedOptimizerWrapper):
            raise AccelerateError(
                f"optimizer {type(getattr(opt, 'optimizer', opt)).__name__} was prepared without DeepSpeed next to "
                "DeepSpeed engines: graphzero.accelerate cannot tell which model it trains. Prepare each model "
                "together with its optimizer"
            )
    registry = _registry(accelerator)
    taken = {record.name: engine for engine, record in registry.items()}
    for engine in engines:
        name = _plugin_name(engine, plugins, registry) or "model"
        if taken.get(name, engine) is not engine:
            # Several models prepared under one plugin: model, model1, model2, ...
            name = next(f"{name}{k}" for k in range(1, len(taken) + 2) if f"{name}{k}" not in taken)
        taken[name] = engine
        if engine.optimizer is None:
            # Inference only (a teacher): nothing to reduce or step. Its parameters get plain
            # autograd .grad if a loss reaches them with grad enabled.
            log.info(
                "graphzero.accelerate: model %r has no optimizer (inference only); left to DeepSpeed", name
            )
            continue
        optimizers = [opt for opt in accelerator._optimizers if opt.optimizer is engine.optimizer]
        found.append((name, engine, optimizers))
    return found


def _plugin_name(engine: Any, plugins: dict, registry: dict) -> str | None:
    record = registry.get(engine)
    if record is not None:
        return record.name
    # Accelerate passes the active plugin's config dict itself to deepspeed.initialize.
    for name, plugin in plugins.items():
        if getattr(plugin, "deepspeed_config", None) is getattr(engine, "config", object()):
            return name
    return None


def _check_gas(accelerator: Any, record: _Model) -> None:
    gas = record.engine.gradient_accumulation_steps()
    if gas != accelerator.gradient_accumulation_steps:
        raise AccelerateError(
            f"model {record.name!r}: DeepSpeed gradient_accumulation_steps={gas} but the Accelerator accumulates "
            f"over {accelerator.gradient_accumulation_steps} micro-batches: the engine would scale gradients by "
            f"1/{gas} and step on Accelerate's boundary. Give every plugin the same gradient_accumulation_steps "
            "(or 'auto') as the Accelerator"
        )


# -- the Accelerate-specific part that reads DeepSpeed optimizer state ----------------------------


def _has_gradients(engine: Any) -> bool:
    """Whether the engine holds reduced gradients its next boundary step() would consume."""
    binding = deepspeed_adapter.binding_of(engine)
    if binding is None:  # given back to DeepSpeed (graphzero.detach)
        return False
    opt = engine.optimizer
    local = binding.param_set.local
    if local is not None and local.pending:   # ZeRO-1: kept locally, reduced by the boundary step()
        return True
    if binding.kind == "bf16":
        return any(any(flags) for flags in opt.fp32_groups_has_gradients)
    return any(opt.averaged_gradients.get(i) is not None for i in range(len(binding.param_set.groups)))


# -- patches --------------------------------------------------------------------------------------


def _patch_optimizer(opt: Any, record: _Model) -> None:
    engine = record.engine

    def step(closure: Any = None) -> None:
        if closure is not None:
            raise AccelerateError(
                f"model {record.name!r}: optimizer.step(closure) is not supported by DeepSpeed engines"
            )
        sync = opt.gradient_state.sync_gradients
        if sync and not _has_gradients(engine):
            raise AccelerateError(
                f"model {record.name!r}: optimizer.step() at an accumulation boundary, but the model received no "
                "gradient since its last step (a second step() without a backward in between, or a loss that does "
                "not reach this model)"
            )
        # DeepSpeed's managed accumulation: engine.step() every micro-batch; Accelerate decides the boundary.
        engine.set_gradient_accumulation_boundary(sync)
        engine.step()

    def zero_grad(set_to_none: bool | None = None) -> None:
        if opt.gradient_state.sync_gradients:
            engine.zero_grad()  # drops graphzero's accumulated shards too (adapter)

    opt.step = step
    opt.zero_grad = zero_grad


class _PlainBackward:
    """Stands in for Accelerate's ``DeepSpeedEngineWrapper``: ``accelerator.backward(loss)`` becomes
    one plain ``loss.backward()``; stepping is left to the prepared optimizers."""

    def __init__(self, accelerator: Any, wrapped: Any) -> None:
        self._accelerator = accelerator
        self.wrapped = wrapped
        # Accelerate reads .engine (free_memory) and get_global_grad_norm() of the first engine.
        self.engine = getattr(wrapped, "engine", None)

    def get_global_grad_norm(self) -> Any:
        return self.wrapped.get_global_grad_norm() if self.wrapped is not None else None

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        accelerator = self._accelerator
        registry = _registry(accelerator)
        records = list(registry.values())
        grad_fn = loss.grad_fn
        if grad_fn is not None and grad_fn.metadata.get("graphzero_reduced"):
            raise AccelerateError(
                f"accelerator.backward() of a loss whose graph was already reduced by graphzero (models "
                f"{sorted(r.name for r in records)}): a second backward would add every engine's reduced "
                "gradient again. Call accelerator.backward() once per loss (sum the losses first)"
            )
        unattached = [
            m for m in accelerator._models if _is_engine(m) and m.optimizer is not None and m not in registry
        ]
        if unattached:
            raise AccelerateError(
                f"model ({_describe(unattached[0])}) was prepared after graphzero.accelerate.enable(): call "
                "enable(accelerator) again after the last accelerator.prepare()"
            )
        for record in records:
            _check_gas(accelerator, record)
        # Gradients a boundary backward left are consumed by a step() or dropped by zero_grad()
        # (the optimizer's or the engine's own) before the next backward, or nobody steps them.
        stale = [r.name for r in records if r.awaiting_step and _has_gradients(r.engine)]
        if stale:
            raise AccelerateError(
                f"model(s) {stale} still hold gradients from the last accumulation boundary that neither "
                "optimizer.step() nor optimizer.zero_grad() consumed; under graphzero.accelerate, "
                "accelerator.backward() does not step engines: call each prepared optimizer's step() (and zero_grad())"
            )
        for record in records:
            record.awaiting_step = False
            # This backward's boundary is Accelerate's: a ZeRO-1 engine with gas > 1 reduces only
            # at the boundary, and would otherwise see the flag its last step() left.
            record.engine.set_gradient_accumulation_boundary(sync_gradients)
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
        # graphzero reduces in-graph (ZeRO-1: at the boundary); DeepSpeed's no_sync would refuse ZeRO-2
        # (Accelerate chooses by the last selected plugin, not by this model's stage).
        if deepspeed_adapter.binding_of(model) is not None:
            yield
        else:
            with original_no_sync(model):
                yield

    accelerator.no_sync = no_sync


__all__ = ["MAX_VERSION_EXCLUSIVE", "MIN_VERSION", "disable", "enable"]
