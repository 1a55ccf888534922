"""What autograd was asked to accumulate, as seen from inside a compiled backward.

Eager autograd writes ``param.grad`` only for the leaves of this backward (all, ``inputs=``, or none
for ``torch.autograd.grad``); the runtime asks autograd per engine and writes a shard exactly then.
Collectives run either way, so every rank issues the same ones.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from .errors import AutogradUsageError, InternalsError
from .ownership import ParamSet

# _will_engine_execute_node's error for a leaf under torch.autograd.grad() (2.13-2.15): "no .grad".
_AUTOGRAD_GRAD_LEAF = "currently running autograd.grad()"


class AccumulationProbe:
    """Per engine of one compiled backward: does this backward accumulate into its parameters?"""

    def __init__(self, present: dict[ParamSet, Sequence[tuple[torch.Tensor, str]]]) -> None:
        """``present``: per engine, each ``(leaf, name)`` receiving a gradient here (a parameter,
        or its ZeRO-3 shard)."""
        self.present = present
        # AccumulateGrad nodes, kept alive so that the engine sees the same node objects.
        self._nodes: dict[ParamSet, list] = {}

    def _accumulate_nodes(self, ps: ParamSet) -> list:
        if ps not in self._nodes:
            self._nodes[ps] = [get_gradient_edge(leaf).node for leaf, _ in self.present[ps]]
        return self._nodes[ps]

    def accumulating(self) -> dict[ParamSet, bool]:
        """Which engines' shards this backward writes; raises for what graphzero cannot honour."""
        if _create_graph():
            raise AutogradUsageError(
                "backward(create_graph=True) / autograd.grad(create_graph=True) through a graphzero graph "
                f"that owns engine(s) {[ps.name for ps in self.present]}: higher-order gradients of "
                "engine-owned parameters are not supported (their gradients are reduced into shards)")
        out = {}
        for ps, params in self.present.items():
            try:
                will = [torch._C._will_engine_execute_node(node) for node in self._accumulate_nodes(ps)]
            except RuntimeError as exc:
                if _AUTOGRAD_GRAD_LEAF not in str(exc):
                    # Anything else is not "no accumulation": reading it so would lose the gradient.
                    raise InternalsError(
                        f"engine {ps.name!r}: torch._C._will_engine_execute_node failed in a graphzero backward "
                        f"(torch {torch.__version__}): {exc}") from exc
                will = [False] * len(params)
            if all(will):
                out[ps] = True
            elif not any(will):
                out[ps] = False
            else:
                picked = [name for (_, name), w in zip(params, will) if w]
                raise AutogradUsageError(
                    f"backward(inputs=...) selects only some of engine {ps.name!r}'s parameters used in this "
                    f"graph ({picked}); pass all of its parameters or none of them")
        return out


def _create_graph() -> bool:
    """Whether this backward runs with ``create_graph=True``: autograd exposes no flag, but AOT
    autograd runs such a backward inside its ``_double_backward``, so look for that frame."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return False
        if frame.f_code.co_name == "_double_backward":
            return True
        frame = frame.f_back
    return False

