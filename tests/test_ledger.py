"""The patch ledger (graphzero/deepspeed_adapter/ledger.py): every change graphzero makes to an
engine is undone exactly, in reverse order.

Unit tests of `PatchLedger` on plain objects, modules and tensors (no DeepSpeed).
"""
from __future__ import annotations

import copy

import pytest
import torch

from graphzero.deepspeed_adapter.ledger import PatchLedger


class Thing:
    def method(self):
        return "class"


def test_set_attr_shadowing_a_class_attribute_is_deleted_again():
    t, ledger = Thing(), PatchLedger("t")
    ledger.set_attr(t, "method", lambda: "patched")
    assert t.method() == "patched"
    ledger.undo()
    assert "method" not in vars(t) and t.method() == "class"
    assert len(ledger) == 0


def test_set_attr_keeps_the_instance_attribute_it_replaced():
    t, ledger = Thing(), PatchLedger("t")
    mine = t.method = lambda: "user's wrapper"
    ledger.set_attr(t, "method", lambda: "graphzero")
    ledger.set_attr(t, "method", lambda: "graphzero again")
    ledger.undo()
    assert vars(t)["method"] is mine


def test_set_attr_to_none_and_back():
    t, ledger = Thing(), PatchLedger("t")
    handle = t.hook = object()
    ledger.set_attr(t, "hook", None)
    assert t.hook is None
    ledger.undo()
    assert t.hook is handle


def test_pop_attr_and_absent_pop():
    t, ledger = Thing(), PatchLedger("t")
    mine = t.zero_grad = object()
    assert ledger.pop_attr(t, "zero_grad") is mine
    assert ledger.pop_attr(t, "missing") is None
    assert "zero_grad" not in vars(t)
    ledger.undo()
    assert vars(t)["zero_grad"] is mine and "missing" not in vars(t)


def test_descriptor_attribute_is_written_back_through_the_descriptor():
    shard, ledger = torch.zeros(3), PatchLedger("shard")
    ledger.set_attr(shard, "requires_grad", True)
    assert shard.requires_grad
    ledger.undo()
    assert not shard.requires_grad


def test_set_attr_refuses_what_it_could_not_undo():
    m, ledger = torch.nn.Linear(2, 2), PatchLedger("m")
    weight = m.weight
    with pytest.raises(TypeError, match="instance attribute"):
        ledger.set_attr(m, "weight", torch.nn.Parameter(torch.ones(2, 2)))
    # nn.Module.__setattr__ put it in _parameters: the ledger refuses, and the caller still sees
    # an error rather than a change that detach would not revert
    assert len(ledger) == 0
    m.weight = weight


def test_removed_hooks_come_back_with_their_ids_and_positions():
    m, ledger = torch.nn.Linear(2, 2), PatchLedger("m")
    calls = []
    h1 = m.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(1), with_kwargs=True)
    h2 = m.register_forward_pre_hook(lambda mod, args: calls.append(2))
    h3 = m.register_forward_hook(lambda mod, args, out: calls.append(3), always_call=True)
    pre_before, post_before = list(m._forward_pre_hooks.items()), list(m._forward_hooks.items())
    kw_before, always_before = dict(m._forward_pre_hooks_with_kwargs), dict(m._forward_hooks_always_called)
    ledger.remove_hook(h1)
    ledger.remove_hook(h3)
    mine = ledger.add_hook(m.register_forward_pre_hook(lambda mod, args: calls.append("gz")))
    m(torch.zeros(2))
    assert calls == [2, "gz"]
    assert h1.id not in m._forward_pre_hooks_with_kwargs and h3.id not in m._forward_hooks_always_called
    ledger.undo()
    assert list(m._forward_pre_hooks.items()) == pre_before
    assert list(m._forward_hooks.items()) == post_before
    assert m._forward_pre_hooks_with_kwargs == kw_before and m._forward_hooks_always_called == always_before
    assert mine.id not in m._forward_pre_hooks
    calls.clear()
    m(torch.zeros(2))
    assert calls == [1, 2, 3]
    # the owner's handle still removes its hook
    h2.remove()
    assert h2.id not in m._forward_pre_hooks


