"""ZeRO-3 with ``DeepSpeedZeroOptimizer_Stage3`` (fp32, and bf16 with fp32 gradient accumulation).

DeepSpeed keeps each parameter empty (``p.numel() == 0``) and this rank's shard in
``p.ds_tensor`` (``p.partition_numel()`` elements, the last rank's tail is padding). While attached:

- DeepSpeed's ZeRO-3 module hooks (fetch/release before and after each submodule, pre/post
  backward) and its gradient hooks are removed; ``detach`` re-installs them;
- every module holding a ZeRO-3 parameter reads it through a property that gathers it from the
  shards (zero3_module.py, SimpleFSDP's design), so Dynamo traces the gather and its reduce-scatter
  backward wherever the compiled step reads the parameter;
- each shard requires grad: the compiled backward returns its reduced shard gradient, which the
  fp32_accumulate pass adds into the group's region of ``grad_partitions_flat_buffer``;
  ``averaged_gradients[i]`` lists DeepSpeed's own per-parameter views of it.

Parameters below ``stage3_param_persistence_threshold`` are gathered in the forward graph like the
others, but their gathered value is saved for backward (``FlatGroup.persistent``, the release pass).
"""
from __future__ import annotations

import functools
import itertools
import logging

import torch
import torch.distributed as dist

from ..errors import UnsupportedConfigError
from ..ownership import FlatGroup
from . import offload, zero3_module
from .base import _BINDING_ATTR, DeepSpeedBinding
from .ds_internals import ds_attr
from .ledger import PatchLedger

log = logging.getLogger("graphzero")

_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
_PARAM_COLLECTIVES = ("all_gather_coalesced", "partition")


def _no_grad(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)
    return wrapped


def check_zero3_config(engine, unsupported, trains: bool = True) -> None:
    """Stage 3 is supported in fp32, and in bf16 with fp32 gradient accumulation (where it trains),
    without offload (checked by the caller), quantized weights or hierarchical partitioning."""
    if trains and engine.bfloat16_enabled() and engine.get_data_types()[1] != torch.float32:
        raise unsupported("zero_optimization.stage=3 with bf16 and grad_accum_dtype!=fp32",
                          'set data_types.grad_accum_dtype="fp32"')
    if engine.zero_quantized_weights() or engine.zero_quantized_nontrainable_weights():
        raise unsupported("zero_optimization.zero_quantized_weights", "quantized ZeRO-3 weights")
    if engine.zero_hpz_partition_size() > 1:
        raise unsupported("zero_optimization.zero_hpz_partition_size>1", "hierarchical partitioning")
    if ds_attr(engine, "autotp_size")() > 1:
        raise unsupported("tensor_parallel.autotp_size>1", "AutoTP shards")


