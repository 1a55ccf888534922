"""ZeRO-1 with gradient accumulation reduces once per optimizer step, as DeepSpeed eager does.

Non-boundary micro-steps add their gradients into a local buffer in the compiled backward; the
boundary micro-step reduces the window's sum (one collective per bucket). Counted at run time
(torch.profiler events of the functional collectives) and in the dump's variant records; numbers
against the single-process reference over 3 optimizer steps, with the norms DeepSpeed clips by.

Tolerances: fp32 as test_multi_engine (gradients rtol 1e-4 / atol 1e-6, parameters rtol 1e-4 /
atol 1e-5, norms rtol 1e-4); against DeepSpeed eager ZeRO-1 (which also sums locally and reduces
once) rtol 1e-5 / atol 1e-6; bf16 as test_bf16 (3% relative L2 per gradient, parameters 2e-2, norms
5%).
"""
from __future__ import annotations

import copy
import json
import math
import pathlib
import tempfile
from typing import Self

import pytest
import torch
import torch.distributed as dist

import graphzero
from scenario_utils import (
    GRAD_TOL,
    PARAM_TOL,
    ReductionCounter,
    Reference,
    assert_grads_close,
    assert_no_full_grads,
    assert_params_close,
    assert_rel_l2_close,
    data,
    ds_config,
    engine,
    full_grads,
    gan_loss,
    mlp,
    rank_world,
)

TIGHT = {"rtol": 1e-5, "atol": 1e-6}
NORM_TOL = {"rtol": 1e-4, "atol": 1e-6}
GAS = 4
STEPS = 3


class Collectives:
    """Gradient collectives (all-reduce / reduce-scatter / all-to-all, graphzero's reduce-scatter on
    gloo) that ran inside the block, counted from the profiler's gloo events: what the compiled graphs (or DeepSpeed) really launched, whatever
    op called them. The one-int64 plan exchange of rank_agreement is an all-gather, not counted;
    the folded norm's all-reduce after a boundary backward (runtime/norm.py: one fp32 per param group,
    a few elements) is counted apart, in ``norms``."""

    def __enter__(self) -> Self:
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        self.names = sorted({e.name for e in self._prof.events() if e.name.startswith("gloo:")})
        reductions = [e for e in self._prof.events() if e.name.startswith("gloo:")
                      and any(op in e.name for op in ("all_reduce", "reduce_scatter", "all_to_all"))]
        self.norms = sum(1 for e in reductions if _numel(e) <= 4)
        self.count = len(reductions) - self.norms


def _numel(event) -> int:
    shapes = [s for s in (event.input_shapes or []) if s]
    return sum(math.prod(s) for s in shapes) if shapes else 1 << 30


