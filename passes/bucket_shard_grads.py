"""bucket_shard_grads: one reduce-scatter per bucket of ZeRO-3 shard gradients instead of one each.

Runs on the backward graph after sum_shard_grads and hold_shard_grads, before annotate_owner. It
groups consecutive per-parameter reduce-scatters of one engine (same process group, dtype) into
buckets of at most ``reduce_bucket_size`` elements, and for every bucket of two or more inserts,
right after the last gradient it needs:

  each padded gradient viewed [world, shard] -> ``aten.cat`` along the shard dimension -> flat ->
  ``reduce_scatter_tensor`` -> ``wait_tensor`` -> per member an ``aten.slice``, the graph output

The wait sits just before the next bucket's collective: one bucket in flight, the full-size
gradients of at most two buckets alive. Records ``gradient_buckets`` and ``reduce_scatter`` per
engine and the plan in ``ctx.zero3_plan`` (compared across ranks, rank_agreement.py).
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import Inserter, PassContext, hoist, last_in_order, shard_grad_reductions
from .contract import pass_contract

PASS = "bucket_shard_grads"
c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _plan(ctx: PassContext, grads: list) -> list[list]:
    buckets: list[list] = []
    open_bucket: dict[tuple, list] = {}
    for rs, wait, owned in grads:
        ps = owned.param_set
        _, op, world, group_name = rs.args
        limit = ctx.bucket_size or ps.bucket_numel
        key = (ps.name, op, world, group_name, rs.args[0].meta["val"].dtype)
        current = open_bucket.get(key)
        numel = rs.args[0].meta["val"].numel()
        if current is not None and sum(r.args[0].meta["val"].numel() for r, _, _ in current) + numel <= limit:
            current.append((rs, wait, owned))
            continue
        open_bucket[key] = [(rs, wait, owned)]
        buckets.append(open_bucket[key])
    return buckets


def _merge(gm: fx.GraphModule, ctx: PassContext, b: int, bucket: list) -> fx.Node:
    """Replace the bucket's reduce-scatters by one; return the new wait."""
    rs0, _, owned0 = bucket[0]
    _, op, world, group_name = rs0.args
    ps = owned0.param_set
    ins = Inserter(gm, ctx, PASS, after=last_in_order(gm, [rs.args[0] for rs, _, _ in bucket]))
    rows = [ins.call(aten.view.default, (rs.args[0], [world, -1]), engine=ps.name,
                     why=f"gradient of {owned.qualname}, one row per destination rank") for rs, _, owned in bucket]
    grid = ins.call(aten.cat.default, (rows, 1), engine=ps.name, why=f"gradient bucket {b}, rank-major")
    flat = ins.call(aten.view.default, (grid, [-1]), engine=ps.name, why=f"gradient bucket {b}, flat")
    coll = ins.call(c10d.reduce_scatter_tensor.default, (flat, op, world, group_name), engine=ps.name,
                    why=f"reduce-scatter gradient bucket {b} ({len(bucket)} shards, {world} ranks)")
    wait = ins.call(c10d.wait_tensor.default, (coll,), engine=ps.name, why=f"wait for gradient bucket {b}")
    offset = 0
    for rs, old_wait, owned in bucket:
        n = old_wait.meta["val"].numel()
        piece = ins.call(aten.slice.Tensor, (wait, 0, offset, offset + n), engine=ps.name,
                         why=f"this rank's shard gradient of {owned.qualname}")
        offset += n
        old_wait.replace_all_uses_with(piece)
        gm.graph.erase_node(old_wait)
        gm.graph.erase_node(rs)
    return wait


@pass_contract(requires={"kept shard grads out"}, provides={"shard grads bucketed"}, invalidates={"grads"})
def bucket_shard_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    grads = shard_grad_reductions(gm, ctx)
    if not grads:
        return gm
    for rs, _, _ in grads:
        hoist(gm, rs)
    grads = shard_grad_reductions(gm, ctx)   # in the new order
    previous_tail: list[fx.Node] = []   # the previous bucket's wait and slices
    for b, bucket in enumerate(_plan(ctx, grads)):
        ps = bucket[0][2].param_set
        if len(bucket) == 1:
            rs, wait, _ = bucket[0]
            tail = [wait]
        else:
            wait = _merge(gm, ctx, b, bucket)
            rs, tail = wait.args[0], [wait, *wait.users]
        # wait for the previous bucket only once this one is issued (if it is issued after it:
        # two engines' buckets may interleave)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if previous_tail and order[rs] > order[previous_tail[0].args[0]]:
            cursor = rs
            for n in previous_tail:
                cursor.append(n)
                cursor = n
        previous_tail = tail
        ctx.count(ps, "gradient_buckets")
        ctx.count(ps, "reduce_scatter")
        val = rs.args[0].meta["val"]
        ctx.count(ps, "comm_bytes_per_step", val.numel() * val.element_size())
        ctx.zero3_plan.append(("grad", ps.name, rs.args[3], rs.args[2],
                                tuple((o.qualname, w.meta["val"].numel()) for _, w, o in bucket)))
    gm.graph.lint()
    gm.recompile()
    return gm
