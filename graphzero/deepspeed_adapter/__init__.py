"""The DeepSpeed adapter: the only package that touches DeepSpeed internals.

``base`` holds what every engine shares (config checks, attach/detach, switching DeepSpeed's own
hooks off and on, the eager safety net); one module per optimizer family binds the buffers its
``step()`` reads: ``zero12`` (DeepSpeedZeroOptimizer), ``bf16`` (BF16_Optimizer), ``zero3``
(DeepSpeedZeroOptimizer_Stage3: also owns the parameter gather).
"""
from .base import DeepSpeedBinding, attach, binding_of, detach

__all__ = ["DeepSpeedBinding", "attach", "binding_of", "detach"]
