"""``graphzero.backend(...)``: the backend as an object bound to its engines.

    step = torch.compile(step, backend=graphzero.backend(gen=gen, disc=disc, inner="eager"))

The constructor attaches the engines before Dynamo traces anything (no compile-start callback).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import fx

from . import deepspeed_adapter
from .compiler import graphzero_backend
from .errors import AttachTooLateError, OptionError
from .options import DefaultName, Options

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(Options)) - {"engines"}


class GraphZeroBackend:
    """A torch.compile backend owning these engines' parameters. Keywords are options where they
    name one, named engines otherwise; ``engines=`` is accepted too (``graphzero.backend(**options)``)."""

    def __init__(self, *engines: Any, **kwargs: Any) -> None:
        options = {k: v for k, v in kwargs.items() if k in _OPTION_NAMES}
        named = {k: v for k, v in kwargs.items() if k not in _OPTION_NAMES and k != "engines"}
        listed = kwargs.get("engines")
        if listed is not None and (engines or named):
            raise OptionError("graphzero.backend: pass engines either as arguments or as engines=..., not both")
        if listed is None:
            listed = {DefaultName(f"engine{i}"): e for i, e in enumerate(engines)}
            for name, engine in named.items():
                if name in listed:
                    raise OptionError(f"graphzero.backend: engine name {name!r} is also a positional engine's name")
                _check_named_engine(name, engine)
                listed[name] = engine
        self.options = Options.parse({**options, "engines": listed})
        self._raw = {**options, "engines": dict(self.options.engines)}
        deepspeed_adapter.attach(self.options.engines, **self.options.step_settings)

    @property
    def engines(self) -> dict[str, Any]:
        return dict(self.options.engines)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None,
                 **kwargs: Any):
        merged = dict(self._raw)
        for key, value in (options or {}).items():
            if key in merged and merged[key] is not value and merged[key] != value:
                raise OptionError(f"option {key!r} is given to both graphzero.backend(...) and torch.compile(options=...)")
            merged[key] = value
        detached = [name for name, engine in self.options.engines if deepspeed_adapter.binding_of(engine) is None]
        if detached:
            raise AttachTooLateError(f"engine(s) {detached} were detached after graphzero.backend(...) was created; "
                                     "create the backend again (or call graphzero.attach) before compiling")
        return graphzero_backend(gm, example_inputs, options=merged, **kwargs)

    def __repr__(self) -> str:
        settings = {k: v for k, v in self._raw.items() if k != "engines"}
        return f"graphzero.backend(engines={list(self.engines)}, {settings})"


def _check_named_engine(name: str, value: Any) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    if not isinstance(value, DeepSpeedEngine):
        raise OptionError(f"graphzero.backend: {name}={type(value).__name__} is neither a DeepSpeed engine nor an "
                          f"option (options are {sorted(_OPTION_NAMES)})")


def backend(*engines: Any, **kwargs: Any) -> GraphZeroBackend:
    """The graphzero backend bound to these engines (attached now), with these options."""
    return GraphZeroBackend(*engines, **kwargs)