def test_post_accumulate_grad_hook_gives_back_the_none_dict():
    p, ledger = torch.nn.Parameter(torch.ones(2)), PatchLedger("p")
    assert p._post_accumulate_grad_hooks is None
    seen = []
    ledger.post_accumulate_grad_hook(p, lambda t: seen.append(t.grad.clone()))
    p.sum().backward()
    assert len(seen) == 1
    ledger.undo()
    assert p._post_accumulate_grad_hooks is None


def test_post_accumulate_grad_hook_keeps_an_existing_dict_and_its_hooks():
    p, ledger = torch.nn.Parameter(torch.ones(2)), PatchLedger("p")
    theirs = p.register_post_accumulate_grad_hook(lambda t: None)
    hooks = p._post_accumulate_grad_hooks
    before = list(hooks.items())
    ledger.remove_hook(theirs)
    ledger.post_accumulate_grad_hook(p, lambda t: None)
    ledger.undo()
    assert p._post_accumulate_grad_hooks is hooks and list(hooks.items()) == before


def test_clear_list_refills_the_same_list():
    lst, ledger = [1, 2, 3], PatchLedger("l")
    items = list(lst)
    ledger.clear_list(lst)
    assert lst == []
    lst.append("new")     # undo restores the list as it was, not what happened since
    ledger.undo()
    assert lst == items


def test_undo_runs_in_reverse_order_and_finishes_after_a_failure():
    order, ledger = [], PatchLedger("engine 'gen'")
    ledger.on_undo(lambda: order.append("first"), "first")

    def boom():
        raise RuntimeError("boom")

    ledger.on_undo(boom, "second")
    ledger.on_undo(lambda: order.append("third"), "third")
    with pytest.raises(RuntimeError, match="boom") as info:
        ledger.undo()
    assert order == ["third", "first"]
    assert any("engine 'gen'" in note and "second" in note for note in info.value.__notes__)
    assert len(ledger) == 0
    ledger.undo()   # nothing left: a second undo is a no-op


def test_nested_ledger():
    t, outer, inner = Thing(), PatchLedger("outer"), PatchLedger("inner")
    outer.set_attr(t, "a", 1)
    inner.set_attr(t, "b", 2)
    outer.on_undo(inner.undo, "inner")
    inner.undo()   # undone early (e.g. the lean step re-configured); outer's undo then finds it empty
    inner.set_attr(t, "b", 3)
    outer.undo()
    assert "a" not in vars(t) and "b" not in vars(t)


# -- detach gives back exactly the engine attach received ------------------------------------------
# Multi-rank scenarios on real DeepSpeed engines (2 gloo ranks), one per optimizer family and stage.

FAMILIES = {  # name -> (ds_config kwargs, the binding kind graphzero picks)
    "zero1": ({"stage": 1}, "zero"),
    "zero2": ({"stage": 2}, "zero"),
    "bf16_zero1": ({"stage": 1, "dtype": "bf16"}, "bf16"),
    "zero3": ({"stage": 3}, "zero3"),
}
_SCALARS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


def _shallow(value):
    """A container's items (their objects, not copies); any other value as itself."""
    if isinstance(value, dict):
        return ("dict", type(value), list(value.items()))
    if isinstance(value, (list, tuple)):
        return ("seq", type(value), list(value))
    if isinstance(value, (set, frozenset)):
        return ("set", type(value), {id(v): v for v in value})
    return ("obj", value)


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, _SCALARS):
        return a == b
    if isinstance(a, tuple) and len(a) == len(b):   # _shallow's records
        return all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, list) and len(a) == len(b):
        return all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and list(a) == list(b):
        return all(_same(a[k], b[k]) for k in a)
    return False


