"""torch Adam/AdamW's update on one flat fp32 partition, through torch's fused kernel.

DeepSpeed's ``torch_adam`` base optimizer takes torch's per-tensor for-loop path, about ten passes
over the partition on CPU; ``torch._fused_adam_``/``_fused_adamw_`` makes one and takes the clip's
divisor as its ``grad_scale``. It rounds differently from the for-loop path by about 1 ulp per step.
Serves the lean step (lean.py) and the ZeRO-3 fused update (zero3_update.py).
"""
from __future__ import annotations

import torch

#: Base optimizers whose update runs through torch's fused kernel.
TORCH_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def base_unsupported_reason(base) -> str | None:
    """Why `update` cannot run this base optimizer's update; None if it can."""
    if type(base) not in TORCH_ADAMS:
        return f"base optimizer {type(base).__name__}"
    for group in base.param_groups:
        if group.get("differentiable") or group.get("capturable"):
            return f"{type(base).__name__} with differentiable or capturable"
    return None


def update(base, index: int, fp32: torch.Tensor, grad: torch.Tensor, divisor: torch.Tensor | None) -> None:
    """One Adam/AdamW step of ``base``'s param group ``index`` on the flat partition ``fp32``, with
    ``grad`` divided by ``divisor`` (the clip) as the kernel reads it."""
    group = base.param_groups[index]
    state = base.state[fp32]
    if not state:
        # As torch.optim.Adam._init_group creates it (non-fused, non-capturable layout), so
        # DeepSpeed's own step and checkpoints find the same tensors.
        from torch.optim.optimizer import _get_scalar_dtype
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
        state["exp_avg"] = torch.zeros_like(fp32, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(fp32, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(fp32, memory_format=torch.preserve_format)
    step = state["step"]
    step += 1
    # The fused kernel wants the step on the parameter's device (torch keeps it on the CPU). A fill,
    # not step.to(device): a pageable host-to-GPU copy synchronises the host every step.
    device_step = step if step.device == fp32.device else torch.full(
        (), float(step), dtype=step.dtype, device=fp32.device)
    beta1, beta2 = (float(b) if torch.is_tensor(b) else b for b in group["betas"])
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
    kernel([fp32.data], [grad], [state["exp_avg"]], [state["exp_avg_sq"]],
           [state["max_exp_avg_sq"]] if group["amsgrad"] else [], [device_step],
           amsgrad=group["amsgrad"], lr=group["lr"], beta1=beta1, beta2=beta2,
           weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
           grad_scale=divisor, found_inf=None)
