"""fp32_accumulate: add each rank's reduced shard into the buffer its engine's optimizer reads.

Per (engine, param group) it appends one placeholder for that buffer (the "sink": a ZeRO
optimizer's fp32 gradient partition, or BF16_Optimizer's fp32 gradient buffer; the runtime passes
the real tensor on every call) and inserts, just before the output:

  cat(reduced chunks in shard order, zeros where no bucket landed) -> convert to the accumulation
  dtype -> multiply by 1/(world*gas) -> add to the sink -> ``aten.copy_`` into the sink.

Inductor fuses the cast, scale and add into one pass over the shard. Finally the owned
gradients are removed from the graph's outputs (None), so autograd keeps no full-size ``.grad``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ._graph import Inserter, PassContext, output_node

PASS = "fp32_accumulate"
aten = torch.ops.aten


def fp32_accumulate(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    out = output_node(gm)
    placeholders = list(graph.find_nodes(op="placeholder"))
    anchor = placeholders[-1]
    targets = []
    for b, bucket in enumerate(ctx.buckets):
        key = (bucket.param_set, bucket.group)
        if key not in targets:
            targets.append(key)
    ins = Inserter(gm, ctx, PASS, after=out.prev)
    for ps, g in targets:
        group = ps.groups[g]
        shard = group.shard_numel(ps.world_size)
        device = ctx.grads_of(ps, g)[0].node.meta["val"].device
        with graph.inserting_after(anchor):
            sink = graph.placeholder(f"graphzero_sink_{ps.name}_{g}")
        anchor = sink
        with ctx.fake_mode:
            sink.meta["val"] = torch.empty(shard, dtype=ps.accum_dtype, device=device)
        sink.meta["graphzero"] = {"pass": PASS, "engine": ps.name,
                                  "why": f"{ps.accum_dtype} gradient shard of param group {g} ({shard} elements)"}
        ctx.sinks.append((ps, g))
        chunks = sorted(((ctx.buckets[b].lo, ctx.buckets[b].hi, node) for b, node in ctx.reduced.items()
                         if ctx.buckets[b].param_set is ps and ctx.buckets[b].group == g), key=lambda t: t[0])
        pieces, cursor = [], 0
        for lo, hi, node in chunks:
            if lo > cursor:
                pieces.append(ins.zeros(lo - cursor, ps.comm_dtype, device, engine=ps.name, why="no bucket here"))
            pieces.append(node)
            cursor = hi
        if cursor < shard:
            pieces.append(ins.zeros(shard - cursor, ps.comm_dtype, device, engine=ps.name, why="no bucket here"))
        why = f"group {g}: shard of {len(ctx.grads_of(ps, g))} gradients"
        delta = pieces[0] if len(pieces) == 1 else ins.call(aten.cat.default, (pieces,), engine=ps.name, why=why)
        if ps.comm_dtype != ps.accum_dtype:
            delta = ins.call(torch.ops.prims.convert_element_type.default, (delta, ps.accum_dtype),
                             engine=ps.name, why=f"upcast reduced shard to {ps.accum_dtype}")
        delta = ins.call(aten.mul.Tensor, (delta, ps.grad_scale), engine=ps.name,
                         why=f"average: 1/(world {ps.world_size} x gas)")
        total = ins.call(aten.add.Tensor, (sink, delta), engine=ps.name, why=f"accumulate into the {ps.accum_dtype} shard")
        ins.call(aten.copy_.default, (sink, total), engine=ps.name, why="write the shard the optimizer reads in step()")
        ctx.count(ps.name, "fp32_accumulate", len(ctx.grads_of(ps, g)))
    values = list(out.args[0])
    for grad in ctx.grads:
        values[grad.slot] = None
    out.args = (tuple(values),) + tuple(out.args[1:])
    graph.eliminate_dead_code()
    gm.recompile()
    return gm
