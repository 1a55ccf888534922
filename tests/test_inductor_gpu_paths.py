"""Inductor code paths that run only for GPU inputs, forced on CPU, on graphzero's graphs.

Inductor skips some of its work when no input is on a GPU. graphzero's first run on a GPU (an H200,
tools/gpu_bench.sh) crashed in one of them: comprehensive padding's ``mark_nodes_dislike_padding``
reads every backward output that compile_fx marked user-visible as a graph node, and graphzero's
backward returns None for the gradients it writes into the engines' partitions. Here
``disable_padding_cpu=False`` runs that pass on CPU: the GAN (discriminator called twice) at ZeRO-2
and ZeRO-3 compiles, the pass really saw graphzero's graphs, and gradients and gradient norms match
the single-process reference over 3 steps.
"""
from __future__ import annotations

import pytest
import torch

import graphzero
from scenario_utils import check_gan_step, data, gan_engines, gan_loss

STEPS = 3


def padding_scenario(stage: int) -> int:
    """The GAN at ``stage`` with inductor's GPU padding pass on; returns how often the pass ran."""
    from torch._inductor import graph as inductor_graph

    rank = torch.distributed.get_rank()
    engines, ref = gan_engines(stage)
    real_extend = inductor_graph.extend_user_visible_output_strides
    seen = []

    def extend(outputs):
        seen.append(len(outputs))
        return real_extend(outputs)

    inductor_graph.extend_user_visible_output_strides = extend
    try:
        # caches off: a cache hit compiles nothing, and the pass would not run
        with torch._inductor.config.patch({"disable_padding_cpu": False, "comprehensive_padding": True,
                                           "force_disable_caches": True}):
            step = torch.compile(gan_loss, backend="graphzero", options={"engines": engines, "inner": "inductor"})
            for t in range(STEPS):
                step(engines, *data(t, rank, (4, 8), (4, 8))).backward()
                check_gan_step(engines, ref, t)
    finally:
        inductor_graph.extend_user_visible_output_strides = real_extend
        graphzero.detach(*engines.values())
    return len(seen)


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide (as in test_zero3.py)
    yield
    ranks.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_gpu_padding_pass_on_graphzero_graphs(ranks, stage):
    runs = ranks.run(padding_scenario, stage)
    # forward and backward graph of the step at least: the pass saw graphzero's own graphs
    assert all(n >= 2 for n in runs), f"inductor's padding pass ran {runs} times per rank"
