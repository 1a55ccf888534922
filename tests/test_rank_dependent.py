"""Rank-dependent graphs train exactly, as under DDP's ``find_unused_parameters`` and DeepSpeed
eager at ZeRO-1/2: each rank training its own task head, a graph break on one rank only (a
``.item()`` logged on rank 0), a step one rank runs eagerly, ZeRO-1 windows whose micro-steps differ
per rank. Where the ranks' plans differ the backward keeps every gradient locally and its end
reduces the union once per engine (runtime/scope.py); checked against the single-process reference
(the mean over ranks of each rank's loss) over 3 optimizer steps, gradients and norms.

What cannot go on without collectives stays a RankDisagreementError on every rank, never a hang:
ZeRO-3 parameters gathered differently per rank (a hang under DeepSpeed eager and FSDP2), and ranks
reaching different engines (tests/test_rank_faults.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from scenario_utils import (
    GRAD_TOL,
    Reference,
    assert_grads_close,
    check_gan_step,
    data,
    ds_config,
    engine,
    full_grads,
    gan_engines,
    gan_loss,
    mlp,
    rank_world,
)

NORM_TOL = {"rtol": 1e-4, "atol": 1e-6}
STEPS = 3


class Heads(nn.ModuleList):
    """One head per task; each rank trains its own task."""

    def forward(self, h: torch.Tensor, task: int) -> torch.Tensor:
        return self[task](torch.relu(h))


class TaskHeads(nn.Module):
    """A small shared trunk and three wide heads (the third a task no rank trains now). Sized so
    that the ranks' gradients land in different ranges of the flat shards: different bucket plans.
    (Where the ranges coincide the ranks reduce one plan, the head a rank did not use as zeros:
    exact too, but not the path these tests are about.)"""

    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.trunk = mlp(8, 8, 8, depth=depth)
        self.heads = Heads(nn.Linear(8, 48) for _ in range(3))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads(self.trunk(x), task)


def heads_loss(models, x, task: int):
    return models["net"](x, task).square().mean()


def heads_loss_breaking_on_task0(models, x, task: int):
    """The same loss, with a graph break between trunk and head where the task is 0 (rank 0)."""
    net = models["net"].module if hasattr(models["net"], "module") else models["net"]
    h = net.trunk(x)
    if task == 0:
        torch._dynamo.graph_break()
    return net.heads(h, task).square().mean()


def task_of(rank: int, micro: int, gas: int, tasks: str) -> int:
    """per_rank: rank r trains head r. boundary_agrees (gas > 1): inside the window rank 0 trains
    head 0 and rank 1 head 2, and at the boundary both train head 2 (the boundary graphs agree,
    while the window's sums differ: its flush must still exchange on every rank)."""
    if tasks == "per_rank" or micro < gas - 1:
        return rank if tasks == "per_rank" else 2 * rank
    return 2


def apart(eng) -> int:
    """Backwards in which the ranks ran different graphs, as the engine's run-time state counts them."""
    from graphzero.deepspeed_adapter import binding_of
    return binding_of(eng).state.backwards_apart


def heads_scenario(stage: int, gas: int, tasks: str = "per_rank", breaking: bool = False) -> str:
    import graphzero
    rank, world = rank_world()
    torch.manual_seed(0)
    model = TaskHeads()
    ref = Reference({"net": model})
    eng = engine(model, ds_config(stage, gas=gas))
    loss_fn = heads_loss_breaking_on_task0 if breaking else heads_loss
    step = torch.compile(loss_fn, backend="graphzero", options={"engines": {"net": eng}, "inner": "eager"})
    try:
        for t in range(STEPS):
            for micro in range(gas):
                i = t * gas + micro
                step({"net": eng}, *data(i, rank, (4, 8)), task_of(rank, micro, gas, tasks)).backward()
                ref.accumulate(heads_loss, [[*data(i, r, (4, 8)), task_of(r, micro, gas, tasks)] for r in range(world)],
                               gas=gas)
                if micro < gas - 1:
                    eng.step()
            assert_grads_close(full_grads(eng), ref.grads("net"), **GRAD_TOL, what=f"rank {rank} step {t}")
            eng.step()
            ref.step()
            torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms["net"], **NORM_TOL)
    except graphzero.RankDisagreementError as err:
        dist.barrier()   # every rank got here: nothing is stuck in a collective
        return f"RankDisagreementError: {err}"
    return f"ok, {apart(eng)} apart"


