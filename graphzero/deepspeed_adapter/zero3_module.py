"""ZeRO-3 parameters read as full tensors wherever the module reads them (SimpleFSDP's design).

DeepSpeed keeps a ZeRO-3 parameter empty with this rank's shard in ``p.ds_tensor`` and gathers it
in per-submodule hooks, which graphzero removes. Instead every module holding a ZeRO-3 parameter
gets its class swapped for a same-named subclass with one property per parameter name, as
torchtitan's SimpleFSDP does: methods, submodules, signatures (HF ``generate`` reads
``inspect.signature``) and instance attributes stay, and a read of ``module.weight``

- while Dynamo traces returns ``shard_gather.gather_shard(p.ds_tensor, ...)``: the gather is in the
  forward graph, once per read, and its gradient flows back to the shard by reduce-scatter;
- in eager inside a module call (evaluation, ``generate``) returns a temporary gathered tensor, so
  nothing stays gathered; an eager gradient reaches the shard (the safety net);
- in eager outside any module call returns the DeepSpeed parameter itself, so
  ``GatheredParameters(module.weight)`` and edits inside it work unchanged.

A frozen parameter is gathered without a gradient. One that requires grad but is in none of its
engine's optimizer groups gets, as under DeepSpeed eager, this rank's own full gradient in ``.grad``
(through ``GRAD_PROXY_ATTR``).

Not ``torch.nn.utils.parametrize``: it renames each parameter in ``named_parameters`` and
``state_dict`` (DeepSpeed's optimizer groups, checkpoints and ``safe_get_full_grad`` key on them),
and DeepSpeed's own attribute reads outside the step would call the parametrization.
``__class__`` is put back on detach.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable

import torch

from ..shard_gather import gather_shard, gather_shard_local_grad, with_tensor_hooks
from .ledger import PatchLedger

# On a ZeRO-3 parameter that no optimizer group of its engine holds but that requires grad: the
# full-shape leaf its gradient is accumulated into (Zero3Binding moves it to the parameter's .grad).
GRAD_PROXY_ATTR = "_graphzero_grad_proxy"


class _EagerDepth:
    """How many module calls are running in eager code (hooks skip themselves under Dynamo)."""

    def __init__(self) -> None:
        self.depth = 0

    def enter(self, _module, _args) -> None:
        if torch.compiler.is_compiling():
            return
        self.depth += 1

    def leave(self, _module, _args, _output) -> None:
        if torch.compiler.is_compiling():
            return
        self.depth -= 1


_HOOKS_ATTR = "_graphzero_param_hooks"


def _share_hook_dicts(module: torch.nn.Module, names: tuple[str, ...], ledger: PatchLedger) -> None:
    """Give each named parameter a hook dict (``register_hook`` fills it in place) and keep the
    dicts on the module under ``_HOOKS_ATTR``."""
    dicts = {}
    for n in names:
        p = module._parameters[n]
        if p._backward_hooks is None:
            p._backward_hooks = OrderedDict()

            def give_back(p=p) -> None:
                if not p._backward_hooks:   # hooks the user registered meanwhile stay
                    p._backward_hooks = None

            ledger.on_undo(give_back, f"hook dict of {n}")
        dicts[n] = p._backward_hooks
    ledger.set_attr(module, _HOOKS_ATTR, dicts)


# On a model's output-embedding module (its LM head) in an HF/TRL ZeRO-3 run: the gathered reads of
# its parameters answer ``ds_status``.
_ANSWERS_DS_STATUS_ATTR = "_graphzero_answers_ds_status"


def _lm_heads(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The output-embedding modules of the HF models in ``module``'s tree, where transformers says
    ZeRO-3 is on (``is_deepspeed_zero3_enabled()``, as under TRL and Accelerate): the one place code
    asks a gathered ZeRO-3 parameter its ``ds_status`` (TRL's fused LM head,
    ``maybe_gather_lm_head_ctx``). Only there: the attribute set on a tensor inside a traced
    checkpointed block is a side effect that breaks the graph."""
    hf = sys.modules.get("transformers.integrations.deepspeed")
    if hf is None or not hf.is_deepspeed_zero3_enabled():
        return []
    heads = []
    for sub in module.modules():
        try:
            head = sub.get_output_embeddings() if hasattr(sub, "get_output_embeddings") else None
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, torch.nn.Module) and all(head is not h for h in heads):
            heads.append(head)
    return heads


