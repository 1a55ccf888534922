"""The first step with ``options["engines"]`` is as exact as every later one, whatever the call shape.

Engines are called through ``engine(x, y)`` (DeepSpeed's own ``engine.forward``, whose hooks break
Dynamo's graph) from a list comprehension (a frame of its own), a loop, a helper function and a
method of another module. graphzero attaches them before Dynamo traces the step (early_attach.py),
so the first call traces one graph without DeepSpeed's hooks; gradients are checked on every step,
the first included, against a single-process reference, and against ``graphzero.attach`` first.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scenario_utils import (
    GRAD_TOL,
    ReductionCounter,
    Reference,
    assert_grads_close,
    assert_no_full_grads,
    ds_config,
    engine,
    full_grads,
    rank_world,
)


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.linears[1](torch.relu(self.linears[0](x))), y)


def _weighted(losses):
    return sum(loss / (i + 1) for i, loss in enumerate(losses))


def comprehension_step(engines, x, y):
    return _weighted([e(x, y) for e in engines])


def loop_step(engines, x, y):
    losses = []
    for e in engines:
        losses.append(e(x, y))
    return _weighted(losses)


def _run_one(e, x, y):
    return e(x, y)


def helper_step(engines, x, y):
    return _weighted([_run_one(e, x, y) for e in engines])


class Ensemble(nn.Module):
    """Another module whose forward calls the engines (kept in a plain list: not submodules)."""

    def __init__(self, engines) -> None:
        super().__init__()
        self.members = list(engines)

    def forward(self, x, y):
        return _weighted([e(x, y) for e in self.members])


SHAPES = {"comprehension": comprehension_step, "loop": loop_step, "helper": helper_step, "method": None}


def first_step_scenario(shape: str, stage: int, how: str, inner: str = "eager", steps: int = 3) -> dict:
    import graphzero
    rank, world = rank_world()
    models = []
    for seed in (42, 43, 44):
        torch.manual_seed(seed)
        models.append(TwoLinear())
    ref = Reference({f"m{i}": m for i, m in enumerate(models)})
    engines = [engine(m, ds_config(stage)) for m in models]
    counter = ReductionCounter(*engines)
    if how == "attach":
        graphzero.attach(*engines)
    if shape == "method":
        ensemble = Ensemble(engines)
        compiled = torch.compile(ensemble, backend="graphzero", options={"engines": engines, "inner": inner})
        call = compiled
    else:
        compiled = torch.compile(SHAPES[shape], backend="graphzero", options={"engines": engines, "inner": inner})

        def call(x, y):
            return compiled(engines, x, y)

    def ref_loss(ms, x, y):
        return _weighted([ms[f"m{i}"](x, y) for i in range(len(engines))])

    def batch(t: int, r: int):
        g = torch.Generator().manual_seed(100 * t + r)
        return torch.randn(8, 4, generator=g), torch.randint(0, 4, (8,), generator=g)

    counters = torch._dynamo.utils.counters
    counters.clear()
    norms = []
    for t in range(steps):
        call(*batch(t, rank)).backward()
        assert_no_full_grads(*engines)
        ref.accumulate(ref_loss, [batch(t, r) for r in range(world)])
        for i, e in enumerate(engines):
            assert_grads_close(full_grads(e), ref.grads(f"m{i}"), **GRAD_TOL, what=f"{shape} step {t} engine{i}")
        for e in engines:
            e.step()
        ref.step()
        for i, e in enumerate(engines):
            torch.testing.assert_close(float(e.get_global_grad_norm()), ref.norms[f"m{i}"], rtol=1e-4, atol=1e-6)
        norms.append([float(e.get_global_grad_norm()) for e in engines])
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": int(sum(counters["graph_break"].values())),
            "norms": norms}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_first_step_exact_for_every_call_shape(ranks, shape):
    from_options = ranks.run(first_step_scenario, shape, 2, "options")
    assert all(r["graphs"] == 1 and r["breaks"] == 0 for r in from_options), from_options


@pytest.mark.parametrize("stage", [1, 2])
def test_first_step_options_equals_attach_first(ranks, stage):
    from_options = ranks.run(first_step_scenario, "comprehension", stage, "options", inner="inductor")
    attached = ranks.run(first_step_scenario, "comprehension", stage, "attach", inner="inductor")
    assert [r["norms"] for r in from_options] == [r["norms"] for r in attached]