@pytest.mark.parametrize("stage,gas,tasks,breaking,apart_per_step", [
    (1, 1, "per_rank", False, 1), (2, 1, "per_rank", False, 1), (1, 2, "per_rank", False, 2),
    (1, 2, "boundary_agrees", False, 1),   # only the window's first micro-step runs apart
    (2, 2, "per_rank", True, 2),           # rank 0 runs two graphs per micro-step, rank 1 one
])
def test_each_rank_trains_its_own_head(ranks, stage, gas, tasks, breaking, apart_per_step):
    out = ranks.run(heads_scenario, stage, gas, tasks, breaking, timeout=240)
    assert out == [f"ok, {STEPS * apart_per_step} apart"] * 2, out


def test_zero3_heads_gathered_per_rank_raise_on_every_rank(ranks):
    """At ZeRO-3 each rank would gather a different head: under DeepSpeed eager the two ranks' hooks
    join one all-gather with different parameters (a hang, or garbage where the shapes match);
    graphzero names it before any gather."""
    out = ranks.run(heads_scenario, 3, 1, timeout=240)
    assert all(o.startswith("RankDisagreementError") and "ranks disagree" in o for o in out), out


LOGGED: list[float] = []


def logged_gan_loss(models, z, real, rank: int):
    """The GAN loss, with a value logged on rank 0 only: a graph break there, one graph on rank 1."""
    fake = models["gen"](z)
    if rank == 0:
        LOGGED.append(fake.sum().item())
    return -models["disc"](fake).mean() + models["disc"](real).mean()


def gan_scenario(stage: int, kind: str) -> int:
    """kind: "log_on_rank0" (a graph break on rank 0 only), "eager_on_rank1" (rank 1 runs the step
    uncompiled: the safety net keeps its gradients once the ranks differ)."""
    rank, _ = rank_world()
    LOGGED.clear()
    engines, ref = gan_engines(stage)
    step = torch.compile(logged_gan_loss, backend="graphzero", options={"inner": "eager"})
    for t in range(STEPS):
        z, real = data(t, rank, (4, 8), (4, 8))
        if kind == "eager_on_rank1" and rank == 1:
            loss = gan_loss(engines, z, real)
        elif kind == "eager_on_rank1":
            loss = torch.compile(gan_loss, backend="graphzero", options={"inner": "eager"})(engines, z, real)
        else:
            loss = step(engines, z, real, rank)
        loss.backward()
        check_gan_step(engines, ref, t)
    return len(LOGGED), [apart(e) for e in engines.values()]


@pytest.mark.parametrize("kind", ["log_on_rank0", "eager_on_rank1"])
def test_ranks_running_different_graphs_train_exactly(ranks, kind):
    out = ranks.run(gan_scenario, 2, kind, timeout=240)
    assert all(backwards == [STEPS, STEPS] for _, backwards in out), out
    if kind == "log_on_rank0":
        assert [logged for logged, _ in out] == [STEPS, 0], out


def split_engines_scenario(inner: str, regather: bool) -> str:
    """A ZeRO-3 trunk engine (every parameter partitioned) and a ZeRO-2 heads engine with a head
    per rank. ``regather``: DeepSpeed's look-ahead set to nothing, so the trunk's backward gathers
    its weights again: collectives after the plans differ."""
    import graphzero
    rank, world = rank_world()
    torch.manual_seed(0)
    model = TaskHeads(depth=4)
    ref = Reference({"trunk": model.trunk, "heads": model.heads})
    cfg3 = ds_config(3)
    cfg3["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if regather:
        cfg3["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=1)
    engines = {"trunk": engine(model.trunk, cfg3), "heads": engine(model.heads, ds_config(2))}

    def loss_fn(models, x, task):
        return models["heads"](models["trunk"](x), task).square().mean()

    step = torch.compile(loss_fn, backend="graphzero", options={"engines": engines, "inner": inner})
    try:
        for t in range(STEPS):
            step(engines, *data(t, rank, (4, 8)), rank).backward()
            ref.accumulate(loss_fn, [[*data(t, r, (4, 8)), r] for r in range(world)])
            for name, eng in engines.items():
                assert_grads_close(full_grads(eng), ref.grads(name), **GRAD_TOL, what=f"rank {rank} step {t} {name}")
                eng.step()
            ref.step()
            for name, eng in engines.items():
                torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name], **NORM_TOL)
    except graphzero.RankDisagreementError as err:
        dist.barrier()
        return str(err)
    return f"ok, {apart(engines['trunk'])} apart"


def test_zero3_trunk_with_a_head_per_rank(ranks):
    assert ranks.run(split_engines_scenario, "inductor", False, timeout=240) == [f"ok, {STEPS} apart"] * 2


def test_zero3_gathers_after_plans_differ_raise_on_every_rank(ranks):
    messages = ranks.run(split_engines_scenario, "eager", True, timeout=240)
    assert all("ranks disagree" in m and "gathers ZeRO-3" in m for m in messages), messages
