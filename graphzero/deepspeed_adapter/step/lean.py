"""A lean ``DeepSpeedZeroOptimizer.step()`` (ZeRO-1/2) for the common configs.

DeepSpeed's own ``step()`` spends most of its time outside the arithmetic (a separate overflow
all-reduce, one norm all-reduce per param group, per-tensor Python loops, timers). This step does
the same arithmetic on each param group's flat fp32 partition:

1. the norm (DeepSpeed's formula, norm.root), folded into the compiled backward (runtime/norm.py)
   or one blocking all-reduce here. An invalid norm is an overflow, so the overflow all-reduce can
   go: a non-finite gradient always invalidates the norm, and for fp32/bf16 nothing else reads it;
2. the clip divisor (norm.clip_divisor), taken by the fused Adam kernel as its ``grad_scale``
   (adam.py), which saves DeepSpeed's ``mul_`` pass (0.3 ms of 2.0 per engine and step on the gan's
   3 MiB shards, CPU); DeepSpeed's ``FusedAdam`` gets the in-place ``mul_`` and its own ``step()``;
3. the copy into the bit16 partition (none where `alias_masters` applies) and one all-gather of
   each group's flat bit16 buffer, left in flight with ``defer_param_gather`` (deferred.py). On a
   gloo pair of ranks it is an all-to-all into the other's flat buffer: gloo's all-gather stages
   through buffers of its own and took 2.2-2.7x as long for the gan's 5-6 MiB buffers
   (docs/benchmarks.md, seventh pass).

Everything DeepSpeed reads afterwards (``_global_grad_norm``, ``overflow``, the base optimizer's
state, the LR scheduler, step counters) stays DeepSpeed's. Results differ from DeepSpeed's path by
about 1 ulp per step (1e-7 relative). Unsupported configs (`unsupported_reason`) and changed
mirrored functions (gate.py) keep DeepSpeed's ``step()``.

With fp32 parameters DeepSpeed holds each partition twice: in the flat parameter buffer (which the
parameters view) and as the fp32 master, copied after every update. `alias_masters` makes the
master's ``.data`` that partition, which skips the copy (0.65 ms per engine and step on the gan's
3 MiB partitions, CPU). A parameter changed in place between steps (``module.load_state_dict``)
then changes the master too (DeepSpeed would overwrite the change). A DeepSpeed call that moves
the master (``offload_states``) ends the alias, and the step copies again (`aliased`).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import allow_inflight_collective_as_graph_input_ctx

from ...devices import all_gather_into
from ..ds_internals import ds_attr
from ..ledger import PatchLedger
from . import adam
from .norm import clip_divisor, root

log = logging.getLogger("graphzero")

#: The profiler range around the parameter all-gather (an all-to-all on a gloo pair).
PARAM_GATHER = "graphzero.param_all_gather"


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
    reason = next((what for bad, what in checks if bad), None)
    if reason is None and type(opt.optimizer) is not _fused_adam_class():   # FusedAdam: LeanStep._update
        reason = adam.base_unsupported_reason(opt.optimizer)
    if reason is not None:
        return reason
    # The all-gather writes bit16_groups_flat: the parameters must be views of it.
    for flat, params in zip(opt.bit16_groups_flat, opt.round_robin_bit16_groups):
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        if any(not lo <= p.data_ptr() < hi for p in params if p.numel()):
            return "parameters that are not views of the flat bit16 buffer"
    return None


class LeanStep:
    """Stands in for ``optimizer.step`` of one ``DeepSpeedZeroOptimizer`` (instance attribute)."""

    def __init__(self, optimizer, state, deferred=None) -> None:
        self.opt = optimizer
        # the engine's run-time state (runtime/state.py): its name and folded norm
        self.state = state
        # a ParamSync: leave the all-gather in flight, wait through it; None: wait here
        self.deferred = deferred
        self.torch_adam = type(optimizer.optimizer) in adam.TORCH_ADAMS
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
        total = self.global_norm()
        invalid = bool((~torch.isfinite(total) | (total < 0)).any())
        # DeepSpeed: bf16 with check_grad_overflow off steps even on an invalid norm.
        opt.overflow = invalid and (opt.dtype != torch.bfloat16 or opt.check_grad_overflow)
        prev_scale = opt.loss_scale
        opt._update_scale(opt.overflow)
        if opt.overflow:
            self._skip()
            return None
        opt._global_grad_norm = total / prev_scale
        divisor = clip_divisor(opt, total, total.device)
        for i, grad in enumerate(grads):
            opt._release_preflattened_grad_buffers(i)
            opt.averaged_gradients[i] = None
            opt.all_grad_tensors[i] = None
            fp32 = opt.single_partition_of_fp32_groups[i]
            grad = grad if grad.dtype == fp32.dtype else grad.to(fp32.dtype)
            self._update(i, fp32, grad, divisor)
            part = partition(opt, i, self.rank[i])
            if not aliased(fp32, part):
                part.data.copy_(fp32.data)
        opt._lazy_init_hp_params_optimizer_state()
        self._all_gather()
        return None

    # -- the pieces -----------------------------------------------------------------------------
    def global_norm(self) -> torch.Tensor:
        """DeepSpeed's ``scaled_global_norm``: the folded squares, else one all-reduce for all groups."""
        folded = self.state.norm
        squares = folded.take() if folded is not None else None
        norms = root(squares if squares is not None else self._blocking_squares())
        invalid = (~torch.isfinite(norms) | (norms < 0)).any()
        combined = torch.linalg.vector_norm(norms, ord=2)
        return torch.where(invalid, torch.full_like(combined, float("inf")), combined)

    def _blocking_squares(self) -> torch.Tensor:
        opt = self.opt
        squares = []
        for group in (opt.averaged_gradients.get(i) for i in range(len(opt.bit16_groups))):
            pieces = [g for g in group if not getattr(g, "_zero_padding", False)]
            if pieces:
                norms = torch._foreach_norm(pieces, 2, dtype=torch.float64)
                squares.append(torch.stack(norms).pow(2.0).sum().float())
            else:
                squares.append(torch.zeros((), dtype=torch.float32, device=group.flat_partition.device))
        total = torch.stack(squares)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
        return total

    def _update(self, i: int, fp32: torch.Tensor, grad: torch.Tensor, divisor: torch.Tensor | None) -> None:
        opt = self.opt
        if not self.torch_adam:
            # DeepSpeed's FusedAdam: its own kernel and state layout; the clip in place first
            if divisor is not None:
                grad.mul_(1.0 / divisor)
            fp32.grad = grad
            opt._optimizer_step(i)
            fp32.grad = None
            return
        adam.update(opt.optimizer, i, fp32, grad, divisor)

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
            # the label tells a trace (and graphzero-compare's byte count) this is a gather
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
                        self.state.name, why)


