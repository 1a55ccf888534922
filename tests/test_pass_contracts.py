"""Pass contracts (passes/contract.py): every pass names the facts it requires and provides, the
pipelines are checked against them, a misordered pipeline is a PipelineOrderError naming the pass and
the fact.
"""
from __future__ import annotations

import pytest

from graphzero import passes
from graphzero.errors import PipelineOrderError
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
