"""schedule_overlap: let collectives run while the rest of backward computes.

With ``overlap`` on, moves every ``wait_tensor`` graphzero inserted down to just before its first
user, so the collective is in flight during the remaining backward compute. Inserts nothing.
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import PassContext
from .contract import pass_contract


@pass_contract(requires={"reduced", "accumulated"}, provides={"waits scheduled"}, optional=True)
def schedule_overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.overlap:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    waits = [n for n in gm.graph.nodes
             if n.target is torch.ops._c10d_functional.wait_tensor.default and "graphzero" in n.meta]
    for wait in waits:
        # The wait moves together with what graphzero chained onto it alone (the slice that keeps
        # this rank's chunk of an all-reduce), or nothing would move.
        chain = [wait]
        while len(chain[-1].users) == 1:
            (user,) = chain[-1].users
            if user.meta.get("graphzero", {}).get("pass") != "insert_reduce_scatter":
                break
            chain.append(user)
        first_user = min(chain[-1].users, key=order.__getitem__)
        for node in chain:
            first_user.prepend(node)
    gm.graph.lint()
    gm.recompile()
    return gm
