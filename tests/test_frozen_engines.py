"""Frozen engines (deepspeed_adapter/frozen.py): DeepSpeed engines without an optimizer attached next
to a trained one, their gathers in the compiled step.

The shape of DeepSpeed #8130: a student (ZeRO-3 or ZeRO-2) whose checkpointed block (torch's
non-reentrant and reentrant checkpoint) takes a frozen teacher's output, computed under no_grad, as
an input; a frozen judge (ZeRO-3) that the gradient flows through, called inside a checkpoint of
the same kind (gathered again in the recompute); gas 2, 3 optimizer steps. Against a single-process
reference: the student's gradients at every boundary and its clipped norm; after every backward no
ZeRO-3 parameter of any engine holds data and no frozen parameter a gradient; one graph, no graph
break; outside the compiled step and after detach the teacher computes what the reference does.
One case offloads the frozen engines' parameters (``offload_param: cpu``).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphzero
from scenario_utils import (
    LR,
    assert_grads_close,
    data,
    ds_config,
    engine,
    full_grads,
    full_params,
    mlp,
    rank_world,
)

GAS = 2


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide (test_zero3.py).
    yield
    ranks.close()


class Student(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.reentrant = reentrant

    def block(self, u, hint):
        return torch.tanh(self.a(u + hint))

    def forward(self, x, hint):
        # the checkpointed block's inputs: one that requires grad (a reentrant checkpoint gives its
        # parameters no gradient otherwise, under plain torch too), and the no-grad hint
        return self.b(checkpoint(self.block, self.inp(x), hint, use_reentrant=self.reentrant))


def make_loss(reentrant: bool):
    def loss_fn(models, x, y):
        with torch.no_grad():
            hint = models["teacher"](x)
        out = models["student"](x, hint)
        # the frozen judge gathered again in the checkpoint's recompute
        judged = checkpoint(models["judge"], out, use_reentrant=reentrant)
        return ((out - y) ** 2).mean() + 0.1 * judged.pow(2).mean()
    return loss_fn


def frozen_config(stage: int, offload: bool = False) -> dict:
    cfg = ds_config(stage, gas=1)
    del cfg["optimizer"], cfg["gradient_clipping"]
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if offload:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def frozen_engine(model: nn.Module, stage: int, offload: bool = False):
    import deepspeed
    eng, *_ = deepspeed.initialize(model=model, config=frozen_config(stage, offload))
    return eng


def zero3_bytes(*engines) -> int:
    """Bytes ZeRO-3 parameters hold gathered (0 when every one is released)."""
    return sum(p.numel() * p.element_size() for e in engines for p in e.module.parameters() if hasattr(p, "ds_tensor"))


def distill_scenario(student_stage: int, teacher_stage: int, reentrant: bool, steps: int = 3,
                     offload: bool = False, flags_left_on: bool = False) -> dict:
    """``flags_left_on``: the frozen models' parameters keep ``requires_grad=True``, as TRL and
    Accelerate prepare a reference or teacher; graphzero attaches them frozen all the same."""
    rank, world = rank_world()
    torch.manual_seed(0)
    models = {"student": Student(reentrant), "teacher": mlp(8, 16, 8).requires_grad_(flags_left_on),
              "judge": mlp(8, 16, 4).requires_grad_(flags_left_on)}
    ref = copy.deepcopy(models)
    ref["teacher"].requires_grad_(False)
    ref["judge"].requires_grad_(False)
    ref_params = list(ref["student"].parameters())
    ref_opt = torch.optim.AdamW(ref_params, lr=LR, weight_decay=0.0)
    cfg = ds_config(student_stage, gas=GAS)
    if student_stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    eng = {"student": engine(models["student"], cfg),
           "teacher": frozen_engine(models["teacher"], teacher_stage, offload),
           "judge": frozen_engine(models["judge"], 3, offload)}
    loss_fn = make_loss(reentrant)
    step = torch.compile(loss_fn, backend="graphzero", options={"engines": eng})
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    norms = []
    for t in range(steps):
        for m in range(GAS):
            loss = step(eng, *data(10 * t + m, rank, (4, 8), (4, 8)))
            loss.backward()
            assert zero3_bytes(*eng.values()) == 0, f"step {t}.{m}: ZeRO-3 parameters left gathered"
            for name in ("teacher", "judge"):
                assert all(p.grad is None for p in eng[name].module.parameters()), f"{name} got a gradient"
                assert all(getattr(p, "ds_tensor", p).grad is None for p in eng[name].module.parameters())
            for r in range(world):
                (loss_fn(ref, *data(10 * t + m, r, (4, 8), (4, 8))) / (world * GAS)).backward()
            if m == GAS - 1:
                assert_grads_close(full_grads(eng["student"]), [p.grad for p in ref_params], rtol=1e-4, atol=1e-6,
                                   what=f"rank {rank} step {t} student")
            eng["student"].step()
        norm = float(torch.nn.utils.clip_grad_norm_(ref_params, 1.0))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(float(eng["student"].get_global_grad_norm()), norm, rtol=1e-4, atol=1e-6)
        norms.append(norm)
    graphs, breaks = counters["stats"]["unique_graphs"], int(sum(counters["graph_break"].values()))
    # outside the compiled step the frozen engines compute as the reference, and release after
    x = data(99, rank, (4, 8))[0]
    with torch.no_grad():
        torch.testing.assert_close(eng["teacher"](x), ref["teacher"](x), rtol=1e-5, atol=1e-6)
    assert zero3_bytes(eng["teacher"]) == 0
    for e in eng.values():
        graphzero.detach(e)
    for name in ("teacher", "judge"):   # the flags as the user left them
        assert all(p.requires_grad == flags_left_on for p in eng[name].module.parameters()), name
    with torch.no_grad():   # DeepSpeed's own hooks again
        torch.testing.assert_close(eng["judge"](x), ref["judge"](x), rtol=1e-5, atol=1e-6)
    dist.barrier()
    return {"graphs": graphs, "breaks": breaks, "norms": norms}


@pytest.mark.parametrize("student_stage,teacher_stage,reentrant,offload", [
    (3, 3, False, False), (2, 3, True, False), (3, 0, False, False), (2, 3, False, True)],
    ids=["zero3-student", "zero2-student-reentrant", "zero0-teacher", "offloaded-teacher-and-judge"])
def test_frozen_teacher_and_judge(ranks, student_stage, teacher_stage, reentrant, offload):
    results = ranks.run(distill_scenario, student_stage, teacher_stage, reentrant, offload=offload)
    assert results[0]["norms"] == results[1]["norms"]
    if not reentrant:
        # the frozen engines' gathers are inside the compiled step
        assert (results[0]["graphs"], results[0]["breaks"]) == (1, 0), results[0]


def test_frozen_engines_whose_parameters_require_grad(ranks):
    """TRL's prepared reference and teacher keep requires_grad=True: attached frozen, trained exactly."""
    results = ranks.run(distill_scenario, 3, 3, False, flags_left_on=True)
    assert results[0]["norms"] == results[1]["norms"]
    assert (results[0]["graphs"], results[0]["breaks"]) == (1, 0), results[0]


