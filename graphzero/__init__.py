"""graphzero: compile-time ZeRO gradient handling for DeepSpeed engines sharing one loss.

    step = torch.compile(step, backend=graphzero.backend(gen=gen, disc=disc))
    step(z, real).backward()        # each engine now holds its reduced fp32 gradient shard
    gen.step(); disc.step()
"""
from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

from .errors import (
    AccelerateError,
    AttachTooLateError,
    AutogradUsageError,
    GraphZeroError,
    NoGradientError,
    NotAnEngineError,
    OptionError,
    OwnershipError,
    RankDisagreementError,
    RankFaultError,
    UnsupportedConfigError,
    VersionError,
    WorldMismatchError,
)
from .versions import check_versions

# Before the modules using torch/DeepSpeed internals: fail here, not deep inside a compile.
check_versions()

from . import deepspeed_adapter, early_attach
from .bound_backend import GraphZeroBackend, backend
from .compiler import graphzero_backend
from .options import Options

__all__ = ["AccelerateError", "AttachTooLateError", "AutogradUsageError", "GraphZeroBackend", "GraphZeroError",
           "NoGradientError", "NotAnEngineError", "OptionError", "OwnershipError", "RankDisagreementError",
           "RankFaultError", "UnsupportedConfigError", "VersionError", "WorldMismatchError", "attach", "backend",
           "detach", "graphzero_backend", "wait_params"]

logging.getLogger("graphzero").addHandler(logging.NullHandler())


def attach(*engines: Any, lean_step: bool | None = None, defer_param_gather: bool | None = None,
           **named_engines: Any) -> None:
    """Let graphzero own these DeepSpeed engines' parameters in every graph compiled with it, for
    code that cannot pass ``options={"engines": ...}``. Naming: deepspeed_adapter/names.py.
    ``lean_step`` / ``defer_param_gather``: the options of that name, set on the engines now."""
    pairs = Options.parse({"engines": [*engines]}).engines + Options.parse({"engines": named_engines}).engines
    settings = Options.parse({"engines": engines or named_engines, "lean_step": lean_step,   # checked as options
                              "defer_param_gather": defer_param_gather}).step_settings
    deepspeed_adapter.attach(pairs, **settings)
    early_attach.install()


def wait_params(*engines: Any) -> None:
    """Wait for the last ``step()``'s deferred all-gather: for a parameter tensor kept from before
    ``step()`` (module calls, ``state_dict``, ``parameters()`` and the next step wait by themselves)."""
    for engine in engines:
        binding = deepspeed_adapter.binding_of(engine)
        if binding is not None:
            binding.wait_params()


def detach(*engines: Any) -> None:
    """Give the engines back to DeepSpeed: its own hooks, forward and backward are restored."""
    for engine in engines:
        deepspeed_adapter.detach(engine)


def _register() -> None:
    # Installed, the entry point registers it; registering again fails with "duplicate name".
    if any(ep.name == "graphzero" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo import list_backends, register_backend
    if "graphzero" not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=graphzero_backend, name="graphzero")


def _register_torch_logs() -> None:
    try:
        from torch._logging._internal import register_log
        register_log("graphzero", "graphzero")
    except Exception:  # TORCH_LOGS integration is a convenience
        logging.getLogger("graphzero").debug("TORCH_LOGS=graphzero is not available", exc_info=True)


_register()
_register_torch_logs()
early_attach.install()


def __getattr__(name: str) -> Any:
    # `import graphzero` must not import the optional accelerate and trl extras.
    if name in ("accelerate", "hf"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
