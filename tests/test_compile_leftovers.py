"""``graphzero_tools.compile_leftovers`` empties what torch keeps of a compile after
``torch._dynamo.reset()`` (graphzero-soak's ``--release-torch-caches``, docs/usage.md).

One process, no ranks: a function guarded on a long-lived object by identity is compiled four
times with AOT autograd and dynamic shapes (so that shape expressions are evaluated and cached),
each after a reset. Before the release, each compile's guard finalizer,
generated FX sources and the entries of ShapeEnv's method caches (keyed by each compile's shape
environment) are still there; after it, none is. Each part is
checked on its own, so a torch upgrade that renames one of them fails here instead of leaving the
soak's figure quietly wrong.
"""
from __future__ import annotations

import gc

import torch
import torch.fx.graph_module
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from graphzero_tools.compile_leftovers import guard_finalizers, release_compile_leftovers


class Scale:
    """A long-lived object the compiled function reads: Dynamo guards on it by identity."""

    def __init__(self) -> None:
        self.factor = 3.0


SCALE = Scale()
COMPILES = 4


def scaled(x: torch.Tensor) -> torch.Tensor:
    return (x * SCALE.factor).sin()


def shape_env_cache_entries() -> int:
    return sum(attr.cache_info().currsize for attr in vars(ShapeEnv).values() if hasattr(attr, "cache_info"))


def leftovers() -> dict[str, int]:
    gc.collect()
    return {"guard finalizers": len(guard_finalizers()), "FX sources": len(torch.fx.graph_module._loader.eval_cache),
            "ShapeEnv cache entries": shape_env_cache_entries()}


def test_release_empties_what_each_compile_left() -> None:
    release_compile_leftovers()
    x = torch.randn(8, requires_grad=True)
    for _ in range(COMPILES):
        torch._dynamo.reset()
        torch.compile(scaled, backend="aot_eager", dynamic=True)(x).sum().backward()
    torch._dynamo.reset()
    left = leftovers()
    assert left["guard finalizers"] >= COMPILES and left["FX sources"] >= COMPILES, left
    assert left["ShapeEnv cache entries"] >= COMPILES, left

    release_compile_leftovers()   # resets Dynamo, then empties
    assert leftovers() == {"guard finalizers": 0, "FX sources": 0, "ShapeEnv cache entries": 0}


def test_release_resets_dynamo_first() -> None:
    """No compiled frame outlives the release with its guard finalizer detached: the next call
    compiles again (and guards again) instead of running an entry that could match a recycled id."""
    release_compile_leftovers()
    step = torch.compile(scaled, backend="eager")
    x = torch.randn(8)
    step(x)
    assert len(guard_finalizers()) >= 1
    release_compile_leftovers()
    assert len(guard_finalizers()) == 0
    step(x)
    assert len(guard_finalizers()) >= 1, "the call after the release ran a cache entry left from before it"
