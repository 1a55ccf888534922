"""Attaching engines: check each engine's DeepSpeed config (every unsupported key named), pick the
binding for its optimizer family, refuse parameters owned twice and mismatched worlds, install.
`attach` validates every engine before changing any.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import NotAnEngineError, OwnershipError, UnsupportedConfigError
from ..ownership import check_same_world
from . import names, step
from .base import DeepSpeedBinding, binding_of
from .bf16 import BF16Binding
from .ds_internals import _optimizer_kind, ds_attr
from .frozen import FrozenBinding, check_frozen, is_frozen
from .zero3 import Zero3Binding, check_zero3_config
from .zero12 import ZeroBinding


def _deepspeed_engine_class() -> type:
    from deepspeed.runtime.engine import DeepSpeedEngine
    return DeepSpeedEngine


def attach(engines: Sequence[tuple[str, object]], *, lean_step: bool | None = None,
           defer_param_gather: bool | None = None) -> list[DeepSpeedBinding]:
    """Attach graphzero to each ``(name, engine)``; idempotent. An `options.DefaultName` is a label
    only (names.py). ``lean_step`` / ``defer_param_gather``: None is not given (step.settle)."""
    engine_cls = _deepspeed_engine_class()
    bindings, settings = [], []
    for name, engine in engines:
        if not isinstance(engine, engine_cls):
            raise NotAnEngineError(
                f"engine {name!r} is a {type(engine).__module__}.{type(engine).__qualname__}, not a DeepSpeed "
                "engine: pass the engine returned by deepspeed.initialize()")
        if binding_of(engine) is None:
            _check_config(name, engine)
        binding = binding_of(engine) or _binding_class(engine)(engine, name)
        settings.append(step.settle(binding.settings, binding.name, lean_step=lean_step,
                                    defer_param_gather=defer_param_gather))
        bindings.append(binding)
    # Ownership is what each engine's optimizer updates (a parameter that requires grad but is in
    # no param group of this engine is not its to reduce).
    claimed: dict[int, str] = {}
    for (name, engine), binding in zip(engines, bindings):
        for group in binding.param_set.groups:
            for pname, p in zip(group.names, group.params):
                owner = binding_of(p)
                other = owner.name if owner is not None and owner.engine is not engine else claimed.get(id(p))
                if other is not None and other != name:
                    raise OwnershipError(f"parameter {pname!r} is owned by two engines: {other!r} and {name!r}")
                claimed[id(p)] = name
    # Engines attached together share one loss, even across a graph break.
    check_same_world([b.param_set for b in bindings])
    final, displaced = names.assign([(name, binding) for (name, _), binding in zip(engines, bindings)])
    # All or nothing: a failed install undoes itself; engines this call attached are detached again.
    installed: list[DeepSpeedBinding] = []
    try:
        for name, binding, wanted in zip(final, bindings, settings):
            binding.rename(name)
            if binding_of(binding.engine) is None:
                binding.configure(wanted)   # the settings install() sees
                binding.install()
                installed.append(binding)
        for binding, wanted in zip(bindings, settings):
            binding.configure(wanted)   # values given for the first time: an attached engine's step anew
    except BaseException as exc:
        for binding in reversed(installed):
            try:
                binding.uninstall()
            except BaseException as undo_exc:  # noqa: BLE001 - the attach error is the one to raise
                exc.add_note(f"graphzero: detaching engine {binding.name!r} after the failed attach failed too: "
                             f"{undo_exc!r}")
        raise
    names.record(final, bindings, displaced)
    return bindings


def detach(engine: object) -> None:
    binding = binding_of(engine)
    if binding is not None:
        binding.uninstall()


def _check_config(name: str, engine) -> None:
    def unsupported(key: str, why: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(f"engine {name!r}: DeepSpeed config {key} is not supported by graphzero yet ({why})")

    stage = engine.zero_optimization_stage()
    frozen = is_frozen(engine)
    if frozen:
        check_frozen(name, engine)
    elif stage == 0:
        raise unsupported("zero_optimization.stage=0", "use ZeRO stage 1 or 2")
    if engine.fp16_enabled() and not frozen:
        raise unsupported("fp16.enabled", "fp16 needs dynamic loss scaling; use bf16")
    offload = _offloads(engine.zero_offload_optimizer())
    if offload is not None and offload != "cpu":
        raise unsupported(f"zero_optimization.offload_optimizer (device {offload})", "optimizer offload to the CPU only")
    param_offload = _offloads(engine.zero_offload_param())
    if param_offload is not None and (param_offload != "cpu" or engine.device.type != "cpu"):
        raise unsupported(f"zero_optimization.offload_param (device {param_offload}, engine on {engine.device.type})",
                          "parameter offload to the CPU of an engine that runs on the CPU only")
    if engine.zero_quantized_gradients():
        raise unsupported("zero_optimization.zero_quantized_gradients", "ZeRO++ quantized gradient reduction")
    if engine.zero_quantized_weights() or engine.zero_quantized_nontrainable_weights():
        raise unsupported("zero_optimization.zero_quantized_weights", "ZeRO++ quantized weights")
    if engine.zero_hpz_partition_size() > 1:
        raise unsupported("zero_optimization.zero_hpz_partition_size", "ZeRO++ hierarchical partitioning")
    if engine.torch_autocast_enabled():
        raise unsupported("torch_autocast.enabled", "autocast inside the engine")
    if not engine.managed_gradient_accumulation():
        raise unsupported("managed_gradient_accumulation=false", "step() would rebuild gradients from .grad")
    # Read explicitly: a DeepSpeed that renamed one of these must not switch its check off.
    if ds_attr(engine, "zenflow"):
        raise unsupported("zenflow", "ZenFlow selective updates")
    if ds_attr(engine, "has_moe_layers"):
        raise unsupported("MoE layers", "expert-parallel gradient groups")
    if ds_attr(engine, "pipeline_parallelism"):
        raise unsupported("PipelineModule", "pipeline parallelism")
    if not ds_attr(engine, "gradient_average"):
        raise unsupported("gradient_allreduce_op=sum", "graphzero averages over the data-parallel group")
    if ds_attr(engine, "sequence_parallel_size") > 1:
        raise unsupported("sequence_parallel_size>1", "sequence-parallel gradient averaging")
    if ds_attr(engine, "is_deepcompile_enabled")():
        raise unsupported("compile.deepcompile", "DeepCompile owns the same gradients")
    kind = _optimizer_kind(engine)
    if frozen:
        if stage == 3:
            check_zero3_config(engine, unsupported, trains=False)
        return
    if kind is None:
        raise unsupported(f"optimizer wrapper {type(engine.optimizer).__name__}",
                          "graphzero binds DeepSpeedZeroOptimizer, BF16_Optimizer and DeepSpeedZeroOptimizer_Stage3")
    if stage == 3:
        check_zero3_config(engine, unsupported)


def _offloads(offload_config) -> str | None:
    """The offload device ("cpu", "nvme"), None where nothing is offloaded."""
    if offload_config is None:   # DeepSpeed's "not configured"
        return None
    device = ds_attr(offload_config, "device")
    device = None if device is None else str(getattr(device, "value", device))
    return None if device in (None, "none") else device


def _binding_class(engine) -> type:
    if is_frozen(engine):
        return FrozenBinding
    return {"zero": ZeroBinding, "bf16": BF16Binding, "zero3": Zero3Binding}[_optimizer_kind(engine)]
