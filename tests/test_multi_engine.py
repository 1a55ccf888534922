"""One loss spanning several DeepSpeed engines, one plain loss.backward(): numbers against a
single-process PyTorch reference.

Tolerances: fp32 gradients rtol 1e-4 / atol 1e-6 and parameters rtol 1e-4 / atol 1e-5 (reduction
order differs from the reference; Adam amplifies near-zero gradients a little).
"""
from __future__ import annotations

import copy

import pytest
import torch

from scenario_utils import (
    GRAD_TOL,
    PARAM_TOL,
    ReductionCounter,
    Reference,
    assert_grads_close,
    assert_no_full_grads,
    assert_params_close,
    compiled_graph_count,
    data,
    ds_config,
    engine,
    full_grads,
    gan_loss,
    mlp,
    rank_world,
)


def gan_scenario(stage: int, inner: str, steps: int = 3, gas: int = 1, hidden: int = 16,
                 bucket: int | None = None) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    G, D = mlp(8, hidden, 8), mlp(8, hidden, 1)
    ref = Reference({"gen": G, "disc": D})
    cfg = ds_config(stage, gas=gas, bucket=bucket)
    gen, disc = engine(G, cfg), engine(D, cfg)
    counter = ReductionCounter(gen, disc)
    # The discriminator engine is called twice: DeepSpeed eager fails this with KeyError: 0.
    step = torch.compile(gan_loss, backend="graphzero",
                         options={"engines": {"gen": gen, "disc": disc}, "inner": inner})
    for t in range(steps):
        for micro in range(gas):
            i = t * gas + micro
            z, real = data(i, rank, (4, 8), (4, 8))
            loss = step({"gen": gen, "disc": disc}, z, real)
            loss.backward()
            assert_no_full_grads(gen, disc)
            ref.accumulate(gan_loss, [data(i, r, (4, 8), (4, 8)) for r in range(world)], gas=gas)
            if micro == gas - 1:
                assert_grads_close(full_grads(gen), ref.grads("gen"), **GRAD_TOL, what=f"step {t} gen")
                assert_grads_close(full_grads(disc), ref.grads("disc"), **GRAD_TOL, what=f"step {t} disc")
            gen.step()
            disc.step()
        ref.step()
        torch.testing.assert_close(float(gen.get_global_grad_norm()), ref.norms["gen"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(float(disc.get_global_grad_norm()), ref.norms["disc"], rtol=1e-4, atol=1e-6)
        assert_params_close(gen, ref.models["gen"], **PARAM_TOL, what=f"step {t} gen")
        assert_params_close(disc, ref.models["disc"], **PARAM_TOL, what=f"step {t} disc")
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    graphs, breaks = compiled_graph_count(step, {"gen": gen, "disc": disc}, *data(0, rank, (4, 8), (4, 8)))
    return {"graphs": graphs, "breaks": breaks}


@pytest.mark.parametrize("stage", [1, 2])
def test_gan_discriminator_called_twice(ranks, stage):
    results = ranks.run(gan_scenario, stage, "inductor")
    assert all(r == {"graphs": 1, "breaks": 0} for r in results), results


def test_gan_eager_inner_gas2(ranks):
    ranks.run(gan_scenario, 2, "eager", gas=2)


@pytest.mark.parametrize("stage", [1, 2])
def test_odd_sizes_and_buckets_cutting_parameters(ranks, stage):
    # 13 hidden units: odd parameter sizes, alignment padding between parameters and at the tail;
    # 37-element buckets cut parameters and shards at arbitrary points.
    ranks.run(gan_scenario, stage, "inductor", steps=2, hidden=13, bucket=37)


def chain_loss(models, x):
    # student -> frozen plain module -> proj -> head, plus an unowned trainable "side" module.
    h = models["proj"].module(models["frozen"](models["student"].module(x)))
    return models["head"](h).square().mean() + models["side"](x).square().mean()


def ref_chain_loss(models, x):
    h = models["proj"](models["frozen"](models["student"](x)))
    return models["head"](h).square().mean() + models["side"](x).square().mean()


def chain_scenario(stage: int, gas: int, inner: str, steps: int = 2, bucket: int | None = None) -> dict:
    """Three engines in a chain with gradient accumulation, a frozen plain module between them,
    and a trainable module no engine owns (it must get its ordinary, un-reduced .grad)."""
    torch.manual_seed(1)
    models = {"student": mlp(8, 16, 8), "proj": mlp(8, 16, 8), "head": mlp(8, 8, 2)}
    frozen, side = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    ref = Reference(models)
    cfg = ds_config(stage, gas=gas, bucket=bucket)
    engines = {name: engine(m, cfg) for name, m in models.items()}
    counter = ReductionCounter(*engines.values())
    train_chain(engines, ref, frozen, side, gas=gas, steps=steps, inner=inner,
                after_backward=assert_no_full_grads, params_close=assert_params_close)
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    return {}


def train_chain(engines: dict, ref: Reference, frozen: torch.nn.Module, side: torch.nn.Module, *, gas: int,
                steps: int, inner: str, after_backward, params_close) -> None:
    """The chain's training loop and checks (shared with the ZeRO-3 chain in test_zero3.py):
    gradients at each boundary, parameters and norms after each step, the frozen module untouched,
    the unowned module's local .grad."""
    rank, world = rank_world()
    frozen.requires_grad_(False)
    ref_side = copy.deepcopy(side)
    step = torch.compile(chain_loss, backend="graphzero", options={"engines": engines, "inner": inner})
    models = {**engines, "frozen": frozen, "side": side}
    for t in range(steps):
        for micro in range(gas):
            i = t * gas + micro
            (x,) = data(i, rank, (4, 8))
            side.zero_grad(set_to_none=True)
            step(models, x).backward()
            after_backward(*engines.values())
            assert frozen.weight.grad is None, "frozen parameter got a gradient"
            # The unowned module keeps plain autograd semantics: its local (per-rank) gradient.
            (side_ref_grad,) = torch.autograd.grad(ref_side(x).square().mean(), [ref_side.weight])
            torch.testing.assert_close(side.weight.grad, side_ref_grad, rtol=1e-5, atol=1e-7)
            ref.accumulate(lambda m, x: ref_chain_loss({**m, "frozen": frozen, "side": ref_side}, x),
                           [data(i, r, (4, 8)) for r in range(world)], gas=gas)
            if micro == gas - 1:
                for name, eng in engines.items():
                    assert_grads_close(full_grads(eng), ref.grads(name), **GRAD_TOL, what=f"step {t} {name}")
            for eng in engines.values():
                eng.step()
        ref.step()
        for name, eng in engines.items():
            params_close(eng, ref.models[name], **PARAM_TOL, what=f"step {t} {name}")
            torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2])
