"""fold_norm: the squared gradient norm of each param group's final shard, in the backward.

For an engine whose step reads a folded norm (``ctx.folds_norm``) and every param group of which
(ZeRO-3: every parameter) this backward accumulates into, it appends a ``(num_groups,)`` fp32
placeholder (kind ``"norm"``) and per group inserts: per parameter piece of this rank's shard ->
fp64 -> sum of squares; summed -> fp32, copied into the buffer. That is DeepSpeed's
``get_grad_norm_direct`` within an fp64 rounding. Pieces: ZeRO-1/2, slices of the accumulated
shard without padding; ZeRO-3, each parameter's whole partition (its padding holds zeros). The sum
over ranks follows the backward (runtime/norm.py). An engine with a group this graph does not
write gets nothing: step() computes its norm.
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import Inserter, Mode, PassContext, Slot, append_placeholder, output_node
from .contract import pass_contract

PASS = "fold_norm"
aten = torch.ops.aten
prims = torch.ops.prims


def _pieces(group, world: int, rank: int) -> list[tuple[int, int]]:
    """Shard-relative ranges of each parameter's piece in this rank's shard, in group order."""
    shard = group.shard_numel(world)
    lo = rank * shard if group.sharded else 0
    out = []
    for offset, p in zip(group.offsets, group.params):
        a, z = max(offset, lo), min(offset + p.numel(), lo + shard)
        if a < z:
            out.append((a - lo, z - lo))
    return out


def _sources(ctx: PassContext, ps) -> list | None:
    """Per group, what its final shard is made of in this graph, or None if this graph does not
    write all of some group: the accumulated shard node (ZeRO-1/2) or the per-parameter pieces (ZeRO-3)."""
    out = []
    for g, group in enumerate(ps.groups):
        if group.presharded:
            source = ctx.accumulated_pieces.get((ps, g))
        else:
            source = ctx.accumulated.get((ps, g)) if group.sharded else None
        if source is None:
            return None
        out.append(source)
    return out


@pass_contract(requires={"accumulated"}, provides={"norm folded"})
def fold_norm(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for ps in ctx.ownership.param_sets:
        if ps not in ctx.folds_norm or (ctx.modes.get(ps) is Mode.KEEP and not any(g.presharded for g in ps.groups)):
            continue
        sources = _sources(ctx, ps)
        if sources is None:
            continue
        first = sources[0][0] if isinstance(sources[0], list) else sources[0]
        device = first.meta["val"].device
        with ctx.fake_mode:
            val = torch.empty((len(ps.groups),), dtype=torch.float32, device=device)
        buf = append_placeholder(gm, ctx, PASS, f"graphzero_norm_{ps.name}", val, Slot.NORM, ps, None,
                                 f"squared gradient norm of each of {len(ps.groups)} param group shard(s)")
        ins = Inserter(gm, ctx, PASS, after=output_node(gm).prev)
        squares = []
        for g, source in enumerate(sources):
            norms = []
            if isinstance(source, list):
                # ZeRO-3: squared where each piece is written, so that only a scalar outlives it (a
                # piece kept to the end of the backward would hold this rank's whole shard)
                pieces = [(Inserter(gm, ctx, PASS, after=piece), piece) for piece in source]
            else:
                pieces = [(ins, ins.call(aten.slice.Tensor, (source, 0, a, z), engine=ps.name, why=f"group {g} piece"))
                          for a, z in _pieces(ps.groups[g], ps.world_size, ps.rank)]
            for at, piece in pieces:
                piece = at.call(prims.convert_element_type.default, (piece, torch.float64), engine=ps.name,
                                why="DeepSpeed norms each piece in fp64")
                sq = at.call(aten.mul.Tensor, (piece, piece), engine=ps.name, why="squares")
                # the square of the piece's fp64 2-norm (inductor lowers the norm itself to this sum)
                norms.append(at.call(aten.sum.default, (sq,), engine=ps.name,
                                     why=f"squared 2-norm of a parameter's piece of group {g}"))
            # the sums go after every square (a ZeRO-3 piece may be the graph's last node: ``ins``'s
            # cursor, which the squares were inserted after)
            ins.cursor = output_node(gm).prev
            if not norms:
                squares.append(ins.zeros(1, torch.float32, device, engine=ps.name, why=f"group {g}: no piece"))
                continue
            total_sq = norms[0]
            for n in norms[1:]:
                total_sq = ins.call(aten.add.Tensor, (total_sq, n), engine=ps.name, why=f"group {g} sum")
            total_sq = ins.call(prims.convert_element_type.default, (total_sq, torch.float32),
                                engine=ps.name, why="DeepSpeed reduces the squares in fp32")
            squares.append(ins.call(aten.reshape.default, (total_sq, [1]), engine=ps.name, why=f"group {g}"))
        cat = squares[0] if len(squares) == 1 else ins.call(aten.cat.default, (squares,), engine=ps.name,
                                                            why="one scalar per param group")
        ins.call(aten.copy_.default, (buf, cat), engine=ps.name, why="the squares step() reads")
        ctx.count(ps, "fold_norm", len(ps.groups))
    gm.graph.lint()
    gm.recompile()
    return gm
