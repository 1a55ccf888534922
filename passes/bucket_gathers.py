"""bucket_gathers: one all-gather per bucket of ZeRO-3 parameters instead of one per parameter.

Runs on the forward and backward graphs, after schedule_gathers (gathers ordered by first use). It
groups consecutive gathers of one engine (same process group and dtype) into buckets of at most
``ParamSet.gather_bucket_numel`` gathered elements, and for every bucket of two or more inserts

  ``aten.cat`` of the shards -> ``all_gather_into_tensor`` -> ``wait_tensor`` ->
  ``graphzero.split_gathered`` (an opaque op, so inductor cannot fuse two buckets' copies)

replacing the per-parameter gathers. A flat concatenation rather than
``all_gather_into_tensor_coalesced``: the flat one measured faster on gloo/CPU (one collective).

Placement (prefetch depth one, across engines; an engine with ``gather_ahead`` off issues each
bucket just before its wait): bucket k's collective is issued just before bucket k-1's wait, its
wait and unpacking just before the first use of its first member. Live gathered bytes are thus
bounded by two buckets plus one bucket's unpacking copy; inductor keeps this order because graphs
with gathers skip its peak-memory reordering (inductor_config.py).

Records per engine ``all_gather_{fwd,bwd}``, ``all_gather_bytes_{fwd,bwd}``,
``gather_buckets_{fwd,bwd}`` and ``gathered_peak_bytes_{fwd,bwd}``; and the bucket plan in
``ctx.zero3_plan`` (compared across ranks, rank_agreement.py).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from ..shard_gather import split_gathered
from ._graph import Inserter, PassContext
from .contract import pass_contract
from .gather import chain_of, tagged_gathers

PASS = "bucket_gathers"
c10d = torch.ops._c10d_functional
aten = torch.ops.aten
SPLIT = split_gathered._opoverload


@dataclasses.dataclass
class _Member:
    gather: fx.Node
    wait: fx.Node
    shard: fx.Node
    engine: str
    param: str

    @property
    def shard_numel(self) -> int:
        return self.shard.meta["val"].numel()


def _members(gm: fx.GraphModule) -> list[_Member]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for g in tagged_gathers(gm):
        waits = [u for u in g.users if u.target is c10d.wait_tensor.default]
        if len(waits) != 1:
            continue
        tag = g.meta["graphzero"]
        out.append(_Member(g, waits[0], g.args[0], tag["engine"], tag.get("param", "?")))
    return sorted(out, key=lambda m: order[m.wait])


def _plan(ctx: PassContext, members: list[_Member]) -> list[list[_Member]]:
    """Consecutive (by first use) members of one engine and group, up to the bucket size."""
    by_name = {ps.name: ps for ps in ctx.ownership.param_sets}
    buckets: list[list[_Member]] = []
    open_bucket: dict[tuple, list[_Member]] = {}
    for m in members:
        ps = by_name[m.engine]
        world, group_name = m.gather.args[1], m.gather.args[2]
        limit = ctx.bucket_size or ps.gather_bucket_numel or ps.bucket_numel
        key = (m.engine, group_name, world, m.shard.meta["val"].dtype)
        current = open_bucket.get(key)
        if current is not None and world * (sum(x.shard_numel for x in current) + m.shard_numel) <= limit:
            current.append(m)
            continue
        open_bucket[key] = [m]
        buckets.append(open_bucket[key])
    return buckets


def _merge(gm: fx.GraphModule, ctx: PassContext, b: int, bucket: list[_Member], issue_before: fx.Node) -> fx.Node:
    """Replace the bucket's gathers by one; return the new wait."""
    first = bucket[0]
    world, group_name = first.gather.args[1], first.gather.args[2]
    engine, names = first.engine, ", ".join(m.param for m in bucket)
    ins = Inserter(gm, ctx, PASS, after=issue_before.prev)
    flat = ins.call(aten.cat.default, ([m.shard for m in bucket],), engine=engine,
                    why=f"shards of gather bucket {b}: {names}")
    coll = ins.call(c10d.all_gather_into_tensor.default, (flat, world, group_name), engine=engine,
                    why=f"all-gather bucket {b} ({len(bucket)} parameters, {world} ranks)")
    ins.cursor = first.wait.prev
    wait = ins.call(c10d.wait_tensor.default, (coll,), engine=engine, why=f"wait for gather bucket {b}")
    split = ins.call(SPLIT, (wait, world, [m.shard_numel for m in bucket]), engine=engine,
                     why=f"bucket {b}'s rows split into its parameters, each contiguous")
    for i, m in enumerate(bucket):
        full = ins.call(operator.getitem, (split, i), engine=engine, why=f"{m.param} gathered")
        m.wait.replace_all_uses_with(full)
        gm.graph.erase_node(m.wait)
        gm.graph.erase_node(m.gather)
    return wait


def _bucket(gm: fx.GraphModule, ctx: PassContext, side: str) -> fx.GraphModule:
    members = _members(gm)
    if not members:
        return gm
    buckets = _plan(ctx, members)
    previous_wait: fx.Node | None = None
    collectives = []
    by_name = {ps.name: ps for ps in ctx.ownership.param_sets}
    for b, bucket in enumerate(buckets):
        first = bucket[0]
        # Issue before the previous bucket (of any engine) is waited for (prefetch depth one); the
        # first bucket stays where its first gather was. An engine that prefetches nothing issues
        # each bucket just before its own wait.
        issue_before = previous_wait or first.gather
        if not by_name[first.engine].gather_ahead:
            issue_before = first.wait
        if len(bucket) == 1:
            if issue_before is not first.gather:
                issue_before.prepend(first.gather)
            wait = first.wait
            coll = first.gather
        else:
            wait = _merge(gm, ctx, b, bucket, issue_before)
            coll = wait.args[0]
        previous_wait = wait
        collectives.append((coll, bucket))
        ctx.zero3_plan.append((side, first.engine, coll.args[2], coll.args[1],
                                tuple((m.param, m.shard_numel) for m in bucket)))
    gm.graph.lint()
    gm.recompile()
    _record(gm, ctx, side, collectives)
    return gm


def _record(gm: fx.GraphModule, ctx: PassContext, side: str, collectives: list) -> None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {ps.name: ps for ps in ctx.ownership.param_sets}
    events: list[tuple[int, int]] = []
    for coll, bucket in collectives:
        val = coll.meta["val"]
        nbytes = val.numel() * val.element_size()
        ps = by_name[bucket[0].engine]
        ctx.count(ps, f"all_gather_{side}")
        ctx.count(ps, f"all_gather_bytes_{side}", nbytes)
        ctx.count(ps, f"gather_params_{side}", len(bucket))
        # live from the collective to the last use of anything derived from it
        derived = chain_of(coll, lambda n: n.meta.get("graphzero", {}).get("pass") in ("release", PASS))
        ends = [order[u] for n in [coll, *derived] for u in n.users] or [order[coll]]
        events += [(order[coll], nbytes), (max(ends) + 1, -nbytes)]
    live = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1] > 0)):
        live += delta
        peak = max(peak, live)
    key = f"gathered_peak_bytes_{side}"
    for ps in {by_name[b[0].engine] for _, b in collectives}:
        ctx.stats[ps][key] = max(ctx.stats[ps].get(key, 0), peak)


@pass_contract(requires={"gather waits at first use"}, provides={"gathers bucketed"})
def bucket_gathers_forward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return _bucket(gm, ctx, "fwd")


@pass_contract(requires={"gather waits at first use"}, provides={"gathers bucketed"})
def bucket_gathers_backward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return _bucket(gm, ctx, "bwd")
