"""A graphzero graph accumulates into an engine's shard exactly what eager autograd would have
accumulated into ``.grad``: ``backward(inputs=...)``, ``torch.autograd.grad``, ``retain_graph`` with
two backward calls, a non-scalar ``out.backward(grad)``; ``create_graph=True`` and a partial
``inputs=`` are refused by name; ``engine.step()`` without a gradient is a named error.
"""
from __future__ import annotations

import pytest
import torch

from scenario_utils import (
    GRAD_TOL,
    PARAM_TOL,
    Reference,
    assert_grads_close,
    assert_params_close,
    data,
    ds_config,
    engine,
    full_grads,
    mlp,
    rank_world,
)


def d_loss(models, z, real):
    gen, disc = models["gen"], models["disc"]
    return disc(gen(z).detach()).mean() - disc(real).mean()


def g_loss(models, z):
    return -models["disc"](models["gen"](z)).mean()


def two_phase_inputs_scenario(stage: int, steps: int = 3) -> None:
    """A two-phase GAN whose G-step is ``loss_g.backward(inputs=gen params)``, with no
    ``disc.zero_grad()`` in between: the D-step gradients must hold no G-step contribution."""
    rank, world = rank_world()
    torch.manual_seed(0)
    G, D = mlp(8, 16, 8), mlp(8, 16, 1)
    ref = Reference({"gen": G, "disc": D})
    cfg = ds_config(stage)
    gen, disc = engine(G, cfg), engine(D, cfg)
    engines = {"gen": gen, "disc": disc}
    d_step = torch.compile(d_loss, backend="graphzero", options={"engines": engines, "inner": "eager"})
    g_step = torch.compile(g_loss, backend="graphzero", options={"engines": engines, "inner": "eager"})
    ref_opt = ref.opts
    for t in range(steps):
        z, real = data(t, rank, (4, 8), (4, 8))
        d_step(engines, z, real).backward()
        for r in range(world):
            (d_loss(ref.models, *data(t, r, (4, 8), (4, 8))) / world).backward()
        assert_grads_close(full_grads(disc), ref.grads("disc"), **GRAD_TOL, what=f"step {t} disc")
        disc.step()
        norm = float(torch.nn.utils.clip_grad_norm_(ref.models["disc"].parameters(), 1.0))
        ref_opt["disc"].step()
        ref_opt["disc"].zero_grad(set_to_none=True)
        torch.testing.assert_close(float(disc.get_global_grad_norm()), norm, rtol=1e-4, atol=1e-6)
        # The G-step: autograd is asked for the generator's gradients only.
        g_step(engines, z).backward(inputs=list(gen.module.parameters()))
        ref_gen_params = list(ref.models["gen"].parameters())
        for r in range(world):
            (g_loss(ref.models, data(t, r, (4, 8), (4, 8))[0]) / world).backward(inputs=ref_gen_params)
        assert all(p.grad is None for p in ref.models["disc"].parameters())
        assert_grads_close(full_grads(gen), ref.grads("gen"), **GRAD_TOL, what=f"step {t} gen")
        gen.step()
        norm = float(torch.nn.utils.clip_grad_norm_(ref_gen_params, 1.0))
        ref_opt["gen"].step()
        ref_opt["gen"].zero_grad(set_to_none=True)
        torch.testing.assert_close(float(gen.get_global_grad_norm()), norm, rtol=1e-4, atol=1e-6)
        assert_params_close(disc, ref.models["disc"], **PARAM_TOL, what=f"step {t} disc")
        assert_params_close(gen, ref.models["gen"], **PARAM_TOL, what=f"step {t} gen")


@pytest.mark.parametrize("stage", [1, 2])
def test_backward_inputs_gives_unlisted_engine_nothing(ranks, stage):
    ranks.run(two_phase_inputs_scenario, stage)


def vector_out(models, x):
    return models["net"](x).sum(dim=0)


