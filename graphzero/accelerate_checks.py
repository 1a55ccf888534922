"""What ``graphzero.accelerate`` checks before it changes anything (version, Accelerator layout,
gradient_accumulation_steps), and how it finds the DeepSpeed models an Accelerator prepared.
Every refusal is a :class:`graphzero.AccelerateError` naming the model.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from .deepspeed_adapter.frozen import is_frozen
from .errors import AccelerateError

log = logging.getLogger("graphzero")

# Tested: accelerate 1.16.0 (transformers 5.24.0, deepspeed 0.19.8); 2.x is unknown.
MIN_VERSION = "1.16"
MAX_VERSION_EXCLUSIVE = "2"


def check_version() -> None:
    try:
        import accelerate
        from accelerate import Accelerator
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper  # noqa: F401
    except ImportError as exc:
        raise AccelerateError(f"graphzero.accelerate needs HF Accelerate (pip install 'graphzero[accelerate]'): {exc}")
    from packaging.version import Version

    version = Version(accelerate.__version__)
    if not Version(MIN_VERSION) <= version < Version(MAX_VERSION_EXCLUSIVE):
        raise AccelerateError(
            f"accelerate {accelerate.__version__} is not a version graphzero.accelerate understands "
            f"(tested: >={MIN_VERSION},<{MAX_VERSION_EXCLUSIVE}); it replaces Accelerate's DeepSpeed backward and "
            "optimizer wrappers and cannot tell whether they still work the way it assumes")
    # Accelerator.backward must reach DeepSpeed through deepspeed_engine_wrapped.backward, the one path replaced.
    try:
        source = inspect.getsource(Accelerator.backward)
    except (OSError, TypeError):
        source = None
    if source is not None and "deepspeed_engine_wrapped.backward" not in source:
        raise AccelerateError(
            f"accelerate {accelerate.__version__}: Accelerator.backward no longer calls "
            "deepspeed_engine_wrapped.backward, which graphzero.accelerate replaces with a plain loss.backward()")


def check_accelerator(accelerator: Any) -> None:
    from accelerate.utils import DistributedType

    for attr in ("_models", "_optimizers", "gradient_state", "deepspeed_engine_wrapped", "no_sync", "state"):
        if not hasattr(accelerator, attr):
            raise AccelerateError(
                f"{type(accelerator).__name__} has no {attr!r}: not an Accelerator this version of "
                "graphzero.accelerate understands")
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise AccelerateError(
            f"the Accelerator uses {accelerator.distributed_type}, not DeepSpeed: graphzero.accelerate trains "
            "models prepared with a DeepSpeed plugin (Accelerator(deepspeed_plugins={...}))")


def is_engine(obj: Any) -> bool:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return isinstance(obj, DeepSpeedEngine)


def describe(model: Any) -> str:
    module = getattr(model, "module", model)
    return f"{type(module).__module__}.{type(module).__qualname__}"


def deepspeed_models(accelerator: Any, known: dict[Any, str]) -> list[tuple[str, Any, list]]:
    """``(name, engine, [optimizer wrappers])`` of each DeepSpeed model, ``None`` for the optimizers of one
    prepared without an optimizer (frozen: deepspeed_adapter/frozen.py) (``known``: engines already
    enabled, which keep their names); refuses models and optimizers prepared without DeepSpeed."""
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

    raw = getattr(accelerator.state, "deepspeed_plugins", None)
    plugins = dict(raw) if isinstance(raw, dict) else ({"model": raw} if raw is not None else {})
    found = []
    engines = [m for m in accelerator._models if is_engine(m)]
    for i, model in enumerate(accelerator._models):
        if is_engine(model):
            continue
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        if trainable and engines:
            raise AccelerateError(
                f"model {i} ({describe(model)}) was prepared without DeepSpeed next to DeepSpeed engines: its "
                f"gradients (e.g. {trainable[0]!r}) would be neither averaged over ranks nor stepped by any engine. "
                "Prepare it through accelerator.prepare() with its own DeepSpeed plugin, or freeze it")
    for opt in accelerator._optimizers:
        if not isinstance(opt, DeepSpeedOptimizerWrapper):
            raise AccelerateError(
                f"optimizer {type(getattr(opt, 'optimizer', opt)).__name__} was prepared without DeepSpeed next to "
                "DeepSpeed engines: graphzero.accelerate cannot tell which model it trains. Prepare each model "
                "together with its optimizer")
    taken = {name: engine for engine, name in known.items()}
    for engine in engines:
        name = plugin_name(engine, plugins, known) or "model"
        if taken.get(name, engine) is not engine:
            # Several models prepared under one plugin: model, model1, model2, ...
            name = next(f"{name}{k}" for k in range(1, len(taken) + 2) if f"{name}{k}" not in taken)
        taken[name] = engine
        if is_frozen(engine):
            # Inference only (a teacher): attached frozen, nothing to reduce or step (optimizers None).
            found.append((name, engine, None))
            continue
        optimizers = [opt for opt in accelerator._optimizers if opt.optimizer is engine.optimizer]
        found.append((name, engine, optimizers))
    return found


def plugin_name(engine: Any, plugins: dict, known: dict[Any, str]) -> str | None:
    if engine in known:
        return known[engine]
    # Accelerate passes the active plugin's config dict itself to deepspeed.initialize.
    for name, plugin in plugins.items():
        if getattr(plugin, "deepspeed_config", None) is getattr(engine, "config", object()):
            return name
    return None


def check_gas(accelerator: Any, name: str, engine: Any) -> None:
    gas = engine.gradient_accumulation_steps()
    if gas != accelerator.gradient_accumulation_steps:
        raise AccelerateError(
            f"model {name!r}: DeepSpeed gradient_accumulation_steps={gas} but the Accelerator accumulates "
            f"over {accelerator.gradient_accumulation_steps} micro-batches: the engine would scale gradients by "
            f"1/{gas} and step on Accelerate's boundary. Give every plugin the same gradient_accumulation_steps "
            "(or 'auto') as the Accelerator")