def test_chain_of_three_engines_gas2(ranks, stage):
    ranks.run(chain_scenario, stage, 2, "inductor")


def test_chain_small_buckets_eager(ranks):
    # A bucket of 64 elements splits every group into several reduce-scatters.
    ranks.run(chain_scenario, 2, 2, "eager", bucket=64)


def transformer_scenario(stage: int, steps: int = 2) -> None:
    """A small GPT body and its LM head as two engines (embedding, layer norm, attention, cross
    entropy): the same checks on a transformer's backward."""
    from graphzero_tools.bench_models import TINY_SIZES, build_workload
    rank, world = rank_world()
    work = build_workload("transformer", TINY_SIZES["transformer"], seed=3)
    ref = Reference(dict(work.parts))
    engines = {name: engine(part, ds_config(stage, micro_batch=2)) for name, part in work.parts.items()}
    counter = ReductionCounter(*engines.values())
    step = torch.compile(work.loss, backend="graphzero", options={"engines": engines})

    def batch(t: int, r: int):
        return work.make_batch(torch.Generator().manual_seed(100 * t + r))

    for t in range(steps):
        step(engines, *batch(t, rank)).backward()
        assert_no_full_grads(*engines.values())
        ref.accumulate(work.loss, [batch(t, r) for r in range(world)])
        for name, eng in engines.items():
            assert_grads_close(full_grads(eng), ref.grads(name), rtol=1e-4, atol=1e-6, what=f"step {t} {name}")
            eng.step()
        ref.step()
        for name, eng in engines.items():
            # Attention's key bias has a gradient that is zero up to rounding; Adam turns that
            # rounding into steps of up to lr, so parameters get atol 1e-3 (gradients above are
            # checked at 1e-6).
            assert_params_close(eng, ref.models[name], rtol=1e-4, atol=1e-3, what=f"step {t} {name}")
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"


