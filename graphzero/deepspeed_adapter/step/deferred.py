"""Materialise a ZeRO-1/2 engine's parameters on demand while their all-gather is deferred.

With ``defer_param_gather`` the lean step leaves the all-gather of each flat bit16 buffer in flight;
c10d registers it under the buffer's storage, so ``_c10d_functional.wait_tensor`` on the buffer or
any parameter viewing it waits for it (a no-op with nothing pending). Everything that reads the
parameters waits first:

- graphzero graphs: the ``wait_params`` pass;
- a forward pre-hook on every submodule holding an owned parameter (eager calls, and graphs of any
  backend, which trace it);
- ``state_dict`` / ``load_state_dict`` of those modules, ``engine.save_checkpoint``,
  ``load_checkpoint``, ``module_state_dict``, ``graphzero.detach``, and the next step;
- ``parameters()`` / ``named_parameters()`` of the engine and its module, through a bound
  ``named_parameters`` on those two instances (Dynamo reads ``named_parameters.__func__``).

Not covered, which is why the option stays off by default: a parameter read directly as a tensor
before the next forward, reached by attribute (``module.fc.weight`` goes through the class's
``nn.Module.__getattr__``, which cannot be hooked per instance) or kept from before ``step()``
(tests/test_deferred_gather.py). Call ``graphzero.wait_params(engine)`` first.
"""
from __future__ import annotations

import functools
import types

import torch

from ..ledger import PatchLedger

c10d = torch.ops._c10d_functional

# Engine methods that read or write every parameter: wait first.
_ENGINE_METHODS = ("save_checkpoint", "load_checkpoint", "module_state_dict")


def _waiter(own: list[torch.nn.Parameter]):
    """A forward pre-hook waiting for ``own``'s deferred all-gathers. ``own`` is a closure variable,
    not a default: Dynamo caches traced functions' defaults in a WeakKeyDictionary keyed by the
    function, and a default reaching the function back (parameter -> binding -> engine -> module ->
    hook) would keep the engine alive for the rest of the process."""

    def wait_own(*_args):
        for p in own:
            c10d.wait_tensor(p)

    return wait_own


class ParamSync:
    """The waits for one engine's deferred parameter all-gathers."""

    def __init__(self, engine, owned: list[torch.nn.Parameter]) -> None:
        self.engine = engine
        self.owned = {id(p) for p in owned}

    def wait(self) -> None:
        """Wait for every pending all-gather of this engine's flat parameter buffers."""
        for flat in self.engine.optimizer.bit16_groups_flat:
            c10d.wait_tensor(flat)

    def install(self, ledger: PatchLedger) -> None:
        """Add the waits; every hook and method goes through ``ledger`` (undone on detach)."""
        for module in self.engine.module.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in self.owned]
            if not own:
                continue
            ledger.add_hook(module.register_forward_pre_hook(_waiter(own)))
            ledger.add_hook(module.register_state_dict_pre_hook(self._wait_eager))
            ledger.add_hook(module.register_load_state_dict_pre_hook(self._wait_eager))
        for name in _ENGINE_METHODS:
            if name in self.engine.__dict__:   # someone else's override: leave it alone
                continue
            ledger.set_attr(self.engine, name, self._waiting(getattr(self.engine, name)))
        for obj in (self.engine, self.engine.module):
            if "named_parameters" not in obj.__dict__:
                ledger.set_attr(obj, "named_parameters",
                                types.MethodType(self._waiting(type(obj).named_parameters), obj))

    def _wait_eager(self, *_args, **_kwargs) -> None:
        if not torch.compiler.is_compiling():   # a graph waits by itself (wait_params pass, hooks)
            self.wait()

    def _waiting(self, fn):
        """``fn`` (a method, or an unbound ``named_parameters``) after `_wait_eager`."""
        @functools.wraps(fn)
        def waiting(*args, **kwargs):
            self._wait_eager()
            return fn(*args, **kwargs)
        return waiting