def _tensor_record(t: torch.Tensor) -> dict:
    rec = {k: _shallow(v) for k, v in vars(t).items()}
    rec["<requires_grad>"] = ("obj", t.requires_grad)
    rec["<grad>"] = ("obj", t.grad)
    rec["<post_accumulate_grad_hooks>"] = _shallow(t._post_accumulate_grad_hooks)
    rec["<backward_hooks>"] = _shallow(t._backward_hooks)
    return rec


def _snapshot(eng) -> dict[str, dict]:
    """Everything graphzero could patch: the engine's, its optimizer's, every submodule's and every
    parameter's attributes (hook dicts and lists item by item), DeepSpeed's ZeRO-3 globals."""
    from deepspeed.runtime.zero import parameter_offload
    opt = eng.optimizer
    snap = {"engine": {k: _shallow(v) for k, v in vars(eng).items()},
            "optimizer": {k: _shallow(v) for k, v in vars(opt).items()}}
    if hasattr(opt, "parameter_offload"):
        snap["parameter_offload"] = {k: _shallow(v) for k, v in vars(opt.parameter_offload).items()}
    for name, module in eng.module.named_modules():
        snap[f"module {name!r}"] = {k: _shallow(v) for k, v in vars(module).items()}
    for name, p in eng.module.named_parameters():
        snap[f"parameter {name!r}"] = _tensor_record(p)
        if getattr(p, "ds_tensor", None) is not None:
            snap[f"shard {name!r}"] = _tensor_record(p.ds_tensor)
    snap["globals"] = {"F.linear": ("obj", torch.nn.functional.linear),
                       "FWD_MODULE_STACK": _shallow(list(parameter_offload.FWD_MODULE_STACK))}
    return snap


def _assert_same_snapshot(before: dict, after: dict, what: str) -> None:
    assert list(before) == list(after), f"{what}: objects differ"
    diffs = []
    for obj, attrs in before.items():
        other = after[obj]
        if set(attrs) != set(other):
            diffs.append(f"{obj}: attributes added {sorted(set(other) - set(attrs))}, "
                         f"removed {sorted(set(attrs) - set(other))}")
        diffs += [f"{obj}.{k}: {attrs[k]!r:.200} -> {other[k]!r:.200}"
                  for k in attrs if k in other and not _same(attrs[k], other[k])]
    assert not diffs, f"{what}: detach did not give back the engine attach received:\n" + "\n".join(diffs)


def _family_engines(family: str):
    """Two engines of the same family with the same initial weights: one to attach, one never attached."""
    from scenario_utils import ds_config, engine, mlp
    kwargs, kind = FAMILIES[family]
    kwargs = dict(kwargs)
    cfg = ds_config(kwargs.pop("stage"), **kwargs)
    dtype = torch.bfloat16 if kwargs.get("dtype") == "bf16" else torch.float32
    torch.manual_seed(11)
    model = mlp(8, 16, 4, depth=3).to(dtype)
    twin = copy.deepcopy(model)
    eng, ref = engine(model, cfg), engine(twin, cfg)
    from graphzero.deepspeed_adapter.ds_internals import _optimizer_kind
    assert _optimizer_kind(eng) == kind, (family, type(eng.optimizer).__name__)
    return eng, ref, dtype


def _weights(eng) -> list[torch.Tensor]:
    """This rank's trained values: the parameters (ZeRO-3: their shards) and the fp32 masters."""
    out = []
    for p in eng.module.parameters():
        out.append((p.ds_tensor if getattr(p, "ds_tensor", None) is not None else p).detach().clone())
    return out


