"""Which graphs own which engines.

- A two-phase GAN whose D-step graph lists only the discriminator and whose G-step graph lists
  only the generator (its loss still runs through the discriminator): every owned gradient is
  reduced in a graph, the eager safety net never runs, and the numbers match the reference.
- Attaching from ``options["engines"]`` at the first call does not drop Dynamo's compiled code of
  other functions in the process: a function compiled before is not compiled again.
"""
from __future__ import annotations

import torch

from graphzero import deepspeed_adapter
from scenario_utils import (
    GRAD_TOL,
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


def d_loss(disc, fake, real):
    return disc(fake).mean() - disc(real).mean()


def g_loss(gen, disc, z):
    return -disc(gen(z)).mean()


def two_phase_scenario(stage: int, steps: int = 3) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    G, D = mlp(8, 16, 8), mlp(8, 16, 1)
    ref = Reference({"gen": G, "disc": D})
    gen, disc = engine(G, ds_config(stage)), engine(D, ds_config(stage))
    d_step = torch.compile(d_loss, backend="graphzero", options={"engines": {"disc": disc}, "inner": "eager"})
    g_step = torch.compile(g_loss, backend="graphzero", options={"engines": {"gen": gen}, "inner": "eager"})
    rg, rd = ref.models["gen"], ref.models["disc"]
    for t in range(steps):
        z, real = data(t, rank, (4, 8), (4, 8))
        disc.zero_grad()
        rd.zero_grad(set_to_none=True)
        with torch.no_grad():
            fake = gen(z)
        d_step(disc, fake, real).backward()
        for r in range(world):
            zr, realr = data(t, r, (4, 8), (4, 8))
            (d_loss(rd, rg(zr).detach(), realr) / world).backward()
        assert_grads_close(full_grads(disc), ref.grads("disc"), **GRAD_TOL, what=f"step {t} disc")
        disc.step()
        torch.nn.utils.clip_grad_norm_(rd.parameters(), 1.0)
        ref.opts["disc"].step()
        # G-step: the graph lists only gen but runs through disc, attached by the D-step graph.
        gen.zero_grad()
        g_step(gen, disc, z).backward()
        for r in range(world):
            (g_loss(rg, rd, data(t, r, (4, 8), (4, 8))[0]) / world).backward()
        assert_grads_close(full_grads(gen), ref.grads("gen"), **GRAD_TOL, what=f"step {t} gen")
        gen.step()
        torch.nn.utils.clip_grad_norm_(rg.parameters(), 1.0)
        ref.opts["gen"].step()
        ref.opts["gen"].zero_grad(set_to_none=True)
        assert_params_close(gen, rg, rtol=1e-4, atol=1e-5, what=f"step {t} gen")
        assert_params_close(disc, rd, rtol=1e-4, atol=1e-5, what=f"step {t} disc")
    return {"safety_net_used": any(deepspeed_adapter.binding_of(e)._warned_eager for e in (gen, disc))}


def test_two_phase_gan_reduces_everything_in_graph(ranks):
    results = ranks.run(two_phase_scenario, 2)
    assert all(r == {"safety_net_used": False} for r in results), results


def other_function_scenario() -> dict:
    rank, _ = rank_world()
    counters = torch._dynamo.utils.counters
    other = torch.compile(lambda x: x.sin() * 2, backend="eager")
    other(torch.randn(3))
    before = counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    net = engine(mlp(8, 16, 4), ds_config(2))
    step = torch.compile(lambda m, x: m(x).square().mean(), backend="graphzero",
                         options={"engines": {"net": net}, "inner": "eager"})
    step(net, *data(0, rank, (4, 8))).backward()
    net.step()
    after_attach = counters["stats"]["unique_graphs"]
    other(torch.randn(3))
    return {"graphzero_graphs": after_attach - before, "other_recompiled": counters["stats"]["unique_graphs"] - after_attach}


def test_attach_from_options_keeps_other_compiled_code(ranks):
    results = ranks.run(other_function_scenario)
    assert all(r == {"graphzero_graphs": 1, "other_recompiled": 0} for r in results), results
