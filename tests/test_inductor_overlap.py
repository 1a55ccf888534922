"""Inductor's comm/compute overlap passes on graphzero's graphs (graphzero/inductor_config.py).

The GAN step (discriminator called twice) with both engines at ZeRO-2 (also with the deferred
parameter all-gather) and at ZeRO-3, compiled with
``inner="inductor"`` and each of inductor's overlap switches off and on:
``reorder_for_compute_comm_overlap`` (with the pass list inductor's config recommends) and
``aten_distributed_optimizations.enable_simple_overlap`` where this torch has it. Each run records
the code inductor generated for every graph (``GraphLowering.save_output_code``, inductor's own
hook for this) and checks that

- every rank issues the same collectives in the same order, and the switch changed no collective's
  place relative to the others (the switch-off run's order);
- gradients (every step, both engines) and gradient norms match the single-process reference, and
  the gradients match the switch-off run's.

A switch graphzero pins (graphzero/inductor_config.py) never reaches its graphs; on ZeRO-3 it is
also tried with the pin lifted, to show what it would do there.
"""
from __future__ import annotations

import re

import pytest
import torch

import graphzero
from graphzero import inductor_config
from scenario_utils import (
    GRAD_TOL,
    assert_grads_close,
    data,
    full_grads,
    gan_engines,
    gan_loss,
)

STEPS = 3
#: variant -> (ZeRO stage of both engines, graphzero options). "zero2-deferred": the lean step leaves
#: the parameter all-gather in flight, issued outside any graph and waited on inside the next forward
#: graph (wait_params), the kind of collective an overlap pass cannot see (pytorch #189454).
VARIANTS = {"zero2": (2, {}), "zero2-deferred": (2, {"defer_param_gather": True}), "zero3": (3, {})}

#: switch -> the inductor config patch that turns it on (the off run sets every switch off)
SWITCHES = {
    "reorder": {inductor_config.REORDER: True,
                inductor_config.REORDER_PASSES: ["reorder_communication_preserving_peak_memory",
                                                 "sink_waits_iterative",
                                                 "reorder_communication_preserving_peak_memory"]},
    "simple_overlap": {inductor_config.SIMPLE_OVERLAP: True},
}
ALL_OFF = {inductor_config.REORDER: False, inductor_config.REORDER_PASSES: [],
           inductor_config.SIMPLE_OVERLAP: False}

# a functional collective or its wait, as inductor's Python wrapper calls it
_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\((.*)\)")
_VIEW_OFFSET = re.compile(r"(reinterpret_tensor\(\w+, \([^)]*\), \([^)]*\)), \d+\)")
_SPLITS = re.compile(r"\[(\d+(?:, \d+)*)\]")


def _available(patch: dict) -> dict:
    return {k: v for k, v in patch.items() if inductor_config.has_option(k)}


def _config_value(name: str):
    owner = torch._inductor.config
    for part in name.split("."):
        owner = getattr(owner, part)
    return owner


def _rank_neutral(args: str) -> str:
    """A call's arguments without what may differ by rank: on gloo an edge rank's all-to-all leaves
    its own chunk out (lower_reduce_scatter), so its input is another slice of the same buffer (the
    view's offset) and its split sizes another arrangement of the same total."""
    args = _VIEW_OFFSET.sub(r"\1)", args)
    return _SPLITS.sub(lambda m: f"[{sum(int(v) for v in m.group(1).split(','))}]", args)


def _calls(code: str) -> list[str]:
    """Every functional collective and wait in one generated module, in program order."""
    out = []
    for line in code.splitlines():
        m = _CALL.search(line)
        if m:
            out.append(f"{m.group(1)}({_rank_neutral(m.group(2))})")
    return out


def overlap_scenario(variant: str, switch: str | None, lift_pin: bool = False) -> dict:
    """The GAN in ``variant`` (VARIANTS) with ``switch`` on (None: every switch off) for STEPS steps."""
    from torch._inductor.graph import GraphLowering

    stage, options = VARIANTS[variant]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engines, ref = gan_engines(stage)
    modules: list[dict] = []

    def save_output_code(code: str) -> None:
        # runs while inductor compiles, inside graphzero's config patch: what the graph really got
        modules.append({"calls": _calls(code),
                        "config": {k: _config_value(k) for k in _available(ALL_OFF)}})

    patch = _available({**ALL_OFF, **(SWITCHES[switch] if switch else {})})
    pinned = inductor_config.PINNED
    saved_hook = GraphLowering.save_output_code
    grads, norms = [], []
    try:
        if lift_pin:
            inductor_config.PINNED = {}
        GraphLowering.save_output_code = staticmethod(save_output_code)
        with torch._inductor.config.patch(patch):
            step = torch.compile(gan_loss, backend="graphzero", options={"engines": engines, "inner": "inductor", **options})
            for t in range(STEPS):
                z, real = data(t, rank, (4, 8), (4, 8))
                step(engines, z, real).backward()
                ref.accumulate(gan_loss, [data(t, r, (4, 8), (4, 8)) for r in range(world)])
                for name, eng in engines.items():
                    got = full_grads(eng)
                    assert_grads_close(got, ref.grads(name), **GRAD_TOL, what=f"{switch} step {t} {name}")
                    grads.append(torch.cat([g.flatten() for g in got]))
                    eng.step()
                ref.step()
                for name, eng in engines.items():
                    norms.append(float(eng.get_global_grad_norm()))
                    torch.testing.assert_close(norms[-1], ref.norms[name], rtol=1e-4, atol=1e-6)
    finally:
        GraphLowering.save_output_code = saved_hook
        inductor_config.PINNED = pinned
        graphzero.detach(*engines.values())
    return {"modules": modules, "grads": grads, "norms": norms}


def _collectives(result: dict) -> list[str]:
    """The collectives (not the waits) in issue order, graph by graph."""
    return [c for m in result["modules"] for c in m["calls"] if not c.startswith("wait_tensor")]


def _check_ranks_agree(results: list[dict], what: str) -> None:
    first = [m["calls"] for m in results[0]["modules"]]
    for rank, r in enumerate(results[1:], 1):
        assert [m["calls"] for m in r["modules"]] == first, f"{what}: rank {rank} issues collectives in another order"
    assert _collectives(results[0]), f"{what}: no collective in the generated code (the check would be empty)"


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide (as in test_zero3.py)
    yield
    ranks.close()


@pytest.fixture(scope="module")
def switch_off(ranks):
    """The switch-off run per variant, computed once."""
    cache: dict[str, list[dict]] = {}

    def get(variant: str) -> list[dict]:
        if variant not in cache:
            cache[variant] = ranks.run(overlap_scenario, variant, None)
            _check_ranks_agree(cache[variant], f"{variant} switches off")
        return cache[variant]
    return get


def _cases():
    # VARIANTS order: every ZeRO-2 run before the first ZeRO-3 engine patches the ranks' torch
    for variant in VARIANTS:
        for switch, patch in SWITCHES.items():
            marks = [] if _available(patch) else [pytest.mark.skip(reason=f"torch {torch.__version__} has no {switch}")]
            yield pytest.param(variant, switch, id=f"{variant}-{switch}", marks=marks)


@pytest.mark.parametrize(("variant", "switch"), list(_cases()))
def test_overlap_switch(ranks, switch_off, variant, switch):
    """The user turns the switch on globally: graphzero's graphs keep their collective order on
    every rank and their gradients; a switch graphzero pins never reaches them."""
    off = switch_off(variant)
    pins = inductor_config.pinned()
    own = inductor_config.inductor_patch(backward=True, overlap=True, gathers=False)  # graphzero's ZeRO-1/2 backward
    on = ranks.run(overlap_scenario, variant, switch)
    what = f"{variant} {switch} on"
    _check_ranks_agree(on, what)
    assert _collectives(on[0]) == _collectives(off[0]), f"{what}: collectives moved relative to each other"
    for rank in range(len(on)):
        for i, (a, b) in enumerate(zip(on[rank]["grads"], off[rank]["grads"])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, i=i: f"{what}: grads {i} vs off: {m}")
        torch.testing.assert_close(on[rank]["norms"], off[rank]["norms"], rtol=1e-6, atol=1e-7)
    for key, value in _available(SWITCHES[switch]).items():
        got = [m["config"][key] for m in on[0]["modules"]]
        if key in pins:
            assert all(v in (pins[key], own.get(key, pins[key])) for v in got), f"{what}: pinned {key} got {got}"
        elif key != inductor_config.REORDER_PASSES:
            assert value in got, f"{what}: {key} never reached graphzero's graphs ({got})"
    moved = [i for i, (a, b) in enumerate(zip(on[0]["modules"], off[0]["modules"])) if a["calls"] != b["calls"]]
    print(f"{what}: {len(on[0]['modules'])} graphs, collectives/waits placed differently in graphs {moved}")
    for graph in on[0]["modules"]:
        print("   ", graph["calls"])


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_pinned_switch_unpinned_zero3(ranks, switch_off, switch):
    """What a pinned switch would do to graphzero's ZeRO-3 graphs (the reason for the pin): ranks
    still agree and gradients stay right (asserted every step against the reference), while the
    collectives' relative order or place changes (printed; see graphzero/inductor_config.py)."""
    if not any(k in inductor_config.pinned() for k in _available(SWITCHES[switch])):
        pytest.skip(f"graphzero does not pin {switch} on torch {torch.__version__}")
    off = switch_off("zero3")
    lifted = ranks.run(overlap_scenario, "zero3", switch, lift_pin=True)
    _check_ranks_agree(lifted, f"ZeRO-3 {switch} unpinned")
    reordered = _collectives(lifted[0]) != _collectives(off[0])
    print(f"ZeRO-3 {switch} unpinned: collectives reordered relative to each other: {reordered}")
    for graph in lifted[0]["modules"]:
        print("   ", graph["calls"])


def test_patch_per_torch_version():
    """The patch graphzero applies: its own sink-waits pass only for a ZeRO-1/2 backward with overlap,
    the pins everywhere, and only options this torch has."""
    pins = inductor_config.pinned()
    assert all(inductor_config.has_option(k) for k in pins)
    z2_bw = inductor_config.inductor_patch(backward=True, overlap=True, gathers=False)
    assert z2_bw[inductor_config.REORDER] is True and z2_bw[inductor_config.REORDER_PASSES] == ["sink_waits_iterative"]
    # ZeRO-3 graphs and every backward: graphzero's placement, not inductor's peak-memory reordering
    peak = {inductor_config.PEAK_MEMORY: False} if inductor_config.has_option(inductor_config.PEAK_MEMORY) else {}
    assert inductor_config.inductor_patch(backward=False, overlap=True, gathers=False) == pins
    assert inductor_config.inductor_patch(backward=True, overlap=False, gathers=False) == {**pins, **peak}
    assert all(z2_bw[k] == v for k, v in peak.items())
    for backward in (False, True):
        assert inductor_config.inductor_patch(backward=backward, overlap=True, gathers=True) == {**pins, **peak}
    with torch._inductor.config.patch(z2_bw):  # every key is a real option of this torch
        pass
