"""graphzero's exceptions. Every error a user can cause is a :class:`GraphZeroError`, raised before
any collective runs, naming the option, engine or parameter at fault.
"""
from __future__ import annotations

from torch._dynamo.exc import ShortenTraceback


# Dynamo wraps a backend's exceptions in BackendCompilerFailed, except ShortenTraceback subclasses:
# `except GraphZeroError` then works around a torch.compile'd call.
class GraphZeroError(ShortenTraceback):
    """Base class of graphzero's user-facing errors."""

    def __init__(self, message: str) -> None:
        super().__init__(message, first_useful_frame=None)


class OptionError(GraphZeroError, ValueError):
    """An unknown option or an option with a bad value."""


class NotAnEngineError(GraphZeroError, TypeError):
    """Something in `engines` is not a DeepSpeed engine."""


class UnsupportedConfigError(GraphZeroError):
    """An engine uses a DeepSpeed feature graphzero does not support yet; the message names the key."""


class OwnershipError(GraphZeroError):
    """A parameter is claimed by two engines."""


class AccelerateError(GraphZeroError):
    """An HF Accelerate setup or loop graphzero cannot make right (``graphzero.accelerate``); names the
    model and the reason."""


class WorldMismatchError(GraphZeroError):
    """Engines in one graph reduce over data-parallel groups of different sizes, or without this rank."""


class AutogradUsageError(GraphZeroError):
    """A backward call graphzero cannot honour exactly (create_graph, a partial ``inputs=``)."""


class NoGradientError(GraphZeroError):
    """``engine.step()`` at a boundary with no gradient for that engine since its last step."""


class RankDisagreementError(GraphZeroError):
    """The ranks of a data-parallel group were about to run different reductions."""


class RankFaultError(GraphZeroError):
    """A collective failed because a peer rank raised, died or timed out."""


class VersionError(GraphZeroError, ImportError):
    """The installed torch or DeepSpeed (``package``, ``version``) is outside the ``tested`` range
    (a pip specifier such as ``>=2.13,<2.14``); raised at import."""

    def __init__(self, message: str, *, package: str, version: str, tested: str) -> None:
        super().__init__(message)
        self.package = package
        self.version = version
        self.tested = tested


class AttachTooLateError(GraphZeroError):
    """``options["engines"]`` names engines that were not attached before Dynamo traced the step
    (graphzero's compile-start callback was removed): the first step may already have run through
    DeepSpeed's own hooks. Names the engines and what to do."""


class InstallError(GraphZeroError):
    """Attaching to an engine failed part-way; everything graphzero had changed on it is restored
    (the patch ledger), and the engine is not attached. The cause is chained (``__cause__``)."""


class InternalsError(GraphZeroError):
    """A torch or DeepSpeed internal graphzero relies on is missing or failed unexpectedly; the
    message names it and the installed versions."""


class PipelineOrderError(GraphZeroError):
    """A pass pipeline runs a pass before one that provides what it requires, or after one that
    invalidated it (passes/contract.py); raised when the pipeline is built. ``pass_name`` and
    ``fact`` name the pass and the missing fact."""

    def __init__(self, message: str, *, pass_name: str, fact: str) -> None:
        super().__init__(message)
        self.pass_name = pass_name
        self.fact = fact
