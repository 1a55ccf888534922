"""bucket: plan which gradients each collective carries. Inserts nothing; fills ``ctx.buckets``.

Within a flat group of S elements per shard, the shard-relative ranges where this graph's
gradients land are cut into chunks [lo, hi) of at most ``bucket_numel / num_shards`` elements;
bucket b carries ``[s*S + lo, s*S + hi)`` for every shard s, so a reduce-scatter hands each rank
chunk b of its own shard: DeepSpeed's layout, whatever the bucket size. Buckets are listed from
the end of the shards (late parameters usually get their gradients first). Presharded (ZeRO-3)
groups get none: their gradients arrive already reduce-scattered.
"""
from __future__ import annotations

from torch import fx

from ._graph import Bucket, GradOutput, PassContext
from .contract import pass_contract


def _landing(ctx: PassContext, ps, g: int) -> list[tuple[GradOutput, list[tuple[int, int]]]]:
    """Each gradient of this graph in group g, with the shard-relative ranges where it lands."""
    group = ps.groups[g]
    shard, nshards = group.shard_numel(ps.world_size), group.num_shards(ps.world_size)
    out = []
    for grad in ctx.grads_of(ps, g):
        start = group.offsets[grad.owned.position]
        end = start + grad.owned.param.numel()
        ranges = [(max(start, s * shard) - s * shard, min(end, (s + 1) * shard) - s * shard)
                  for s in range(nshards) if max(start, s * shard) < min(end, (s + 1) * shard)]
        out.append((grad, ranges))
    return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, z in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], z))
        else:
            merged.append((a, z))
    return merged


@pass_contract(requires={"grads"}, provides={"buckets"})
def bucket(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for ps in ctx.ownership.param_sets:
        for g, group in enumerate(ps.groups):
            if group.presharded:
                continue   # ZeRO-3: the gather's backward already reduce-scattered each shard
            landing = _landing(ctx, ps, g)
            # Only where this graph's gradients land: after a graph break a graph that sees some of
            # a group's parameters does not send the whole group, nor padding no gradient spans.
            covered = _merged([r for _, ranges in landing for r in ranges])
            chunk = max(1, (ctx.bucket_size or ps.bucket_numel) // group.num_shards(ps.world_size))
            pieces = [(lo, min(z, lo + chunk)) for a, z in covered for lo in range(a, z, chunk)]
            for lo, hi in reversed(pieces):
                members = [grad for grad, ranges in landing if any(a < hi and lo < z for a, z in ranges)]
                ctx.buckets.append(Bucket(ps, g, lo, hi, members))
                ctx.count(ps, "buckets")
    return gm
