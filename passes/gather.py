"""schedule_gathers: each ZeRO-3 parameter gather as late as it can be, one gather ahead.

Runs on the forward graph, and on the backward graph (where the release pass made the partitioner
recompute the gathers). Finds the gathers the release pass tagged, orders them by the first use of
the gathered parameter, and moves:

- each ``wait_tensor`` (with the views of the gathered tensor) down to just before that first
  use, so the collective is in flight during the compute before it;
- each ``all_gather_into_tensor`` up to just before the previous gather's first use (prefetch depth
  one), so at most two gathered parameters per engine are in flight or waiting at any point, not
  the whole model.

Inserts nothing. Records per engine the gathers (``all_gather_fwd`` / ``all_gather_bwd``), their
bytes, and per graph the peak bytes of gathered parameters alive at once (``gathered_peak_bytes``).
Bucketing several parameters into one collective is not done yet (one collective per parameter).
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import PassContext

PASS = "schedule_gathers"
c10d = torch.ops._c10d_functional


def _tagged_gathers(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default
            and n.meta.get("graphzero", {}).get("pass") == "release"]


def _chain(gather: fx.Node) -> list[fx.Node]:
    """The gather's wait and the views of the gathered tensor, in graph order."""
    out, frontier = [], list(gather.users)
    while frontier:
        n = frontier.pop()
        if n not in out and n.meta.get("graphzero", {}).get("pass") == "release":
            out.append(n)
            frontier.extend(n.users)
    return out


def _schedule(gm: fx.GraphModule, side: str, ctx: PassContext) -> fx.GraphModule:
    gathers = _tagged_gathers(gm)
    if not gathers:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    plan = []
    for g in gathers:
        chain = sorted(_chain(g), key=order.__getitem__)
        users = [u for n in chain for u in n.users if u not in chain]
        if not users:
            continue
        plan.append((min(order[u] for u in users), g, chain, min(users, key=order.__getitem__)))
    plan.sort(key=lambda t: t[0])
    previous_wait = None   # the first gather stays where it was traced (the top of the graph)
    for _, g, chain, first_use in plan:
        for n in chain:
            first_use.prepend(n)
        if previous_wait is not None:
            previous_wait.prepend(g)   # issued before the previous gather is waited for
        previous_wait = chain[0]
    gm.graph.lint()
    gm.recompile()
    _record(gm, side, ctx, [g for _, g, _, _ in plan])
    return gm


def _record(gm: fx.GraphModule, side: str, ctx: PassContext, gathers: list[fx.Node]) -> None:
    by_engine = {}
    for ps in ctx.ownership.param_sets:
        by_engine[ps.name] = ps
    live, peak = 0, 0
    sizes, last_use = {}, {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for g in gathers:
        val = g.meta["val"]
        sizes[g] = val.numel() * val.element_size()
        chain = _chain(g)
        users = [u for n in chain for u in n.users if u not in chain]
        last_use[g] = max([order[u] for u in users] + [order[n] for n in chain])
        ps = by_engine.get(g.meta["graphzero"]["engine"])
        if ps is not None:
            ctx.count(ps, f"all_gather_{side}")
            ctx.count(ps, f"all_gather_bytes_{side}", sizes[g])
    ends = {}
    for g in gathers:
        ends.setdefault(last_use[g], []).append(g)
    starts = {order[g]: g for g in gathers}
    for i, n in enumerate(gm.graph.nodes):
        if i in starts:
            live += sizes[starts[i]]
            peak = max(peak, live)
        for g in ends.get(i, ()):
            live -= sizes[g]
    for ps in ctx.ownership.param_sets:
        if any(g.meta["graphzero"]["engine"] == ps.name for g in gathers):
            key = f"gathered_peak_bytes_{side}"
            ctx.stats[ps][key] = max(ctx.stats[ps].get(key, 0), peak)


def schedule_gathers_forward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return _schedule(gm, "fwd", ctx)


def schedule_gathers_backward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return _schedule(gm, "bwd", ctx)
