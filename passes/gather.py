"""schedule_gathers: each ZeRO-3 parameter's gathered tensor waited for just before its first use.

Runs on the forward and backward graphs. Moves the ``wait_tensor`` of each gather the release pass
tagged (with the views of the gathered tensor) down to just before the parameter's first use, so
the collective is in flight during the compute before it. Inserts nothing; bucket_gathers (next)
relies on the waits sitting at first use, in first-use order.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from ._graph import PassContext
from .contract import pass_contract

PASS = "schedule_gathers"
c10d = torch.ops._c10d_functional


def _released(n: fx.Node) -> bool:
    return n.meta.get("graphzero", {}).get("pass") == "release"


def tagged_gathers(gm: fx.GraphModule) -> list[fx.Node]:
    """The ZeRO-3 parameter gathers (tagged by the release pass), in graph order."""
    return [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default and _released(n)]


def chain_of(node: fx.Node, keep: Callable[[fx.Node], bool] = _released) -> list[fx.Node]:
    """The transitive users of ``node`` that ``keep`` accepts (its wait and the views of the
    gathered tensor), without the first user outside that chain."""
    out, frontier = [], list(node.users)
    while frontier:
        n = frontier.pop()
        if n not in out and keep(n):
            out.append(n)
            frontier.extend(n.users)
    return out


def _schedule(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for g in tagged_gathers(gm):
        chain = sorted(chain_of(g), key=order.__getitem__)
        users = [u for n in chain for u in n.users if u not in chain]
        if not users:
            continue
        first_use = min(users, key=order.__getitem__)
        for n in chain:
            first_use.prepend(n)
    gm.graph.lint()
    gm.recompile()
    return gm


@pass_contract(requires={"gathers tagged"}, provides={"gather waits at first use"})
def schedule_gathers_forward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return _schedule(gm, ctx)


@pass_contract(requires={"gathers tagged"}, provides={"gather waits at first use"})
def schedule_gathers_backward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return _schedule(gm, ctx)
