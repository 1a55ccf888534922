"""release: gathered ZeRO-3 parameters are not saved for backward; backward gathers them again.

Runs on AOT autograd's JOINT graph. Every all-gather of an owned or frozen ZeRO-3 shard of an
engine, its ``wait_tensor`` and the views derived from it get ``meta["recompute"] =
MUST_RECOMPUTE``: the min-cut partitioner then saves the shard and recomputes the gather in the
backward (collectives are otherwise always saved). Not tagged, as DeepSpeed keeps them gathered:
persistent parameters (``FlatGroup.persistent``), and those whose next use is within
``ParamSet.reuse_distance`` (the larger of ``stage3_max_reuse_distance``, which
``__params_to_release`` scans, and ``stage3_prefetch_bucket_size``, whose prefetch marks parameters
needed again). Between forward and backward use the engine fetches every later parameter twice,
so one is kept when twice the elements gathered after it are below that distance: at DeepSpeed's
defaults an engine under 500M parameters stays gathered, as in eager. Each tagged node also gets
``meta["graphzero"]``, which the partitioner copies into both graphs. Inserts nothing.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ._graph import PassContext
from .contract import pass_contract

PASS = "release"
c10d = torch.ops._c10d_functional


def _gathered_shards(ctx: PassContext, gm: fx.GraphModule) -> dict[fx.Node, tuple]:
    """Primal shard -> (param set, qualified name, persistent, owned): the owned ZeRO-3 shards, and
    the frozen ones (``Ownership.frozen``) of the same engines, gathered but given no gradient."""
    primals = [n for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
    out = {}
    for i, node in enumerate(primals):
        owned = ctx.ownership.inputs.get(i)
        if owned is not None and owned.shard:
            group = owned.param_set.groups[owned.group]
            persistent = bool(group.persistent) and group.persistent[owned.position]
            out[node] = (owned.param_set, owned.qualname, persistent, True)
        elif i in ctx.ownership.frozen:
            ps, name, persistent = ctx.ownership.frozen[i]
            out[node] = (ps, f"{ps.name}.{name}", persistent, False)
    return out


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _kept_within_reuse_distance(gathers: list[tuple[fx.Node, tuple]]) -> set[fx.Node]:
    """The gathers (in forward order) whose parameter DeepSpeed would keep for its backward use:
    twice the elements its engine gathers after it are below the engine's reuse distance."""
    kept, after = set(), {}
    for node, (ps, *_rest) in reversed(gathers):
        if 2 * after.get(ps, 0) < ps.reuse_distance:
            kept.add(node)
        after[ps] = after.get(ps, 0) + node.meta["val"].numel()
    return kept


@pass_contract(provides={"gathers tagged"})
def release(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    shards = _gathered_shards(ctx, gm)
    gathers = [(n, shards[n.args[0]]) for n in gm.graph.nodes
               if n.target is c10d.all_gather_into_tensor.default and n.args[0] in shards]
    kept = _kept_within_reuse_distance(gathers)
    for node, (ps, qualname, persistent, owned) in gathers:
        keep = persistent or node in kept
        chain, frontier = [node], list(node.users)
        while frontier:
            user = frontier.pop()
            if user in chain:
                continue
            if user.target is c10d.wait_tensor.default or _is_view(user):
                chain.append(user)
                frontier.extend(user.users)
        # A parameter DeepSpeed keeps gathered is saved for backward.
        why = "kept for backward (persistent, or used again within DeepSpeed's look-ahead)" if keep \
            else "recomputed in backward, not saved"
        for n in chain:
            if not keep:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["graphzero"] = {"pass": PASS, "engine": ps.name, "param": qualname,
                                   "why": f"gather of {qualname}: {why}"}
        ctx.count(ps, "gathered_params" if owned else "gathered_frozen_params")
    return gm
