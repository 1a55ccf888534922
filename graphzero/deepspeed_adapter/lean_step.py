"""A lean ``DeepSpeedZeroOptimizer.step()`` (ZeRO-1/2) for the common configs.

DeepSpeed's own ``step()`` (``stage_1_and_2.py``) spends most of its time outside the arithmetic:
a separate overflow all-reduce, one norm all-reduce per param group, per-tensor Python loops,
timers, and ``torch.optim.AdamW``'s for-loop path, which on CPU makes about ten passes over the
fp32 partition. This step does the same arithmetic on each param group's flat fp32 partition:

1. every group's squared gradient norm (DeepSpeed's formula: each parameter's piece of the
   partition normed in fp64, padding excluded, summed; inf/NaN masked to -1; groups combined with
   an L2 norm): computed in the compiled backward and all-reduced asynchronously right after it
   (norm_fold.py), or, where that is not the norm of the current shards, one blocking all-reduce here. An invalid norm is an overflow, as in DeepSpeed's step, which is
   why the separate overflow all-reduce can go: a non-finite gradient always makes the norm
   invalid, and for fp32/bf16 (no dynamic loss scale) nothing else reads the flag;
2. the clip, with DeepSpeed's divisor ``max(1, (norm + 1e-6) / clip)``;
3. the update: ``torch.optim.Adam``/``AdamW`` through torch's fused CPU/GPU kernel
   (``torch._fused_adam_``/``_fused_adamw_``) on the optimizer's own state tensors (``step``,
   ``exp_avg``, ``exp_avg_sq``), created the way torch creates them, with the clip's divisor as
   the kernel's ``grad_scale``: it divides each gradient as it reads it (and stores the clipped
   gradient back, as DeepSpeed's in-place clip leaves it), which saves DeepSpeed's separate
   ``mul_`` pass over the partition (0.3 ms of 2.0 per engine and step on the gan's 3 MiB shards,
   CPU); any other supported base optimizer (DeepSpeed's ``FusedAdam``) gets DeepSpeed's in-place
   ``mul_`` and runs its own ``step()``;
4. the copy into the bit16 partition (none where the master is that partition: master_alias.py)
   and one all-gather of each group's flat bit16 buffer;
   with ``defer_param_gather`` launched and left in flight (registered with c10d under the
   buffer's storage, so a ``wait_tensor`` on any parameter waits for it: param_sync.py and the
   ``wait_params`` pass), otherwise waited for here as DeepSpeed does. On a gloo group of two
   ranks the all-gather is an all-to-all in which each rank sends its partition to the other and
   receives the other's straight into the flat buffer (a zero split for itself): gloo's
   all-gather copies the input and the output through staging buffers of its own, and took
   2.2-2.7x as long for the gan's 5-6 MiB buffers (docs/benchmarks.md, seventh pass). The same
   bytes arrive in the same place.

Everything DeepSpeed reads afterwards stays DeepSpeed's: ``_global_grad_norm`` (so
``engine.get_global_grad_norm()``), ``overflow``, the base optimizer's state and param groups (so
checkpoints load either way), the LR scheduler and the step counters (``engine.step()`` still does
that bookkeeping around this call). Numerics: identical norm and clip divisor; dividing by it
(the kernel) rather than multiplying by its inverse (DeepSpeed) and the fused Adam kernel round
differently from torch's for-loop path by about 1 ulp per step (1e-7 relative).

Configs this does not cover fall back to DeepSpeed's own ``step()`` (``unsupported_reason``).
So does a DeepSpeed whose functions this step mirrors are not the ones it was written against:
``MIRRORED`` lists each (step, norm, clip, overflow, all-gather helpers) with a fingerprint of its
source in DeepSpeed 0.19.8; at attach ``changed_mirrors`` recomputes them, and any difference
(a DeepSpeed fix this copy would miss) leaves DeepSpeed's own step in place, with a warning.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import textwrap

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import allow_inflight_collective_as_graph_input_ctx

from ..devices import all_gather_into
from . import fused_adam, master_alias
from .ds_internals import ds_attr

log = logging.getLogger("graphzero")

#: The profiler range around the parameter all-gather (an all-to-all on a gloo pair).
PARAM_GATHER = "graphzero.param_all_gather"


#: What this module re-implements, as ``module:qualname`` -> `fingerprint` of its source in
#: DeepSpeed 0.19.8. Recompute with ``python -m graphzero.deepspeed_adapter.lean_step`` after
#: checking a new DeepSpeed's versions of these against this module.
MIRRORED: dict[str, str] = {
    # the step itself: overflow branch, norm, clip, update, copy into bit16, all-gather
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.step":
        "a2d8d2337aa84128cee14eec52236ec9d68d1ec4e6a8efb303b5dcca981b7294",
    # the norm (_global_norm): per-group fp64 pieces without padding, one all-reduce, -1 masking
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
    # the clip (_clip_divisor) and the update (_update)
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.unscale_and_clip_grads":
        "cb0b04fe2145e38439981e4a0c67da6dda303e5742dbe6ff72e49aef2f5cbd3c",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._optimizer_step":
        "6f46d25e76261218ffb3b3b11083fe334a0191aedb98bd038cdda05476191b6b",
    # the parameter all-gather (_all_gather)
    "deepspeed.runtime.utils:all_gather_dp_groups":
        "f8b0beff6522ce2416af670fe04092db836a468247626163bd774a397df57638",
}


def _resolve(path: str):
    module, qualname = path.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def fingerprint(fn) -> str:
    """sha256 of a function's source, dedented, without blank lines, comment-only lines and
    trailing whitespace (a reformatted comment does not turn the lean step off; any code does)."""
    lines = textwrap.dedent(inspect.getsource(inspect.unwrap(fn))).splitlines()
    kept = [line.rstrip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


def changed_mirrors(expected: dict[str, str] | None = None) -> list[str]:
    """The mirrored DeepSpeed functions whose source differs from the one this step was written
    against (or that are gone): empty when the lean step may stand in for DeepSpeed's."""
    changed = []
    for path, digest in (MIRRORED if expected is None else expected).items():
        try:
            actual = fingerprint(_resolve(path))
        except (ImportError, AttributeError, OSError, TypeError):
            actual = None
        if actual != digest:
            changed.append(path)
    return changed


