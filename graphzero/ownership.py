"""Who owns which parameter: `ParamSet` per engine, and the map from graph inputs to them.

Nothing here knows about DeepSpeed: the adapter (deepspeed_adapter/) builds a `ParamSet` (an
engine's immutable layout) per engine, and passes only read them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from .errors import OwnershipError, WorldMismatchError


@dataclasses.dataclass(frozen=True, eq=False)
class FlatGroup:
    """One flat gradient buffer of an engine's optimizer (one per optimizer param group).

    Parameter k's gradient occupies ``[offsets[k], offsets[k] + params[k].numel())`` of a flat
    buffer of ``numel`` elements (gaps and the tail are zero padding). With ``sharded`` the buffer
    is split into ``world_size`` equal shards and rank r keeps shard r; otherwise every rank keeps
    the whole buffer.

    ``presharded`` (ZeRO-3): the graph never sees these parameters whole; its inputs are their
    shards, and each shard's gradient (already reduce-scattered by the gather's backward) lands at
    ``offsets[k]`` of this rank's shard of the group: no further collective.
    """

    params: tuple[torch.nn.Parameter, ...]
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    numel: int
    sharded: bool
    presharded: bool = False
    shard_sizes: tuple[int, ...] = ()   # presharded: elements of each parameter's shard
    full_numels: tuple[int, ...] = ()   # presharded: elements of each parameter, whole
    # presharded: parameters the engine keeps gathered (ZeRO-3 persistence threshold)
    persistent: tuple[bool, ...] = ()

    def shard_numel(self, world_size: int) -> int:
        return self.numel // world_size if self.sharded else self.numel

    def num_shards(self, world_size: int) -> int:
        return world_size if self.sharded else 1

    def shard_numel_of(self, k: int) -> int:
        """Presharded groups: elements of parameter k's shard (a world-th of it, padded)."""
        return self.shard_sizes[k]


@dataclasses.dataclass(frozen=True, eq=False)
class ParamSet:
    """The layout of one engine's gradients: the parameters it owns, how their gradients are
    reduced and where this rank's shard of each param group lives. Immutable: what changes while
    training is in runtime/state.py."""

    name: str
    stage: int
    groups: tuple[FlatGroup, ...]
    process_group: object
    group_name: str
    world_size: int
    rank: int
    comm_dtype: torch.dtype
    accum_dtype: torch.dtype
    bucket_numel: int
    # 1/(world x gas) when the layout was built; the run-time factor is the binding's runtime_scale()
    grad_scale: float
    backend: str
    # where every buffer its collectives read or write is created (devices.py)
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    # the dtype of a partial gradient sum (runtime/partial.py): ZeRO-1/2 the accumulation dtype,
    # ZeRO-3 the dtype of the gathered parameters' full gradients; None: accum_dtype
    partial_dtype: torch.dtype | None = None
    # ZeRO-3 shard maps, read when a graph is compiled (shards may be re-created): owned shards,
    # {id(shard): (group, position)}; shards gathered without a gradient, {id(shard): (name, persistent)}
    shard_inputs: Callable[[], dict[int, tuple[int, int]]] | None = None
    frozen_shards: Callable[[], dict[int, tuple[str, bool]]] | None = None
    # ZeRO-3: gathered elements per parameter all-gather (bucket_gathers); None: bucket_numel
    gather_bucket_numel: int | None = None
    # ZeRO-3: a gather bucket is issued before the previous bucket's wait (prefetch), else at its use
    gather_ahead: bool = True
    # ZeRO-3: how far ahead (elements) DeepSpeed keeps a parameter gathered for its next use (release.py)
    reuse_distance: int = 0

    def __post_init__(self) -> None:
        if self.partial_dtype is None:
            object.__setattr__(self, "partial_dtype", self.accum_dtype)
        object.__setattr__(self, "_where", {id(p): (g, k) for g, grp in enumerate(self.groups)
                                            for k, p in enumerate(grp.params)})

    def locate(self, param: torch.Tensor) -> tuple[int, int] | None:
        """(group index, position in group) of an owned parameter, else None."""
        return self._where.get(id(param))

    def scratch_sinks(self) -> list[torch.Tensor]:
        """Zeroed buffers shaped like sinks(), for a backward whose result must not be kept."""
        return [torch.zeros(g.shard_numel(self.world_size), dtype=self.accum_dtype, device=self.device)
                for g in self.groups]

    @property
    def numel(self) -> int:
        return sum(sum(grp.full_numels) if grp.presharded else sum(p.numel() for p in grp.params)
                   for grp in self.groups)

    @property
    def num_params(self) -> int:
        return sum(len(grp.params) for grp in self.groups)


