"""The ``collective`` option on real gloo ranks: each way of reducing a bucket to a rank's shard gives
the reference's gradients.

On gloo, ``"auto"`` sends each reduce-scatter as an all-to-all and sums the received chunks
(passes/lower_reduce_scatter.py: gloo's own reduce-scatter is an all-reduce underneath);
``"reduce_scatter"`` keeps the backend's. The GAN (discriminator called twice) at ZeRO-2 and ZeRO-3,
3 steps each, gradients and gradient norms against the single-process reference, and the ops the
compiled step really ran (torch.profiler) show which one was used.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import graphzero
from scenario_utils import check_gan_step, data, gan_engines, gan_loss

STEPS = 3
A2A, RS = "_c10d_functional::all_to_all_single", "_c10d_functional::reduce_scatter_tensor"


def collective_scenario(stage: int, collective: str) -> set[str]:
    """3 checked GAN steps with ``collective``; the reduction ops the compiled step ran."""
    rank = torch.distributed.get_rank()
    engines, ref = gan_engines(stage)
    ran: set[str] = set()
    try:
        step = torch.compile(gan_loss, backend="graphzero", options={"engines": engines, "collective": collective})
        for t in range(STEPS):
            # not the first step: compiling traces both ops on fake tensors
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if t else \
                    contextlib.nullcontext() as prof:
                step(engines, *data(t, rank, (4, 8), (4, 8))).backward()
            if t:
                ran |= {e.name for e in prof.events() if e.name in (A2A, RS)}
            check_gan_step(engines, ref, t)
    finally:
        graphzero.detach(*engines.values())
        torch._dynamo.reset()
    return ran


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide (as in test_zero3.py)
    yield
    ranks.close()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("collective, expected", [("auto", {A2A}), ("reduce_scatter", {RS})])
def test_each_collective_reduces_to_the_reference(ranks, stage, collective, expected):
    for ran in ranks.run(collective_scenario, stage, collective):
        assert ran == expected, ran
