"""Reading DeepSpeed: its version, an attribute graphzero relies on (missing = a named error), and
which optimizer family an engine runs. No binding state; the adapter's modules share these."""
from __future__ import annotations

from ..errors import InternalsError


def _deepspeed_version() -> str:
    import deepspeed
    return str(deepspeed.__version__)


def ds_attr(obj: object, attr: str):
    """``getattr(obj, attr)`` for a DeepSpeed attribute graphzero checks: missing is an
    `InternalsError` naming it and the installed DeepSpeed, never a default that switches a check off."""
    try:
        return getattr(obj, attr)
    except AttributeError as exc:
        if hasattr(type(obj), attr):   # a property that failed inside: not a missing attribute
            raise
        raise _missing(obj, attr) from exc


def _missing(obj: object, attr: str) -> InternalsError:
    return InternalsError(
        f"{type(obj).__module__}.{type(obj).__qualname__} has no attribute {attr!r}, which graphzero reads "
        f"(installed DeepSpeed {_deepspeed_version()}; graphzero is tested with the versions in graphzero/versions.py)")


def _optimizer_kind(engine) -> str | None:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3):
        return "zero3"
    if isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
        return "zero"
    if isinstance(engine.optimizer, BF16_Optimizer):
        return "bf16"
    return None
