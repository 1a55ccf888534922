"""hold_shard_grads: ZeRO-3 gradients of an engine that another graph of this backward still
reaches are held, and the last such graph reduces each parameter's sum once.

Runs after sum_shard_grads and before bucket_shard_grads, only in the variants that need it
(``ctx.modes``; per-parameter partial sums, runtime/partial.py). For each shard gradient
``wait(reduce_scatter(x))`` it appends a placeholder for the held sum (``Slot.PARTIAL``), then:

- ``Mode.KEEP``: ``held + x`` -> ``aten.copy_`` into ``held``; the reduce-scatter, its wait and the
  graph output go;
- ``Mode.REDUCE_PARTIAL``: the reduce-scatter reads ``x + held``. The runtime drops the released
  sums after the call.

Records the inputs held or released in ``ctx.partial_grads``, and ``held`` / ``released`` counts.
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import (
    Inserter,
    Mode,
    PassContext,
    Slot,
    append_placeholder,
    drop_outputs,
    hoist,
    last_in_order,
    output_node,
    shard_grad_reductions,
)
from .contract import pass_contract

PASS = "hold_shard_grads"
aten = torch.ops.aten
convert = torch.ops.prims.convert_element_type.default


def _as(ins: Inserter, x: fx.Node, dtype: torch.dtype, ps, why: str) -> fx.Node:
    return x if x.meta["val"].dtype == dtype else ins.call(convert, (x, dtype), engine=ps.name, why=why)


@pass_contract(requires={"one reduce-scatter per shard grad"}, provides={"kept shard grads out"},
               invalidates={"grads"})
def hold_shard_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    held = {ps: mode for ps, mode in ctx.modes.items() if any(g.presharded for g in ps.groups)}
    if not held:
        return gm
    reductions = shard_grad_reductions(gm, ctx)
    out = output_node(gm)
    dropped: list[tuple[fx.Node, fx.Node]] = []   # (reduce-scatter, wait) of held gradients
    for ps, mode in held.items():
        for rs, wait, owned in (r for r in reductions if r[2].param_set is ps):
            x = rs.args[0]
            g, k = owned.group, owned.position
            with ctx.fake_mode:
                val = torch.empty((ps.world_size * ps.groups[g].shard_numel_of(k),), dtype=ps.partial_dtype,
                                  device=x.meta["val"].device)
            kept = append_placeholder(gm, ctx, PASS, f"graphzero_held_{ps.name}_{g}_{k}", val, Slot.PARTIAL, ps, (g, k),
                                      f"{owned.qualname}'s full gradient held from other graphs of this backward")
            hoist(gm, x)
            ins = Inserter(gm, ctx, PASS, after=last_in_order(gm, [x, kept]))
            if mode is Mode.KEEP:
                total = ins.call(aten.add.Tensor, (kept, _as(ins, x, ps.partial_dtype, ps, "in the held dtype")),
                                 engine=ps.name, why=f"hold {owned.qualname}'s gradient: another graph reduces it")
                ins.call(aten.copy_.default, (kept, total), engine=ps.name, why="write the held sum")
                dropped.append((rs, wait))
            else:
                total = ins.call(aten.add.Tensor, (x, _as(ins, kept, x.meta["val"].dtype, ps, "in the gradient's dtype")),
                                 engine=ps.name, why=f"{owned.qualname}'s gradient of every graph of this backward")
                rs.replace_input_with(x, total)
            ctx.count(ps, "held" if mode is Mode.KEEP else "released")
            ctx.partial_grads.setdefault(ps, []).append(owned)
    if dropped:
        values = list(out.args[0])
        drop_outputs(gm, [values.index(wait) for _, wait in dropped])
        for rs, wait in dropped:
            gm.graph.erase_node(wait)
            gm.graph.erase_node(rs)
    gm.graph.lint()
    gm.recompile()
    return gm
