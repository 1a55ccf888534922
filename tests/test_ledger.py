"""The patch ledger (graphzero/deepspeed_adapter/ledger.py): every change graphzero makes to an
engine is undone exactly, in reverse order.

Unit tests of `PatchLedger` on plain objects, modules and tensors (no DeepSpeed).
"""
from __future__ import annotations

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
