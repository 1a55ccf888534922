"""Every tensor graphzero hands to a collective lives on the device its process group needs.

The suite runs gloo on CPU, where a tensor created without a device happens to be right; NCCL takes
CUDA tensors only. Here the process group is *reported* as NCCL (only the backend lookup is mocked,
tests/fake_cuda.py) and a cuda:0 is emulated on CPU tensors, so every collective that graphzero
issues records the device of each tensor handed to it: all must be the device
``graphzero.devices.collective_device`` names for an NCCL group (cuda:0), while the collectives
themselves run on the real gloo group. Covered: the rank agreement, the eager safety net, the
ZeRO-1 window's local sums and their flush at the boundary, the lean step's norm all-reduce and
parameter all-gather, the ZeRO-3 gather and its reduce-scatter. Gradients norms and parameters are
compared with a single-process reference over 3 steps, so the emulation changes no numbers.

Host syncs of device tensors that graphzero's own code does are listed and checked too: the
agreement's result check (``tolist``; its scheduling is the rank-agreement work's) and the lean
step's overflow decision (DeepSpeed's own step reads it on the host as well).
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from scenario_utils import (
    PARAM_TOL,
    Reference,
    clone_models,
    data,
    ds_config,
    engine,
    gan_loss,
    mlp,
    rank_world,
)

STEPS = 3


# -- the helper --------------------------------------------------------------------------------
class _Group:
    def __init__(self, *types: str) -> None:
        self._device_types = [torch.device(t) for t in types]


@pytest.mark.parametrize("backend,fallback,expected", [
    ("nccl", None, "cuda:3"), ("nccl", "cpu", "cuda:3"), ("nccl", "cuda:1", "cuda:1"),
    ("gloo", None, "cpu"), ("gloo", "cuda:1", "cuda:1"), ("gloo", "cpu", "cpu"),
    ("cpu:gloo,cuda:nccl", None, "cpu"), ("cpu:gloo,cuda:nccl", "cuda:2", "cuda:2"),
    ("cuda:nccl", None, "cuda:3"), ("xccl", None, "xpu:3"),
])
def test_collective_device(backend, fallback, expected):
    from graphzero.devices import collective_device
    with mock.patch.object(dist, "get_backend", lambda group=None: backend), \
            mock.patch.object(torch.cuda, "current_device", lambda: 3), \
            mock.patch.object(torch.xpu, "current_device", lambda: 3):
        assert collective_device(object(), fallback) == torch.device(expected)


def test_collective_device_of_a_plugin_backend():
    """A backend torch does not know: the devices the group registered, as torch's object collectives."""
    from graphzero.devices import collective_device
    with mock.patch.object(dist, "get_backend", lambda group=None: "hccl_plugin"), \
            mock.patch.object(torch.cuda, "current_device", lambda: 1):
        assert collective_device(_Group("cuda")) == torch.device("cuda:1")
        assert collective_device(_Group("cpu", "cuda")) == torch.device("cpu")


# -- the multi-rank scenarios ------------------------------------------------------------------
def _engines(stage: int, gas: int):
    torch.manual_seed(11)
    models = {"gen": mlp(8, 16, 8), "disc": mlp(8, 16, 1)}
    ref = Reference(clone_models(**models))
    return {k: engine(m, ds_config(stage, gas=gas)) for k, m in models.items()}, ref


def _summary(mode) -> dict:
    return {"calls": [(c.name, [str(d) for d in c.devices], str(c.expected), c.origin) for c in mode.graphzero_calls()],
            "host_syncs": sorted({(n, o) for n, o in mode.host_syncs if o is not None}),
            "mixed": sorted({(n, o) for n, o in mode.mixed if o is not None})}


