"""Which graphs own which engines.

- A two-phase GAN whose D-step graph lists only the discriminator and whose G-step graph lists
  only the generator (its loss still runs through the discriminator): every owned gradient is
  reduced in a graph, the eager safety net never runs, and the numbers match the reference.
- The same with each step attaching its one engine without a name (a list, positional
  ``graphzero.attach`` / ``graphzero.backend``): the two get different default names (issue 29:
  both were ``engine0``, and the G-step graph, reaching both, failed FX code generation); with
  names that are not Python identifiers; at ZeRO-1, 2 and 3.
- Attaching from ``options["engines"]`` at the first call does not drop Dynamo's compiled code of
  other functions in the process: a function compiled before is not compiled again.
"""
from __future__ import annotations

import pytest
import torch

from graphzero import deepspeed_adapter
from scenario_utils import (
    GRAD_TOL,
    Reference,
    assert_grads_close,
    data,
    ds_config,
    engine,
    full_grads,
    full_params,
    mlp,
    rank_world,
)


def d_loss(disc, fake, real):
    return disc(fake).mean() - disc(real).mean()


def g_loss(gen, disc, z):
    return -disc(gen(z)).mean()


# How the alternating GAN's two compiled steps attach their engines: each step attaches only its
# own engine, in a separate call, and the G-step's graph also reaches the discriminator.
ATTACH_FORMS = ("dict", "list", "attach", "backend")


def _two_steps(how: str, gen, disc):
    """(d_step, g_step), each compiled over one engine, attached the ``how`` way. The dict form
    names them with names that are not Python identifiers (placeholders derive from them)."""
    import graphzero
    if how == "dict":
        return (torch.compile(d_loss, backend="graphzero", options={"engines": {"disc-1": disc}, "inner": "eager"}),
                torch.compile(g_loss, backend="graphzero", options={"engines": {"my gen": gen}, "inner": "eager"}))
    if how == "list":
        return (torch.compile(d_loss, backend="graphzero", options={"engines": [disc], "inner": "eager"}),
                torch.compile(g_loss, backend="graphzero", options={"engines": [gen], "inner": "eager"}))
    if how == "attach":
        graphzero.attach(disc)
        d_step = torch.compile(d_loss, backend="graphzero", options={"inner": "eager"})
        graphzero.attach(gen)
        return d_step, torch.compile(g_loss, backend="graphzero", options={"inner": "eager"})
    assert how == "backend", how
    return (torch.compile(d_loss, backend=graphzero.backend(disc, inner="eager")),
            torch.compile(g_loss, backend=graphzero.backend(gen, inner="eager")))


def two_phase_scenario(stage: int, how: str = "dict", steps: int = 3) -> dict:
    """The alternating GAN: each optimizer step a D-step (``disc.zero_grad()`` first, as users do)
    then a G-step whose loss runs through ``disc``; gradients, gradient norms and parameters
    against the single-process reference."""
    import graphzero
    rank, world = rank_world()
    torch.manual_seed(0)
    G, D = mlp(8, 16, 8), mlp(8, 16, 1)
    ref = Reference({"gen": G, "disc": D})
    cfg = ds_config(stage)
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    gen, disc = engine(G, cfg), engine(D, cfg)
    d_step, g_step = _two_steps(how, gen, disc)
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
        norm = float(torch.nn.utils.clip_grad_norm_(rd.parameters(), 1.0))
        torch.testing.assert_close(float(disc.get_global_grad_norm()), norm, rtol=1e-4, atol=1e-6)
        ref.opts["disc"].step()
        # G-step: the graph lists only gen but runs through disc, attached by the D-step graph.
        gen.zero_grad()
        g_step(gen, disc, z).backward()
        for r in range(world):
            (g_loss(rg, rd, data(t, r, (4, 8), (4, 8))[0]) / world).backward()
        assert_grads_close(full_grads(gen), ref.grads("gen"), **GRAD_TOL, what=f"step {t} gen")
        gen.step()
        norm = float(torch.nn.utils.clip_grad_norm_(rg.parameters(), 1.0))
        torch.testing.assert_close(float(gen.get_global_grad_norm()), norm, rtol=1e-4, atol=1e-6)
        ref.opts["gen"].step()
        ref.opts["gen"].zero_grad(set_to_none=True)
        for eng, model, name in ((gen, rg, "gen"), (disc, rd, "disc")):
            assert_grads_close(full_params(eng), [p.detach() for p in model.parameters()], rtol=1e-4, atol=1e-5,
                               what=f"step {t} {name} parameters")
    names = [deepspeed_adapter.binding_of(e).name for e in (gen, disc)]
    if how != "dict":
        # listing an attached engine again without a name keeps its name
        graphzero.attach(disc)
        assert deepspeed_adapter.binding_of(disc).name == names[1]
    return {"safety_net_used": any(deepspeed_adapter.binding_of(e)._warned_eager for e in (gen, disc)),
            "names": names}


def _check_two_phase(results: list[dict], how: str) -> None:
    assert all(not r["safety_net_used"] for r in results), results
    gen_name, disc_name = results[0]["names"]
    assert all(r["names"] == [gen_name, disc_name] for r in results), results   # the same on every rank
    if how == "dict":
        assert (gen_name, disc_name) == ("my gen", "disc-1"), results
    else:
        # each attach named its one engine by default: two names, never engine0 twice
        assert disc_name.startswith("engine") and gen_name.startswith("engine") and gen_name != disc_name, results


def test_two_phase_gan_reduces_everything_in_graph(ranks):
    _check_two_phase(ranks.run(two_phase_scenario, 2), "dict")


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("how", [h for h in ATTACH_FORMS if h != "dict"])
def test_alternating_gan_one_engine_per_attach(ranks, how, stage):
    """Issue 29: each step attaches its one engine without a name (default ``engineK`` names,
    unique per process); the G-step's graph reaches both and compiles."""
    _check_two_phase(ranks.run(two_phase_scenario, stage, how), how)


@pytest.mark.parametrize("stage", [1, 3])
def test_alternating_gan_non_identifier_names(ranks, stage):
    """Engine names that are not Python identifiers ("disc-1", "my gen") name graph placeholders."""
    _check_two_phase(ranks.run(two_phase_scenario, stage, "dict"), "dict")


def test_alternating_gan_zero1_list(ranks):
    _check_two_phase(ranks.run(two_phase_scenario, 1, "list"), "list")


def names_scenario() -> dict:
    """The naming rule (deepspeed_adapter/names.py) across separate attach calls, no compile."""
    import graphzero
    torch.manual_seed(0)
    a, b, c = (engine(mlp(4, 8, 2), ds_config(2)) for _ in range(3))

    def name(e):
        return deepspeed_adapter.binding_of(e).name

    graphzero.attach(a)
    graphzero.attach(b)
    defaults = [name(a), name(b)]
    graphzero.attach(b, a)                 # attached engines keep their names
    kept = [name(a), name(b)]
    graphzero.attach(critic=a)             # an explicit name renames
    graphzero.attach(critic=c)             # and the earlier holder gives it up
    taken = [name(a), name(c)]
    graphzero.detach(b)
    graphzero.attach(b)                    # detached and attached again: its old name back
    return {"defaults": defaults, "kept": kept, "taken": taken, "again": name(b)}


def test_engine_names_unique_across_attach_calls(ranks):
    for r in ranks.run(names_scenario):
        first, second = r["defaults"]
        assert first != second and first.startswith("engine") and second.startswith("engine"), r
        assert r["kept"] == r["defaults"], r
        assert r["taken"][0].startswith("critic#") and r["taken"][1] == "critic", r
        assert r["again"] == second, r


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
