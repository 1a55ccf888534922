"""The ``graphzero-compare`` runners built on PyTorch alone: DDP (the parameter reference), FSDP2
(``fully_shard``) and the single-process ideal (plain ``torch.compile`` + fused AdamW)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .bench_models import Block
from .bench_runner import Runner, TensorList, local_tensor, to_device, walk_tensors


class _TorchRunner(Runner):
    """One wrapper and one ``torch.optim.AdamW`` per part; ``clip_grad_norm_`` per part; with bf16
    the forward runs under ``torch.autocast(bf16)`` when ``autocast_bf16`` (fp32 weights and
    gradients)."""

    autocast_bf16 = False

    def _wrap(self, module: nn.Module) -> nn.Module:
        raise NotImplementedError

    def _optimizer(self, params) -> torch.optim.Optimizer:
        h = self.ctx.hyper
        return torch.optim.AdamW(params, lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)

    def _inner(self, model: nn.Module) -> nn.Module:
        return model

    def _wrap_frozen(self, module: nn.Module) -> nn.Module:
        """A part the step calls but never trains (no gradient to synchronize)."""
        return module

    def setup(self) -> None:
        frozen = self.ctx.workload.frozen
        self.models = {k: (self._wrap_frozen if k in frozen else self._wrap)(m.to(self.ctx.device))
                       for k, m in self.ctx.fresh_parts().items()}
        self.optims = {k: self._optimizer(m.parameters()) for k, m in self.models.items() if k not in frozen}

    def compute_loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.ctx.workload.loss(self.models, *batch)

    def forward(self, batch):
        batch = to_device(batch, self.ctx.device, torch.float32)
        if self.autocast_bf16 and self.ctx.bf16:
            with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16):
                return self.compute_loss(batch)
        return self.compute_loss(batch)

    def backward(self, loss, boundary):
        (loss / self.ctx.gas).backward()

    def optimizer_step(self) -> None:
        for k, optim in self.optims.items():
            torch.nn.utils.clip_grad_norm_(self.models[k].parameters(), self.ctx.hyper.clip)
            optim.step()
            optim.zero_grad(set_to_none=True)

    def memory_tensors(self):
        grads: TensorList = []
        state: TensorList = []
        params: list[torch.Tensor] = []
        for k, model in self.models.items():
            for pn, p in model.named_parameters():
                params.append(local_tensor(p))
                if p.grad is not None:
                    grads.append((f"{k}.{pn}.grad", local_tensor(p.grad)))
            if k in self.optims:
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
    autocast_bf16 = True

    def _wrap(self, module):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        return DDP(module, device_ids=ids, gradient_as_bucket_view=True)

    def _inner(self, model):
        return getattr(model, "module", model)

    def micro_context(self, boundary):
        if boundary:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for k in self.optims:
            stack.enter_context(self.models[k].no_sync())
        return stack


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The submodules FSDP2 shards on their own with ZeRO-3 (``--stage 3``): every transformer
    ``Block``, ``Linear`` and ``Embedding`` below the part's root, outermost first (the root keeps
    what is left, e.g. the final LayerNorm). A part that is one Linear (the LM head) has none."""
    units: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, (Block, nn.Linear, nn.Embedding)):
            units.append(child)
        else:
            units.extend(shard_units(child))
    return units


