"""bucket: plan which gradients each collective carries. Inserts nothing; fills ``ctx.buckets``.

A flat group of S elements per shard is cut into chunks [lo, hi) of at most
``bucket_numel / num_shards`` elements; bucket b carries, for every shard s, the range
``[s*S + lo, s*S + hi)`` of the group's flat buffer. A reduce-scatter of that bucket therefore
hands each rank exactly chunk b of its own shard: the layout DeepSpeed's optimizer reads, with
no padding and no all-to-all, whatever the bucket size.

Buckets are listed from the end of the shards to the start (parameters late in the flat order
usually get their gradients first); each collective is then placed right after the last gradient
it needs. The graph, hence the order of collectives, is the same on every rank.
Buckets in which no gradient of this graph lands (e.g. after a graph break) are dropped.
"""
from __future__ import annotations

import math

import torch.fx as fx

from ._graph import Bucket, PassContext


def _members(ctx: PassContext, ps, g: int, lo: int, hi: int):
    group = ps.groups[g]
    shard, nshards = group.shard_numel(ps.world_size), group.num_shards(ps.world_size)
    out = []
    for grad in ctx.grads_of(ps, g):
        start = group.offsets[grad.owned.position]
        end = start + grad.owned.param.numel()
        if any(start < s * shard + hi and s * shard + lo < end for s in range(nshards)):
            out.append(grad)
    return out


def bucket(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for ps in ctx.ownership.param_sets:
        for g, group in enumerate(ps.groups):
            if not ctx.grads_of(ps, g):
                continue
            shard, nshards = group.shard_numel(ps.world_size), group.num_shards(ps.world_size)
            chunk = max(1, (ctx.bucket_size or ps.bucket_numel) // nshards)
            n_chunks = math.ceil(shard / chunk)
            for c in reversed(range(n_chunks)):
                lo, hi = c * chunk, min(shard, (c + 1) * chunk)
                members = _members(ctx, ps, g, lo, hi)
                if members:
                    ctx.buckets.append(Bucket(ps, g, lo, hi, members))
                    ctx.count(ps, "buckets")
    return gm