def _eager_steps_match(eng, ref, dtype, steps: int = 2) -> None:
    """DeepSpeed eager (engine.backward + step) trains the detached engine exactly as an engine
    graphzero never touched: bitwise-equal weights and gradient norms."""
    import torch.distributed as dist

    from scenario_utils import ReductionCounter, data
    rank = dist.get_rank()
    counter = ReductionCounter(eng)
    for t in range(steps):
        (x,) = data(t, rank, (4, 8), dtype=dtype)
        norms = []
        for e in (eng, ref):
            loss = e(x).float().square().mean()
            e.backward(loss)
            e.step()
            norms.append(float(e.get_global_grad_norm()))
        assert norms[0] == norms[1] and norms[0] > 0, f"eager step {t}: norms {norms}"
        for a, b in zip(_weights(eng), _weights(ref)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, t=t: f"eager step {t}: {m}")
    assert counter.total > 0 or eng.zero_optimization_stage() == 3, "DeepSpeed's own reduction did not run"


def attach_detach_scenario(family: str) -> None:
    from graphzero import deepspeed_adapter
    eng, ref, dtype = _family_engines(family)
    before = _snapshot(eng)
    # lean step and deferred gather on: the ZeRO-1/2 binding patches all it can
    deepspeed_adapter.attach([("net", eng)], lean_step=True, defer_param_gather=True)
    binding = deepspeed_adapter.binding_of(eng)
    assert binding is not None and len(binding.ledger) > 0
    assert "forward" in vars(eng) and "step" in vars(eng)
    deepspeed_adapter.detach(eng)
    assert deepspeed_adapter.binding_of(eng) is None and len(binding.ledger) == 0
    _assert_same_snapshot(before, _snapshot(eng), f"{family}: attach then detach")
    _eager_steps_match(eng, ref, dtype)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_detach_restores_the_engine(ranks, family):
    ranks.run(attach_detach_scenario, family)


def _fail_at(monkeypatch_target: tuple[object, str], n: int):
    """Make the n-th call of ``owner.name`` (n >= 1) raise; returns the undo."""
    owner, name = monkeypatch_target
    original = vars(owner)[name]
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError(f"injected failure in {name} (call {n})")
        return original(*args, **kwargs)

    setattr(owner, name, failing)
    return lambda: setattr(owner, name, original)


def failed_install_scenario(family: str, where: str) -> None:
    """An install that fails midway: the ledger undoes what it did, the engine is not attached, the
    error is a GraphZeroError naming the engine (the cause chained), and the engine trains as before."""
    from graphzero import deepspeed_adapter
    from graphzero.deepspeed_adapter import zero3
    from graphzero.deepspeed_adapter.step import lean
    from graphzero.errors import GraphZeroError, InstallError
    eng, ref, dtype = _family_engines(family)
    before = _snapshot(eng)
    if where == "midway":
        # count the ledger's set_attr calls of a whole install, then fail at half of them
        deepspeed_adapter.attach([("net", eng)], lean_step=True, defer_param_gather=True)
        total = sum(e.startswith("set ") for e in deepspeed_adapter.binding_of(eng).ledger.entries())
        deepspeed_adapter.detach(eng)
        restore = _fail_at((PatchLedger, "set_attr"), total // 2)
    elif where == "lean_step":       # the ZeRO-1/2 binding's last install step
        restore = _fail_at((lean.LeanStep, "__init__"), 1)
    elif where == "zero3_collectives":   # ZeRO-3's own install, after DeepSpeed's hooks are out
        restore = _fail_at_module_function(zero3, "_no_grad", 4)
    else:
        raise AssertionError(where)
    try:
        with pytest.raises(GraphZeroError) as info:
            deepspeed_adapter.attach([("net", eng)], lean_step=True, defer_param_gather=True)
    finally:
        restore()
    err = info.value
    assert isinstance(err, InstallError), type(err)
    assert "engine 'net'" in str(err) and "DeepSpeed" in str(err) and "injected failure" in str(err), str(err)
    assert isinstance(err.__cause__, RuntimeError)
    assert deepspeed_adapter.binding_of(eng) is None
    _assert_same_snapshot(before, _snapshot(eng), f"{family}: install failed at {where}")
    _eager_steps_match(eng, ref, dtype)


def _fail_at_module_function(module, name: str, n: int):
    original = getattr(module, name)
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError(f"injected failure in {name} (call {n})")
        return original(*args, **kwargs)

    setattr(module, name, failing)
    return lambda: setattr(module, name, original)


@pytest.mark.parametrize("family,where", [
    ("zero1", "midway"), ("zero2", "lean_step"), ("bf16_zero1", "midway"),
    ("zero3", "midway"), ("zero3", "zero3_collectives")])
def test_failed_install_rolls_back(ranks, family, where):
    ranks.run(failed_install_scenario, family, where)


def _patch_view(snap: dict) -> dict:
    """The part of a snapshot that patches change: functions, methods and hook handles, hook dicts and
    lists, the flags graphzero sets, tensors' hooks and requires_grad (not training state)."""
    import types

    from torch.utils.hooks import RemovableHandle
    kinds = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, RemovableHandle)
    keep = {"enable_backward_allreduce", "_graphzero_binding", "<requires_grad>"}

    def wanted(key: str, rec) -> bool:
        return "hook" in key or key in keep or (rec[0] == "obj" and isinstance(rec[1], kinds))

    return {obj: {k: rec for k, rec in attrs.items() if wanted(k, rec)} for obj, attrs in snap.items()}