class FSDP2Runner(_TorchRunner):
    """PyTorch FSDP2 on a 1-D device mesh: ``fully_shard`` with one root per part; with ZeRO-3
    (``--stage 3``) first each of :func:`shard_units` with ``reshard_after_forward=True``, so that
    only a unit's parameters (plus prefetch) are gathered at a time, like DeepSpeed ZeRO-3. bf16
    uses ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; gradient sync only on the
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
        if self.ctx.stage == 3:
            units = shard_units(module)
            # a tied parameter (GPT-2's lm_head and wte) cannot be in two FSDP groups: the root keeps it
            owners: dict[int, int] = {}
            for unit in units:
                for p in unit.parameters():
                    owners[id(p)] = owners.get(id(p), 0) + 1
            for unit in units:
                if all(owners[id(p)] == 1 for p in unit.parameters()):
                    fully_shard(unit, mesh=self._mesh, reshard_after_forward=True, **kwargs)
        return fully_shard(module, mesh=self._mesh, **kwargs)

    def _wrap_frozen(self, module):
        return self._wrap(module)   # sharded and gathered like the trained parts (a frozen ZeRO-3 engine)

    def micro_context(self, boundary):
        for k in self.optims:
            self.models[k].set_requires_gradient_sync(boundary)
        return contextlib.nullcontext()

    def gathered_params(self):
        """Unsharded parameters are plain tensors registered in place of the sharded DTensors
        between FSDP2's all-gather and its reshard. ZeRO-3 only (per-unit sharding)."""
        from torch.distributed.tensor import DTensor

        if self.ctx.stage != 3:
            return None

        return [p for m in self.models.values() for p in m.parameters() if not isinstance(p, DTensor)]


class FSDP2CompiledRunner(FSDP2Runner):
    """FSDP2 as ``fsdp2``, each unit's forward compiled with ``torch.compile`` before it is sharded
    (torchtitan's per-block pattern): the units of :func:`shard_units` at every stage, or each child
    of a part that has none; FSDP2's hooks and collectives stay outside the compiled blocks."""

    name = "fsdp2-compiled"
    compiled = True
    opt_in = True   # a compile per unit: minutes on the client workloads

    def _wrap(self, module):
        units = shard_units(module) or list(module.children())
        for unit in units:
            unit.forward = torch.compile(unit.forward)
        return super()._wrap(module)


def _inductor_with_graphzero_guards(gm, example_inputs):
    """inductor, with the switches graphzero's own backward graphs get against a known inductor
    miscompile (graphzero/inductor_guards.py: on torch < 2.15 CPU a UNet's gradients come out
    wrong otherwise), so that the ideal trains what the other runners train."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from graphzero.inductor_guards import backward_patches, device_type_of

    def inner(graph, inputs, **kwargs):
        patches = backward_patches(device_type=device_type_of(inputs)) if kwargs.get("is_backward") else {}
        with torch._inductor.config.patch(patches):
            return compile_fx_inner(graph, inputs, **kwargs)

    # AOTAutograd's cache keys on the config at entry, before the backward's patch: a hit would
    # bring back an unguarded backward compiled earlier (measured: the same wrong parameters)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner)


class TorchCompileFusedRunner(_TorchRunner):
    """The ideal (no DeepSpeed, no DDP): the loss function under plain ``torch.compile`` (inductor;
    with graphzero's miscompile guard on the backward where the workload needs it:
    `_inductor_with_graphzero_guards`),
    ``torch.optim.AdamW(fused=True)`` and ``clip_grad_norm_`` per part; bf16 under
    ``torch.autocast``. With several ranks every trained gradient is averaged by one all-reduce of
    one flat buffer after the last backward (the fewest collectives, none overlapped): a floor on
    compute and on collective count, not on time where another runner hides its collectives."""

    name = "torch-compile-fused"
    compiled = True
    autocast_bf16 = True

    def setup(self) -> None:
        super().setup()
        loss_fn, models = self.ctx.workload.loss, self.models

        def step(*batch):
            return loss_fn(models, *batch)

        guarded = self.ctx.workload.inductor_backward_miscompiled
        self._compiled = torch.compile(step, backend=_inductor_with_graphzero_guards if guarded else "inductor")

    def _wrap(self, module):
        return module

    def _optimizer(self, params):
        h = self.ctx.hyper
        return torch.optim.AdamW(params, lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay,
                                 fused=True)

    def compute_loss(self, batch):
        return self._compiled(*batch)

    def optimizer_step(self) -> None:
        if self.ctx.world_size > 1:
            self._average_gradients()
        super().optimizer_step()

    def _average_gradients(self) -> None:
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for k in self.optims for p in self.models[k].parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(self.ctx.world_size)
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)
