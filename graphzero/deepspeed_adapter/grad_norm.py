"""The gradient norm an attached engine's next ``step()`` will report, computed before that step.

DeepSpeed computes an engine's global gradient norm inside ``step()`` and caches it for
``engine.get_global_grad_norm()``, so between a backward and the step only the previous step's
norm is known. Frameworks that ask for the norm in between (Accelerate's ``clip_grad_norm_``, called
after ``accelerator.backward`` and before ``optimizer.step()``) need the current one.

``current_grad_norm(engine)`` computes it from the reduced gradients graphzero left in the
optimizer's buffers, with the same function the engine's step will use (graphzero's lean step's,
or DeepSpeed's own per optimizer family), so the value equals the ``get_global_grad_norm()`` of
the step that follows. It is a collective over the engine's data-parallel group (ZeRO-1/2/3: each
rank holds a shard) and must be called on every rank; it changes nothing.
"""
from __future__ import annotations

import torch

from .base import binding_of


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
        else:
            lean = binding.lean_step
            if lean is not None:
                groups = [opt.averaged_gradients.get(i) for i in range(len(opt.bit16_groups))]
                norm = lean._global_norm(groups)
            else:
                norm = opt.scaled_global_norm()
        return float(norm) / float(opt.loss_scale)
