"""A lean ``DeepSpeedZeroOptimizer.step()`` (ZeRO-1/2) for the common configs.

DeepSpeed's own ``step()`` (``stage_1_and_2.py``) spends most of its time outside the arithmetic:
a separate overflow all-reduce, one norm all-reduce per param group, per-tensor Python loops,
timers, and ``torch.optim.AdamW``'s for-loop path, which on CPU makes about ten passes over the
fp32 partition. This step does the same arithmetic on each param group's flat fp32 partition:

1. every group's squared gradient norm (DeepSpeed's formula: each parameter's piece of the
   partition normed in fp64, padding excluded, summed; inf/NaN masked to -1; groups combined with
   an L2 norm; norm.root): computed in the compiled backward and all-reduced asynchronously right
   after it (runtime/norm.py), or, where that is not the norm of the current shards, one blocking
   all-reduce here. An invalid norm is an overflow, as in DeepSpeed's step, which is why the
   separate overflow all-reduce can go: a non-finite gradient always makes the norm invalid, and
   for fp32/bf16 (no dynamic loss scale) nothing else reads the flag;
2. the clip, with DeepSpeed's divisor ``max(1, (norm + 1e-6) / clip)`` (norm.clip_divisor);
3. the update: ``torch.optim.Adam``/``AdamW`` through torch's fused kernel on the optimizer's own
   state (adam.py), with the clip's divisor as the kernel's ``grad_scale``: it divides each
   gradient as it reads it (and stores the clipped gradient back, as DeepSpeed's in-place clip
   leaves it), which saves DeepSpeed's separate ``mul_`` pass over the partition (0.3 ms of 2.0 per
   engine and step on the gan's 3 MiB shards, CPU); DeepSpeed's ``FusedAdam`` gets DeepSpeed's
   in-place ``mul_`` and runs its own ``step()``;
4. the copy into the bit16 partition (none where the master is that partition: `alias_masters`)
   and one all-gather of each group's flat bit16 buffer, with ``defer_param_gather`` left in
   flight (registered with c10d under the buffer's storage, so a ``wait_tensor`` on any parameter
   waits for it: deferred.py, the ``wait_params`` pass). On a gloo pair of ranks the all-gather is
   an all-to-all, each rank sending its partition straight into the other's flat buffer: gloo's
   all-gather stages input and output through buffers of its own and took 2.2-2.7x as long for the
   gan's 5-6 MiB buffers (docs/benchmarks.md, seventh pass).

Everything DeepSpeed reads afterwards stays DeepSpeed's: ``_global_grad_norm``, ``overflow``, the
base optimizer's state and param groups (checkpoints load either way), the LR scheduler and the
step counters (``engine.step()`` does that bookkeeping around this call). Numerics: the same norm
and clip divisor; dividing by it rather than multiplying by its inverse and the fused kernel round
differently from DeepSpeed's path by about 1 ulp per step (1e-7 relative). Configs this does not
cover (`unsupported_reason`) and a DeepSpeed whose mirrored functions changed (gate.py) keep
DeepSpeed's own ``step()``.

With fp32 parameters DeepSpeed holds each group's partition twice, in the flat parameter buffer
(``parallel_partitioned_bit16_groups[i][rank]``, which the parameters view) and as the fp32 master
(``single_partition_of_fp32_groups[i]``), copied after every update. `alias_masters` makes the
master's ``.data`` that partition: the update writes the parameters, the copy is skipped (0.65 ms
per engine and step on the gan's 3 MiB partitions, CPU), each rank holds one partition less. The
master object, the state keyed by it, checkpoints and DeepSpeed's own ``step()`` are unchanged; the
``_hp_mapping`` fragments (``safe_get_full_fp32_param``) are re-made on the new storage. By design a
parameter changed in place between steps (``module.load_state_dict``) changes this rank's master
with it (DeepSpeed would overwrite the change); where the two differ when the alias is made, the
parameters' values are kept. Undone on detach; a DeepSpeed call that moves the master
(``offload_states``) ends the alias, and the lean step then copies as DeepSpeed does (`aliased`).
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
        # the engine's run-time state (graphzero/runtime/state.py): its name and folded norm (read per
        # step: the squares the compiled backward computed and already all-reduced)
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
        """DeepSpeed's ``scaled_global_norm`` of the gradients in ``averaged_gradients``, with one
        all-reduce for all groups, or none where the compiled backward folded the squares in
        (graphzero/runtime/norm.py; taking them leaves the next call the blocking way)."""
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
            # DeepSpeed's FusedAdam: its own fused kernel and its own state layout; the clip first,
            # in place, as DeepSpeed does it.
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
                        self.state.name, why)


# -- the fp32 masters as this rank's partition of the flat parameter buffer ---------------------
def partition(opt, i: int, rank: int) -> torch.Tensor:
    """This rank's partition of group ``i`` in the flat parameter buffer."""
    return opt.parallel_partitioned_bit16_groups[i][rank]


def aliased(master: torch.Tensor, part: torch.Tensor) -> bool:
    return master.data_ptr() == part.data_ptr() and master.numel() == part.numel()


def alias_masters(opt, ranks: list[int], ledger: PatchLedger) -> list[int]:
    """Point each fp32 master at its partition of the flat buffer where both are fp32 on one device;
    returns the groups aliased. ``ranks``: this rank in each group's data-parallel group."""
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
    """Each parameter's fp32 fragment (``_hp_mapping.hp_fragment``, a narrow of the master that
    ``safe_get_full_fp32_param`` reads) re-made on the master's current storage, in the same
    mapping object."""
    for i in groups:
        master = opt.single_partition_of_fp32_groups[i]
        for param in opt.bit16_groups[i]:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is not None:
                address = ds_attr(mapping, "hp_fragment_address")
                mapping.hp_fragment = master.narrow(0, address.start, address.numel)