def _dump_dir(rank: int) -> str:
    path = [tempfile.mkdtemp(prefix="graphzero-z1acc-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def regression_loss(model, x, y):
    return (model(x) - y).square().mean()


def single_engine_scenario(inner: str, bucket: int) -> dict:
    """One ZeRO-1 engine, gas 4: collectives per micro-step, against DeepSpeed eager ZeRO-1 and the
    torch reference; a zero_grad() mid-window throws the window's local sum away."""
    rank, world = rank_world()
    torch.manual_seed(3)
    M = mlp(6, 24, 3, depth=3)
    ref = Reference({"m": M})
    ds_eager = engine(copy.deepcopy(M), ds_config(1, gas=GAS))
    gz = engine(M, ds_config(1, gas=GAS, bucket=bucket))
    dump_dir = _dump_dir(rank)
    step = torch.compile(regression_loss, backend="graphzero",
                         options={"engines": {"m": gz}, "inner": inner, "dump_dir": dump_dir})
    counter = ReductionCounter(gz)
    # A micro-step thrown away by zero_grad: its local sum must not reach the first step.
    step(gz, *data(50, rank, (5, 6), (5, 3))).backward()
    gz.zero_grad()
    per_micro, names = [], set()
    for t in range(STEPS):
        for micro in range(GAS):
            i = t * GAS + micro
            x, y = data(i, rank, (5, 6), (5, 3))
            ds_eager.backward(regression_loss(ds_eager, x, y))
            with Collectives() as seen:
                step(gz, x, y).backward()
            per_micro.append(seen.count)
            names.update(seen.names)
            assert_no_full_grads(gz)
            ref.accumulate(lambda m, x, y: regression_loss(m["m"], x, y),
                           [data(i, r, (5, 6), (5, 3)) for r in range(world)], gas=GAS)
            if micro == GAS - 1:
                assert_grads_close(full_grads(gz), ref.grads("m"), **GRAD_TOL, what=f"step {t}")
                assert_grads_close(full_grads(gz), full_grads(ds_eager), **TIGHT, what=f"step {t} vs DeepSpeed")
            ds_eager.step()
            gz.step()
        ref.step()
        assert_params_close(gz, ds_eager.module, **TIGHT, what=f"step {t} graphzero vs DeepSpeed eager")
        assert_params_close(gz, ref.models["m"], **PARAM_TOL, what=f"step {t} graphzero vs torch")
        torch.testing.assert_close(float(gz.get_global_grad_norm()), ref.norms["m"], **NORM_TOL)
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    assert not gz._graphzero_binding._warned_eager, "gradients took the eager safety net"
    dist.barrier()
    graphs = None
    if rank == 0:
        summary = json.loads((pathlib.Path(dump_dir) / "summary.json").read_text())
        graphs = {g.get("variant"): g["engines"]["m"] for g in summary["graphs"]}
    return {"per_micro": per_micro, "graphs": graphs, "numel": sum(p.numel() for p in M.parameters()),
            "names": sorted(names)}


@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_zero1_gas4_reduces_once_per_optimizer_step(ranks, inner):
    # 64 elements per bucket: several collectives at the boundary.
    results = ranks.run(single_engine_scenario, inner, 64)
    graphs = results[0]["graphs"]
    assert set(graphs) == {"accumulate", "boundary"}, graphs
    acc, bnd = graphs["accumulate"], graphs["boundary"]
    buckets = bnd["buckets"]
    assert buckets >= results[0]["numel"] // 64 > 1, bnd
    # not a boundary: nothing reduced; the boundary: one collective per bucket, the whole gradient once
    assert acc["all_reduce"] + acc["reduce_scatter"] == 0 and acc["comm_bytes_per_step"] == 0, acc
    assert bnd["all_reduce"] + bnd["reduce_scatter"] == buckets, bnd
    assert bnd["comm_bytes_per_step"] >= 4 * results[0]["numel"], bnd
    assert acc["local_accumulate"] == bnd["local_accumulate"] == 6, graphs   # 3 Linear layers
    for r in results:
        # the thrown-away micro-step, then 3 optimizer steps of gas 4
        assert r["per_micro"] == [0, 0, 0, buckets] * STEPS, (r["per_micro"], r["names"])


def gan_scenario(stages: dict[str, int], inner: str) -> dict:
    """A GAN whose discriminator is called twice in one graph, ZeRO-1 with gas 4, next to a
    ZeRO-2 generator (which keeps reducing every micro-step, as DeepSpeed eager does)."""
    rank, world = rank_world()
    torch.manual_seed(0)
    G, D = mlp(8, 16, 8), mlp(8, 16, 1)
    ref = Reference({"gen": G, "disc": D})
    gen, disc = engine(G, ds_config(stages["gen"], gas=GAS)), engine(D, ds_config(stages["disc"], gas=GAS))
    models = {"gen": gen, "disc": disc}
    counter = ReductionCounter(gen, disc)
    step = torch.compile(gan_loss, backend="graphzero", options={"engines": models, "inner": inner})
    per_micro = []
    for t in range(STEPS):
        for micro in range(GAS):
            i = t * GAS + micro
            with Collectives() as seen:
                step(models, *data(i, rank, (4, 8), (4, 8))).backward()
            per_micro.append(seen.count)
            assert_no_full_grads(gen, disc)
            ref.accumulate(gan_loss, [data(i, r, (4, 8), (4, 8)) for r in range(world)], gas=GAS)
            if micro == GAS - 1:
                for name, eng in models.items():
                    assert_grads_close(full_grads(eng), ref.grads(name), **GRAD_TOL, what=f"step {t} {name}")
            gen.step()
            disc.step()
        ref.step()
        for name, eng in models.items():
            torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name], **NORM_TOL)
            assert_params_close(eng, ref.models[name], **PARAM_TOL, what=f"step {t} {name}")
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    return {"per_micro": per_micro}


@pytest.mark.parametrize("stages", [{"gen": 2, "disc": 1}, {"gen": 1, "disc": 1}], ids=["z2gen-z1disc", "z1-both"])
def test_gan_zero1_disc_called_twice_gas4(ranks, stages):
    per_micro = ranks.run(gan_scenario, stages, "inductor")[0]["per_micro"]
    # default buckets: one collective per engine that reduces this micro-step
    every_micro = sum(1 for s in stages.values() if s == 2)
    at_boundary = len(stages)
    assert per_micro == [every_micro] * (GAS - 1) + [at_boundary] + [every_micro] * (GAS - 1) + [at_boundary] \
        + [every_micro] * (GAS - 1) + [at_boundary], per_micro


