"""release: gathered ZeRO-3 parameters are not saved for backward; backward gathers them again.

Runs on AOT autograd's JOINT graph, before the partitioner splits it. For every
``_c10d_functional.all_gather_into_tensor`` of an owned shard (a primal input that is a ZeRO-3
shard; or a frozen ZeRO-3 shard of the same engine, ``Ownership.frozen``: a LoRA base), it tags the
gather, its ``wait_tensor`` and every view derived from the gathered tensor
with ``meta["recompute"] = MUST_RECOMPUTE``: the min-cut partitioner then saves the (small) shard
instead of the full parameter and recomputes the gather in the backward graph (collectives are
otherwise always saved). Parameters the engine keeps gathered (``FlatGroup.persistent``: below
``stage3_param_persistence_threshold``) are not tagged for recomputation: their gathered value is
saved, and backward does not gather them again. Each tagged node also gets ``meta["graphzero"]``, which the partitioner
copies into both graphs, so later passes find the gathers on either side. Inserts nothing.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ._graph import PassContext

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


def release(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    shards = _gathered_shards(ctx, gm)
    for node in list(gm.graph.nodes):
        if node.target is not c10d.all_gather_into_tensor.default or node.args[0] not in shards:
            continue
        ps, qualname, persistent, owned = shards[node.args[0]]
        chain, frontier = [node], list(node.users)
        while frontier:
            user = frontier.pop()
            if user in chain:
                continue
            if user.target is c10d.wait_tensor.default or _is_view(user):
                chain.append(user)
                frontier.extend(user.users)
        # A persistent (small) parameter is saved for backward, as DeepSpeed keeps it gathered.
        for n in chain:
            if not persistent:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["graphzero"] = {"pass": PASS, "engine": ps.name, "param": qualname,
                                   "why": f"gather of {qualname}: recomputed in backward, not saved"}
        ctx.count(ps, "gathered_params" if owned else "gathered_frozen_params")
    return gm
