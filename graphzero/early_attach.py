"""Attach the engines named in ``options["engines"]`` before Dynamo traces the step.

The backend itself only runs once Dynamo has traced a graph. By then, for the first call, Dynamo
may already have run parts of the step eagerly through DeepSpeed's own ``engine.forward`` (its
hooks break the graph), e.g. when the engines are called from a list comprehension or a helper
frame: those parts would reduce and scale gradients DeepSpeed's way, and the first step would
differ from every later one. So graphzero attaches earlier, from a Dynamo compile-start callback:
it runs before Dynamo traces any frame, finds the backend of the compile in progress and, if it
is graphzero with ``options["engines"]``, attaches them. The step is then traced once, without
DeepSpeed's hooks, exactly as with ``graphzero.attach()`` before the first call.

``torch._dynamo.reset()`` clears Dynamo's callbacks; graphzero installs this one again whenever
it runs (import, each backend call, graphzero.attach). The backend keeps a fallback for a compile that
starts with the callback missing (see backend.RetraceAfterAttach).
"""
from __future__ import annotations

import sys
from typing import Any

import torch

_CONVERT_FRAME_FILE = "convert_frame.py"


def install() -> None:
    """Register the compile-start callback with Dynamo (idempotent)."""
    handler = torch._dynamo.callback_handler
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)


def _on_compile_start(_args: Any) -> None:
    options = _options_of_compile_in_progress()
    if not options or not options.get("engines"):
        return
    from . import deepspeed_adapter
    from .options import Options
    # A GraphZeroError here (bad option, not an engine, unsupported config) reaches the caller of
    # the compiled step as it is, before anything is traced: Dynamo re-raises it on every rank.
    opts = Options.parse(options)
    deepspeed_adapter.attach(opts.engines, **opts.step_settings)


def _options_of_compile_in_progress() -> dict | None:
    """The graphzero ``options`` of the torch.compile whose frame Dynamo starts compiling, if any.

    Dynamo's callback gets no backend, so read it from ``convert_frame._compile``'s
    ``compiler_fn`` argument on the stack (the only place it lives during a compile).
    """
    from torch._dynamo.eval_frame import innermost_backend

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_compile" and code.co_filename.endswith(_CONVERT_FRAME_FILE):
            wrapper = innermost_backend(frame.f_locals.get("compiler_fn"))
            if not getattr(getattr(wrapper, "compiler_fn", None), "is_graphzero_backend", False):
                return None
            return dict(getattr(wrapper, "kwargs", {}).get("options") or {})
        frame = frame.f_back
    return None
