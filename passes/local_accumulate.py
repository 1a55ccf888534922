"""local_accumulate: ZeRO-1 with gradient accumulation reduces once per optimizer step, and a
ZeRO-1/2 engine reached by two graphs of one backward once per backward.

A compiled graph cannot skip a collective at run time, so the backend compiles one backward variant
per boundary state (``ctx.modes``, graphzero/runtime/) and this pass makes the difference, with flat
partial sums (runtime/partial.py). Per param group it appends a placeholder for the window's local
full-size buffer and, per engine, one for the averaging factor; then:

- ``Mode.KEEP`` (not a boundary, or not the last graph): ``buffer + cat(gradient x factor, zeros)``
  -> ``aten.copy_`` into the buffer; the engine's buckets are dropped (no collective);
- ``Mode.REDUCE_PARTIAL`` (the boundary, or the last graph): ``buffer slice + gradient x factor``
  replaces each owned gradient for the later passes, so its buckets reduce the window's sum. The
  runtime zeroes the flushed slices after the call.

The factor is applied per micro-step, so a window whose micro-steps were launched differently
(``engine.backward`` divides the loss by gas itself) still sums correctly.
"""
from __future__ import annotations

import torch
from torch import fx

from ..ownership import ParamSet
from ._graph import Inserter, Mode, PassContext, Slot, append_placeholder, last_in_order, output_node
from .contract import pass_contract

PASS = "local_accumulate"
aten = torch.ops.aten
convert = torch.ops.prims.convert_element_type.default


def _scaled(ins: Inserter, grad, ps: ParamSet, scale: fx.Node) -> fx.Node:
    x = grad.node
    if x.meta["val"].dtype != ps.accum_dtype:
        x = ins.call(convert, (x, ps.accum_dtype), engine=ps.name,
                     why=f"grad of {grad.owned.qualname} in the accumulation dtype {ps.accum_dtype}")
    x = ins.call(aten.reshape.default, (x, [-1]), engine=ps.name, why=f"flatten grad of {grad.owned.qualname}")
    return ins.call(aten.mul.Tensor, (x, scale), engine=ps.name,
                    why=f"average this micro-step: 1/(world {ps.world_size} x gas)")


def _accumulate(gm: fx.GraphModule, ctx: PassContext, ps: ParamSet, g: int, buf: fx.Node, scale: fx.Node) -> None:
    group = ps.groups[g]
    grads = sorted(ctx.grads_of(ps, g), key=lambda grad: group.offsets[grad.owned.position])
    device = grads[0].node.meta["val"].device
    ins = Inserter(gm, ctx, PASS, after=output_node(gm).prev)
    pieces, cursor = [], 0
    for grad in grads:
        start = group.offsets[grad.owned.position]
        if start > cursor:
            pieces.append(ins.zeros(start - cursor, ps.accum_dtype, device, engine=ps.name,
                                    why="padding or parameters without a gradient here"))
        pieces.append(_scaled(ins, grad, ps, scale))
        cursor = start + grad.owned.param.numel()
    if cursor < group.numel:
        pieces.append(ins.zeros(group.numel - cursor, ps.accum_dtype, device, engine=ps.name,
                                why="padding or parameters without a gradient here"))
    delta = pieces[0] if len(pieces) == 1 else ins.call(aten.cat.default, (pieces,), engine=ps.name,
                                                        why=f"group {g}: this micro-step's gradients, flat")
    total = ins.call(aten.add.Tensor, (buf, delta), engine=ps.name, why="accumulate locally: not a boundary")
    ins.call(aten.copy_.default, (buf, total), engine=ps.name, why="write the window's local gradient sum")


def _flush(gm: fx.GraphModule, ctx: PassContext, ps: ParamSet, g: int, buf: fx.Node, scale: fx.Node) -> None:
    group = ps.groups[g]
    for grad in ctx.grads_of(ps, g):
        # after the buffer too: a gradient may itself be an input of the graph
        ins = Inserter(gm, ctx, PASS, after=last_in_order(gm, [grad.node, buf, scale]))
        start = group.offsets[grad.owned.position]
        mine = ins.call(aten.slice.Tensor, (buf, 0, start, start + grad.owned.param.numel()), engine=ps.name,
                        why=f"{grad.owned.qualname}'s sum over the window's earlier micro-steps")
        grad.node = ins.call(aten.add.Tensor, (mine, _scaled(ins, grad, ps, scale)), engine=ps.name,
                             why=f"the window's gradient of {grad.owned.qualname}, reduced once at the boundary")


@pass_contract(requires={"grads", "buckets"}, provides={"flat partial sums"})
def local_accumulate(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    flat = {ps: mode for ps, mode in ctx.modes.items() if not any(g.presharded for g in ps.groups)}
    if not flat:
        return gm
    for ps, mode in flat.items():
        groups = sorted({grad.owned.group for grad in ctx.grads if grad.owned.param_set is ps})
        if not groups:
            continue
        ctx.partial_grads[ps] = [grad.owned for grad in ctx.grads if grad.owned.param_set is ps]
        device = ctx.grads_of(ps, groups[0])[0].node.meta["val"].device
        bufs = {}
        for g in groups:
            with ctx.fake_mode:
                val = torch.empty((ps.groups[g].numel,), dtype=ps.accum_dtype, device=device)
            bufs[g] = append_placeholder(gm, ctx, PASS, f"graphzero_local_{ps.name}_{g}", val, Slot.PARTIAL, ps, g,
                                         f"{ps.accum_dtype} local gradient sum of param group {g} (this window)")
        with ctx.fake_mode:
            val = torch.empty((), dtype=torch.float32, device=device)
        scale = append_placeholder(gm, ctx, PASS, f"graphzero_local_scale_{ps.name}", val, Slot.SCALE, ps, None,
                                   f"averaging factor, normally 1/(world {ps.world_size} x gas)")
        for g in groups:
            (_accumulate if mode is Mode.KEEP else _flush)(gm, ctx, ps, g, bufs[g], scale)
            ctx.count(ps, "local_accumulate", len(ctx.grads_of(ps, g)))
        if mode is Mode.KEEP:
            # nothing to reduce this micro-step
            dropped = [b for b in ctx.buckets if b.param_set is ps]
            ctx.buckets = [b for b in ctx.buckets if b.param_set is not ps]
            ctx.count(ps, "buckets", -len(dropped))
    gm.graph.lint()
    gm.recompile()
    return gm