def unattached_scenario(offload: bool) -> dict:
    """A frozen ZeRO-3 teacher left out of ``engines`` (the shape most often met: a teacher or
    reference the user forgot): DeepSpeed's hooks gather it, the step breaks into pieces, graphzero
    says which engine to list, and the student trains as the reference does. A dead weak proxy
    lying in the process (Dynamo's and TRL's code leave such) must not break the warning's search
    for the engine (it once crashed the compile with ReferenceError)."""
    import logging
    import weakref
    rank, world = rank_world()
    torch.manual_seed(0)
    models = {"student": Student(False), "teacher": mlp(8, 16, 8).requires_grad_(False)}
    ref = copy.deepcopy(models)
    ref_params = list(ref["student"].parameters())
    cfg = ds_config(3)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    eng = {"student": engine(models["student"], cfg), "teacher": frozen_engine(models["teacher"], 3, offload)}

    def loss(models, x):
        with torch.no_grad():
            hint = models["teacher"](x)
        return models["student"](x, hint).square().mean()

    class Gone:
        pass

    dead_proxy = weakref.proxy(Gone())   # its referent is collected at once
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("graphzero").addHandler(handler)
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    try:
        step = torch.compile(loss, backend="graphzero", options={"engines": {"student": eng["student"]}})
        for t in range(3):
            step(eng, *data(t, rank, (4, 8))).backward()
            for r in range(world):
                (loss(ref, *data(t, r, (4, 8))) / world).backward()
            assert_grads_close(full_grads(eng["student"]), [p.grad for p in ref_params], rtol=1e-4, atol=1e-6,
                               what=f"rank {rank} step {t} student")
            for p in ref_params:
                p.grad = None
            eng["student"].step()
            with torch.no_grad():   # the reference takes the engine's step: the next step starts level
                for p, q in zip(ref_params, full_params(eng["student"])):
                    p.copy_(q)
    finally:
        logging.getLogger("graphzero").removeHandler(handler)
    del dead_proxy
    for e in eng.values():
        graphzero.detach(e)
    return {"warnings": [w for w in warnings if "does not own" in w],
            "breaks": int(sum(counters["graph_break"].values()))}


@pytest.mark.parametrize("offload", [False, True], ids=["teacher", "offloaded-teacher"])
def test_unattached_frozen_engine_named(ranks, offload):
    for r in ranks.run(unattached_scenario, offload):
        assert r["breaks"] > 0
        assert len(r["warnings"]) == 1, r["warnings"]   # once per engine, not per graph
        assert "Sequential" in r["warnings"][0] and "no optimizer (frozen)" in r["warnings"][0]
        assert "0.weight" in r["warnings"][0] and "options['engines']" in r["warnings"][0]
