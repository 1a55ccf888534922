"""Attach the engines named in ``options["engines"]`` before Dynamo traces the step.

The string backend gives graphzero no call before tracing, and Dynamo may run parts of the first
call eagerly through DeepSpeed's hooks. So graphzero attaches from a compile-start callback, kept
across ``torch._dynamo.reset()``; if it is gone all the same, the backend raises
:class:`~graphzero.errors.AttachTooLateError` on every rank. (``graphzero.backend(...)`` needs none of this.)
"""
from __future__ import annotations

import sys
from typing import Any

import torch

_CONVERT_FRAME_FILE = "convert_frame.py"


class _CallbacksKeepingGraphZero(list):
    """Dynamo's start-callback list whose ``clear()`` keeps graphzero's callback."""

    def clear(self) -> None:
        keep = [cb for cb in self if cb is _on_compile_start]
        super().clear()
        self.extend(keep)


def install() -> None:
    """Register the compile-start callback, surviving ``torch._dynamo.reset()`` (idempotent)."""
    handler = torch._dynamo.callback_handler
    if not isinstance(handler.start_callbacks, _CallbacksKeepingGraphZero):
        handler.start_callbacks = _CallbacksKeepingGraphZero(handler.start_callbacks)
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)


def uninstall() -> None:
    """Remove the callback (the string backend's options path then raises AttachTooLateError)."""
    handler = torch._dynamo.callback_handler
    while _on_compile_start in handler.start_callbacks:
        handler.remove_start_callback(_on_compile_start)


def installed() -> bool:
    return _on_compile_start in torch._dynamo.callback_handler.start_callbacks


def _on_compile_start(_args: Any) -> None:
    options = _options_of_compile_in_progress()
    if not options or not options.get("engines"):
        return
    from . import deepspeed_adapter
    from .options import Options
    # A GraphZeroError here reaches the caller before anything is traced (Dynamo re-raises it on
    # every rank). This runs under Dynamo's callback lock: attaching must not compile anything.
    opts = Options.parse(options)
    deepspeed_adapter.attach(opts.engines, **opts.step_settings)


def _options_of_compile_in_progress() -> dict | None:
    """The graphzero ``options`` of the compile in progress, read from ``convert_frame._compile``'s
    ``compiler_fn`` on the stack (Dynamo's callback gets no backend; if torch moves it, nothing is
    found and the backend raises AttachTooLateError)."""
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
