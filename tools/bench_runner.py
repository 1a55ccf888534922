"""What every ``graphzero-compare`` runner shares: the run context (workload, ZeRO stage, dtype, gas,
DeepSpeed config), the optimizer hyperparameters, and the :class:`Runner` interface.

A runner trains one copy of the workload (fresh parts with the reference weights) its own way.
Interface (driven by bench_worker.py, which owns timing, failure agreement and metrics):

- ``setup()``: build engines / wrappers / optimizers (may run collectives).
- ``step(micro_batches, before_optimizer=None, phases=None) -> loss``: one optimizer step over
  ``gas`` micro-batches, built from ``micro_context`` / ``forward`` / ``backward`` per micro-batch and
  ``optimizer_step``; ``phases(name)`` (a context manager) brackets each "forward", "backward" and
  "step" phase, which is how the worker times them; ``before_optimizer`` is called after the last
  backward, before the optimizer (the metrics hook that counts gradient bytes).
- ``memory_tensors()``: live gradient / optimizer-state / parameter tensors of this rank.
- ``gathered_params()``: the parameter tensors held in full on this rank right now, for runners
  that shard parameters in eager code (ZeRO-3, FSDP2); None where the runner cannot say.
- ``full_params()``: every parameter, full and fp32 on CPU (a collective: call on all ranks).
- ``close()``: drop everything.

The graphzero runners also have ``graph_stats()`` (the gathered-parameter peak of the compiled
schedule, from graphzero's dump) and ``eager_grads_seen()`` (calls of graphzero's eager safety net).

Raising :class:`RunnerSkipped` in ``setup`` marks the runner skipped; any other exception marks it
failed. The runners themselves are in bench_runners_deepspeed.py and bench_runners_torch.py; the
registry is bench_runners.py.
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
Phases = Callable[[str], contextlib.AbstractContextManager]


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
    prefetch_bucket_size: int | None = None  # zero_optimization.stage3_prefetch_bucket_size (ZeRO-3)
    max_live_parameters: int | None = None  # zero_optimization.stage3_max_live_parameters (ZeRO-3)
    max_reuse_distance: int | None = None  # zero_optimization.stage3_max_reuse_distance (ZeRO-3)
    persistence_threshold: int = 0  # zero_optimization.stage3_param_persistence_threshold (ZeRO-3)
    frozen_stage: int = 3  # the ZeRO stage of DeepSpeed engines without an optimizer (the rlhf's reference and reward)

    def fresh_parts(self) -> dict[str, nn.Module]:
        return {name: copy.deepcopy(part) for name, part in self.workload.parts.items()}

    def ds_config(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        h = self.hyper
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = self.persistence_threshold
            if self.prefetch_bucket_size is not None:
                zero["stage3_prefetch_bucket_size"] = self.prefetch_bucket_size
            if self.max_live_parameters is not None:
                zero["stage3_max_live_parameters"] = self.max_live_parameters
            if self.max_reuse_distance is not None:
                zero["stage3_max_reuse_distance"] = self.max_reuse_distance
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


def to_device(batch: Iterable[torch.Tensor], device: torch.device, float_dtype: torch.dtype):
    return tuple(t.to(device=device, dtype=float_dtype) if t.is_floating_point() else t.to(device)
                 for t in batch)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
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
        out.append((path, local_tensor(obj)))
        if obj.is_leaf and obj.grad is not None:
            out.append((path + ".grad", local_tensor(obj.grad)))
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


def _untimed(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class Runner:
    name: ClassVar[str] = "?"
    compiled: ClassVar[bool] = False
    # run only when named in --runners (a variant of another runner's config, e.g. offload)
    opt_in: ClassVar[bool] = False

    def __init__(self, ctx: RunContext):
        self.ctx = ctx

    def setup(self) -> None:
        raise NotImplementedError

    def micro_context(self, boundary: bool) -> contextlib.AbstractContextManager:
        """Entered around one micro-batch's forward and backward (e.g. DDP's ``no_sync``)."""
        return contextlib.nullcontext()

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The loss of one micro-batch (moving the batch to the device is part of it)."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def step(self, micro_batches: list[tuple[torch.Tensor, ...]],
             before_optimizer: Callable[[], None] | None = None,
             phases: Phases | None = None) -> torch.Tensor:
        phase = phases or _untimed
        total = None
        for i, mb in enumerate(micro_batches):
            boundary = i == len(micro_batches) - 1
            with self.micro_context(boundary):
                with phase("forward"):
                    loss = self.forward(mb)
                with phase("backward"):
                    self.backward(loss, boundary)
            loss = loss.detach().float()
            total = loss if total is None else total + loss
        if before_optimizer is not None:
            before_optimizer()
        with phase("step"):
            self.optimizer_step()
        return total / len(micro_batches)

    def memory_tensors(self) -> tuple[TensorList, TensorList, list[torch.Tensor]]:
        """(gradient tensors, optimizer-state tensors, parameter tensors) live on this rank."""
        raise NotImplementedError

    def gathered_params(self) -> list[torch.Tensor] | None:
        return None

    def full_params(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass
