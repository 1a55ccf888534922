"""No silent fallbacks (issue 18 item 5): an unexpected error from a torch or DeepSpeed internal is
raised with graphzero's context, and a DeepSpeed attribute a config check reads is read explicitly
(missing: an error naming it and the DeepSpeed version, never a default that turns the check off).
The lean step's source gate has its own file (test_lean_step_gate.py).
"""
from __future__ import annotations

import pytest
import torch

from graphzero.autograd_semantics import AccumulationProbe
from graphzero.errors import GraphZeroError, InternalsError


class _Engine:
    """Stands in for a ParamSet: AccumulationProbe reads only its name (and hashes it)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _probe(*leaves: torch.Tensor) -> tuple[AccumulationProbe, _Engine]:
    ps = _Engine("net")
    return AccumulationProbe({ps: [(leaf, f"p{i}") for i, leaf in enumerate(leaves)]}), ps


def _in_backward(fn, loss_fn, *, grad_of=None):
    """Run ``fn()`` inside the backward of ``loss_fn()`` (a custom Function's backward, as a compiled
    backward runs); ``grad_of``: use torch.autograd.grad with these inputs instead of backward()."""
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            try:
                seen["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                seen["error"] = exc
            return g

    out = Probe.apply(loss_fn()).sum()
    if grad_of is None:
        out.backward()
    else:
        torch.autograd.grad(out, grad_of)
    if "error" in seen:
        raise seen["error"]
    return seen["value"]


def test_accumulation_probe_reads_the_expected_cases():
    w, v = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    probe, ps = _probe(w, v)
    assert _in_backward(probe.accumulating, lambda: w * v) == {ps: True}
    probe, ps = _probe(w, v)
    # torch.autograd.grad writes no .grad: torch raises for the leaf, which is read as "not accumulating"
    assert _in_backward(probe.accumulating, lambda: w * v, grad_of=[w, v]) == {ps: False}


def test_unexpected_autograd_engine_error_is_raised_with_context():
    w = torch.nn.Parameter(torch.ones(3))
    probe, _ = _probe(w)
    # Outside a backward torch raises another RuntimeError: not "no accumulation" (the gradient
    # would be lost), but a graphzero error naming the engine, the torch internal and the cause.
    with pytest.raises(InternalsError, match="engine 'net'.*_will_engine_execute_node") as info:
        probe.accumulating()
    assert isinstance(info.value, GraphZeroError) and isinstance(info.value.__cause__, RuntimeError)
    assert torch.__version__ in str(info.value)


# -- config checks read DeepSpeed's attributes explicitly -------------------------------------------
def missing_attribute_scenario(attr: str) -> str:
    import deepspeed

    from graphzero import deepspeed_adapter
    from scenario_utils import ds_config, engine, mlp
    eng = engine(mlp(4, 8, 2), ds_config(2))
    saved = vars(eng).pop(attr)   # as if DeepSpeed had renamed it
    try:
        with pytest.raises(InternalsError) as info:
            deepspeed_adapter.attach([("net", eng)])
    finally:
        vars(eng)[attr] = saved
    msg = str(info.value)
    assert repr(attr) in msg and deepspeed.__version__ in msg, msg
    assert deepspeed_adapter.binding_of(eng) is None
    return msg


@pytest.mark.parametrize("attr", ["zenflow", "has_moe_layers", "gradient_average", "sequence_parallel_size",
                                  "module_forward_pre_hook"])
def test_missing_deepspeed_attribute_is_an_error(ranks, attr):
    ranks.run(missing_attribute_scenario, attr)
