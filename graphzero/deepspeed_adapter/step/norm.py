"""DeepSpeed's gradient-norm root and clip divisor, shared by every step graphzero installs, and
`current_grad_norm`: the norm an engine's next ``step()`` will report, computed before it (for
Accelerate's ``clip_grad_norm_``) with the function that step uses. A collective over the
engine's data-parallel group; it changes nothing.
"""
from __future__ import annotations

import torch

from ..bound import binding_of


def root(squares: torch.Tensor) -> torch.Tensor:
    """Per param group, the norm from its summed squares as ``get_grad_norm_direct`` ends: the
    square root, inf/NaN masked to -1 (an invalid norm)."""
    norms = squares.pow(0.5)
    return norms.masked_fill(norms.isnan() | norms.isinf(), -1.0)


def clip_divisor(opt, norm, device: torch.device) -> torch.Tensor | None:
    """What ``unscale_and_clip_grads`` divides the gradients by, computed with its operations:
    ``max(1, (norm / loss_scale + 1e-6) / clip) * loss_scale`` (the loss scale alone without a clip);
    None where that is 1."""
    combined = opt.loss_scale
    if opt.clip_grad > 0.0:
        clip = ((norm / opt.loss_scale) + 1e-6) / opt.clip_grad
        combined = torch.clamp(clip, min=1.0) * opt.loss_scale
    if not torch.is_tensor(combined) and combined == 1.0:
        return None
    return torch.as_tensor(combined, dtype=torch.float32, device=device)


def current_grad_norm(engine) -> float:
    """Pre-clip global L2 norm of the gradients ``engine`` holds now (collective, read-only)."""
    binding = binding_of(engine)
    if binding is None:
        raise ValueError("current_grad_norm: the engine is not attached to graphzero")
    opt = engine.optimizer
    with torch.no_grad():
        if binding.kind == "bf16":
            from deepspeed.runtime.utils import get_global_norm_of_tensors

            grads, _expert = opt.get_grads_for_norm()
            norm = get_global_norm_of_tensors(input_tensors=grads, mpu=opt.mpu, norm_type=opt.norm_type)
            return float(norm)  # BF16_Optimizer: no loss scale
        if binding.kind == "zero3":
            from deepspeed.runtime.utils import combine_grad_norm_groups

            norm = combine_grad_norm_groups(opt._get_norm_groups())
        elif binding.step.lean_step is not None:
            norm = binding.step.lean_step.global_norm()
        else:
            norm = opt.scaled_global_norm()
        return float(norm) / float(opt.loss_scale)
