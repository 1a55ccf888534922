"""One re-trace after engines are attached from ``options["engines"]``.

The backend first runs when Dynamo has already traced (part of) the user's step through
DeepSpeed's own ``engine.forward``, whose hooks break the graph; the frames traced that way keep
their graph breaks. The first backward after the attach (a quiet point: nothing is being
compiled) drops Dynamo's compiled code, so the next call traces the step again, now without
DeepSpeed's hooks: one graph instead of several. ``graphzero.attach()`` before the first call
avoids the extra compile altogether.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from .ownership import ParamSet

log = logging.getLogger("graphzero")


def request(param_sets: Iterable[ParamSet]) -> None:
    for ps in param_sets:
        ps.retrace_pending = True


def maybe_reset(param_sets: Iterable[ParamSet]) -> None:
    pending = [ps for ps in param_sets if ps.retrace_pending]
    if not pending:
        return
    for ps in pending:
        ps.retrace_pending = False
    log.info("graphzero attached engine(s) %s during the first compile; dropping Dynamo's compiled code so "
             "the next call traces the step without DeepSpeed's forward hooks", [ps.name for ps in pending])
    torch._dynamo.reset_code_caches()
    # Recorded in Dynamo's counters so that the dump can leave out graphs compiled before the
    # re-trace and their graph breaks.
    counters = torch._dynamo.utils.counters["graphzero"]
    counters["retraces"] += 1
    counters["graph_breaks_before_retrace"] = int(sum(torch._dynamo.utils.counters["graph_break"].values()))


def generation() -> int:
    """How many re-traces happened so far in this process."""
    return torch._dynamo.utils.counters["graphzero"]["retraces"]


def graph_breaks() -> int:
    """Dynamo graph breaks since the last re-trace."""
    total = int(sum(torch._dynamo.utils.counters["graph_break"].values()))
    return total - torch._dynamo.utils.counters["graphzero"]["graph_breaks_before_retrace"]