# -- the fp32 masters as this rank's partition of the flat parameter buffer ---------------------
def partition(opt, i: int, rank: int) -> torch.Tensor:
    """This rank's partition of group ``i`` in the flat parameter buffer."""
    return opt.parallel_partitioned_bit16_groups[i][rank]


def aliased(master: torch.Tensor, part: torch.Tensor) -> bool:
    return master.data_ptr() == part.data_ptr() and master.numel() == part.numel()


def alias_masters(opt, ranks: list[int], ledger: PatchLedger) -> list[int]:
    """Point each fp32 master at its partition of the flat buffer where both are fp32 on one device
    (``ranks``: this rank per group); returns the groups aliased."""
    done = []
    for i, master in enumerate(opt.single_partition_of_fp32_groups):
        part = partition(opt, i, ranks[i])
        if (master.dtype != torch.float32 or part.dtype != torch.float32 or master.device != part.device
                or master.shape != part.shape or not part.is_contiguous() or aliased(master, part)):
            continue
        master.data = part.data
        done.append(i)
    if done:
        ledger.on_undo(lambda: _unalias(opt, done), "the fp32 masters' own storage")
        _repoint_fragments(opt, done)
    return done


def _unalias(opt, groups: list[int]) -> None:
    for i in groups:
        master = opt.single_partition_of_fp32_groups[i]
        master.data = master.data.clone()
    _repoint_fragments(opt, groups)


def _repoint_fragments(opt, groups: list[int]) -> None:
    """Each parameter's ``_hp_mapping.hp_fragment`` (``safe_get_full_fp32_param``) re-made on its
    master's current storage."""
    for i in groups:
        master = opt.single_partition_of_fp32_groups[i]
        for param in opt.bit16_groups[i]:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is not None:
                address = ds_attr(mapping, "hp_fragment_address")
                mapping.hp_fragment = master.narrow(0, address.start, address.numel)
