"""What torch keeps of each compile after ``torch._dynamo.reset()``, and a way to release it.

Measured with ``debug/recompile_memory.py`` on the ZeRO-3 GAN (docs/reliability.md, "ZeRO-3 with a
new graph every 500 steps"); torch 2.13 keeps, per forced compile:

- in the Flight Recorder (on by default, ``TORCH_FR_BUFFER_SIZE`` entries, 2000), the Python stack
  of each recent collective, and with it the compiled frame that issued it. Only the environment
  variable turns it off; nothing here can release it.
- in ``ShapeEnv``'s method caches, the compile's shape environment with its fake tensors and guards:
  ``_inner_evaluate_expr`` is an ``lru_cache(256)`` keyed by the environment, and
  ``_maybe_evaluate_static`` an unbounded cache cleared only when an environment's version counter
  differs from the last one seen, which compiles of static shapes do not change.
- in FX's source cache (``torch.fx.graph_module._loader``) and ``linecache``, the source and a copy
  of the globals of every GraphModule ever generated, for tracebacks; unbounded.
- in ``weakref.finalize`` callbacks on every object a guard matched by identity (``ID_MATCH``,
  types, DeepSpeed's engines and parameters), the compile's ``CheckFunctionManager`` with its guard
  tree (verbose guard code, the user's stacks): ``CheckFunctionManager.id_ref`` registers a
  finalizer that invalidates the cache entry when the object dies, and a reset does not detach it,
  so for objects that live as long as the job each compile's guards stay (torch's own comment in
  ``guards.py`` names the risk). The larger a frame's guard set, the more: ZeRO-3 engines are
  guarded on many DeepSpeed objects.
- in Dynamo's compilation metrics, a record per compile with the inductor config as JSON; bounded.

``graphzero-soak --release-torch-caches`` calls :func:`release_compile_leftovers` instead of a bare
reset, so that what is left of a compile is graphzero's. These are torch internals: a measuring
tool's business, not the backend's.
"""
from __future__ import annotations

import functools
import linecache
import weakref


def release_compile_leftovers() -> None:
    """``torch._dynamo.reset()``, then empty the caches above. The reset comes first because a guard
    finalizer detached from a live cache entry would let that entry match a new object that reuses
    a dead one's id. Never call it during a compile."""
    import torch._dynamo
    import torch._dynamo.utils
    import torch.fx.graph_module
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    torch._dynamo.reset()
    for attr in vars(ShapeEnv).values():
        if hasattr(attr, "cache_clear"):
            attr.cache_clear()
    sources = torch.fx.graph_module._loader.eval_cache
    for key in sources:
        linecache.cache.pop(key, None)
    sources.clear()
    torch._dynamo.utils.clear_compilation_metrics()
    for finalizer in guard_finalizers():
        finalizer.detach()


def guard_finalizers() -> list[weakref.finalize]:
    """The finalizers Dynamo's guards registered on objects matched by identity, whether their cache entries are live or not."""
    from torch._dynamo.guards import CheckFunctionManager

    return [finalizer for finalizer, info in list(weakref.finalize._registry.items())
            if isinstance(info.func, functools.partial)
            and getattr(info.func.func, "__func__", None) is CheckFunctionManager.invalidate]