def test_transformer_body_and_head(ranks):
    ranks.run(transformer_scenario, 2)


def engine_backward_scenario(stage: int, gas_gen: int, gas_disc: int, boundaries: int = 3) -> None:
    """``gen.backward(loss)`` on the GAN loss, which also runs through ``disc``, the two engines
    with gradient-accumulation steps of their own: each engine's gradient is averaged over its own
    gas micro-batches (as ``loss.backward()`` gives it), gradients and norms at each engine's
    boundaries. The first call is written ``gen.backward(step(...))``: ``gen.backward`` is looked
    up before ``step`` attaches the engines, so DeepSpeed's own engine.backward runs it (loss /
    gen's gas), and ``disc`` must still get its own 1/gas."""
    rank, world = rank_world()
    torch.manual_seed(0)
    models = {"gen": mlp(8, 16, 8), "disc": mlp(8, 16, 1)}
    ref = Reference(models)
    gas = {"gen": gas_gen, "disc": gas_disc}
    engines = {}
    for name, model in models.items():
        cfg = ds_config(stage, gas=gas[name])
        if stage == 3:
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        engines[name] = engine(model, cfg)
    gen = engines["gen"]
    step = torch.compile(gan_loss, backend="graphzero", options={"engines": engines, "inner": "eager"})
    params = {name: [p for p in m.parameters() if p.requires_grad] for name, m in ref.models.items()}
    for i in range(boundaries * max(gas.values())):
        z, real = data(i, rank, (4, 8), (4, 8))
        backward = gen.backward   # before step(...) runs: DeepSpeed's own on the first call
        assert (backward.__func__ is type(gen).backward) == (i == 0), i
        backward(step(engines, z, real))
        assert_no_full_grads(*engines.values())
        for r in range(world):
            loss = gan_loss(ref.models, *data(i, r, (4, 8), (4, 8))) / world
            grads = torch.autograd.grad(loss, params["gen"] + params["disc"])
            owners = ["gen"] * len(params["gen"]) + ["disc"] * len(params["disc"])
            for p, g, owner in zip(params["gen"] + params["disc"], grads, owners):
                p.grad = g / gas[owner] if p.grad is None else p.grad + g / gas[owner]
        at_boundary = [name for name in engines if (i + 1) % gas[name] == 0]
        for name in at_boundary:
            assert_grads_close(full_grads(engines[name]), ref.grads(name), **GRAD_TOL,
                               what=f"gas {gas} micro-step {i} {name}")
        for eng in engines.values():
            eng.step()
        for name in at_boundary:
            norm = float(torch.nn.utils.clip_grad_norm_(params[name], ref.clip))
            ref.opts[name].step()
            ref.opts[name].zero_grad(set_to_none=True)
            torch.testing.assert_close(float(engines[name].get_global_grad_norm()), norm, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name, i=i: f"micro-step {i} {name} gradient norm: {m}")


@pytest.mark.parametrize("gas_gen, gas_disc", [(2, 1), (2, 2), (1, 2)])
def test_engine_backward_gives_each_engine_its_own_gas(ranks, gas_gen, gas_disc):
    ranks.run(engine_backward_scenario, 2, gas_gen, gas_disc)


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_backward_own_gas_zero1_zero3(ranks, stage):
    ranks.run(engine_backward_scenario, stage, 2, 1)
