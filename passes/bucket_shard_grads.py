"""bucket_shard_grads: one reduce-scatter per bucket of ZeRO-3 shard gradients instead of one each.

Runs on the backward graph before annotate_owner. First, a parameter gathered several times
(an engine called twice in the step) has its full gradients summed and reduce-scattered once
(``_sum_before_reduce``). Each ZeRO-3 shard's gradient arrives from the
gather's backward as ``reduce_scatter_tensor(padded full gradient)`` -> ``wait_tensor`` -> graph
output. Walking those reduce-scatters in graph order (the order backward produces gradients), it
groups consecutive ones of one engine (same process group, dtype) into buckets of at most the
engine's ``reduce_bucket_size`` elements (graphzero's ``bucket_size`` option overrides it), and
for every bucket of two or more inserts, right after the last gradient the bucket needs:

  each padded gradient viewed [world, shard] -> ``aten.cat`` along the shard dimension -> flat ->
  ``_c10d_functional.reduce_scatter_tensor`` (rank r receives the concatenation of its shards) ->
  ``wait_tensor`` -> per member an ``aten.slice`` of its shard, which becomes the graph output

and erases the per-parameter reduce-scatters. The wait sits just before the next bucket's
collective (or the output): one bucket in flight while backward computes the next, and the full-size
gradients of at most two buckets alive. The graph, hence the order of collectives, is the same on
every rank. Records ``gradient_buckets`` and ``reduce_scatter`` (collectives) per engine and the
plan in ``ctx.zero3_plan`` (compared across ranks, rank_agreement.py).
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import Inserter, PassContext, last_in_order, output_node

PASS = "bucket_shard_grads"
c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _is_lone_reduce(node: object) -> bool:
    """``wait_tensor(reduce_scatter_tensor(x))`` with no other user of either."""
    if not isinstance(node, fx.Node) or node.target is not c10d.wait_tensor.default or len(node.users) != 1:
        return False
    rs = node.args[0]
    return rs.target is c10d.reduce_scatter_tensor.default and len(rs.users) == 1


def _sum_before_reduce(gm: fx.GraphModule, ctx: PassContext) -> None:
    """A parameter gathered more than once in the graph (an engine called twice: a GAN's
    discriminator) gets one reduce-scatter per gather, and autograd adds the reduced shards. The
    reduce-scatter is linear, so reduce the sum instead: one reduce-scatter of the summed full
    gradient, as DeepSpeed reduces the accumulated ``.grad`` once (bytes per step = DeepSpeed's).
    ``add(wait(rs(a)), wait(rs(b)))`` becomes ``wait(rs(a + b))``, repeated for three or more calls."""
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
                continue
            a, b = node.args
            if not (_is_lone_reduce(a) and _is_lone_reduce(b)) or a is b:
                continue
            rs_a, rs_b = a.args[0], b.args[0]
            x, y = rs_a.args[0], rs_b.args[0]
            if rs_a.args[1:] != rs_b.args[1:] or x.meta["val"].shape != y.meta["val"].shape \
                    or x.meta["val"].dtype != y.meta["val"].dtype:
                continue
            engine = node.meta.get("graphzero", {}).get("engine", "")
            ins = Inserter(gm, ctx, PASS, after=last_in_order(gm, [x, y]))
            total = ins.call(aten.add.Tensor, (x, y), engine=engine,
                             why="sum a parameter's full gradients over its calls, then reduce-scatter once")
            rs = ins.call(c10d.reduce_scatter_tensor.default, (total, *rs_a.args[1:]), engine=engine,
                          why="one reduce-scatter of the summed gradient")
            wait = ins.call(c10d.wait_tensor.default, (rs,), engine=engine, why="wait for it")
            node.replace_all_uses_with(wait)
            for dead in (node, a, b, rs_a, rs_b):
                gm.graph.erase_node(dead)
            changed = True


def _shard_grads(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[fx.Node, fx.Node, object]]:
    """(reduce_scatter, wait, owned input) of every ZeRO-3 shard gradient among the outputs, in
    graph order of the reduce-scatters."""
    out = output_node(gm)
    descs = out.meta.get("desc") or ()
    found = []
    for value, desc in zip(out.args[0], descs):
        idx = getattr(getattr(desc, "grad_of", None), "idx", None)
        owned = ctx.ownership.inputs.get(idx) if idx is not None else None
        if owned is None or not owned.shard or not isinstance(value, fx.Node):
            continue
        if value.target is not c10d.wait_tensor.default or len(value.users) != 1:
            continue
        rs = value.args[0]
        if rs.target is c10d.reduce_scatter_tensor.default and len(rs.users) == 1:
            found.append((rs, value, owned))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(found, key=lambda t: order[t[0]])


_MOVABLE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.constant_pad_nd.default,
            aten.clone.default, torch.ops.prims.convert_element_type.default}


def _hoist(gm: fx.GraphModule, node: fx.Node) -> None:
    """Move ``node`` (and the single-use views/pads feeding it) up to just after its inputs: AOT
    places the gathers' reduce-scatters and their flattening views at the end of the backward,
    which would keep every full-size gradient alive until then."""
    for a in node.all_input_nodes:
        if a.op == "call_function" and a.target in _MOVABLE and len(a.users) == 1:
            _hoist(gm, a)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inputs = node.all_input_nodes
    if inputs:
        latest = max(inputs, key=order.__getitem__)
        if latest.op != "placeholder" and order[latest] + 1 < order[node]:
            latest.append(node)


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


def bucket_shard_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    _sum_before_reduce(gm, ctx)
    grads = _shard_grads(gm, ctx)
    if not grads:
        return gm
    for rs, _, _ in grads:
        _hoist(gm, rs)
    grads = _shard_grads(gm, ctx)   # in the new order
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
