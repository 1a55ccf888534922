"""The runners that ``graphzero-compare`` sets against each other.

A runner trains one copy of the workload (fresh parts with the reference weights) its own way.
Interface (driven by ``compare.py``, which owns timing, failure agreement and metrics):

- ``setup()``: build engines / wrappers / optimizers (may run collectives).
- ``step(micro_batches, before_optimizer=None) -> loss``: one optimizer step over ``gas``
  micro-batches; ``before_optimizer`` is called after the last backward, before the optimizer
  (the metrics hook that counts gradient bytes).
- ``memory_tensors()``: live gradient / optimizer-state / parameter tensors of this rank.
- ``full_params()``: every parameter, full and fp32 on CPU (a collective: call on all ranks).
- ``close()``: drop everything.

Raising :class:`RunnerSkipped` in ``setup`` marks the runner skipped; any other exception marks it
failed. DeepSpeed is imported only inside DeepSpeed runners' ``setup``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .bench_models import Workload

TensorList = list[tuple[str, torch.Tensor]]


class RunnerSkipped(Exception):
    """The runner does not apply here (e.g. DeepCompile without CUDA)."""


@dataclass(frozen=True)
class Hyper:
    """Optimizer hyperparameters shared by every runner: AdamW (DeepSpeed's ``Adam`` with
    ``torch_adam: true`` and ``adam_w_mode`` is ``torch.optim.AdamW``), global-norm clipping per
    part (DeepSpeed's ``gradient_clipping`` is per engine)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip: float = 1.0


@dataclass
class RunContext:
    workload: Workload
    stage: int
    bf16: bool
    gas: int
    rank: int
    world_size: int
    device: torch.device
    hyper: Hyper = field(default_factory=Hyper)
    graphzero_call: str = "engine"  # "engine": engine(x); "module": engine.module(x)
    reduce_bucket_size: int | None = None  # zero_optimization.reduce_bucket_size; None: DeepSpeed's default

    def fresh_parts(self) -> dict[str, nn.Module]:
        return {name: copy.deepcopy(part) for name, part in self.workload.parts.items()}

    def ds_config(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        h = self.hyper
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
        if self.reduce_bucket_size is not None:
            zero["reduce_bucket_size"] = self.reduce_bucket_size
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.workload.size.batch,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": h.clip,
            "optimizer": {"type": "Adam", "params": {
                "lr": h.lr, "betas": list(h.betas), "eps": h.eps, "weight_decay": h.weight_decay,
                "torch_adam": True, "adam_w_mode": True}},
            "zero_optimization": zero,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
            "timers": {"throughput": {"enabled": False}},
        }
        if self.bf16:
            cfg["bf16"] = {"enabled": True}
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        cfg.update(extra or {})
        return cfg


def _to_device(batch: Iterable[torch.Tensor], device: torch.device, float_dtype: torch.dtype):
    return tuple(t.to(device=device, dtype=float_dtype) if t.is_floating_point() else t.to(device)
                 for t in batch)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a DTensor (FSDP2), or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def walk_tensors(obj: Any, path: str, out: TensorList, *, depth: int = 0,
                 seen: set[int] | None = None) -> TensorList:
    """Every tensor reachable from ``obj`` through containers, optimizers and the ``__dict__`` of
    DeepSpeed/graphzero objects (not through ``nn.Module``s), as ``(attribute path, tensor)``.
    A tensor's ``.grad`` is reported as ``<path>.grad``."""
    seen = set() if seen is None else seen
    if depth > 8 or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return out
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append((path, _local(obj)))
        if obj.is_leaf and obj.grad is not None:
            out.append((path + ".grad", _local(obj.grad)))
    elif isinstance(obj, nn.Module):
        pass
    elif isinstance(obj, dict):
        for k, v in obj.items():
            walk_tensors(v, f"{path}.{k}" if isinstance(k, (str, int)) else f"{path}[]", out,
                         depth=depth + 1, seen=seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            walk_tensors(v, f"{path}[{i}]", out, depth=depth + 1, seen=seen)
    elif isinstance(obj, torch.optim.Optimizer):
        walk_tensors(obj.state, path + ".state", out, depth=depth + 1, seen=seen)
        walk_tensors(obj.param_groups, path + ".param_groups", out, depth=depth + 1, seen=seen)
    elif type(obj).__module__.split(".")[0] in ("deepspeed", "graphzero") and hasattr(obj, "__dict__"):
        walk_tensors(vars(obj), path, out, depth=depth + 1, seen=seen)
    return out


class Runner:
    name: ClassVar[str] = "?"
    compiled: ClassVar[bool] = False

    def __init__(self, ctx: RunContext):
        self.ctx = ctx

    def setup(self) -> None:
        raise NotImplementedError

    def micro_step(self, batch: tuple[torch.Tensor, ...], boundary: bool) -> torch.Tensor:
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def step(self, micro_batches: list[tuple[torch.Tensor, ...]],
             before_optimizer: Callable[[], None] | None = None) -> torch.Tensor:
        total = None
        for i, mb in enumerate(micro_batches):
            loss = self.micro_step(mb, boundary=i == len(micro_batches) - 1)
            total = loss if total is None else total + loss
        if before_optimizer is not None:
            before_optimizer()
        self.optimizer_step()
        return total / len(micro_batches)

    def memory_tensors(self) -> tuple[TensorList, TensorList, list[torch.Tensor]]:
        """(gradient tensors, optimizer-state tensors, parameter tensors) live on this rank."""
        raise NotImplementedError

    def full_params(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------- DeepSpeed


class DeepSpeedPlainBackward(Runner):
    """DeepSpeed eager: ``loss = loss_fn(engines, batch)`` (each part called as ``engine(x)``),
    plain ``loss.backward()``, then ``engine.step()`` for every engine (every micro-batch: managed
    gradient accumulation)."""

    name = "ds-plain-backward"
    extra_config: ClassVar[dict[str, Any]] = {}

    def setup(self) -> None:
        import deepspeed

        self.engines: dict[str, Any] = {}
        for part_name, module in self.ctx.fresh_parts().items():
            engine, *_ = deepspeed.initialize(model=module, config=self.ctx.ds_config(self.extra_config))
            self.engines[part_name] = engine

    def _float_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.ctx.bf16 else torch.float32

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.ctx.workload.loss(self.engines, *batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def micro_step(self, batch, boundary):
        loss = self.forward(_to_device(batch, self.ctx.device, self._float_dtype()))
        self.backward(loss)
        if not boundary:
            for engine in self.engines.values():
                engine.step()  # not a boundary: DeepSpeed only counts the micro-step
        return loss.detach().float()

    def optimizer_step(self) -> None:
        for engine in self.engines.values():
            engine.step()

    def memory_tensors(self):
        grads: TensorList = []
        state: TensorList = []
        params: list[torch.Tensor] = []
        for part_name, engine in self.engines.items():
            for pn, p in engine.module.named_parameters():
                params.append(p)
                if getattr(p, "ds_tensor", None) is not None:
                    params.append(p.ds_tensor)
                if p.grad is not None:
                    grads.append((f"{part_name}.{pn}.grad", p.grad))
            for path, t in walk_tensors(engine.optimizer, f"{part_name}.optimizer", []):
                is_grad = any(w in path.lower() for w in ("grad", "ipg"))  # ipg: gradient buckets
                (grads if is_grad else state).append((path, t))
        return grads, state, params

    def full_params(self):
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for part_name, engine in self.engines.items():
            for pn, p in engine.module.named_parameters():
                full = safe_get_full_fp32_param(p)
                out[f"{part_name}.{pn}"] = (p.detach() if full is None else full).float().cpu().clone()
        return out

    def close(self) -> None:
        for engine in getattr(self, "engines", {}).values():
            with contextlib.suppress(Exception):
                engine.destroy()
        self.engines = {}


class DeepSpeedEngineBackward(DeepSpeedPlainBackward):
    """DeepSpeed eager with ``engine.backward(loss)``. A loss spanning several engines is driven by
    the engine of the last part (the one producing the loss: ``b``, ``disc``, ``c``, ``head``);
    the other engines see it through their own output hooks, as DeepSpeed 0.19 does for a shared
    loss."""

    name = "ds-engine-backward"

    def backward(self, loss: torch.Tensor) -> None:
        list(self.engines.values())[-1].backward(loss)


class GraphZeroRunner(DeepSpeedPlainBackward):
    """graphzero (DESIGN.md section 1): the same DeepSpeed engines, the loss function compiled with
    ``torch.compile(step, backend="graphzero", options={"engines": {...}, "inner": ...})``, plain
    ``loss.backward()``, then each ``engine.step()``."""

    name = "graphzero-inductor"
    compiled = True
    inner: ClassVar[str] = "inductor"

    def setup(self) -> None:
        import graphzero  # noqa: F401  (importing registers the backend)

        super().setup()
        parts = {k: (e if self.ctx.graphzero_call == "engine" else e.module) for k, e in self.engines.items()}
        loss_fn = self.ctx.workload.loss

        def step(*batch):
            return loss_fn(parts, *batch)

        self._compiled = torch.compile(step, backend="graphzero",
                                       options={"engines": dict(self.engines), "inner": self.inner})

    def forward(self, batch):
        return self._compiled(*batch)


class GraphZeroEagerRunner(GraphZeroRunner):
    name = "graphzero-eager"
    inner = "eager"


class DeepCompileRunner(DeepSpeedEngineBackward):
    """DeepSpeed DeepCompile (``compile: {deepcompile: true}`` + ``engine.compile()``): CUDA only."""

    name = "deepcompile"
    compiled = True
    extra_config: ClassVar[dict[str, Any]] = {"compile": {"deepcompile": True}}

    def setup(self) -> None:
        if self.ctx.device.type != "cuda":
            raise RunnerSkipped("needs CUDA")
        super().setup()
        for engine in self.engines.values():
            engine.compile()


# ------------------------------------------------------------------------------------------- torch


class _TorchRunner(Runner):
    """One wrapper and one ``torch.optim.AdamW`` per part; ``clip_grad_norm_`` per part."""

    def _wrap(self, module: nn.Module) -> nn.Module:
        raise NotImplementedError

    def _sync_context(self, boundary: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _inner(self, model: nn.Module) -> nn.Module:
        return model

    def setup(self) -> None:
        h = self.ctx.hyper
        self.models = {k: self._wrap(m.to(self.ctx.device)) for k, m in self.ctx.fresh_parts().items()}
        self.optims = {k: torch.optim.AdamW(m.parameters(), lr=h.lr, betas=h.betas, eps=h.eps,
                                            weight_decay=h.weight_decay)
                       for k, m in self.models.items()}

    def micro_step(self, batch, boundary):
        batch = _to_device(batch, self.ctx.device, torch.float32)
        with self._sync_context(boundary):
            with self._autocast():
                loss = self.ctx.workload.loss(self.models, *batch)
            (loss / self.ctx.gas).backward()
        return loss.detach().float()

    def optimizer_step(self) -> None:
        for k, model in self.models.items():
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.ctx.hyper.clip)
            self.optims[k].step()
            self.optims[k].zero_grad(set_to_none=True)

    def memory_tensors(self):
        grads: TensorList = []
        state: TensorList = []
        params: list[torch.Tensor] = []
        for k, model in self.models.items():
            for pn, p in model.named_parameters():
                params.append(_local(p))
                if p.grad is not None:
                    grads.append((f"{k}.{pn}.grad", _local(p.grad)))
            walk_tensors(self.optims[k].state, f"{k}.optim.state", state)
        return grads, state, params

    def full_params(self):
        out = {}
        for k, model in self.models.items():
            for pn, p in self._inner(model).named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                out[f"{k}.{pn}"] = full.float().cpu().clone()
        return out

    def close(self) -> None:
        self.models, self.optims = {}, {}


class DDPRunner(_TorchRunner):
    """PyTorch DDP, one wrapper per part (``gradient_as_bucket_view=True``, so the gradient buckets
    are the ``.grad`` tensors counted); ``no_sync`` on non-boundary micro-batches; bf16 runs under
    ``torch.autocast`` with fp32 weights and gradients."""

    name = "ddp"

    def _wrap(self, module):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        return DDP(module, device_ids=ids, gradient_as_bucket_view=True)

    def _inner(self, model):
        return model.module

    def _sync_context(self, boundary):
        if boundary:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for model in self.models.values():
            stack.enter_context(model.no_sync())
        return stack

    def _autocast(self):
        if not self.ctx.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)


class FSDP2Runner(_TorchRunner):
    """PyTorch FSDP2: ``fully_shard`` with one root per part on a 1-D device mesh; bf16 uses
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; gradient sync only on the
    boundary micro-batch (``set_requires_gradient_sync``)."""

    name = "fsdp2"

    def _wrap(self, module):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not hasattr(self, "_mesh"):
            self._mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        kwargs = {}
        if self.ctx.bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return fully_shard(module, mesh=self._mesh, **kwargs)

    def _sync_context(self, boundary):
        for model in self.models.values():
            model.set_requires_gradient_sync(boundary)
        return contextlib.nullcontext()


RUNNERS: dict[str, type[Runner]] = {cls.name: cls for cls in (
    GraphZeroRunner, GraphZeroEagerRunner, DeepSpeedEngineBackward, DeepSpeedPlainBackward,
    DDPRunner, FSDP2Runner, DeepCompileRunner)}