def bf16_scenario() -> dict:
    """bf16 ZeRO-1 with fp32 accumulation (DeepSpeed's BF16_Optimizer: every rank holds the full
    fp32 gradient), gas 4: reduced (all-reduce) once per optimizer step too, as DeepSpeed eager
    does (buffered_allreduce_fallback at the boundary)."""
    rank, world = rank_world()
    torch.manual_seed(2)
    G, D = mlp(8, 32, 8).to(torch.bfloat16), mlp(8, 32, 1).to(torch.bfloat16)
    ref = Reference({"gen": G, "disc": D}, dtype=torch.float32)
    cfg = ds_config(1, gas=GAS, dtype="bf16")
    models = {"gen": engine(G, cfg), "disc": engine(D, cfg)}
    kinds = sorted({type(e.optimizer).__name__ for e in models.values()})
    counter = ReductionCounter(*models.values())
    step = torch.compile(gan_loss, backend="graphzero", options={"engines": models})
    per_micro = []
    for t in range(STEPS):
        for micro in range(GAS):
            i = t * GAS + micro
            with Collectives() as seen:
                step(models, *data(i, rank, (8, 8), (8, 8), dtype=torch.bfloat16)).backward()
            per_micro.append(seen.count)
            assert_no_full_grads(*models.values())
            ref.accumulate(gan_loss, [[a.float() for a in data(i, r, (8, 8), (8, 8), dtype=torch.bfloat16)]
                                      for r in range(world)], gas=GAS)
            if micro == GAS - 1:
                for name, eng in models.items():
                    assert all(g.dtype == torch.float32 for g in full_grads(eng))
                    assert_rel_l2_close(full_grads(eng), ref.grads(name), tol=3e-2, what=f"step {t} {name}")
            for eng in models.values():
                eng.step()
        ref.step()
        for name, eng in models.items():
            assert_params_close(eng, ref.models[name], rtol=2e-2, atol=2e-2, what=f"step {t} {name}")
            torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name], rtol=5e-2, atol=1e-3)
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    return {"optimizer": kinds, "per_micro": per_micro}


def test_bf16_zero1_gas4_reduces_once_per_optimizer_step(ranks):
    result = ranks.run(bf16_scenario)[0]
    assert result["optimizer"] == ["BF16_Optimizer"], result
    assert result["per_micro"] == [0, 0, 0, 2] * STEPS, result


def chain_scenario() -> dict:
    """test_multi_engine's chain (student -> frozen -> proj -> head, and an unowned module) with
    mixed stages: ZeRO-1 student and head keep their non-boundary micro-steps local, the ZeRO-2
    proj reduces every micro-step."""
    from test_multi_engine import train_chain
    torch.manual_seed(1)
    models = {"student": mlp(8, 16, 8), "proj": mlp(8, 16, 8), "head": mlp(8, 8, 2)}
    stages = {"student": 1, "proj": 2, "head": 1}
    frozen, side = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    ref = Reference(models)
    engines = {name: engine(m, ds_config(stages[name], gas=GAS)) for name, m in models.items()}
    counter = ReductionCounter(*engines.values())
    pending: list[tuple[int, ...]] = []

    def after_backward(*engs) -> None:
        assert_no_full_grads(*engs)
        # how many parameters each engine holds locally, not reduced yet
        pending.append(tuple(len(e._graphzero_binding.state.partial.pending) for e in engs))

    train_chain(engines, ref, frozen, side, gas=GAS, steps=STEPS, inner="inductor",
                after_backward=after_backward, params_close=assert_params_close)
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    return {"pending": pending}


def test_chain_mixed_zero1_gas4_and_zero2(ranks):
    pending = ranks.run(chain_scenario)[0]["pending"]
    # student and head (ZeRO-1, 4 parameters each) hold their window locally until the boundary
    # reduces it; proj (ZeRO-2) holds nothing after a backward
    assert pending == ([(4, 0, 4)] * (GAS - 1) + [(0, 0, 0)]) * STEPS, pending


def full_loss(model, x, y):
    return (model(x) - y).square().mean()


def first_layer_loss(model, x, y):
    return model[0](x).square().mean()


