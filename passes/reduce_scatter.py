"""insert_reduce_scatter: one collective per bucket, on the owning engine's data-parallel group.

For each bucket it inserts, right after the last gradient the bucket needs (to overlap the rest of
backward): each gradient flattened in the communication dtype -> its pieces in the bucket (zeros
for padding and missing gradients) -> cat -> ``reduce_scatter_tensor`` -> ``wait_tensor``.

Sharded groups use a reduce-scatter, or with ``collective="all_reduce"`` an all-reduce and a slice
of this rank's chunk; groups every rank keeps whole (BF16_Optimizer) an all-reduce. Scaling happens
later, in the accumulation dtype (fp32_accumulate). Functional collectives rather than custom ops:
inductor's comm passes recognise them.
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import Bucket, Inserter, PassContext, last_in_order
from .contract import pass_contract

PASS = "insert_reduce_scatter"
c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _use_all_reduce(ctx: PassContext, bucket: Bucket) -> bool:
    ps = bucket.param_set
    if not ps.groups[bucket.group].sharded:
        return True
    return ctx.collective == "all_reduce"


def _bucket_input(ins: Inserter, ctx: PassContext, b: int, bucket: Bucket, flat: dict) -> fx.Node:
    """The concatenation, shard by shard, of every piece of gradient in the bucket's ranges."""
    ps, group = bucket.param_set, bucket.param_set.groups[bucket.group]
    shard, nshards = group.shard_numel(ps.world_size), group.num_shards(ps.world_size)
    device = bucket.members[0].node.meta["val"].device
    by_position = {m.owned.position: m for m in bucket.members}
    pieces: list[fx.Node] = []
    pending_zeros = 0

    def flush_zeros() -> None:
        nonlocal pending_zeros
        if pending_zeros:
            pieces.append(ins.zeros(pending_zeros, ps.comm_dtype, device, engine=ps.name,
                                    why=f"padding or absent gradients in bucket {b}"))
            pending_zeros = 0

    for s in range(nshards):
        start, end = s * shard + bucket.lo, s * shard + bucket.hi
        cursor = start
        for k, offset in enumerate(group.offsets):
            numel = group.params[k].numel()
            a, z = max(offset, start), min(offset + numel, end)
            if a >= z:
                continue
            pending_zeros += a - cursor
            member = by_position.get(k)
            if member is None:
                pending_zeros += z - a
            else:
                flush_zeros()
                src = flat[member.slot]
                if (a - offset, z - offset) != (0, numel):
                    src = ins.call(aten.slice.Tensor, (src, 0, a - offset, z - offset), engine=ps.name,
                                   why=f"part of {member.owned.qualname} in shard {s} of bucket {b}")
                pieces.append(src)
            cursor = z
        pending_zeros += end - cursor
    flush_zeros()
    if len(pieces) == 1:
        return pieces[0]
    return ins.call(aten.cat.default, (pieces,), engine=ps.name, why=f"bucket {b} input")


@pass_contract(requires={"buckets", "flat partial sums"}, provides={"reduced", "bucket cats"})
def insert_reduce_scatter(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for b, bucket in enumerate(ctx.buckets):
        ps = bucket.param_set
        ins = Inserter(gm, ctx, PASS, after=last_in_order(gm, [m.node for m in bucket.members]))
        # Per bucket, not shared: buckets sit at different points of the graph, and a node made
        # for a later bucket may come after an earlier-placed one that would need it.
        flat: dict[int, fx.Node] = {}
        for m in bucket.members:
            x = m.node
            if x.meta["val"].dtype != ps.comm_dtype:
                x = ins.call(torch.ops.prims.convert_element_type.default, (x, ps.comm_dtype), engine=ps.name,
                             why=f"cast grad of {m.owned.qualname} to the communication dtype {ps.comm_dtype}")
            # reshape, not view: a gradient may come out non-contiguous (a parameter used
            # through .t(), a channels_last weight)
            flat[m.slot] = ins.call(aten.reshape.default, (x, [-1]), engine=ps.name,
                                    why=f"flatten grad of {m.owned.qualname}")
        inp = _bucket_input(ins, ctx, b, bucket, flat)
        numel = inp.meta["val"].numel()
        if _use_all_reduce(ctx, bucket):
            coll = ins.call(c10d.all_reduce.default, (inp, "sum", ps.group_name), engine=ps.name,
                            why=f"all-reduce bucket {b} ({numel} elements) over {ps.world_size} ranks")
            out = ins.call(c10d.wait_tensor.default, (coll,), engine=ps.name, why=f"wait for bucket {b}")
            if ps.groups[bucket.group].sharded:
                c = bucket.chunk_numel
                out = ins.call(aten.slice.Tensor, (out, 0, ps.rank * c, (ps.rank + 1) * c), engine=ps.name,
                               why=f"keep only this rank's chunk of bucket {b}")
            ctx.count(ps, "all_reduce")
        else:
            coll = ins.call(c10d.reduce_scatter_tensor.default, (inp, "sum", ps.world_size, ps.group_name),
                            engine=ps.name, why=f"reduce-scatter bucket {b} ({numel} elements) over {ps.world_size} ranks")
            out = ins.call(c10d.wait_tensor.default, (coll,), engine=ps.name, why=f"wait for bucket {b}")
            ctx.count(ps, "reduce_scatter")
        nbytes = numel * inp.meta["val"].element_size()
        ctx.count(ps, "comm_bytes_per_step", nbytes)
        by_dtype = ctx.stats[ps].setdefault("comm_bytes_by_dtype", {})
        key = str(ps.comm_dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + nbytes
        ctx.reduced[b] = out
    return gm