def nccl_reported_scenario(stage: int, gas: int, skip_boundary_backward: bool) -> dict:
    """Eager steps (no compile: the safety net, ZeRO-1 local sums and flush, the lean step; at
    ZeRO-3 the module's gathers) and one direct agreement, with the group reported as NCCL."""
    from fake_cuda import reported_as_nccl

    import graphzero
    from graphzero import rank_agreement

    rank, world = rank_world()
    engines, ref = _engines(stage, gas)
    with reported_as_nccl(*engines.values()) as mode:
        graphzero.attach(**engines)
        try:
            assert all(eng._graphzero_binding.param_set.device == torch.device("cuda:0") for eng in engines.values())
            rank_agreement.agree(rank_agreement.fingerprint(("device test", stage)),
                                 engines["gen"].optimizer.dp_process_group, "the device test")
            for t in range(STEPS):
                for micro in range(gas):
                    if not (skip_boundary_backward and micro == gas - 1):
                        inputs = [x.to("cuda:0") for x in data(t * gas + micro, rank, (4, 8), (4, 8))]
                        gan_loss(engines, *inputs).backward()
                        ref.accumulate(gan_loss, [data(t * gas + micro, r, (4, 8), (4, 8)) for r in range(world)], gas)
                    for eng in engines.values():
                        eng.step()
                ref.step()
                for name, eng in engines.items():
                    with torch._C.DisableTorchFunction():
                        torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name],
                                                   rtol=1e-4, atol=1e-6, msg=f"step {t} {name} norm")
            for name, eng in engines.items():
                _assert_params(eng, ref.models[name], f"{name} after {STEPS} steps")
        finally:
            graphzero.detach(*engines.values())
    return _summary(mode)


def _assert_params(eng, ref_model, what: str) -> None:
    with torch._C.DisableTorchFunction():
        if eng.zero_optimization_stage() == 3:
            import deepspeed
            with deepspeed.zero.GatheredParameters(list(eng.module.parameters())):
                params = [p.detach().clone() for p in eng.module.parameters()]
        else:
            params = [p.detach().clone() for p in eng.module.parameters()]
        for p, q in zip(params, ref_model.parameters()):
            torch.testing.assert_close(p, q.detach(), **PARAM_TOL, msg=lambda m: f"{what}: {m}")


def _check(summaries: list[dict], needed: set[str]) -> None:
    for rank, s in enumerate(summaries):
        seen = {name for name, *_ in s["calls"]}
        assert needed <= seen, f"rank {rank}: collectives {needed - seen} never ran; saw {sorted(seen)}"
        wrong = [c for c in s["calls"] if any(d != c[2] for d in c[1]) or c[2] != "cuda:0"]
        assert not wrong, f"rank {rank}: tensors on a device NCCL would reject (name, devices, needed, where):\n" + \
            "\n".join(map(str, wrong))
        assert not s["mixed"], f"rank {rank}: graphzero ops mixing cuda:0 and CPU tensors: {s['mixed']}"
        syncs = {(n, o.split(":")[0]) for n, o in s["host_syncs"]}
        allowed = {("tolist", "graphzero/rank_agreement.py"), ("__bool__", "graphzero/deepspeed_adapter/step/lean.py")}
        assert syncs <= allowed, f"rank {rank}: host syncs on the hot path: {sorted(syncs - allowed)}"


@pytest.mark.parametrize("stage,gas,skip,needed", [
    (2, 1, False, {"all_reduce", "all_gather_single"}),
    # the boundary micro-step has no backward: its step() flushes the window's local sums
    (1, 2, True, {"all_reduce", "all_gather_single"}),
    (3, 1, False, {"all_gather_into_tensor", "reduce_scatter_tensor"}),
])
def test_collectives_on_the_nccl_device(ranks, stage, gas, skip, needed):
    _check(ranks.run(nccl_reported_scenario, stage, gas, skip), needed)


def cpu_engine_on_nccl_scenario() -> str:
    import graphzero
    from graphzero.errors import UnsupportedConfigError
    engines, _ = _engines(2, 1)
    with mock.patch.object(dist, "get_backend", lambda group=None: "nccl"), \
            pytest.raises(UnsupportedConfigError) as err:
        graphzero.attach(**engines)
    assert not any(hasattr(e, "_graphzero_binding") for e in engines.values())
    return str(err.value)


def test_engine_on_a_device_its_group_cannot_reduce(ranks):
    for message in ranks.run(cpu_engine_on_nccl_scenario):
        assert "'gen'" in message and "cpu" in message and "nccl" in message, message