def leftovers_and_safety_net_scenario() -> dict:
    """Gradients kept locally that no boundary graph reduces are reduced when the boundary backward
    ends: a boundary micro-step that reaches only the first layer, and the eager safety net
    (an attached engine whose micro-steps run uncompiled) at gas 2, 3 optimizer steps each."""
    rank, world = rank_world()
    torch.manual_seed(4)
    M = mlp(6, 12, 3)
    ref = Reference({"m": M})
    gz = engine(M, ds_config(1, gas=2))
    full = torch.compile(full_loss, backend="graphzero", options={"engines": {"m": gz}, "inner": "eager"})
    part = torch.compile(first_layer_loss, backend="graphzero", options={"engines": {"m": gz}, "inner": "eager"})
    seen_eager = []
    for t in range(2 * STEPS):
        eager = t >= STEPS
        for micro, (fn, compiled) in enumerate([(full_loss, full), (first_layer_loss, part)]):
            i = 2 * t + micro
            x, y = data(i, rank, (5, 6), (5, 3))
            with Collectives() as seen:
                # eager: the module itself, outside any graph (the eager safety net reduces)
                (fn(gz.module, x, y) if eager else compiled(gz.module, x, y)).backward()
            if eager:
                seen_eager.append(seen.count)
            assert_no_full_grads(gz)
            ref.accumulate(lambda m, x, y, fn=fn: fn(m["m"], x, y), [data(i, r, (5, 6), (5, 3)) for r in range(world)],
                           gas=2)
            if micro == 1:
                # complete when the boundary backward returns (before step()), as under DeepSpeed
                assert_grads_close(full_grads(gz), ref.grads("m"), **GRAD_TOL, what=f"step {t} (eager={eager})")
            gz.step()
        ref.step()
        assert_params_close(gz, ref.models["m"], **PARAM_TOL, what=f"step {t} (eager={eager})")
        torch.testing.assert_close(float(gz.get_global_grad_norm()), ref.norms["m"], **NORM_TOL)
    return {"eager_collectives": seen_eager}


def test_leftovers_reduced_at_the_boundary_and_eager_safety_net(ranks):
    result = ranks.run(leftovers_and_safety_net_scenario)[0]
    # the safety net: nothing at the non-boundary micro-step, at the boundary one all-reduce per
    # first-layer parameter and one for the second layer's window sum (end of the backward)
    assert result["eager_collectives"] == [0, 3] * STEPS, result


def gas_change_scenario() -> list[int]:
    """set_train_batch_size between optimizer steps: windows of gas 4, then 2, then 1 (every
    micro-step a boundary) on a graph compiled at gas 4."""
    rank, world = rank_world()
    torch.manual_seed(5)
    M = mlp(6, 16, 3)
    ref = Reference({"m": M})
    gz = engine(M, ds_config(1, gas=4))
    step = torch.compile(full_loss, backend="graphzero", options={"engines": {"m": gz}, "inner": "eager"})
    i, per_micro = 0, []
    for gas in (4, 2, 1, 1):
        gz.set_train_batch_size(gz.train_micro_batch_size_per_gpu() * gas * world)
        for _ in range(gas):
            with Collectives() as seen:
                step(gz, *data(i, rank, (5, 6), (5, 3))).backward()
            per_micro.append(seen.count)
            ref.accumulate(lambda m, x, y: full_loss(m["m"], x, y), [data(i, r, (5, 6), (5, 3)) for r in range(world)],
                           gas=gas)
            gz.step()
            i += 1
        ref.step()
        assert_params_close(gz, ref.models["m"], **PARAM_TOL, what=f"window of gas {gas}")
        torch.testing.assert_close(float(gz.get_global_grad_norm()), ref.norms["m"], **NORM_TOL)
    return per_micro


def test_gas_changed_between_steps(ranks):
    per_micro = ranks.run(gas_change_scenario)[0]
    # one bucket: reduced at each window's boundary only
    assert per_micro == [0, 0, 0, 1, 0, 1, 1, 1], per_micro


def boundary_disagreement_scenario() -> str:
    """One rank at its boundary, the other not: different variants, a RankDisagreementError on
    every rank before any gradient collective."""
    rank, _ = rank_world()
    torch.manual_seed(6)
    gz = engine(mlp(6, 12, 3), ds_config(1, gas=2))
    step = torch.compile(full_loss, backend="graphzero", options={"engines": {"m": gz}, "inner": "eager"})
    step(gz, *data(0, rank, (5, 6), (5, 3))).backward()
    gz.step()
    gz.set_gradient_accumulation_boundary(rank == 1)
    try:
        step(gz, *data(1, rank, (5, 6), (5, 3))).backward()
    except graphzero.RankDisagreementError as err:
        message = str(err)
    else:
        raise AssertionError("ranks in different accumulation states reduced and nothing noticed")
    dist.barrier()
    return message


def test_ranks_that_disagree_on_the_boundary_raise(ranks):
    messages = ranks.run(boundary_disagreement_scenario, timeout=180)
    assert all("ranks disagree" in m for m in messages), messages
