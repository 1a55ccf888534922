"""The ZeRO-3 parameter gather, as an autograd function of the shard.

Forward: all-gather of the shards, the first ``numel`` elements viewed to the parameter's shape.
Backward: reduce-scatter SUM (averaging happens later, in fp32, in the fp32_accumulate pass).
Functional collectives, so Dynamo, inductor and AOT's partitioner see them (recompute, not save).
"""
from __future__ import annotations

import torch

c10d = torch.ops._c10d_functional


class _GatherShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, numel: int, shape: tuple[int, ...], world: int, group_name: str):
        ctx.world, ctx.group_name, ctx.padded = world, group_name, shard.numel() * world
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard.contiguous(), world, group_name))
        return full[:numel].view(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not torch.compiler.is_compiling():   # traced into a graph it is a collective the plan lists
            _refuse_where_ranks_ran_apart()
        flat = grad.contiguous().view(-1)
        if flat.numel() < ctx.padded:
            flat = torch.nn.functional.pad(flat, (0, ctx.padded - flat.numel()))
        shard = c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", ctx.world, ctx.group_name))
        return shard, None, None, None, None


class _GatherShardLocalGrad(torch.autograd.Function):
    """The same gather; its full gradient goes, unreduced, to ``proxy`` (a full-shape leaf)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, proxy: torch.Tensor, numel: int, shape: tuple[int, ...], world: int,
                group_name: str):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard.contiguous(), world, group_name))
        return full[:numel].view(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad, None, None, None, None


def _refuse_where_ranks_ran_apart() -> None:
    """Run eagerly inside a backward in which the ranks ran different graphs, this reduce-scatter
    would meet other collectives: a RankDisagreementError on every rank instead (runtime/scope.py)."""
    from .runtime import scope
    backward = scope.running()
    if backward is not None and backward.diverged is not None:
        backward.abort("a ZeRO-3 parameter's gradient reduced by eager autograd")


def gather_shard(shard: torch.Tensor, numel: int, shape: tuple[int, ...], world: int,
                 group_name: str) -> torch.Tensor:
    """The full parameter from every rank's ``shard``; its gradient is reduce-scattered back."""
    return _GatherShard.apply(shard, numel, tuple(shape), world, group_name)


def gather_shard_local_grad(shard: torch.Tensor, proxy: torch.Tensor, numel: int, shape: tuple[int, ...],
                            world: int, group_name: str) -> torch.Tensor:
    """The full parameter from every rank's ``shard``; its gradient, unreduced, goes to ``proxy``."""
    return _GatherShardLocalGrad.apply(shard, proxy, numel, tuple(shape), world, group_name)


class _TensorHooks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full: torch.Tensor, hooks: tuple):
        ctx.hooks = hooks
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        for hook in ctx.hooks:
            out = hook(grad)
            grad = grad if out is None else out
        return grad, None


def with_tensor_hooks(full: torch.Tensor, hooks: tuple) -> torch.Tensor:
    """``full`` whose gradient passes through a parameter's ``register_hook`` hooks, in order, before
    the reduce-scatter (as DeepSpeed eager's hooks see this rank's unreduced gradient)."""
    return _TensorHooks.apply(full, hooks)


@torch.library.custom_op("graphzero::split_gathered", mutates_args=())
def split_gathered(gathered: torch.Tensor, world: int, shard_sizes: list[int]) -> list[torch.Tensor]:
    """A gather bucket's rows split into each member's contiguous ``world x shard`` tensor.

    Opaque, not slices: inductor fused the copies of independent buckets (same loop sizes) into one
    kernel, making every forward compute wait for every engine's gather."""
    grid = gathered.view(world, -1)
    outs = [gathered.new_empty(world * s) for s in shard_sizes]
    torch.split_with_sizes_copy(grid, shard_sizes, dim=1, out=[o.view(world, s) for o, s in zip(outs, shard_sizes)])
    return outs


@split_gathered.register_fake
def _(gathered: torch.Tensor, world: int, shard_sizes: list[int]) -> list[torch.Tensor]:
    return [gathered.new_empty(world * s) for s in shard_sizes]
