"""The DeepSpeed adapter: the only package that touches DeepSpeed internals.

``attach`` checks configs and attaches or detaches engines; ``base`` holds what every binding
shares; ``zero12``, ``bf16`` and ``zero3`` bind one optimizer family each, ``frozen`` engines
without one; ``step/`` holds the optimizer step; ``ledger`` records every change so that
``detach`` undoes it exactly.
"""
from .attach import attach, detach
from .base import DeepSpeedBinding, binding_of
from .unattached import warn_unattached_zero3

__all__ = ["DeepSpeedBinding", "attach", "binding_of", "detach", "warn_unattached_zero3"]
