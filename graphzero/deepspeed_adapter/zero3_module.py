"""ZeRO-3 parameters read as full tensors wherever the module reads them (SimpleFSDP's design).

DeepSpeed keeps a ZeRO-3 parameter empty (``p.numel() == 0``) with this rank's shard in
``p.ds_tensor``, and gathers it in per-submodule hooks. graphzero removes those hooks while it owns
the engine. Instead, every module that holds a ZeRO-3 parameter gets its class swapped for a
subclass (same name; one per module class and parameter names, shared by identical modules) with
one property per parameter name, as torchtitan's SimpleFSDP does: the module keeps its methods,
submodules, signatures (HF ``generate`` reads ``inspect.signature``) and instance attributes
(wrapped forwards), and a read of ``module.weight``

- while Dynamo traces (the compiled step; whatever it calls: forward, another method, a submodule,
  the attribute itself) returns ``shard_gather.gather_shard(p.ds_tensor, ...)``: the gather is in
  the forward graph, once per read, and the passes (release, schedule_gathers, bucket_gathers) find
  it by its op as before; the gradient flows back to the shard by reduce-scatter;
- in eager inside a module call (evaluation, ``generate``: a forward hook of any submodule is
  running) returns a temporary gathered tensor from the same gather, so the current parameters are
  seen and nothing stays gathered; a gradient computed eagerly reaches the shard (the safety net);
- in eager outside any module call returns the DeepSpeed parameter itself, as DeepSpeed eager
  does: ``GatheredParameters(module.weight)`` and edits inside it work unchanged.

A parameter whose ``requires_grad`` is off (frozen, or frozen for one micro-step) is gathered without
a gradient. One that requires grad but is in none of its engine's optimizer groups gets, as under
DeepSpeed eager, this rank's own full gradient in ``.grad`` (through ``GRAD_PROXY_ATTR``), not a
reduced shard.

Not ``torch.nn.utils.parametrize``: it moves each parameter to ``parametrizations.<name>.original``,
which renames it in ``named_parameters`` and ``state_dict`` (DeepSpeed's optimizer groups, its
checkpoints and ``safe_get_full_grad`` key on the names and objects), and its parametrization
would be called by DeepSpeed's own attribute reads outside the step. A property on the class reads
``module._parameters`` and changes nothing else; ``__class__`` is put back on detach.
"""
from __future__ import annotations

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


def _reader(depth: _EagerDepth, world: int, group_name: str) -> Callable[[torch.nn.Module, str], torch.Tensor]:
    def read(module: torch.nn.Module, name: str) -> torch.Tensor:
        p = module._parameters[name]
        if not (torch.compiler.is_compiling() or depth.depth > 0):
            return p
        if not p.requires_grad:
            # An owned shard requires grad for as long as graphzero owns it, but a parameter
            # frozen for this step must get no gradient, as under eager autograd (Dynamo guards on
            # p.requires_grad: the step is compiled again when it changes).
            with torch.no_grad():
                return gather_shard(p.ds_tensor, p.ds_numel, p.ds_shape, world, group_name)
        proxy = getattr(p, GRAD_PROXY_ATTR, None)
        # an owned shard requires grad (another engine's, attached after this one, too)
        if proxy is not None and not p.ds_tensor.requires_grad:
            full = gather_shard_local_grad(p.ds_tensor, proxy, p.ds_numel, p.ds_shape, world, group_name)
        else:
            full = gather_shard(p.ds_tensor, p.ds_numel, p.ds_shape, world, group_name)
        # the parameter's own hook dict, reached without reading the (empty) parameter's hooks in
        # the trace: a traced read made it a graph input whose None gradient autograd handed to
        # the hooks. Read once per trace; a hook registered later is refused at backward
        # (compiler.BackwardWithRuntimeInputs).
        hooks = getattr(module, _HOOKS_ATTR)[name]
        return with_tensor_hooks(full, tuple(hooks.values())) if hooks else full
    return read


_READ_ATTR = "_graphzero_read"
# (module class, ZeRO-3 parameter names) -> its gathering subclass: identical modules share one
# class (torch.compile sees one class, not one per instance); what differs per engine (its group,
# the eager depth) is the instance's reader, and owned/frozen is decided per parameter at each read
_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _gathering_class(cls: type, names: tuple[str, ...]) -> type:
    if (cls, names) not in _CLASSES:
        props = {n: property(lambda self, n=n: getattr(self, _READ_ATTR)(self, n)) for n in names}
        # Same name and module, so error messages, HF's class-name lookups and repr read as before.
        props.update(__module__=cls.__module__, __qualname__=cls.__qualname__, _graphzero_gathering=True)
        _CLASSES[(cls, names)] = type(cls.__name__, (cls,), props)
    return _CLASSES[(cls, names)]


def install(module: torch.nn.Module, world: int, group_name: str, ledger: PatchLedger) -> int:
    """Make every ZeRO-3 parameter of ``module``'s tree read as a gathered tensor (see the module
    docstring); every change goes through ``ledger``. Returns the number of modules swapped."""
    depth = _EagerDepth()
    read = _reader(depth, world, group_name)
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