def autograd_calls_scenario() -> dict:
    """autograd.grad touches no shard; retain_graph with two backwards accumulates twice; a
    non-scalar out.backward(grad) matches the reference."""
    import graphzero
    rank, world = rank_world()
    torch.manual_seed(2)
    N = mlp(8, 16, 4)
    ref = Reference({"net": N})
    net = engine(N, ds_config(2))
    f = torch.compile(vector_out, backend="graphzero", options={"engines": {"net": net}, "inner": "eager"})
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])

    # autograd.grad with respect to the input: no shard is written, the input gradient is right.
    (x,) = data(0, rank, (4, 8))
    x.requires_grad_(True)
    (gx,) = torch.autograd.grad(f({"net": net}, x), [x], grad_outputs=weights)
    x_ref = x.detach().clone().requires_grad_(True)
    (gx_ref,) = torch.autograd.grad(vector_out(ref.models, x_ref), [x_ref], grad_outputs=weights)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-7)
    try:
        net.step()
        raise AssertionError("step() after autograd.grad only must find no gradient")
    except graphzero.NoGradientError as err:
        no_grad_message = str(err)

    # retain_graph=True, two backward calls: the shard gets both, as .grad would.
    out = f({"net": net}, data(1, rank, (4, 8))[0])
    out.backward(weights, retain_graph=True)
    out.backward(weights)
    for r in range(world):
        for _ in range(2):
            (vector_out(ref.models, data(1, r, (4, 8))[0]) / world).backward(weights)
    assert_grads_close(full_grads(net), ref.grads("net"), **GRAD_TOL, what="retain_graph twice")
    net.step()
    ref.step()
    torch.testing.assert_close(float(net.get_global_grad_norm()), ref.norms["net"], rtol=1e-4, atol=1e-6)
    assert_params_close(net, ref.models["net"], **PARAM_TOL, what="after retain_graph step")

    # create_graph=True is refused by name, on every rank, before any collective.
    try:
        f({"net": net}, data(2, rank, (4, 8))[0]).backward(weights, create_graph=True)
        raise AssertionError("create_graph=True must be refused")
    except graphzero.AutogradUsageError as err:
        create_graph_message = str(err)

    # A partial inputs= over one engine's parameters is refused by name.
    first = next(iter(net.module.parameters()))
    try:
        f({"net": net}, data(3, rank, (4, 8))[0]).backward(weights, inputs=[first])
        raise AssertionError("a partial inputs= must be refused")
    except graphzero.AutogradUsageError as err:
        partial_message = str(err)

    # The engine still trains normally afterwards.
    net.zero_grad()
    ref.models["net"].zero_grad(set_to_none=True)
    f({"net": net}, data(4, rank, (4, 8))[0]).backward(weights)
    for r in range(world):
        (vector_out(ref.models, data(4, r, (4, 8))[0]) / world).backward(weights)
    assert_grads_close(full_grads(net), ref.grads("net"), **GRAD_TOL, what="after refused calls")
    net.step()
    ref.step()
    assert_params_close(net, ref.models["net"], **PARAM_TOL, what="after refused calls")
    return {"no_grad": no_grad_message, "create_graph": create_graph_message, "partial": partial_message}


def test_autograd_grad_retain_graph_nonscalar_and_refusals(ranks):
    results = ranks.run(autograd_calls_scenario)
    for r in results:
        assert "engine 'net'" in r["no_grad"] and "step()" in r["no_grad"]
        assert "create_graph" in r["create_graph"] and "net" in r["create_graph"]
        assert "inputs=" in r["partial"] and "net." in r["partial"]


def scale_wrt_gas_scenario(steps: int = 3, gas: int = 2) -> None:
    """``engine.backward(loss / gas, scale_wrt_gas=False)`` (transformers' Trainer divides by gas
    itself) gives under graphzero the gradients DeepSpeed eager gives, at every boundary."""
    import copy
    rank, _ = rank_world()
    torch.manual_seed(0)
    model = mlp(8, 16, 4)
    twin, owned = engine(copy.deepcopy(model), ds_config(2, gas=gas)), engine(model, ds_config(2, gas=gas))
    loss_of = lambda m, x: m["net"](x).square().mean()
    step = torch.compile(loss_of, backend="graphzero", options={"engines": {"net": owned}, "inner": "eager"})
    for t in range(steps):
        for m in range(gas):
            (x,) = data(t * gas + m, rank, (4, 8))
            returned = twin.backward(loss_of({"net": twin}, x) / gas, scale_wrt_gas=False)
            mine = owned.backward(step({"net": owned}, x) / gas, scale_wrt_gas=False)
            torch.testing.assert_close(mine, returned)
            if m == gas - 1:
                assert_grads_close(full_grads(owned), full_grads(twin), **GRAD_TOL, what=f"step {t}")
            twin.step()
            owned.step()


def test_engine_backward_scale_wrt_gas_false(ranks):
    ranks.run(scale_wrt_gas_scenario)
