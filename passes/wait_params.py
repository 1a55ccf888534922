"""wait_params: every read of an owned ZeRO-1/2 parameter waits for its deferred all-gather.

Runs on the forward graph. With ``defer_param_gather`` the lean step leaves the parameters'
all-gather in flight; ``wait_tensor`` on any parameter viewing the flat buffer waits for it.
For each owned, unsharded parameter input the graph reads, this pass inserts one
``wait_tensor(param)`` before its first use and routes every other use through the wait's result
(a data dependency no compiler can reorder). Waits already traced from the adapter's module hooks
are folded into this one. Records per engine ``param_waits``. Graph outputs keep the parameter
itself: backward runs after this forward has waited.
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import Inserter, PassContext
from .contract import pass_contract

PASS = "wait_params"
c10d = torch.ops._c10d_functional


def _owned_params(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[fx.Node, object]]:
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        idx = getattr(node.meta.get("desc"), "idx", None)
        owned = ctx.ownership.inputs.get(idx) if isinstance(idx, int) else None
        if owned is not None and not owned.shard:
            out.append((node, owned))
    return out


@pass_contract(provides={"param waits"})
def wait_params(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for param, owned in _owned_params(gm, ctx):
        for old in [u for u in param.users if u.target is c10d.wait_tensor.default]:
            old.replace_all_uses_with(param)
            gm.graph.erase_node(old)
        uses = [u for u in param.users if u.op != "output"]
        if not uses:
            continue
        first = min(uses, key=order.__getitem__)
        wait = Inserter(gm, ctx, PASS, first.prev).call(
            c10d.wait_tensor.default, (param,), engine=owned.param_set.name,
            why=f"{owned.qualname}: its all-gather may still be in flight from the last optimizer step")
        for use in uses:
            use.replace_input_with(param, wait)
        ctx.count(owned.param_set, "param_waits")
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
