"""Where an engine or an owned parameter keeps its binding; its own module so that names.py finds
bindings without importing base.py, which imports names.py.
"""
from __future__ import annotations

from typing import Any

BINDING_ATTR = "_graphzero_binding"


def binding_of(obj: object) -> Any:
    """The binding (a base.DeepSpeedBinding) attached to an engine or an owned parameter, if any."""
    return getattr(obj, BINDING_ATTR, None)