@dataclasses.dataclass(frozen=True)
class OwnedInput:
    """A graph input that is a parameter some ParamSet owns."""

    index: int
    param_set: ParamSet
    group: int
    position: int
    shard: bool = False   # the input is the parameter's ZeRO-3 shard, not the parameter
    # The graph input itself: the leaf autograd accumulates this gradient into (the parameter, or
    # its shard); compared by identity, never hashed.
    leaf: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def param(self) -> torch.nn.Parameter:
        return self.param_set.groups[self.group].params[self.position]

    @property
    def qualname(self) -> str:
        return f"{self.param_set.name}.{self.param_set.groups[self.group].names[self.position]}"


@dataclasses.dataclass(frozen=True)
class Ownership:
    """Map from graph input index to the ParamSet owning it."""

    inputs: dict[int, OwnedInput]
    param_sets: tuple[ParamSet, ...]
    # graph inputs that are frozen ZeRO-3 shards (of a trained engine, or of a frozen one):
    # index -> (param set, parameter name, persistent)
    frozen: dict[int, tuple[ParamSet, str, bool]] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, example_inputs: Sequence[object], param_sets: Sequence[ParamSet]) -> Ownership:
        owned: dict[int, OwnedInput] = {}
        shards = {ps: ps.shard_inputs() for ps in param_sets if ps.shard_inputs is not None}
        for i, x in enumerate(example_inputs):
            if not isinstance(x, torch.Tensor):
                continue
            for ps in param_sets:
                where = ps.locate(x) if isinstance(x, torch.nn.Parameter) else None
                if where is not None and not ps.groups[where[0]].presharded:
                    # A tensor hook must see this rank's gradient before the reduction, as under
                    # DeepSpeed eager: the gradient leaves the graph and the safety net reduces it.
                    if not has_tensor_hooks(x):
                        owned[i] = OwnedInput(i, ps, *where, leaf=x)
                    break
                where = shards.get(ps, {}).get(id(x))
                if where is not None:
                    owned[i] = OwnedInput(i, ps, *where, shard=True, leaf=x)
                    break
        frozen = {}
        for ps in param_sets:
            shards = ps.frozen_shards() if ps.frozen_shards is not None else {}
            for i, x in enumerate(example_inputs):
                if i not in owned and isinstance(x, torch.Tensor) and id(x) in shards:
                    frozen[i] = (ps, *shards[id(x)])
        # engines whose gradients this graph produces, or whose frozen shards it gathers
        used = tuple(ps for ps in param_sets if any(o.param_set is ps for o in owned.values())
                     or any(f[0] is ps for f in frozen.values()))
        names = [ps.name for ps in used]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            # attach keeps names unique (deepspeed_adapter/names.py); plans and dumps key engines by name
            raise OwnershipError(f"engine name(s) {twice} belong to more than one engine in this graph")
        check_same_world(used)
        return cls(owned, used, frozen)

    @property
    def trained(self) -> tuple[ParamSet, ...]:
        """The engines whose gradients this graph produces (``param_sets`` less those it only gathers)."""
        return tuple(ps for ps in self.param_sets if any(o.param_set is ps for o in self.inputs.values()))


def has_tensor_hooks(t: torch.Tensor) -> bool:
    """Whether ``t.register_hook`` hooks are registered on ``t`` (not post-accumulate ones)."""
    return bool(t._backward_hooks)


def check_same_world(param_sets: Sequence[ParamSet]) -> None:
    # One loss is averaged over the data-parallel ranks; engines that average over different
    # groups sizes would each see a different "global batch".
    if len({ps.world_size for ps in param_sets}) > 1:
        raise WorldMismatchError(
            "engines in one compiled graph must share a data-parallel world size, got "
            + ", ".join(f"engine {ps.name!r}: {ps.world_size}" for ps in param_sets))
    # Same size is not enough: the averaged gradient differs unless the same ranks contribute.
    members = {ps.name: _group_ranks(ps) for ps in param_sets}
    if len(set(members.values())) > 1:
        raise WorldMismatchError(
            "engines in one compiled graph must average over the same data-parallel ranks, got "
            + ", ".join(f"engine {name!r}: ranks {list(ranks)}" for name, ranks in members.items()))


def _group_ranks(ps: ParamSet) -> tuple[int, ...]:
    import torch.distributed as dist
    if ps.process_group is None or not dist.is_initialized():
        return tuple(range(ps.world_size))
    return tuple(dist.get_process_group_ranks(ps.process_group))
