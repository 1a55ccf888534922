"""Attach the engines named in ``options["engines"]`` before Dynamo traces the step.

``torch.compile(step, backend=graphzero.backend(gen=gen, disc=disc))`` attaches in the backend
object's constructor and needs nothing from this module. The string form
``backend="graphzero", options={"engines": [...]}`` gives graphzero no call before Dynamo starts
tracing, and by the time the backend runs, Dynamo may already have run parts of the first call
eagerly through DeepSpeed's own ``engine.forward`` (its hooks break the graph; e.g. engines called
from a list comprehension or a helper frame): those parts would reduce and scale gradients
DeepSpeed's way (ZeRO-1/2), or be traced with ZeRO-3's empty parameters. So graphzero attaches
from a Dynamo compile-start callback: it runs before Dynamo traces any frame, finds the backend
of the compile in progress and, if it is graphzero with ``options["engines"]``, attaches them.

``torch._dynamo.reset()`` clears Dynamo's callbacks (test suites and notebooks call it all the
time). graphzero's callback survives it: the callback list is swapped for one whose ``clear()``
keeps graphzero's entry, so the callback is back before the next compile traces anything. Where
it is gone all the same (someone removed it, or a torch whose internals differ), the backend
finds the engines unattached and raises :class:`~graphzero.errors.AttachTooLateError` on every
rank: never a first step traced through DeepSpeed's hooks.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

_CONVERT_FRAME_FILE = "convert_frame.py"


class _CallbacksKeepingGraphZero(list):
    """Dynamo's start-callback list, except that ``clear()`` (``torch._dynamo.reset()``) keeps
    graphzero's callback."""

    def clear(self) -> None:
        keep = [cb for cb in self if cb is _on_compile_start]
        super().clear()
        self.extend(keep)


def install() -> None:
    """Register the compile-start callback with Dynamo so that it survives ``torch._dynamo.reset()``
    (idempotent)."""
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
    # A GraphZeroError here (bad option, not an engine, unsupported config) reaches the caller of
    # the compiled step as it is, before anything is traced: Dynamo re-raises it on every rank.
    # This runs under Dynamo's callback lock: attaching must not compile anything.
    opts = Options.parse(options)
    deepspeed_adapter.attach(opts.engines, **opts.step_settings)


def _options_of_compile_in_progress() -> dict | None:
    """The graphzero ``options`` of the torch.compile whose frame Dynamo starts compiling, if any.

    Dynamo's callback gets no backend, so read it from ``convert_frame._compile``'s
    ``compiler_fn`` argument on the stack (the only place it lives during a compile). If a torch
    release moves it, nothing is found, the engines stay unattached and the backend says so
    (AttachTooLateError) instead of compiling a wrong first step.
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
