"""The source-fingerprint gate: graphzero's steps stand in for DeepSpeed functions only while those
have the source they were written against (each table: ``module:qualname`` to the `fingerprint` of
its source in DeepSpeed 0.19.8). Recompute with ``python -m graphzero.deepspeed_adapter.step.gate``
after checking a new DeepSpeed's versions against lean.py and zero3_update.py.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap

#: What the ZeRO-1/2 lean step (lean.py) re-implements.
MIRRORED: dict[str, str] = {
    # the step itself: overflow branch, norm, clip, update, copy into bit16, all-gather
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.step":
        "a2d8d2337aa84128cee14eec52236ec9d68d1ec4e6a8efb303b5dcca981b7294",
    # the norm (LeanStep.global_norm): per-group fp64 pieces without padding, one all-reduce, -1 masking
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.scaled_global_norm":
        "7c0e0519726ce50974a10a2212060f4917bf75292fd076eb8c1cd2cbd9b10c4d",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.get_grad_norm_direct":
        "a026b9a3030c5c7233da588c84470b94a7376e0d5949a0ca35b44383588caab0",
    "deepspeed.runtime.utils:combine_grad_norm_groups":
        "e1b7b7af171510a8e6c9496e7c87326482f3341a8adb885742501d77a23f134d",
    "deepspeed.runtime.utils:mask_nan_or_inf_with_val_inplace":
        "2b4a382333746265870c60a12ab9364e760d425cf3e28d1cab29289134965d9e",
    "deepspeed.runtime.utils:is_invalid_grad_norm":
        "f51bdb9f619ef5cee762309bf89d8d8f251c0edb3169080f65894c0d34040175",
    # the overflow all-reduce the lean step drops (an invalid norm is the same overflow)
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.check_overflow":
        "21e688469410dcb9b8e294232a90068233e8bd35dc84d432a04e02516c74fd9e",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.has_overflow":
        "276d94de0eb5df4c7ef3a9100854a0defdd3e2c3839b43b37ff21fb2ac12511d",
    # the clip (norm.clip_divisor) and the update (LeanStep._update)
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.unscale_and_clip_grads":
        "cb0b04fe2145e38439981e4a0c67da6dda303e5742dbe6ff72e49aef2f5cbd3c",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._optimizer_step":
        "6f46d25e76261218ffb3b3b11083fe334a0191aedb98bd038cdda05476191b6b",
    # the parameter all-gather (LeanStep._all_gather)
    "deepspeed.runtime.utils:all_gather_dp_groups":
        "f8b0beff6522ce2416af670fe04092db836a468247626163bd774a397df57638",
}

#: What the ZeRO-3 fused update (zero3_update.py) stands in for.
ZERO3_MIRRORED: dict[str, str] = {
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._optimizer_step":
        "c545e42b5991c1d94f52583fa19504dacbcd7916a613440d64f88aa6af0721e8",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads":
        "b14a234e25414b2c712fca676806897bc2289ca56b9ec5604785724dd922eed8",
}


def _resolve(path: str):
    module, qualname = path.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def fingerprint(fn) -> str:
    """sha256 of a function's source, dedented, without blank lines, comment-only lines and
    trailing whitespace (a reformatted comment does not turn a step off; any code does)."""
    lines = textwrap.dedent(inspect.getsource(inspect.unwrap(fn))).splitlines()
    kept = [line.rstrip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


def changed_mirrors(expected: dict[str, str] | None = None) -> list[str]:
    """The mirrored DeepSpeed functions (default: `MIRRORED`) whose source differs from the one
    graphzero was written against, or that are gone: empty when graphzero's step may stand in."""
    changed = []
    for path, digest in (MIRRORED if expected is None else expected).items():
        try:
            actual = fingerprint(_resolve(path))
        except (ImportError, AttributeError, OSError, TypeError):
            actual = None
        if actual != digest:
            changed.append(path)
    return changed


if __name__ == "__main__":   # print the fingerprints of the installed DeepSpeed
    for _path in {**MIRRORED, **ZERO3_MIRRORED}:
        print(f"    {_path!r}:\n        {fingerprint(_resolve(_path))!r},")
