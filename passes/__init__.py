"""graphzero's FX passes on AOT autograd's graphs, and the one place their order lives.

Three pipelines: on the joint graph before the partitioner (``JOINT_PIPELINE``), on the forward
graph (``FORWARD_PIPELINE``), on the backward graph (``PIPELINE``).

Each pass is ``(gm, ctx) -> gm``; its docstring says what it inserts. A pass reads and extends only
its `PassContext`, so it can be run on a hand-built graph without DeepSpeed or a process group.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import fx

from ._graph import Bucket, GradOutput, Mode, PassContext, RuntimeInput, Slot
from .annotate_owner import annotate_owner
from .bucket import bucket
from .bucket_gathers import bucket_gathers_backward, bucket_gathers_forward
from .bucket_shard_grads import bucket_shard_grads
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

# Order matters: each pass relies on what the previous ones put in the context.
#   annotate_owner -> ctx.grads; bucket -> ctx.buckets; local_accumulate (ZeRO-1 with gas > 1, or a
#   ZeRO-1/2 engine another graph of the same backward reaches again: keeps the gradients local and
#   drops their buckets, or feeds the local sum to them) -> ctx.buckets, grads; insert_reduce_scatter -> ctx.reduced;
#   fp32_accumulate -> ctx.runtime_inputs, ctx.accumulated (and drops owned grads from the outputs);
#   fold_norm (the squared norm of each accumulated shard, for the lean step or ZeRO-3's step); schedule_overlap moves waits;
#   lower_reduce_scatter (gloo: each reduce-scatter as an all-to-all + sum), where the waits stand;
#   write_into_bucket (matmul gradients computed into the bucket) last: nothing after it looks for a cat.
PIPELINE: tuple[Pass, ...] = (annotate_owner, bucket, local_accumulate, insert_reduce_scatter, fp32_accumulate,
                              fold_norm, schedule_overlap, lower_reduce_scatter, write_into_bucket)
# release tags the ZeRO-3 gathers DeepSpeed would not keep for recomputation: the partitioner then
# saves their shards, not the parameters.
JOINT_PIPELINE: tuple[Pass, ...] = (release,)
# wait_params: ZeRO-1/2 parameters wait for a deferred all-gather before their first read;
# schedule_gathers_forward needs release's tags (the partitioner copies them into the forward graph);
# bucket_gathers_forward needs the waits at first use, in first-use order (schedule_gathers).
FORWARD_PIPELINE: tuple[Pass, ...] = (wait_params, schedule_gathers_forward, bucket_gathers_forward)
# ZeRO-3 backward: the recomputed gathers are scheduled and bucketed like the forward ones; then a
# parameter's gradients in this graph are summed into one reduce-scatter (sum_shard_grads), held
# for or summed with those of other graphs of the same backward (hold_shard_grads, only in the
# variants that need it) and bucketed (bucket_shard_grads), all before annotate_owner reads the outputs.
ZERO3_BACKWARD: tuple[Pass, ...] = (schedule_gathers_backward, bucket_gathers_backward, sum_shard_grads,
                                    hold_shard_grads, bucket_shard_grads)


def backward_pipeline(gathers: bool) -> tuple[Pass, ...]:
    """The backward passes; with ZeRO-3 gathers, ZERO3_BACKWARD first."""
    return (ZERO3_BACKWARD if gathers else ()) + PIPELINE


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
    "fold_norm",
    "fp32_accumulate",
    "hold_shard_grads",
    "insert_reduce_scatter",
    "local_accumulate",
    "lower_reduce_scatter",
    "release",
    "run_pipeline",
    "schedule_gathers_backward",
    "schedule_gathers_forward",
    "schedule_overlap",
    "sum_shard_grads",
    "wait_params",
    "write_into_bucket",
]