def _inside_module_call(tree: frozenset[int]) -> bool:
    """Whether a call of a module of ``tree`` (ids) is running further up the Python stack. A module
    call that straddles a graph break runs its forward pre-hook traced (not counted by
    ``_EagerDepth``) and the rest of the call eagerly, in ``_call_impl`` frames or Dynamo's resume
    functions of them: seen under TRL's DPOTrainer, where the policy's embedding otherwise read the
    empty DeepSpeed parameter. Only eager reads that ``_EagerDepth`` places outside every call ask."""
    frame = sys._getframe(2)
    while frame is not None:
        if "_call_impl" in frame.f_code.co_name and id(frame.f_locals.get("self")) in tree:
            return True
        frame = frame.f_back
    return False


def _reader(depth: _EagerDepth, world: int, group_name: str,
            tree: frozenset[int]) -> Callable[[torch.nn.Module, str], torch.Tensor]:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    available = ZeroParamStatus.AVAILABLE

    def gathered(module: torch.nn.Module, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        if not p.requires_grad:
            # frozen for this step: no gradient, as under eager autograd (Dynamo guards on
            # p.requires_grad)
            with torch.no_grad():
                return gather_shard(p.ds_tensor, p.ds_numel, p.ds_shape, world, group_name)
        proxy = getattr(p, GRAD_PROXY_ATTR, None)
        # an owned shard requires grad (another engine's, attached after this one, too)
        if proxy is not None and not p.ds_tensor.requires_grad:
            full = gather_shard_local_grad(p.ds_tensor, proxy, p.ds_numel, p.ds_shape, world, group_name)
        else:
            full = gather_shard(p.ds_tensor, p.ds_numel, p.ds_shape, world, group_name)
        # the hook dict, not the (empty) parameter's hooks: a traced read made it a graph input
        # whose None gradient autograd handed to the hooks. A hook registered after the trace is
        # refused at backward (compiler.BackwardWithRuntimeInputs).
        hooks = getattr(module, _HOOKS_ATTR)[name]
        return with_tensor_hooks(full, tuple(hooks.values())) if hooks else full

    def read(module: torch.nn.Module, name: str) -> torch.Tensor:
        p = module._parameters[name]
        if not (torch.compiler.is_compiling() or depth.depth > 0 or _inside_module_call(tree)):
            return p
        full = gathered(module, name, p)
        if getattr(module, _ANSWERS_DS_STATUS_ATTR, False):
            # code that asks a ZeRO-3 parameter whether to gather it hears that this one is gathered
            full.ds_status = available
        return full
    return read


_READ_ATTR = "_graphzero_read"
# (module class, ZeRO-3 parameter names) -> its gathering subclass, shared so that torch.compile
# sees one class, not one per instance; per-engine state lives in the instance's reader
_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _gathering_class(cls: type, names: tuple[str, ...]) -> type:
    if (cls, names) not in _CLASSES:
        props = {n: property(lambda self, n=n: getattr(self, _READ_ATTR)(self, n)) for n in names}
        # Same name and module, so error messages, HF's class-name lookups and repr read as before.
        props.update(__module__=cls.__module__, __qualname__=cls.__qualname__, _graphzero_gathering=True)
        _CLASSES[(cls, names)] = type(cls.__name__, (cls,), props)
    return _CLASSES[(cls, names)]


def install(module: torch.nn.Module, world: int, group_name: str, ledger: PatchLedger) -> int:
    """Make every ZeRO-3 parameter of ``module``'s tree read as a gathered tensor, through ``ledger``;
    returns the number of modules swapped."""
    depth = _EagerDepth()
    read = _reader(depth, world, group_name, frozenset(id(m) for m in module.modules()))
    for head in _lm_heads(module):
        ledger.set_attr(head, _ANSWERS_DS_STATUS_ATTR, True)
    swapped = 0
    for sub in module.modules():
        ledger.add_hook(sub.register_forward_pre_hook(depth.enter))
        ledger.add_hook(sub.register_forward_hook(depth.leave, always_call=True))
        names = tuple(n for n, p in sub._parameters.items() if p is not None and hasattr(p, "ds_tensor"))
        if names and not getattr(type(sub), "_graphzero_gathering", False):
            _share_hook_dicts(sub, names, ledger)
            ledger.set_attr(sub, _READ_ATTR, read)
            ledger.set_attr(sub, "__class__", _gathering_class(type(sub), names))
            swapped += 1
    return swapped
