"""A warning for ZeRO-3 engines graphzero does not own inside a graphzero step.

DeepSpeed gathers such an engine's parameters in module hooks that Dynamo cannot trace: every
submodule breaks the compiled step, and the gathered parameters reach the graphs as inputs. A
frozen engine (no optimizer) listed with the others keeps its gathers in the graph (frozen.py).
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from typing import Any

import torch

from .bound import binding_of
from .frozen import is_frozen

log = logging.getLogger("graphzero")

# ds_ids already warned about: one warning per engine per process, not one per graph
_WARNED: set[int] = set()


def warn_unattached_zero3(example_inputs: Sequence[Any], graph_id: str) -> None:
    """Warn, naming the engine, when a graph reads ZeRO-3 parameters DeepSpeed gathered itself."""
    params = [x for x in example_inputs if isinstance(x, torch.nn.Parameter) and hasattr(x, "ds_tensor")
              and binding_of(x.ds_tensor) is None and x.ds_id not in _WARNED]
    if not params:
        return
    ids = {id(p) for p in params}
    from deepspeed.runtime.engine import DeepSpeedEngine
    # Only on this path (once per engine): which engine holds them, for the message. type(), not
    # isinstance: isinstance reads __class__, which on a dead weakref.proxy raises ReferenceError.
    engines = [o for o in gc.get_objects() if issubclass(type(o), DeepSpeedEngine)]
    for engine in engines:
        mine = [n for n, p in engine.module.named_parameters() if id(p) in ids]
        if not mine:
            continue
        _WARNED.update(p.ds_id for p in engine.module.parameters() if hasattr(p, "ds_id"))
        what = "no optimizer (frozen)" if is_frozen(engine) else "an optimizer"
        log.warning(
            "graph %s reads ZeRO-3 parameters of a DeepSpeed engine graphzero does not own (a %s with %s, "
            "parameters %s): DeepSpeed's hooks gather them around each of its submodules, which breaks the "
            "compiled step into pieces. List that engine with the others (options['engines'] or "
            "graphzero.attach); one without an optimizer is attached frozen and gathered inside the graph",
            graph_id, type(engine.module).__name__, what, mine[:3])
    _WARNED.update(p.ds_id for p in params)
