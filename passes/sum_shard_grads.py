"""sum_shard_grads: a ZeRO-3 parameter used several times in one graph is reduce-scattered once.

A parameter gathered more than once in the graph (a GAN's discriminator called twice) gets one
reduce-scatter per gather. The reduce-scatter is linear, so reduce the sum instead, as DeepSpeed
reduces the accumulated ``.grad`` once:
``add(wait(rs(a)), wait(rs(b)))`` -> ``wait(rs(a + b))``. Calls in different graphs of one backward
are summed by hold_shard_grads instead.
"""
from __future__ import annotations

import torch
from torch import fx

from ._graph import Inserter, PassContext, last_in_order
from .contract import pass_contract

PASS = "sum_shard_grads"
c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _is_lone_reduce(node: object) -> bool:
    """``wait_tensor(reduce_scatter_tensor(x))`` with no other user of either."""
    if not isinstance(node, fx.Node) or node.target is not c10d.wait_tensor.default or len(node.users) != 1:
        return False
    rs = node.args[0]
    return rs.target is c10d.reduce_scatter_tensor.default and len(rs.users) == 1


@pass_contract(provides={"one reduce-scatter per shard grad"}, invalidates={"grads"})
def sum_shard_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
                continue
            a, b = node.args
            if not (_is_lone_reduce(a) and _is_lone_reduce(b)) or a is b:
                continue
            rs_a, rs_b = a.args[0], b.args[0]
            x, y = rs_a.args[0], rs_b.args[0]
            if rs_a.args[1:] != rs_b.args[1:] or x.meta["val"].shape != y.meta["val"].shape \
                    or x.meta["val"].dtype != y.meta["val"].dtype:
                continue
            engine = node.meta.get("graphzero", {}).get("engine", "")
            ins = Inserter(gm, ctx, PASS, after=last_in_order(gm, [x, y]))
            total = ins.call(aten.add.Tensor, (x, y), engine=engine,
                             why="sum a parameter's full gradients over its calls, then reduce-scatter once")
            rs = ins.call(c10d.reduce_scatter_tensor.default, (total, *rs_a.args[1:]), engine=engine,
                          why="one reduce-scatter of the summed gradient")
            wait = ins.call(c10d.wait_tensor.default, (rs,), engine=engine, why="wait for it")
            node.replace_all_uses_with(wait)
            for dead in (node, a, b, rs_a, rs_b):
                gm.graph.erase_node(dead)
            changed = True
    gm.graph.lint()
    gm.recompile()
    return gm
