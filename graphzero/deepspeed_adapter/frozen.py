"""Frozen engines: a DeepSpeed engine without an optimizer (a teacher, a reference or reward model),
attached so that its forward runs inside graphzero's graphs.

At ZeRO-3 DeepSpeed's module hooks are removed and every module reads its parameters gathered
(zero3_module.py), so Dynamo traces the gathers instead of breaking the graph at each submodule.
Every shard is a frozen shard of the engine's layout (``ParamSet.frozen_shards``, no groups): the
passes gather it per bucket with the trained engines' gathers, prefetched in the same schedule,
never reduced, released after its last use (passes/release.py). Outside a compiled step (``generate``,
evaluation) the same reader gathers eagerly for the module call and releases after it, as
DeepSpeed's hooks do. At ZeRO-0 only ``engine.forward``'s timers and hooks go (base.plain_forward).

A frozen engine has no gradient and no optimizer step of graphzero's: nothing is reduced for it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import devices
from ..errors import UnsupportedConfigError
from ..ownership import FlatGroup
from . import zero3_module
from .base import DeepSpeedBinding, plain_forward
from .bound import BINDING_ATTR
from .ds_internals import ds_attr
from .ledger import PatchLedger
from .step.zero3_update import coalesce_gathers
from .zero3 import gather_plan, remove_zero3_hooks, reuse_distance, use_torch_linear


def is_frozen(engine) -> bool:
    """An engine DeepSpeed built without an optimizer (ZeRO-3: its parameter manager only)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    return engine.optimizer is None or type(engine.optimizer) is DeepSpeedZeRoOffload


def check_frozen(name: str, engine) -> None:
    """A frozen engine's ZeRO-3 parameters are all partitioned over one group. Their ``requires_grad``
    flags do not matter: TRL and Accelerate prepare reference, teacher and reward models with them
    left on, and nothing trains a frozen engine (its shards never require grad, so its gathers carry
    no gradient; at ZeRO-0 such a parameter is one no engine owns: plain ``.grad``)."""
    ranks = {tuple(dist.get_process_group_ranks(p.ds_process_group))
             for p in engine.module.parameters() if hasattr(p, "ds_tensor")}
    if len(ranks) > 1:
        raise UnsupportedConfigError(f"engine {name!r}: its ZeRO-3 parameters are partitioned over different "
                                     "process groups")


class FrozenBinding(DeepSpeedBinding):
    """graphzero's hold on an engine without an optimizer: its gathers, no gradient."""

    trains = False

    def _flat_groups(self, names: dict[int, str]) -> tuple[list[FlatGroup], torch.dtype]:
        dtype = next((p.dtype for p in self.engine.module.parameters()), torch.float32)
        return [], dtype

    def _zero3_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.engine.module.named_parameters() if hasattr(p, "ds_tensor")]

    def _process_groups(self) -> list:
        params = self._zero3_params()
        if params:
            return [params[0][1].ds_process_group]
        return [ds_attr(self.engine, "data_parallel_group") or dist.group.WORLD]

    def _layout_extras(self) -> dict:
        if self.engine.zero_optimization_stage() != 3:
            return {}
        gather_bucket_numel, gather_ahead = gather_plan(self.engine, self.name)
        return {"frozen_shards": self.frozen_shards, "gather_bucket_numel": gather_bucket_numel,
                "gather_ahead": gather_ahead, "reuse_distance": reuse_distance(self.engine)}

    def frozen_shards(self) -> dict[int, tuple[str, bool]]:
        """Every ZeRO-3 parameter's shard (read when a graph is compiled)."""
        return {id(p.ds_tensor): (n, bool(getattr(p, "ds_persist", False))) for n, p in self._zero3_params()}

    def sinks(self) -> list[torch.Tensor]:
        return []

    def _install(self, ledger: PatchLedger) -> None:
        engine = self.engine
        plain_forward(engine, ledger)
        if engine.zero_optimization_stage() != 3:
            return
        remove_zero3_hooks(engine.optimizer, ledger)
        use_torch_linear(self.name, ledger)
        for _, p in self._zero3_params():
            ledger.set_attr(p.ds_tensor, BINDING_ATTR, self)   # graphs compiled without options find the engine
        coalesce_gathers(engine.module, ledger)
        ps = self.param_set
        zero3_module.install(engine.module, ps.world_size, ps.group_name, ledger)

    def summary(self) -> str:
        ps = self.param_set
        shards = self._zero3_params()
        numel = sum(int(p.ds_numel) for _, p in shards)
        return (f"graphzero attached engine {self.name!r} frozen (no optimizer): ZeRO-{ps.stage}, "
                f"{len(shards)} ZeRO-3 parameters ({numel} elements) gathered in its graphs, world {ps.world_size}, "
                f"on {devices.engine_device(self.engine.device, self.engine.module.parameters())}")
