"""graphzero's FX passes on AOT autograd's graphs, and the one place their order lives.

Three pipelines: on the joint graph before the partitioner (``JOINT_PIPELINE``), on the forward
graph (``FORWARD_PIPELINE``), on the backward graph (``PIPELINE``).

Each pass is ``(gm, ctx) -> gm``; its docstring says what it inserts. A pass reads and extends only
its `PassContext`, so it can be run on a hand-built graph without DeepSpeed or a process group.
"""
from __future__ import annotations

from collections.abc import Callable, Collection

from torch import fx

from ._graph import Bucket, GradOutput, Mode, PassContext, RuntimeInput, Slot
from .annotate_owner import annotate_owner
from .bucket import bucket
from .bucket_gathers import bucket_gathers_backward, bucket_gathers_forward
from .bucket_shard_grads import bucket_shard_grads
from .contract import check_pipeline, pass_contract
from .fold_norm import fold_norm
from .fp32_accumulate import fp32_accumulate
from .gather import schedule_gathers_backward, schedule_gathers_forward
from .hold_shard_grads import hold_shard_grads
from .local_accumulate import local_accumulate
from .lower_reduce_scatter import lower_reduce_scatter
from .reduce_scatter import insert_reduce_scatter
from .release import release
from .schedule import schedule_overlap
from .sum_shard_grads import sum_shard_grads
from .wait_params import wait_params
from .write_into_bucket import write_into_bucket

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

# Order matters: each order below is checked against the passes' contracts (contract.py) at import.
PIPELINE: tuple[Pass, ...] = (annotate_owner, bucket, local_accumulate, insert_reduce_scatter, fp32_accumulate,
                              fold_norm, schedule_overlap, lower_reduce_scatter, write_into_bucket)
JOINT_PIPELINE: tuple[Pass, ...] = (release,)
FORWARD_PIPELINE: tuple[Pass, ...] = (wait_params, schedule_gathers_forward, bucket_gathers_forward)
# ZeRO-3 backward: runs before PIPELINE (annotate_owner reads the outputs these passes rewrite).
ZERO3_BACKWARD: tuple[Pass, ...] = (schedule_gathers_backward, bucket_gathers_backward, sum_shard_grads,
                                    hold_shard_grads, bucket_shard_grads)
# passes the option ``disable_passes`` may leave out (debugging): nothing requires what they provide
OPTIONAL_PASSES = frozenset(p.__name__ for p in PIPELINE + ZERO3_BACKWARD if p.contract.optional)
# the forward and backward graphs have what the joint pipeline gave (the partitioner copies its tags)
_AFTER_JOINT = check_pipeline(JOINT_PIPELINE)
check_pipeline(FORWARD_PIPELINE, _AFTER_JOINT)


def backward_pipeline(gathers: bool, disabled: Collection[str] = ()) -> tuple[Pass, ...]:
    """The backward passes, checked: with ZeRO-3 gathers, ZERO3_BACKWARD first; without the
    optional passes named in ``disabled``."""
    if set(disabled) - OPTIONAL_PASSES:
        raise ValueError(f"only optional passes can be left out ({sorted(OPTIONAL_PASSES)}), got {sorted(disabled)}")
    pipeline = tuple(p for p in (ZERO3_BACKWARD if gathers else ()) + PIPELINE
                     if p.__name__ not in disabled)
    check_pipeline(pipeline, _AFTER_JOINT)
    return pipeline


for _gathers in (False, True):   # each backward pipeline, whole and without its optional passes
    backward_pipeline(_gathers)
    backward_pipeline(_gathers, OPTIONAL_PASSES)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext,
                 after_pass: Callable[[str, fx.GraphModule], None] | None = None,
                 pipeline: tuple[Pass, ...] = PIPELINE) -> fx.GraphModule:
    """Run every pass in order; ``after_pass(name, gm)`` sees the graph after each one (for the dump)."""
    for p in pipeline:
        gm = p(gm, ctx)
        if after_pass is not None:
            after_pass(p.__name__, gm)
    return gm


__all__ = [
    "FORWARD_PIPELINE",
    "JOINT_PIPELINE",
    "OPTIONAL_PASSES",
    "PIPELINE",
    "ZERO3_BACKWARD",
    "Bucket",
    "GradOutput",
    "Mode",
    "PassContext",
    "RuntimeInput",
    "Slot",
    "annotate_owner",
    "backward_pipeline",
    "bucket",
    "bucket_gathers_backward",
    "bucket_gathers_forward",
    "bucket_shard_grads",
    "check_pipeline",
    "fold_norm",
    "fp32_accumulate",
    "hold_shard_grads",
    "insert_reduce_scatter",
    "local_accumulate",
    "lower_reduce_scatter",
    "pass_contract",
    "release",
    "run_pipeline",
    "schedule_gathers_backward",
    "schedule_gathers_forward",
    "schedule_overlap",
    "sum_shard_grads",
    "wait_params",
    "write_into_bucket",
]
