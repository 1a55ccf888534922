"""The default suite's fixed sample of the long parametrized tests: a case outside a test's sample
is skipped, naming the switch, unless ``GRAPHZERO_MATRIX=full`` (``make test-full``) runs them all.

Each sample keeps every dimension the test exists for (each ZeRO stage, each dtype, each call
shape) at least once; what it drops are their combinations. Inductor's cold compile of each new
graph dominates the suite on 2 CPU cores, so a dropped case saves its compiles."""
from __future__ import annotations

import os
from collections.abc import Iterable

import pytest

FULL = os.environ.get("GRAPHZERO_MATRIX") == "full"
ONLY_FULL = pytest.mark.skip(reason="outside the default sample: GRAPHZERO_MATRIX=full (make test-full)")


def sample(cases: Iterable, default: Iterable) -> list:
    """``cases`` as pytest parameters; those not in ``default`` skip unless GRAPHZERO_MATRIX=full.
    A tuple case fills several arguments (``parametrize("stage,gas", sample(...))``)."""
    cases, default = list(cases), list(default)
    unknown = [c for c in default if c not in cases]
    assert not unknown, f"default sample names cases that do not exist: {unknown}"
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)),
                         marks=[] if FULL or case in default else [ONLY_FULL]) for case in cases]
