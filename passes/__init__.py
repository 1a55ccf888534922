"""graphzero's FX passes on the AOT backward graph, and the one place their order lives.

Each pass is ``(gm, ctx) -> gm``; its docstring says what it inserts. A pass reads and extends only
its `PassContext`, so it can be run on a hand-built graph without DeepSpeed or a process group.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import fx

from ._graph import Bucket, GradOutput, PassContext
from .annotate_owner import annotate_owner
from .bucket import bucket
from .fp32_accumulate import fp32_accumulate
from .reduce_scatter import insert_reduce_scatter
from .schedule import schedule_overlap

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

# Order matters: each pass relies on what the previous ones put in the context.
#   annotate_owner -> ctx.grads; bucket -> ctx.buckets; insert_reduce_scatter -> ctx.reduced;
#   fp32_accumulate -> ctx.runtime_inputs (and drops owned grads from the outputs); schedule_overlap moves waits.
PIPELINE: tuple[Pass, ...] = (annotate_owner, bucket, insert_reduce_scatter, fp32_accumulate, schedule_overlap)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext,
                 after_pass: Callable[[str, fx.GraphModule], None] | None = None) -> fx.GraphModule:
    """Run every pass in order; ``after_pass(name, gm)`` sees the graph after each one (for the dump)."""
    for p in PIPELINE:
        gm = p(gm, ctx)
        if after_pass is not None:
            after_pass(p.__name__, gm)
    return gm


__all__ = [
    "PIPELINE",
    "Bucket",
    "GradOutput",
    "PassContext",
    "annotate_owner",
    "bucket",
    "fp32_accumulate",
    "insert_reduce_scatter",
    "run_pipeline",
    "schedule_overlap",
]
