"""The DeepSpeed adapter: the only package that touches DeepSpeed internals.

``attach`` attaches and detaches engines; ``base`` holds what every binding shares; ``zero12``,
``bf16`` and ``zero3`` bind each optimizer family's buffers; ``ledger`` records every change so
that ``detach`` (or a failed ``attach``) undoes it exactly.
"""
from .attach import attach, detach
from .base import DeepSpeedBinding, binding_of

__all__ = ["DeepSpeedBinding", "attach", "binding_of", "detach"]