def gather_plan(engine, name: str) -> tuple[int, bool]:
    """(elements per parameter gather, whether a gather is issued ahead of the previous one's
    wait): stage3_prefetch_bucket_size, capped so that bucket_gathers' two live buckets stay
    within stage3_max_live_parameters. A prefetch bucket of 0 is DeepSpeed's "no prefetch":
    each parameter gathered on its own at its use (not the reduce bucket, which at 5e8 elements
    would gather a whole model in one collective)."""
    prefetch = int(engine.zero_prefetch_bucket_size())
    max_live = int(engine.zero_max_live_parameters())
    if max_live <= 1:
        raise UnsupportedConfigError(
            f"engine {name!r}: zero_optimization.stage3_max_live_parameters={max_live} leaves no room "
            "for a parameter gather; set it to 2 or more")
    if prefetch <= 0:
        return 1, False
    return min(prefetch, max_live // 2), True


def reuse_distance(engine) -> int:
    """How far ahead (elements) DeepSpeed keeps a parameter gathered for its next use (release.py)."""
    return max(int(ds_attr(engine, "zero_max_reuse_distance")()), int(engine.zero_prefetch_bucket_size()))


def remove_zero3_hooks(offload, ledger: PatchLedger) -> None:
    """DeepSpeed's ZeRO-3 module hooks (what its _remove_module_hooks removes) of a
    ``DeepSpeedZeRoOffload``, kept as they are so that detach puts the same hooks back
    (setup_zero_stage3_hooks would make new ones)."""
    for handle in (*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook):
        ledger.remove_hook(handle)
    # TRL's and DeepSpeed's unwrap_model_for_generation empty these lists and register the hooks
    # anew afterwards (_register_deepspeed_module): that would put DeepSpeed's gathers back on a
    # module graphzero gathers for, and the next compiled step would trace them (a silent wrong
    # gradient). While attached the re-registration does nothing; detach gives back these lists
    # and their hooks.
    for attr in ("forward_hooks", "backward_hooks"):
        ledger.set_attr(offload, attr, getattr(offload, attr))
    told = []

    def register_deepspeed_module(module, *args, **kwargs) -> None:
        if not told:
            told.append(True)
            log.info("DeepSpeed's ZeRO-3 hooks re-registered on %s (e.g. after TRL's or DeepSpeed's "
                     "unwrap_model_for_generation): left out while graphzero owns the engine, which gathers its "
                     "parameters itself", type(module).__name__)

    ledger.set_attr(offload, "_register_deepspeed_module", register_deepspeed_module)


def use_torch_linear(name: str, ledger: PatchLedger) -> None:
    """Put torch's ``torch.nn.functional.linear`` back while a ZeRO-3 engine is attached.

    DeepSpeed's ZeRO-3 initialisation replaces it process-wide with ``zero3_linear_wrap`` (an
    autograd function saving the weight and gathering it again in backward, for DeepSpeed's hooks),
    which "persists unless manually reset": the user's other models run through it (measured 2x
    slower in a DDP step, docs/benchmarks.md), and in graphzero's graphs, whose gathers graphzero
    owns, it buys nothing. DeepSpeed's ZeRO-3 engines train with torch's linear too (its
    ``memory_efficient_linear: false``). Detach puts DeepSpeed's back (the first engine's ledger that
    changed it)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ZeroInit
    original = getattr(ZeroInit, "linear_bk", None)
    if original is None or torch.nn.functional.linear is not zero3_linear_wrap:
        return
    ledger.set_attr(torch.nn.functional, "linear", original)
    log.info("engine %r: torch.nn.functional.linear is torch's again while graphzero owns ZeRO-3 engines "
             "(DeepSpeed's ZeRO-3 init had replaced it process-wide)", name)


def _release_reduce_bucket(bucket, ledger: PatchLedger) -> None:
    """Free DeepSpeed's ZeRO-3 reduce bucket (1.9 GiB in fp32 at the default 5e8, per engine; only
    the removed gradient hooks fill it) while attached; allocate it empty on detach, as
    ``reload_states`` does. Not ``ledger.set_attr``: the ledger would keep the old buffer alive."""
    buffer = bucket.buffer
    if buffer is None:
        return
    shape, dtype, device = buffer.shape, buffer.dtype, buffer.device
    bucket.buffer = None
    del buffer

    def allocate() -> None:
        bucket.buffer = torch.empty(shape, dtype=dtype, device=device)
    ledger.on_undo(allocate, f"allocate DeepSpeed's {dtype} ZeRO-3 reduce bucket again")


def _give_grad_proxy(p: torch.nn.Parameter, ledger: PatchLedger) -> None:
    """A ZeRO-3 parameter outside every optimizer group: DeepSpeed eager leaves this rank's own full,
    unreduced gradient in its ``.grad``. The gather's backward (zero3_module.py) gives it to a
    full-shape stride-0 leaf instead, whose hook moves it into ``p.grad``."""
    shape = tuple(p.ds_shape)
    proxy = torch.zeros(1, dtype=p.ds_tensor.dtype, device=p.ds_tensor.device)
    proxy = proxy.as_strided(shape, (0,) * len(shape)).detach().requires_grad_(True)

    @torch.no_grad()
    def move(leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is None:
            return
        if p.grad is not None:
            p.grad.add_(grad)
        elif tuple(p.shape) == shape:   # a persistent parameter keeps its data gathered
            p.grad = grad
        else:
            # .grad must match the data's shape when assigned, not afterwards (DeepSpeed's own
            # release empties the data under a full .grad the same way)
            data = p.data
            p.data = grad
            try:
                p.grad = grad
            finally:
                p.data = data

    ledger.set_attr(p, zero3_module.GRAD_PROXY_ATTR, proxy)
    ledger.post_accumulate_grad_hook(proxy, move)


class Zero3Binding(DeepSpeedBinding):
    def __init__(self, engine, name: str) -> None:
        # per group: (requires_grad of each parameter, the list installed in averaged_gradients)
        self._installed_lists: dict[int, tuple[tuple[bool, ...], list]] = {}
        self._stale = False
        self._frozen_listed = False
        super().__init__(engine, name)

    @property
    def frozen_listed(self) -> bool:
        """The last sinks() listed zeros for a frozen parameter (step/zero3_update.py)."""
        return self._frozen_listed

    # -- layout and buffers -------------------------------------------------------------------
    def _process_groups(self) -> list:
        # Parameters are partitioned over their ds_process_group (a different object for the same
        # ranks, usually): the gather must use the same ranks as the optimizer's partitions.
        opt = self.engine.optimizer
        ranks = dist.get_process_group_ranks(opt.dp_process_group)
        for p in itertools.chain.from_iterable(opt.fp16_groups):
            if dist.get_process_group_ranks(p.ds_process_group) != ranks:
                raise UnsupportedConfigError(f"engine {self.name!r}: a parameter is partitioned over other ranks "
                                             "than the optimizer's data-parallel group")
        return [opt.dp_process_group]

    def _flat_groups(self, names: dict[int, str]) -> tuple[list[FlatGroup], torch.dtype]:
        opt = self.engine.optimizer
        world = dist.get_world_size(group=opt.dp_process_group)
        groups = []
        for i, params in enumerate(opt.fp16_groups):
            sizes = tuple(int(p.partition_numel()) for p in params)
            offsets = tuple(itertools.accumulate((0,) + sizes[:-1]))
            groups.append(FlatGroup(
                params=tuple(params), names=tuple(names.get(id(p), f"group{i}.param{k}") for k, p in enumerate(params)),
                offsets=offsets, numel=world * sum(sizes), sharded=True, presharded=True, shard_sizes=sizes,
                full_numels=tuple(int(p.ds_numel) for p in params),
                persistent=tuple(bool(ds_attr(p, "ds_persist")) for p in params)))
        return groups, opt.gradient_accumulation_dtype

    def _layout_extras(self) -> dict:
        opt = self.engine.optimizer
        gather_bucket_numel, gather_ahead = gather_plan(self.engine, self.name)
        params = [p for group in opt.fp16_groups for p in group]
        return {
            "shard_inputs": self._trainable_shard_inputs, "frozen_shards": self.frozen_shards,
            "gather_bucket_numel": gather_bucket_numel, "gather_ahead": gather_ahead,
            "reuse_distance": reuse_distance(self.engine),
            # the padded full gradients the gathers' backward produces are in the parameters' dtype
            "partial_dtype": params[0].dtype if params else self.engine.communication_data_type}

    def frozen_shards(self) -> dict[int, tuple[str, bool]]:
        """The module's ZeRO-3 parameters that get no engine gradient in a graph compiled now, by
        shard: those outside the optimizer (frozen, or given their own ``.grad``: zero3_module.py)
        and owned ones whose ``requires_grad`` is off (read when a graph is compiled; Dynamo
        compiles again when it changes). Gathered like the owned ones, never reduced."""
        trainable = self._trainable_shard_inputs()
        return {id(p.ds_tensor): (n, bool(getattr(p, "ds_persist", False)))
                for n, p in self.engine.module.named_parameters()
                if hasattr(p, "ds_tensor") and id(p.ds_tensor) not in trainable}

    def shard_inputs(self) -> dict[int, tuple[int, int]]:
        return {id(p.ds_tensor): (g, k) for g, group in enumerate(self.param_set.groups)
                for k, p in enumerate(group.params)}

    def _trainable_shard_inputs(self) -> dict[int, tuple[int, int]]:
        """shard_inputs() less the parameters frozen now (``requires_grad`` off): a graph compiled
        now gives those no gradient (zero3_module.py), so they are not its to reduce."""
        return {id(p.ds_tensor): (g, k) for g, group in enumerate(self.param_set.groups)
                for k, p in enumerate(group.params) if p.requires_grad}

    def _region(self, i: int) -> torch.Tensor:
        """Group i's contiguous part of the optimizer's flat fp32 gradient-partition buffer."""
        opt = self.engine.optimizer
        views = getattr(opt, _GRAD_PARTITIONS)
        first = views[self.param_set.groups[i].params[0].ds_id]
        flat = opt.grad_partitions_flat_buffer
        start = first.storage_offset() - flat.storage_offset()
        return flat.narrow(0, start, self.param_set.groups[i].numel // self.param_set.world_size)

    def sinks(self) -> list[torch.Tensor]:
        """Per group, its region of ``grad_partitions_flat_buffer``. ``step()`` consumes
        ``averaged_gradients[i]`` but never zeroes the buffer: a missing entry (or a zero_grad since)
        means "start again from zeros"; a list DeepSpeed replaced (its public
        ``allreduce_gradients()`` lists the same views again) does not.

        The list is made as DeepSpeed's epilogue makes it: each parameter's view, or zeros where
        ``requires_grad`` is off, as ``step()`` and checkpoints see under DeepSpeed eager."""
        opt = self.engine.optimizer
        views = getattr(opt, _GRAD_PARTITIONS)
        out = []
        frozen = False
        for i, group in enumerate(self.param_set.groups):
            region = self._region(i)
            if self._stale or opt.averaged_gradients.get(i) is None:
                region.zero_()
            trainable = tuple(p.requires_grad for p in group.params)
            installed = self._installed_lists.get(i)
            if installed is None or installed[0] != trainable or opt.averaged_gradients.get(i) is not installed[1]:
                listed = [views[p.ds_id] if p.requires_grad else torch.zeros_like(p.ds_tensor) for p in group.params]
                opt.averaged_gradients[i] = listed
                self._installed_lists[i] = (trainable, listed)
            frozen = frozen or not all(trainable)
            out.append(region)
        self._stale = False
        self._frozen_listed = frozen
        return out

    def drop_sinks(self) -> None:
        # Not cleared here: stage-3 step() calls its own zero_grad() between computing the norm and
        # reading averaged_gradients. The next backward starts from zeros instead.
        self._stale = True

    # -- install / uninstall ------------------------------------------------------------------
    def _install(self, ledger: PatchLedger) -> None:
        self._check_frozen_groups(self.engine.module)
        super()._install(ledger)
        opt, module = self.engine.optimizer, self.engine.module
        remove_zero3_hooks(opt.parameter_offload, ledger)
        use_torch_linear(self.name, ledger)
        for bucket in opt.ipg_buckets.values():
            _release_reduce_bucket(bucket, ledger)
        ps = self.param_set
        owned = [(n, p) for g in ps.groups for n, p in zip(g.names, g.params)]
        for _, p in owned:
            ledger.set_attr(p.ds_tensor, "grad", None)
            ledger.set_attr(p.ds_tensor, "requires_grad", True)
            ledger.set_attr(p.ds_tensor, _BINDING_ATTR, self)   # graphs compiled without options find the engine
            # DeepSpeed's own gathers write into views made under no_grad: with a shard that
            # requires grad they must run under no_grad too.
            for attr in _PARAM_COLLECTIVES:
                ledger.set_attr(p, attr, _no_grad(getattr(p, attr)))
            ledger.post_accumulate_grad_hook(p.ds_tensor, self._accumulate_eager_shard)
        owned_ids = {id(p) for _, p in owned}
        for p in module.parameters():
            if hasattr(p, "ds_tensor") and id(p) not in owned_ids:
                _give_grad_proxy(p, ledger)
        zero3_module.install(module, ps.world_size, ps.group_name, ledger)
        if ds_attr(opt, "offload_optimizer"):
            self._install_offload(ledger)

    def _install_offload(self, ledger: PatchLedger) -> None:
        """Optimizer offload: DeepSpeed's gradient partitions (``grad_partitions_flat_buffer``) are
        host buffers, and its epilogue copies each into the CPU optimizer's fp32 gradient at the
        boundary (``_offload_grad_partition_at_boundary``, which also records the per-parameter norm
        its step reads). graphzero's graphs accumulate into those partitions; the boundary copy is
        made at the end of the boundary backward and in ``step()`` (offload.py); after ``step()`` the
        next window starts from zeros."""
        if self.engine.optimizer.grad_partitions_flat_buffer.device.type != self.param_set.device.type:
            raise UnsupportedConfigError(
                f"engine {self.name!r}: optimizer offload of an engine on {self.param_set.device}: graphzero "
                "accumulates gradients into DeepSpeed's host partitions only where the engine runs on the CPU so far")
        offload.install(self, ledger, self._copy_to_offloaded, after_step=self.drop_sinks)

    @torch.no_grad()
    def _copy_to_offloaded(self) -> None:
        opt = self.engine.optimizer
        views = getattr(opt, _GRAD_PARTITIONS)
        for group in opt.fp16_groups:
            for p in group:
                opt._offload_grad_partition_at_boundary(p, views[p.ds_id], {}, {})

    def _check_frozen_groups(self, module) -> None:
        """Frozen ZeRO-3 parameters (a LoRA base) are gathered too, over the optimizer's group."""
        ranks = dist.get_process_group_ranks(self.param_set.process_group or dist.group.WORLD)
        for n, p in module.named_parameters():
            if hasattr(p, "ds_tensor") and dist.get_process_group_ranks(p.ds_process_group) != ranks:
                raise UnsupportedConfigError(f"engine {self.name!r}: parameter {n!r} is partitioned over other "
                                             "ranks than the optimizer's data-parallel group")

    # -- safety net -----------------------------------------------------------------------------
    @torch.no_grad()
    def _accumulate_eager_shard(self, shard: torch.Tensor) -> None:
        """A shard gradient from eager autograd (the module run outside a graphzero graph): the
        gather's backward already summed it over ranks; scale it into the sink."""
        if shard.grad is None:
            return
        self.eager_gradients += 1
        g, k = self.shard_inputs()[id(shard)]
        group = self.param_set.groups[g]
        sink = self.state.write_sinks()[g]
        sink[group.offsets[k]:group.offsets[k] + group.shard_numel_of(k)].add_(
            shard.grad.to(sink.dtype), alpha=self.runtime_scale())
        shard.grad = None
