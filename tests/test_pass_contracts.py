"""Pass contracts (passes/contract.py): every pass names the facts it requires and provides, the
pipelines are checked against them, a misordered pipeline is a PipelineOrderError naming the pass and
the fact; the option ``disable_passes`` leaves an optional pass out, and gradients stay exact.
"""
from __future__ import annotations

import copy

import pytest
import torch

from graphzero import compiler, passes
from graphzero.errors import OptionError, PipelineOrderError
from graphzero.options import Options
from graphzero.passes import (
    FORWARD_PIPELINE,
    JOINT_PIPELINE,
    PIPELINE,
    ZERO3_BACKWARD,
    annotate_owner,
    backward_pipeline,
    bucket,
    bucket_gathers_forward,
    check_pipeline,
    schedule_gathers_forward,
    sum_shard_grads,
)
from scenario_utils import (
    assert_grads_close,
    assert_params_close,
    data,
    ds_config,
    engine,
    full_grads,
    mlp,
    rank_world,
)

ALL = JOINT_PIPELINE + FORWARD_PIPELINE + ZERO3_BACKWARD + PIPELINE


def test_every_pass_has_a_contract_and_the_pipelines_satisfy_them():
    assert all(p.contract.requires or p.contract.provides for p in ALL)
    joint = check_pipeline(JOINT_PIPELINE)
    check_pipeline(FORWARD_PIPELINE, joint)
    for gathers in (False, True):
        assert backward_pipeline(gathers) == (ZERO3_BACKWARD if gathers else ()) + PIPELINE
    assert passes.OPTIONAL_PASSES == {"schedule_overlap", "write_into_bucket"}


@pytest.mark.parametrize(("order", "pass_name", "fact", "why"), [
    ((bucket, annotate_owner), "bucket", "grads", "annotate_owner provides it later"),
    # ZeRO-3's passes rewrite the gradient outputs: after annotate_owner, its ctx.grads are stale
    ((annotate_owner, sum_shard_grads, bucket), "bucket", "grads", "sum_shard_grads invalidated it"),
    # lowering replaces the waits ctx.reduced holds: the overlap scheduling must come first
    (tuple(p for p in PIPELINE if p.__name__ != "schedule_overlap") + (passes.schedule_overlap,),
     "schedule_overlap", "reduced", "lower_reduce_scatter invalidated it"),
    ((bucket_gathers_forward, schedule_gathers_forward), "bucket_gathers_forward", "gather waits at first use",
     "schedule_gathers_forward provides it later"),
])
def test_a_misordered_pipeline_names_the_pass_and_the_missing_fact(order, pass_name, fact, why):
    with pytest.raises(PipelineOrderError) as info:
        check_pipeline(order, {"gathers tagged"})
    assert (info.value.pass_name, info.value.fact) == (pass_name, fact)
    assert f"pass {pass_name} requires {fact!r}" in str(info.value) and why in str(info.value)


def test_the_backward_pipeline_is_checked_when_built(monkeypatch):
    monkeypatch.setattr(passes, "PIPELINE", (passes.bucket, *PIPELINE))
    with pytest.raises(PipelineOrderError, match="pass bucket requires 'grads'"):
        backward_pipeline(False)
    with pytest.raises(ValueError, match="only optional passes"):
        passes.backward_pipeline(False, ["fold_norm"])


def test_disable_passes_option():
    assert Options.parse({}).disable_passes == ()
    opts = Options.parse({"disable_passes": ["write_into_bucket", "schedule_overlap", "write_into_bucket"]})
    assert opts.disable_passes == ("schedule_overlap", "write_into_bucket")
    assert [p.__name__ for p in backward_pipeline(False, opts.disable_passes)] == [
        "annotate_owner", "bucket", "local_accumulate", "insert_reduce_scatter", "fp32_accumulate", "fold_norm",
        "lower_reduce_scatter"]
    for value, needle in ((["fold_norm"], "pass 'fold_norm' cannot be disabled"),
                          (["write_into_buckets"], "unknown pass 'write_into_buckets'"),
                          ("write_into_bucket", "must be a list of pass names")):
        with pytest.raises(OptionError, match=needle):
            Options.parse({"disable_passes": value})


def regression_loss(model, x, y):
    return (model(x) - y).square().mean()


def disabled_passes_scenario(disabled: tuple[str, ...], steps: int = 2) -> None:
    """graphzero with ``disabled`` left out against DeepSpeed eager: the compiled backward has no node
    of a disabled pass, and gradients and parameters match at test_single_engine's tolerances."""
    rank, _ = rank_world()
    torch.manual_seed(3)
    M = mlp(6, 24, 3, depth=3)
    ds_eager = engine(copy.deepcopy(M), ds_config(2))
    gz = engine(M, ds_config(2))
    seen: list[tuple[set[str], set[str]]] = []   # (passes run, passes that left nodes) per backward

    def recording(gm, ctx, after_pass=None, pipeline=PIPELINE):
        gm = original(gm, ctx, after_pass, pipeline)
        seen.append(({p.__name__ for p in pipeline}, {n.meta["graphzero"]["pass"] for n in gm.graph.nodes
                                                      if "graphzero" in n.meta}))
        return gm

    original, compiler.run_pipeline = compiler.run_pipeline, recording
    try:
        step = torch.compile(regression_loss, backend="graphzero",
                             options={"engines": {"model": gz}, "disable_passes": list(disabled)})
        for t in range(steps):
            x, y = data(t, rank, (5, 6), (5, 3))
            ds_eager.backward(regression_loss(ds_eager, x, y))
            gz.backward(step(gz, x, y))
            assert_grads_close(full_grads(gz), full_grads(ds_eager), rtol=1e-5, atol=1e-6, what=f"step {t}")
            ds_eager.step()
            gz.step()
            assert_params_close(gz, ds_eager.module, rtol=1e-5, atol=1e-6, what=f"step {t}")
    finally:
        compiler.run_pipeline = original
    backward = [(ran, left) for ran, left in seen if "annotate_owner" in ran]
    assert backward, seen
    for ran, left in backward:
        assert not (ran | left) & set(disabled) and {"insert_reduce_scatter", "lower_reduce_scatter"} <= left
        # the Linear weight gradients are matmuls it rewrites (under inductor; with inner="eager" none are)
        assert ("write_into_bucket" in left) == ("write_into_bucket" not in disabled)


@pytest.mark.parametrize("disabled", [(), ("schedule_overlap", "write_into_bucket")])
def test_disabled_passes_leave_no_node_and_gradients_stay_exact(ranks, disabled):
    ranks.run(disabled_passes_scenario, disabled)
