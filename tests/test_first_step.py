"""The first step with ``options["engines"]`` is as exact as every later one, whatever the call shape.

Engines are called through ``engine(x, y)`` (DeepSpeed's own ``engine.forward``, whose hooks break
Dynamo's graph) from a list comprehension (a frame of its own), a loop, a helper function and a
method of another module. graphzero attaches them before Dynamo traces the step (early_attach.py),
so the first call traces one graph without DeepSpeed's hooks; gradients are checked on every step,
the first included, against a single-process reference, and against ``graphzero.attach`` first.
Default suite: every call shape at ZeRO-2 and the comprehension at ZeRO-1 and 3
(tests/suite_sample.py); ``GRAPHZERO_MATRIX=full`` every shape at every stage.
"""
from __future__ import annotations

import pytest
import torch
from suite_sample import sample
from torch import nn

from scenario_utils import (
    GRAD_TOL,
    ReductionCounter,
    Reference,
    assert_grads_close,
    assert_no_full_grads,
    check_gan_step,
    data,
    ds_config,
    engine,
    full_grads,
    gan_loss,
    mlp,
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
# every call shape at ZeRO-2, every stage with the comprehension
SHAPE_STAGE_SAMPLE = sample([(shape, stage) for stage in (1, 2, 3) for shape in SHAPES],
                            default=[(shape, 2) for shape in SHAPES] + [("comprehension", 1), ("comprehension", 3)])


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
    if how == "reset":
        torch._dynamo.reset()   # as notebooks and test suites do; graphzero's callback survives it
    if how == "backend":
        settings = {"backend": graphzero.backend(*engines, inner=inner)}
    else:
        settings = {"backend": "graphzero", "options": {"engines": engines, "inner": inner}}
    if shape == "method":
        compiled = torch.compile(Ensemble(engines), **settings)
        call = compiled
    else:
        compiled = torch.compile(SHAPES[shape], **settings)

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
        if how == "no_hook" and t == 0:
            # Without the compile-start callback the engines are still DeepSpeed's when Dynamo traces:
            # the first call must refuse (on every rank), never train a wrong first step.
            graphzero.early_attach.uninstall()
            try:
                call(*batch(t, rank)).backward()
            except graphzero.AttachTooLateError as err:
                return {"error": type(err).__name__, "message": str(err)}
            finally:
                graphzero.early_attach.install()
        else:
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
    return {"error": None, "graphs": counters["stats"]["unique_graphs"], "breaks": int(sum(counters["graph_break"].values())),
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


@pytest.mark.parametrize("shape,stage", SHAPE_STAGE_SAMPLE)
def test_backend_object_first_step_exact(ranks, shape, stage):
    """graphzero.backend(...) attaches in its constructor: one graph, exact from the first step."""
    results = ranks.run(first_step_scenario, shape, stage, "backend")
    # ZeRO-3 compiles a second graph (the engine's own forward frame); exactness is checked in the scenario
    assert all(r["graphs"] == (1 if stage < 3 else 2) and r["breaks"] == 0 for r in results), results


@pytest.mark.parametrize("shape,stage", SHAPE_STAGE_SAMPLE)
def test_options_first_step_exact_after_dynamo_reset(ranks, shape, stage):
    """torch._dynamo.reset() right before the compile keeps graphzero's compile-start callback."""
    results = ranks.run(first_step_scenario, shape, stage, "reset")
    # ZeRO-3 compiles a second graph (the engine's own forward frame); exactness is checked in the scenario
    assert all(r["graphs"] == (1 if stage < 3 else 2) and r["breaks"] == 0 for r in results), results


@pytest.mark.parametrize("shape,stage", SHAPE_STAGE_SAMPLE)
def test_options_without_compile_start_hook_refuse_on_every_rank(ranks, shape, stage):
    """With the callback removed the first call is a named error on every rank, never a first step
    traced through DeepSpeed's hooks."""
    results = ranks.run(first_step_scenario, shape, stage, "no_hook")
    assert [r["error"] for r in results] == ["AttachTooLateError"] * len(results), results
    assert "engine0" in results[0]["message"] and "graphzero.backend" in results[0]["message"]


def zero3_gan_after_reset_scenario(how: str, steps: int = 3) -> dict:
    """The reported case: a GAN, both engines at ZeRO-3 (plain nn.Sequential MLPs),
    ``torch._dynamo.reset()``, then ``backend="graphzero"`` with ``options["engines"]``."""
    import graphzero
    rank, _ = rank_world()
    torch.manual_seed(0)
    models = {"gen": mlp(8, 16, 8), "disc": mlp(8, 16, 1)}
    ref = Reference(models)
    cfg = ds_config(3)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engines = {name: engine(m, cfg) for name, m in models.items()}
    torch._dynamo.reset()
    if how == "no_hook":
        graphzero.early_attach.uninstall()
    try:
        step = torch.compile(gan_loss, backend="graphzero", options={"engines": engines, "inner": "eager"})
        for t in range(steps):
            try:
                step(engines, *data(t, rank, (4, 8), (4, 8))).backward()
            except graphzero.AttachTooLateError as err:
                return {"error": type(err).__name__, "step": t, "attached": graphzero.deepspeed_adapter.binding_of(
                    engines["gen"]) is not None}
            check_gan_step(engines, ref, t)
    finally:
        graphzero.early_attach.install()
    return {"error": None}


def test_zero3_gan_options_exact_after_dynamo_reset(ranks):
    assert [r["error"] for r in ranks.run(zero3_gan_after_reset_scenario, "reset")] == [None, None]


def test_zero3_gan_options_without_hook_is_a_named_error(ranks):
    results = ranks.run(zero3_gan_after_reset_scenario, "no_hook")
    assert results == [{"error": "AttachTooLateError", "step": 0, "attached": False}] * 2, results
