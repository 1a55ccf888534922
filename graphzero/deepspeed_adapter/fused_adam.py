"""torch Adam/AdamW's update on one flat fp32 partition, through torch's fused kernel.

DeepSpeed runs its base optimizer on each param group's flat fp32 partition (ZeRO-3: each
sub-group's). A ``torch.optim.Adam``/``AdamW`` built the way DeepSpeed's ``torch_adam`` builds it
(neither ``fused`` nor ``foreach``) takes torch's per-tensor for-loop path, which on CPU makes
about ten passes over the partition; ``torch._fused_adam_``/``_fused_adamw_`` makes one, and takes
the clip's divisor as its ``grad_scale`` (it divides each gradient as it reads it), which saves
DeepSpeed's separate in-place ``mul_`` pass. The state tensors (``step``, ``exp_avg``,
``exp_avg_sq``) are the optimizer's own, created the way torch creates them, so DeepSpeed's own step
and checkpoints find the same tensors either way. The fused kernel rounds differently from the
for-loop path by about 1 ulp per step.

`update` is the ZeRO-1/2 lean step's update (lean_step.py); `Zero3FusedUpdate` stands in for
``DeepSpeedZeroOptimizer_Stage3``'s clip and base-optimizer call where `zero3_unsupported_reason`
finds nothing against it (graphzero option ``lean_step=False`` keeps DeepSpeed's).
"""
from __future__ import annotations

import torch

from .ds_internals import ds_attr

#: Base optimizers whose update runs through torch's fused kernel.
TORCH_ADAMS = (torch.optim.Adam, torch.optim.AdamW)

#: The ZeRO-3 functions `Zero3FusedUpdate` stands in for, as ``module:qualname`` -> fingerprint of
#: their source in DeepSpeed 0.19.8 (lean_step.fingerprint; a changed one keeps DeepSpeed's).
ZERO3_MIRRORED: dict[str, str] = {
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._optimizer_step":
        "c545e42b5991c1d94f52583fa19504dacbcd7916a613440d64f88aa6af0721e8",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads":
        "b14a234e25414b2c712fca676806897bc2289ca56b9ec5604785724dd922eed8",
}


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


def zero3_unsupported_reason(opt) -> str | None:
    """Why `Zero3FusedUpdate` cannot stand in for this ZeRO-3 optimizer's update; None if it can
    (the caller also checks ``ZERO3_MIRRORED`` with lean_step.changed_mirrors)."""
    checks = (
        (ds_attr(opt, "offload_optimizer") or ds_attr(opt, "swap_optimizer"), "optimizer offload"),
        (ds_attr(opt, "zenflow"), "ZenFlow"),
        (ds_attr(opt, "torch_autocast_gradscaler") is not None, "torch autocast"),
        (ds_attr(opt, "use_muon"), "Muon"),
        (any(f.dtype != torch.float32 for f in ds_attr(opt, "fp32_partitioned_groups_flat")), "non-fp32 master weights"),
    )
    for bad, what in checks:
        if bad:
            return what
    return base_unsupported_reason(opt.optimizer)


class Zero3FusedUpdate:
    """``unscale_and_clip_grads`` and ``_optimizer_step`` of one ``DeepSpeedZeroOptimizer_Stage3``
    (instance attributes): the clip's divisor is kept, not applied, and the update divides by it."""

    def __init__(self, opt) -> None:
        self.opt = opt
        self._divisors: dict[int, torch.Tensor] = {}

    def unscale_and_clip_grads(self, sub_group_id: int, total_norm) -> None:
        opt = self.opt
        # DeepSpeed's combined scale, as it computes it (a tensor when the norm is one)
        combined = opt.loss_scale
        if opt.clip_grad > 0.0:
            clip = ((total_norm / opt.loss_scale) + 1e-6) / opt.clip_grad
            combined = torch.clamp(clip, min=1.0) * opt.loss_scale
        if torch.is_tensor(combined) or combined != 1.0:
            flat = opt.fp32_partitioned_groups_flat[sub_group_id]
            self._divisors[sub_group_id] = torch.as_tensor(combined, dtype=torch.float32, device=flat.device)

    def optimizer_step(self, sub_group_id: int) -> None:
        opt = self.opt
        fp32 = opt.fp32_partitioned_groups_flat[sub_group_id]
        divisor = self._divisors.pop(sub_group_id, None)
        update(opt.optimizer, opt.sub_group_to_group_id[sub_group_id], fp32, fp32.grad, divisor)
