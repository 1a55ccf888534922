"""Graph breaks inside the step: each subgraph's backward reduces its own gradients into the right
engine, exactly once (a double reduction would double the gradients; a missed one would leave
them out), including an engine whose parameters are split across two graphs; and an engine that
two graphs of one backward reach reduces each parameter's sum once, as DeepSpeed eager does (the
graph whose backward runs first keeps its gradients local: graphzero/runtime/scope.py).
"""
from __future__ import annotations

import torch
from torch import nn

from graphzero_tools.bench_metrics import summarize_collectives
from scenario_utils import (
    ReductionCounter,
    Reference,
    assert_grads_close,
    assert_no_full_grads,
    assert_params_close,
    check_gan_step,
    compiled_graph_count,
    data,
    ds_config,
    engine,
    full_grads,
    gan_engines,
    gan_loss,
    mlp,
    rank_world,
)


class BreakInside(nn.Module):
    """A discriminator whose forward has a graph break between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(h)


def broken_gan_loss(models, z, real):
    fake = models["gen"](z)
    torch._dynamo.graph_break()
    return -models["disc"](fake).mean() + models["disc"](real).mean()


def graph_break_scenario(inner: str, steps: int = 2) -> dict:
    rank, world = rank_world()
    torch.manual_seed(5)
    G, D = mlp(8, 16, 8), BreakInside()
    ref = Reference({"gen": G, "disc": D})
    gen, disc = engine(G, ds_config(2)), engine(D, ds_config(1))
    counter = ReductionCounter(gen, disc)
    step = torch.compile(broken_gan_loss, backend="graphzero",
                         options={"engines": {"gen": gen, "disc": disc}, "inner": inner})
    for t in range(steps):
        z, real = data(t, rank, (4, 8), (4, 8))
        step({"gen": gen, "disc": disc}, z, real).backward()
        assert_no_full_grads(gen, disc)
        ref.accumulate(broken_gan_loss, [data(t, r, (4, 8), (4, 8)) for r in range(world)])
        assert_grads_close(full_grads(gen), ref.grads("gen"), rtol=1e-4, atol=1e-6, what=f"step {t} gen")
        assert_grads_close(full_grads(disc), ref.grads("disc"), rtol=1e-4, atol=1e-6, what=f"step {t} disc")
        gen.step()
        disc.step()
        ref.step()
        assert_params_close(gen, ref.models["gen"], rtol=1e-4, atol=1e-5, what=f"step {t} gen")
        assert_params_close(disc, ref.models["disc"], rtol=1e-4, atol=1e-5, what=f"step {t} disc")
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    graphs, breaks = compiled_graph_count(step, {"gen": gen, "disc": disc}, *data(0, rank, (4, 8), (4, 8)))
    return {"graphs": graphs, "breaks": breaks}


def test_graph_breaks_between_and_inside_engines(ranks):
    results = ranks.run(graph_break_scenario, "inductor")
    # gen | disc.first | disc.second (twice, around the break inside disc) | the loss tail
    assert all(r["graphs"] >= 3 and r["breaks"] >= 2 for r in results), results


def test_graph_breaks_eager_inner(ranks):
    ranks.run(graph_break_scenario, "eager")


def two_graph_gan_loss(models, z, real):
    """gan_loss with a graph break between the discriminator's two calls: two graphs reach it."""
    fake_score = models["disc"](models["gen"](z)).mean()
    torch._dynamo.graph_break()
    return -fake_score + models["disc"](real).mean()


def bytes_per_backward_scenario(stage: int, broken: bool) -> list:
    """The GAN at ``stage`` over 3 steps, checked against the reference (gradients, norms); the
    bytes each backward reduced (torch.profiler; reduce_scatter, so that a byte is a byte)."""
    rank, world = rank_world()
    engines, ref = gan_engines(stage)
    step = torch.compile(two_graph_gan_loss if broken else gan_loss, backend="graphzero",
                         options={"collective": "reduce_scatter"})
    reduced = []
    for t in range(3):
        out = step(engines, *data(t, rank, (4, 8), (4, 8)))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            out.backward()
        reduced.append(summarize_collectives(prof.events(), world)["bytes_reduced"])
        check_gan_step(engines, ref, t)
    return reduced


def test_an_engine_in_two_graphs_reduces_once_per_step(ranks):
    for stage in (1, 2):
        one = ranks.run(bytes_per_backward_scenario, stage, False)[0]
        two = ranks.run(bytes_per_backward_scenario, stage, True)[0]
        # reduced in both graphs, the discriminator's bytes would count twice
        assert two == one, (stage, one, two)
