"""The ``graphzero-compare`` runners built on DeepSpeed engines: DeepSpeed eager (plain
``loss.backward()`` and ``engine.backward``), graphzero (inductor and eager inner compiler) and
DeepCompile. DeepSpeed is imported only inside ``setup``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch

from .bench_runner import Runner, RunnerSkipped, TensorList, to_device, walk_tensors


class DeepSpeedPlainBackward(Runner):
    """DeepSpeed eager: ``loss = loss_fn(engines, batch)`` (each part called as ``engine(x)``),
    plain ``loss.backward()``, then ``engine.step()`` for every engine (every micro-batch: managed
    gradient accumulation)."""

    name = "ds-plain-backward"
    extra_config: ClassVar[dict[str, Any]] = {}
    zero_config: ClassVar[dict[str, Any]] = {}   # merged into zero_optimization

    def setup(self) -> None:
        import deepspeed

        self.engines: dict[str, Any] = {}
        for part_name, module in self.ctx.fresh_parts().items():
            config = self.ctx.ds_config(self.extra_config)
            config["zero_optimization"].update(self.zero_config)
            if part_name in self.ctx.workload.frozen:
                # no optimizer: an inference engine (ZeRO-3 as examples/rlhf_ppo.py's reference and reward,
                # or --frozen-stage 0)
                del config["optimizer"], config["gradient_clipping"]
                config["zero_optimization"] = ({"stage": 3, "stage3_param_persistence_threshold": 0}
                                               if self.ctx.frozen_stage == 3 else {"stage": 0})
            engine, *_ = deepspeed.initialize(model=module, config=config)
            self.engines[part_name] = engine

    def _float_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.ctx.bf16 else torch.float32

    def compute_loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.ctx.workload.loss(self.engines, *batch)

    def forward(self, batch):
        return self.compute_loss(to_device(batch, self.ctx.device, self._float_dtype()))

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def trained_engines(self) -> list[Any]:
        return [e for k, e in self.engines.items() if k not in self.ctx.workload.frozen]

    def backward(self, loss, boundary):
        self.run_backward(loss)
        if not boundary:
            for engine in self.trained_engines():
                engine.step()  # not a boundary: DeepSpeed only counts the micro-step

    def optimizer_step(self) -> None:
        for engine in self.trained_engines():
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

    def gathered_params(self):
        """ZeRO-3: a released parameter's ``data`` is an empty tensor (its shard is ``ds_tensor``),
        so the non-empty ones are those gathered right now (views of DeepSpeed's gather buffers)."""
        if self.ctx.stage != 3:
            return None
        return [p for e in self.engines.values() for p in e.module.parameters() if p.numel()]

    def full_params(self):
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for part_name, engine in self.engines.items():
            if part_name in self.ctx.workload.frozen:   # no optimizer, no fp32 master: gather the module's
                params = list(engine.module.named_parameters())
                with deepspeed.zero.GatheredParameters([p for _, p in params]):
                    out.update({f"{part_name}.{pn}": p.detach().float().cpu().clone() for pn, p in params})
                continue
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

    def run_backward(self, loss):
        self.trained_engines()[-1].backward(loss)


class GraphZeroRunner(DeepSpeedPlainBackward):
    """graphzero (DESIGN.md section 1): the same DeepSpeed engines, the loss function compiled with
    ``torch.compile(step, backend="graphzero", options={"engines": {...}, "inner": ...})``, plain
    ``loss.backward()``, then each ``engine.step()``. With ZeRO-3 it also writes graphzero's dump
    (rank 0, a temporary directory), whose summary has the gathered-parameter peak of the
    compiled schedule (:meth:`graph_stats`)."""

    name = "graphzero-inductor"
    compiled = True
    inner: ClassVar[str] = "inductor"
    # graphzero's optimizer-step options (docs/usage.md): the defaults unless a variant below sets them
    step_options: ClassVar[dict[str, Any]] = {}

    def setup(self) -> None:
        import graphzero  # noqa: F401  (importing registers the backend)

        super().setup()
        parts = {k: (e if self.ctx.graphzero_call == "engine" else e.module) for k, e in self.engines.items()}
        loss_fn = self.ctx.workload.loss

        def step(*batch):
            return loss_fn(parts, *batch)

        options: dict[str, Any] = {"engines": dict(self.engines), "inner": self.inner, **self.step_options}
        self._dump_dir = None
        # GRAPHZERO_COMPARE_DUMP_DIR: keep each runner's dump there (wire_bytes.py reads its summary)
        self._keep_dump = os.environ.get("GRAPHZERO_COMPARE_DUMP_DIR")
        if self._keep_dump:
            self._dump_dir = os.path.join(self._keep_dump, self.name)
            options["dump_dir"] = self._dump_dir
        elif self.ctx.stage == 3:
            self._dump_dir = tempfile.mkdtemp(prefix=f"graphzero-compare-{self.name}-")
            options["dump_dir"] = self._dump_dir
        self._compiled = torch.compile(step, backend="graphzero", options=options)

    def compute_loss(self, batch):
        return self._compiled(*batch)

    def gathered_params(self):
        return None  # gathered inside the compiled graph: see graph_stats

    def eager_grads_seen(self) -> int:
        """How many gradients graphzero's eager safety net has reduced for these engines: each is a
        gradient eager autograd delivered to an owned parameter (ZeRO-3: its shard), since compiled
        graphs return none for the parameters they own. Read from the bindings' counters: a tensor
        hook of our own would itself take a ZeRO-1/2 parameter out of the compiled reduction."""
        from graphzero.deepspeed_adapter import binding_of
        return sum(b.eager_gradients for b in (binding_of(e) for e in self.engines.values()) if b is not None)

    def graph_stats(self) -> dict[str, int] | None:
        """The gathered-parameter peak of the compiled forward / backward (bytes, the most over the
        compiled graphs; the dump records the graph-wide peak under every engine that gathers), from
        the dump summary. None on ranks that do not write the dump, or without ZeRO-3."""
        path = Path(self._dump_dir) / "summary.json" if self._dump_dir else None
        if path is None or not path.exists():
            return None
        stats = {"forward": 0, "backward": 0}
        for graph in json.loads(path.read_text()).get("graphs", []):
            for engine in graph.get("engines", {}).values():
                stats["forward"] = max(stats["forward"], engine.get("gathered_peak_bytes_fwd", 0))
                stats["backward"] = max(stats["backward"], engine.get("gathered_peak_bytes_bwd", 0))
        return stats

    def close(self) -> None:
        super().close()
        if getattr(self, "_dump_dir", None) and not self._keep_dump:
            shutil.rmtree(self._dump_dir, ignore_errors=True)
            self._dump_dir = None


class GraphZeroEagerRunner(GraphZeroRunner):
    name = "graphzero-eager"
    inner = "eager"


class GraphZeroDeferredRunner(GraphZeroRunner):
    """graphzero-inductor with ``defer_param_gather``: the lean step leaves the parameter
    all-gather in flight and the next compiled forward waits for it."""

    name = "graphzero-deferred"
    step_options: ClassVar[dict[str, bool]] = {"defer_param_gather": True}


class GraphZeroReduceScatterRunner(GraphZeroRunner):
    """graphzero-inductor with ``collective="reduce_scatter"``, the backend's own (the NCCL choice;
    on gloo "auto" sends an all-to-all instead, as gloo's reduce-scatter is an all-reduce
    underneath)."""

    name = "graphzero-rs"
    step_options: ClassVar[dict[str, Any]] = {"collective": "reduce_scatter"}


class GraphZeroDeepSpeedStepRunner(GraphZeroRunner):
    """graphzero-inductor with ``lean_step=False``: DeepSpeed's own ``optimizer.step()``."""

    name = "graphzero-ds-step"
    step_options: ClassVar[dict[str, bool]] = {"lean_step": False}


OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


class DeepSpeedOffload(DeepSpeedPlainBackward):
    """DeepSpeed eager with ``offload_optimizer: {device: cpu}`` (the optimizer on the CPU: torch
    AdamW here, as every runner's). Opt-in: ``--runners ds-offload,graphzero-offload,...``."""

    name = "ds-offload"
    opt_in = True
    zero_config: ClassVar[dict[str, Any]] = OFFLOAD


class DeepSpeedEngineBackwardOffload(DeepSpeedEngineBackward):
    """``ds-engine-backward`` with ``offload_optimizer: {device: cpu}``: DeepSpeed eager's offload
    where a plain backward leaves an engine's gradient wrong (the gan). Opt-in."""

    name = "ds-engine-backward-offload"
    opt_in = True
    zero_config: ClassVar[dict[str, Any]] = OFFLOAD


class GraphZeroOffloadRunner(GraphZeroRunner):
    """graphzero-inductor with ``offload_optimizer: {device: cpu}`` (CPU engines only so far)."""

    name = "graphzero-offload"
    opt_in = True
    zero_config: ClassVar[dict[str, Any]] = OFFLOAD

    def setup(self) -> None:
        if self.ctx.device.type != "cpu":
            raise RunnerSkipped("graphzero's optimizer offload runs on CPU engines only so far")
        super().setup()


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

    def gathered_params(self):
        return None  # gathered inside DeepCompile's graph
