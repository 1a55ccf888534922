"""Engine names: one per attached engine, unique in the process whatever attached it.

- Unnamed: keeps its name while attached, else its last name if free, else the smallest
  ``engineK`` never given to another engine in this process.
- Explicit: a clash within one call is an `OwnershipError`; an earlier engine holding it is renamed
  ``name#2`` (logged), not refused: it is usually stale, kept alive by Dynamo's caches, and each
  rank's garbage collector must not decide a name.

``_GIVEN`` (every name given, weakly to its last engine) is the only state, written by `record`.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

from ..errors import OwnershipError
from ..options import DefaultName
from .bound import binding_of

# a base.DeepSpeedBinding (not imported: base imports this module)
DeepSpeedBinding = Any

log = logging.getLogger("graphzero")

_GIVEN: dict[str, weakref.ref] = {}


def _holder(name: str) -> DeepSpeedBinding | None:
    """The binding of the live, attached engine whose current name is ``name``, if any."""
    ref = _GIVEN.get(name)
    engine = ref() if ref is not None else None
    binding = binding_of(engine) if engine is not None else None
    return binding if binding is not None and binding.name == name else None


def _describe(binding: DeepSpeedBinding) -> str:
    ps = binding.param_set
    return (f"a ZeRO-{ps.stage} engine of {type(binding.engine.module).__name__} with {ps.num_params} parameters, "
            f"{ps.numel} elements")


def assign(requests: Sequence[tuple[str, DeepSpeedBinding]]) -> tuple[list[str], list[tuple[DeepSpeedBinding, str]]]:
    """Names for one attach call's ``(label, binding)`` pairs, and ``(binding, new name)`` displaced."""
    mine = {id(b.engine) for _, b in requests}
    kept = {b.name: b for label, b in requests if isinstance(label, DefaultName) and b.installed}
    explicit = [label for label, _ in requests if not isinstance(label, DefaultName)]
    names: list[str] = []
    displaced: list[tuple[DeepSpeedBinding, str]] = []
    reserved = set(explicit) | set(kept)
    for label, binding in requests:
        if isinstance(label, DefaultName):
            name = binding.name if binding.installed else _default_name(binding.engine, reserved)
            reserved.add(name)
            names.append(name)
            continue
        other = kept.get(label)
        if other is not None and other.engine is not binding.engine:
            raise OwnershipError(
                f"engine name {label!r} is asked for {_describe(binding)}, but {_describe(other)}, listed in the "
                f"same call without a name, keeps it as its name; name one of them differently")
        holder = _holder(label)
        if holder is not None and id(holder.engine) not in mine:
            k = 2
            while f"{label}#{k}" in _GIVEN or f"{label}#{k}" in reserved:
                k += 1
            displaced.append((holder, f"{label}#{k}"))
            reserved.add(f"{label}#{k}")
        names.append(label)
    return names, displaced


def _default_name(engine: object, reserved: set[str]) -> str:
    for name, ref in reversed(_GIVEN.items()):
        # attached before and detached since: its last name again, if still free
        if ref() is engine:
            if name not in reserved and _holder(name) is None:
                return name
            break
    k = 0
    while f"engine{k}" in _GIVEN or f"engine{k}" in reserved:
        k += 1
    return f"engine{k}"


def record(names: Sequence[str], bindings: Sequence[DeepSpeedBinding],
           displaced: Sequence[tuple[DeepSpeedBinding, str]]) -> None:
    """The engines are attached under ``names`` now; the displaced ones are renamed."""
    for binding, new in displaced:
        if binding.installed:
            log.warning("engine %r (%s) is renamed %r: a newly attached engine is named %r explicitly",
                        binding.name, _describe(binding), new, binding.name)
            binding.rename(new)
            _remember(new, binding.engine)
    for name, binding in zip(names, bindings):
        _remember(name, binding.engine)


def _remember(name: str, engine: object) -> None:
    _GIVEN.pop(name, None)   # the latest name given comes last
    _GIVEN[name] = weakref.ref(engine)


def attached_engines() -> list[object]:
    """Every live engine attached now (each under the one name it holds)."""
    return [b.engine for b in (_holder(name) for name in list(_GIVEN)) if b is not None]