def trained_then_detached_scenario(family: str) -> None:
    """Attached, trained by graphzero for 2 steps, detached: every patch is gone (the same hooks,
    methods and flags as before attach), and DeepSpeed eager continues the run as an engine trained
    by DeepSpeed eager throughout does (within fp32 reduction-order rounding)."""
    import torch.distributed as dist

    from graphzero import deepspeed_adapter
    from scenario_utils import data
    eng, ref, dtype = _family_engines(family)
    before = _patch_view(_snapshot(eng))
    rank = dist.get_rank()
    step = torch.compile(lambda models, x: models["net"](x).float().square().mean(), backend="graphzero",
                         options={"engines": {"net": eng}, "lean_step": True, "defer_param_gather": True})
    for t in range(2):
        (x,) = data(t, rank, (4, 8), dtype=dtype)
        step({"net": eng}, x).backward()
        eng.step()
        ref.backward(ref(x).float().square().mean())
        ref.step()
    deepspeed_adapter.detach(eng)
    _assert_same_snapshot(before, _patch_view(_snapshot(eng)), f"{family}: trained, then detached")
    for t in range(2, 5):
        (x,) = data(t, rank, (4, 8), dtype=dtype)
        norms = []
        for e in (eng, ref):
            e.backward(e(x).float().square().mean())
            e.step()
            norms.append(float(e.get_global_grad_norm()))
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=0)
        for a, b in zip(_weights(eng), _weights(ref)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, t=t: f"eager step {t}: {m}")


@pytest.mark.parametrize("family", ["zero1", "zero2", "zero3"])
def test_trained_then_detached(ranks, family):
    ranks.run(trained_then_detached_scenario, family)


def failed_attach_of_two_scenario() -> None:
    """attach([a, b]) where b's install fails: a, installed first by the same call, is detached
    again; both engines are exactly as before."""
    from graphzero import deepspeed_adapter
    from graphzero.deepspeed_adapter import zero3
    from graphzero.errors import InstallError
    first, _, _ = _family_engines("zero2")
    second, _, _ = _family_engines("zero3")
    before = [_snapshot(first), _snapshot(second)]
    restore = _fail_at_module_function(zero3, "_no_grad", 2)
    try:
        with pytest.raises(InstallError, match="engine 'b'"):
            deepspeed_adapter.attach([("a", first), ("b", second)])
    finally:
        restore()
    assert deepspeed_adapter.binding_of(first) is None and deepspeed_adapter.binding_of(second) is None
    for eng, snap, name in zip((first, second), before, "ab"):
        _assert_same_snapshot(snap, _snapshot(eng), f"engine {name!r} after the failed attach of two")


def test_failed_attach_of_two_engines_detaches_both(ranks):
    ranks.run(failed_attach_of_two_scenario)
