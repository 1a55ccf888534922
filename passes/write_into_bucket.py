"""write_into_bucket: matmul gradients computed straight into their bucket (DDP's
``gradient_as_bucket_view``, at compile time).

Inductor on CPU copies every input of a ZeRO-1/2 bucket's ``cat`` into its buffer unless it can be
laid out there, which a matmul's fixed-layout output cannot: a write and a read of the whole bucket
per backward (about 5 ms of a 60 ms gan backward on the 2-core CPU machine, docs/benchmarks.md,
seventh pass).

For every bucket ``cat`` with pieces that are the flattened result of a matmul nothing else reads
(``mm``, or ``mm + mm`` for a parameter used twice), it inserts ``aten.empty`` (the bucket) before
the first such matmul; ``aten.addmm_(<the piece's slice, viewed to the matmul's shape>, a, b,
beta=0)`` in place of each matmul (``beta=1`` for the second ``mm``; ``beta=0`` never reads the
uninitialised bucket); and where the ``cat`` stood, ``aten.copy_`` of the other pieces and an
``aten.alias`` of the bucket that replaces the ``cat``. It runs last, after lower_reduce_scatter
has sliced the ``cat``: the slices read the bucket as written.
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import Inserter, PassContext
from .contract import pass_contract

PASS = "write_into_bucket"
aten = torch.ops.aten
_FLATTEN = (aten.reshape.default, aten.view.default)


def _single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def _flattened(pieces: list[fx.Node], i: int) -> tuple[fx.Node, int] | None:
    """``(flat, n)`` when pieces ``i .. i+n-1`` are together the whole of ``flat``, a flattening
    view read by nothing else: ``flat`` itself, or its consecutive slices in order (a parameter
    that straddles two shards lies in two chunks of the bucket, side by side)."""
    piece = pieces[i]
    if piece.op != "call_function":
        return None
    if piece.target in _FLATTEN:
        return (piece, 1) if _single_user(piece) else None
    if piece.target is not aten.slice.Tensor:
        return None
    flat = piece.args[0]
    if not isinstance(flat, fx.Node) or flat.target not in _FLATTEN:
        return None
    numel, cursor, n = flat.meta["val"].numel(), 0, 0
    while cursor < numel and i + n < len(pieces):
        nxt = pieces[i + n]
        if nxt.target is not aten.slice.Tensor or nxt.args[0] is not flat or nxt.args[1:3] != (0, cursor):
            return None
        cursor, n = nxt.args[3], n + 1
    return (flat, n) if cursor == numel and len(flat.users) == n else None


def _matmuls(flat: fx.Node, order: dict[fx.Node, int]) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(result, [mm, ...])`` when ``flat`` flattens ``result``, a matmul (or the sum of two, in
    graph ``order``) that only ``flat`` reads; None otherwise."""
    result = flat.args[0]
    if not isinstance(result, fx.Node) or not _single_user(result):
        return None
    if result.target is aten.mm.default:
        mms = [result]
    elif (result.target is aten.add.Tensor and not result.kwargs and len(result.args) == 2
          and all(isinstance(x, fx.Node) and x.target is aten.mm.default and _single_user(x) for x in result.args)):
        mms = sorted(result.args, key=order.__getitem__)
    else:
        return None
    val = result.meta["val"]
    if val.dim() != 2 or not val.is_contiguous() or val.dtype != flat.meta["val"].dtype:
        return None
    return result, mms


def _write_into(gm: fx.GraphModule, ctx: PassContext, cat: fx.Node) -> bool:
    pieces = list(cat.args[0])
    offsets, cursor = [], 0
    for piece in pieces:
        offsets.append(cursor)
        cursor += piece.meta["val"].numel()
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    # first piece -> (flattening view, pieces it spans, matmul result, its mm nodes)
    matched: dict[int, tuple[fx.Node, int, fx.Node, list[fx.Node]]] = {}
    i = 0
    while i < len(pieces):
        run = _flattened(pieces, i)
        found = _matmuls(run[0], order) if run is not None else None
        if run is not None and found is not None:
            matched[i] = (run[0], run[1], *found)
        i += run[1] if run is not None else 1
    if not matched:
        return False
    engine = cat.meta["graphzero"]["engine"]
    val = cat.meta["val"]
    first = min((mms[0] for *_, mms in matched.values()), key=order.__getitem__)
    ins = Inserter(gm, ctx, PASS, after=first.prev)
    bucket = ins.call(aten.empty.memory_format, ([val.numel()],),
                      {"dtype": val.dtype, "device": val.device, "pin_memory": False},
                      engine=engine, why=f"{cat.meta['graphzero']['why']}, written in place")

    def slice_of(at: Inserter, i: int, numel: int) -> fx.Node:
        return at.call(aten.slice.Tensor, (bucket, 0, offsets[i], offsets[i] + numel), engine=engine,
                       why=f"piece {i} of the bucket")

    covered = set()
    for i, (flat, n, result, mms) in matched.items():
        covered.update(range(i, i + n))
        at = Inserter(gm, ctx, PASS, after=mms[0].prev)
        out = at.call(aten.view.default, (slice_of(at, i, flat.meta["val"].numel()), list(result.meta["val"].shape)),
                      engine=engine, why=f"piece {i} of the bucket, as the matmul's result")
        for k, mm in enumerate(mms):
            if k:
                at = Inserter(gm, ctx, PASS, after=mm.prev)
            at.call(aten.addmm_.default, (out, *mm.args), {"beta": 1 if k else 0}, engine=engine,
                    why="the gradient's matmul, written into the bucket" + (" (added)" if k else ""))
    at = Inserter(gm, ctx, PASS, after=cat)
    for i, piece in enumerate(pieces):
        if i not in covered:
            at.call(aten.copy_.default, (slice_of(at, i, piece.meta["val"].numel()), piece), engine=engine,
                    why=f"piece {i} into the bucket")
    written = at.call(aten.alias.default, (bucket,), engine=engine, why="the bucket as written")
    cat.replace_all_uses_with(written)
    gm.graph.erase_node(cat)
    for i, (flat, n, result, mms) in matched.items():
        for piece in pieces[i:i + n]:
            if piece is not flat:
                gm.graph.erase_node(piece)
        gm.graph.erase_node(flat)
        gm.graph.erase_node(result)
        for mm in mms:
            if mm is not result:
                gm.graph.erase_node(mm)
    return True


@pass_contract(requires={"bucket cats", "owned grads out of outputs"},
               invalidates={"grads", "bucket cats"}, optional=True)
def write_into_bucket(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    cats = [n for n in gm.graph.find_nodes(op="call_function", target=aten.cat.default)
            if n.meta.get("graphzero", {}).get("pass") == "insert_reduce_scatter"]
    changed = False
    for cat in cats:
        changed |= _write_into(gm, ctx, cat)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm

