"""The lean step's source gate (gate.MIRRORED): the lean ZeRO-1/2 step stands in for
``DeepSpeedZeroOptimizer.step()`` only while the DeepSpeed functions it re-implements are the ones it
was written against; otherwise DeepSpeed's own step runs, with one warning naming what changed.

- the fingerprints recorded for DeepSpeed 0.19.8 match the installed DeepSpeed 0.19.8;
- the fingerprint ignores comments and blank lines, and sees any code change;
- on 2 gloo ranks, a GAN at ZeRO-2 with a clip that bites: with the table changed, or with one
  mirrored function's source changed (a monkeypatched ``unscale_and_clip_grads``), the engines keep
  DeepSpeed's step (no ``LeanStep`` installed), the warning is logged once per engine naming the
  function, and parameters are bitwise those of engines run with ``lean_step=False`` and within the
  fp32 tolerances of the single-process reference after every one of 3 steps.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from graphzero.deepspeed_adapter.step import gate
from scenario_utils import (
    PARAM_TOL,
    Reference,
    assert_params_close,
    data,
    ds_config,
    engine,
    gan_loss,
    mlp,
    rank_world,
)

CLIP = 0.01   # below the first-step norms (about 0.05): the clip bites
UNSCALE = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.unscale_and_clip_grads"


def test_recorded_fingerprints_match_deepspeed_0_19_8():
    import deepspeed
    if deepspeed.__version__ != "0.19.8":
        pytest.skip(f"fingerprints are recorded for DeepSpeed 0.19.8, not {deepspeed.__version__}")
    assert gate.changed_mirrors() == []
    assert gate.changed_mirrors(gate.ZERO3_MIRRORED) == [] and len(gate.ZERO3_MIRRORED) == 2
    assert UNSCALE in gate.MIRRORED and len(gate.MIRRORED) >= 10


def _load(tmp_path, name: str, source: str):
    import importlib.util
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.norm


def test_fingerprint_sees_code_not_comments(tmp_path):
    fp = gate.fingerprint
    plain = _load(tmp_path, "plain", "def norm(x):\n    return x * 2\n")
    commented = _load(tmp_path, "commented", "def norm(x):\n    # a comment DeepSpeed adds\n\n    return x * 2   \n")
    fixed = _load(tmp_path, "fixed", "def norm(x):\n    return x * 2.0\n")
    assert len(fp(plain)) == 64
    assert fp(plain) == fp(commented)
    assert fp(plain) != fp(fixed)
    assert gate.changed_mirrors({"json:dumps": fp(plain)}) == ["json:dumps"]
    assert gate.changed_mirrors({"json:no_such_function": fp(plain)}) == ["json:no_such_function"]
    import json
    assert gate.changed_mirrors({"json:dumps": fp(json.dumps)}) == []


def gate_scenario(mode: str, steps: int = 3) -> list[str]:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    rank, world = rank_world()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("graphzero")
    logger.addHandler(handler)
    original_table, original_unscale = dict(gate.MIRRORED), DeepSpeedZeroOptimizer.unscale_and_clip_grads
    if mode == "table":
        gate.MIRRORED[UNSCALE] = "0" * 64
    elif mode == "source":
        def unscale_and_clip_grads(self, grad_groups_flat, total_norm):   # a DeepSpeed change graphzero has not seen
            return original_unscale(self, grad_groups_flat, total_norm)
        DeepSpeedZeroOptimizer.unscale_and_clip_grads = unscale_and_clip_grads
    else:
        assert mode == "unchanged", mode
    try:
        torch.manual_seed(5)
        models = {"gen": mlp(8, 32, 8, depth=3), "disc": mlp(8, 32, 1, depth=3)}
        ref = Reference(models, clip=CLIP)
        cfg = ds_config(2, clip=CLIP)
        gated = {k: engine(copy.deepcopy(m), cfg) for k, m in models.items()}
        own = {k: engine(copy.deepcopy(m), cfg) for k, m in models.items()}
        step_gated = torch.compile(gan_loss, backend="graphzero", options={"engines": gated, "lean_step": True})
        step_own = torch.compile(gan_loss, backend="graphzero", options={"engines": own, "lean_step": False})
        for t in range(steps):
            z, real = data(t, rank, (4, 8), (4, 8))
            step_gated(gated, z, real).backward()
            step_own(own, z, real).backward()
            for eng in (*gated.values(), *own.values()):
                eng.step()
            ref.accumulate(gan_loss, [data(t, r, (4, 8), (4, 8)) for r in range(world)])
            ref.step()
            for name, eng in gated.items():
                kind = type(eng.optimizer.__dict__.get("step")).__name__
                assert kind == ("LeanStep" if mode == "unchanged" else "NoneType"), (mode, kind)
                what = f"{mode} step {t} {name}"
                norm = float(own[name].get_global_grad_norm())
                if t == 0:
                    assert norm > CLIP, f"{what}: the clip ({CLIP}) does not bite (norm {norm})"
                if mode != "unchanged":   # DeepSpeed's own step on both sides: bitwise
                    assert float(eng.get_global_grad_norm()) == norm, what
                    assert_params_close(eng, own[name].module, rtol=0, atol=0, what=f"{what} vs lean_step=False")
                assert_params_close(eng, ref.models[name], **PARAM_TOL, what=f"{what} vs reference")
    finally:
        gate.MIRRORED.clear()
        gate.MIRRORED.update(original_table)
        DeepSpeedZeroOptimizer.unscale_and_clip_grads = original_unscale
        logger.removeHandler(handler)
    return [r.getMessage() for r in records if "lean step" in r.getMessage()]


@pytest.mark.parametrize("mode", ["table", "source"])
def test_changed_deepspeed_source_keeps_deepspeed_step(ranks, mode):
    for messages in ranks.run(gate_scenario, mode):
        # once per engine (gen, disc), although attach runs for every compiled graph
        assert len(messages) == 2, messages
        for msg, name in zip(sorted(messages), ("disc", "gen")):
            assert f"engine {name!r}" in msg and UNSCALE in msg and "DeepSpeed 0.19.8" in msg, msg


def test_unchanged_source_keeps_the_lean_step(ranks):
    assert ranks.run(gate_scenario, "unchanged") == [[], []]