def _fused_adam_class():
    try:
        from deepspeed.ops.adam import FusedAdam
    except ImportError:   # DeepSpeed builds without its op builders
        return None
    return FusedAdam


def unsupported_reason(engine) -> str | None:
    """Why the lean step cannot stand in for this engine's ``optimizer.step()``; None if it can."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    opt = engine.optimizer
    if type(opt) is not DeepSpeedZeroOptimizer:
        return f"optimizer wrapper {type(opt).__name__}"
    checks = (
        (opt.cpu_offload, "optimizer offload"),
        (opt.zenflow, "ZenFlow"),
        (opt.torch_autocast_gradscaler is not None, "torch autocast"),
        (opt.has_moe_layers, "MoE layers"),
        (opt.mpu is not None, "model parallelism (mpu)"),
        (not opt.compute_grad_norm, "zero_optimization.compute_grad_norm=false"),
        (opt.dtype not in (torch.float32, torch.bfloat16), f"parameter dtype {opt.dtype}"),
        (opt.custom_loss_scaler or float(opt.loss_scale) != 1.0, "a loss scale other than 1"),
        (ds_attr(opt.loss_scaler, "dynamic"), "dynamic loss scaling"),
        (any(g.dtype != torch.float32 for g in opt.single_partition_of_fp32_groups), "non-fp32 master weights"),
        (any(opt._is_muon_group(g) for g in opt.bit16_groups), "Muon"),
    )
    for bad, what in checks:
        if bad:
            return what
    base = opt.optimizer
    ds_fused_adam = _fused_adam_class()
    if type(base) in fused_adam.TORCH_ADAMS:
        reason = fused_adam.base_unsupported_reason(base)
        if reason is not None:
            return reason
    elif ds_fused_adam is None or type(base) is not ds_fused_adam:
        return f"base optimizer {type(base).__name__} (lean step: torch Adam/AdamW, DeepSpeed FusedAdam)"
    # The all-gather writes bit16_groups_flat: the parameters must be views of it.
    for flat, params in zip(opt.bit16_groups_flat, opt.round_robin_bit16_groups):
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        if any(not lo <= p.data_ptr() < hi for p in params if p.numel()):
            return "parameters that are not views of the flat bit16 buffer"
    return None


class LeanStep:
    """Stands in for ``optimizer.step`` of one ``DeepSpeedZeroOptimizer`` (instance attribute)."""

    def __init__(self, optimizer, name: str, deferred=None, folded=None) -> None:
        self.opt = optimizer
        self.name = name
        # a norm_fold.FoldedNorm: the squares the compiled backward computed and already all-reduced
        self.folded = folded
        # a ParamSync: leave the all-gather in flight, wait through it; None: wait here
        self.deferred = deferred
        self.torch_adam = type(optimizer.optimizer) in fused_adam.TORCH_ADAMS
        self.world = [dist.get_world_size(group=g) for g in optimizer.real_dp_process_group]
        self.rank = [dist.get_rank(group=g) for g in optimizer.real_dp_process_group]
        # per group: the all-gather as a pairwise all-to-all (the same choice on every rank of a group)
        self.pairwise = [w == 2 and dist.get_backend(g) == "gloo"
                         for w, g in zip(self.world, optimizer.real_dp_process_group)]
        self._warned: set[str] = set()

    def __call__(self, closure=None) -> None:
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID
        opt = self.opt
        opt.micro_step_id = INITIAL_MICRO_STEP_ID
        if self.deferred is not None:
            # the last step's gather (if nothing read the parameters since) writes what we update
            self.deferred.wait()
        groups = [opt.averaged_gradients.get(i) for i in range(len(opt.bit16_groups))]
        if any(getattr(g, "flat_partition", None) is None for g in groups):
            # Not graphzero's flat partitions (the same on every rank: sinks are installed alike).
            self._fall_back("a gradient group without a flat partition")
            return type(opt).step(opt, closure)
        grads = [g.flat_partition.view(-1) for g in groups]
        norm = self._global_norm(groups)
        invalid = bool((~torch.isfinite(norm) | (norm < 0)).any())
        # DeepSpeed: bf16 with check_grad_overflow off steps even on an invalid norm.
        opt.overflow = invalid and (opt.dtype != torch.bfloat16 or opt.check_grad_overflow)
        prev_scale = opt.loss_scale
        opt._update_scale(opt.overflow)
        if opt.overflow:
            self._skip()
            return None
        opt._global_grad_norm = norm / prev_scale
        divisor = self._clip_divisor(norm)
        for i, grad in enumerate(grads):
            opt._release_preflattened_grad_buffers(i)
            opt.averaged_gradients[i] = None
            opt.all_grad_tensors[i] = None
            fp32 = opt.single_partition_of_fp32_groups[i]
            grad = grad if grad.dtype == fp32.dtype else grad.to(fp32.dtype)
            self._update(i, fp32, grad, divisor)
            part = master_alias.partition(opt, i, self.rank[i])
            if not master_alias.aliased(fp32, part):
                part.data.copy_(fp32.data)
        opt._lazy_init_hp_params_optimizer_state()
        self._all_gather()
        return None

    # -- the pieces -----------------------------------------------------------------------------
    def _global_norm(self, groups) -> torch.Tensor:
        """DeepSpeed's ``scaled_global_norm`` with one all-reduce for all groups, or none where the
        compiled backward folded the squares in (norm_fold.py)."""
        total = self.folded.take() if self.folded is not None else None
        if total is None:
            total = self._blocking_squares(groups)
        total = total.pow(0.5)
        total.masked_fill_(total.isnan() | total.isinf(), -1.0)
        invalid = (~torch.isfinite(total) | (total < 0)).any()
        combined = torch.linalg.vector_norm(total, ord=2)
        return torch.where(invalid, torch.full_like(combined, float("inf")), combined)

    def _blocking_squares(self, groups) -> torch.Tensor:
        opt = self.opt
        squares = []
        for group in groups:
            pieces = [g for g in group if not getattr(g, "_zero_padding", False)]
            if pieces:
                norms = torch._foreach_norm(pieces, 2, dtype=torch.float64)
                squares.append(torch.stack(norms).pow(2.0).sum().float())
            else:
                squares.append(torch.zeros((), dtype=torch.float32, device=group.flat_partition.device))
        total = torch.stack(squares)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
        return total

    def _clip_divisor(self, norm: torch.Tensor) -> torch.Tensor | None:
        """What ``unscale_and_clip_grads`` divides the gradients by (``max(1, (norm + 1e-6) / clip)``
        times the loss scale), computed with the same operations; None where it divides by 1."""
        opt = self.opt
        if opt.clip_grad == 0.0 and opt.loss_scale == 1.0:
            return None
        combined = opt.loss_scale
        if opt.clip_grad > 0.0:
            clip = ((norm / opt.loss_scale) + 1e-6) / opt.clip_grad
            combined = torch.clamp(clip, min=1.0) * opt.loss_scale
        return torch.as_tensor(combined, dtype=torch.float32, device=norm.device)

    def _update(self, i: int, fp32: torch.Tensor, grad: torch.Tensor, divisor: torch.Tensor | None) -> None:
        opt = self.opt
        if not self.torch_adam:
            # DeepSpeed's FusedAdam: its own fused kernel and its own state layout; the clip first,
            # in place, as DeepSpeed does it.
            if divisor is not None:
                grad.mul_(1.0 / divisor)
            fp32.grad = grad
            opt._optimizer_step(i)
            fp32.grad = None
            return
        fused_adam.update(opt.optimizer, i, fp32, grad, divisor)

    def _all_gather(self) -> None:
        opt = self.opt
        # Under torch.profiler a gloo collective launched inside a profiling session and finished
        # after it stops crashes the process (torch 2.13, reproduced with a plain async all-gather
        # and work.wait()): no deferral while profiling.
        defer = self.deferred is not None and not torch._C._autograd._profiler_enabled()
        for i, flat in enumerate(opt.bit16_groups_flat):
            if self.world[i] == 1:
                continue
            group, rank = opt.real_dp_process_group[i], self.rank[i]
            partitions = opt.parallel_partitioned_bit16_groups[i]
            # the profiler label tells a trace (and graphzero-compare's byte count) that this
            # all-to-all is a gather, not a reduction
            with allow_inflight_collective_as_graph_input_ctx(defer), torch.profiler.record_function(PARAM_GATHER):
                if self.pairwise[i]:
                    # rank 0 sends [nothing to itself, all to rank 1]; rank 1 the mirror image
                    splits = [0, 0]
                    splits[1 - rank] = partitions[rank].numel()
                    dist.all_to_all_single(partitions[1 - rank], partitions[rank], output_split_sizes=splits,
                                           input_split_sizes=splits, group=group, async_op=defer)
                else:
                    all_gather_into(flat, partitions[rank], group=group, async_op=defer)

    def _skip(self) -> None:
        """DeepSpeed's overflow branch: no update, gradients dropped, the norm reported as inf."""
        opt = self.opt
        opt._global_grad_norm = float("inf")
        opt.zero_grad(set_to_none=True)
        opt._release_preflattened_grad_buffers()
        for k in list(opt.averaged_gradients):
            opt.averaged_gradients[k] = None
            opt.all_grad_tensors[k] = None

    def _fall_back(self, why: str) -> None:
        if why not in self._warned:
            self._warned.add(why)
            log.warning("engine %r: lean optimizer step not used for this step (%s); running DeepSpeed's step()",
                        self.name, why)


if __name__ == "__main__":   # print the fingerprints of the installed DeepSpeed (see MIRRORED)
    from .fused_adam import ZERO3_MIRRORED
    for _path in {**MIRRORED, **ZERO3_MIRRORED}:
        print(f"    {_path!r}:\n        {fingerprint(_resolve(_path))!r},")
