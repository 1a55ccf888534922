"""The DeepSpeed adapter: the only package that touches DeepSpeed internals.

``attach`` checks configs and attaches or detaches engines; ``base`` holds what every binding
shares (switching DeepSpeed's own hooks off and on, the eager safety net); one module per
optimizer family binds the buffers its ``step()`` reads: ``zero12`` (DeepSpeedZeroOptimizer),
``bf16`` (BF16_Optimizer), ``zero3`` (DeepSpeedZeroOptimizer_Stage3: also owns the parameter
gather); ``step/`` holds the optimizer step (lean step, fused update, deferred gather, norm). ``ledger``
records every change a binding makes so that ``detach`` (or a failed ``attach``) undoes it exactly.
"""
from .attach import attach, detach
from .base import DeepSpeedBinding, binding_of

__all__ = ["DeepSpeedBinding", "attach", "binding_of", "detach"]
