"""The backend's options, parsed once into a frozen dataclass."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from .errors import OptionError
from .passes import FORWARD_PIPELINE, JOINT_PIPELINE, OPTIONAL_PASSES, PIPELINE, ZERO3_BACKWARD

INNER_COMPILERS = ("inductor", "eager")
COLLECTIVES = ("auto", "reduce_scatter", "all_to_all", "all_reduce")
DUMP_RANKS = ("0", "all")


class DefaultName(str):
    """The label ``engineI`` of an engine listed without a name, for errors about the list; attaching
    may give the engine another name (deepspeed_adapter/names.py)."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True)
class Options:
    """Parsed `options=` of ``torch.compile(..., backend="graphzero")``.

    engines: ``(name, engine)`` pairs (a `DefaultName` where the engine was listed without a
        name); empty means "the engines attached with graphzero.attach".
    inner: ``"inductor"`` compiles the transformed graphs with inductor, ``"eager"`` runs them as FX.
    bucket_size: elements per reduction bucket; None means each engine's
        ``zero_optimization.reduce_bucket_size``.
    collective: how a bucket is reduced to each rank's shard: ``"reduce_scatter"``,
        ``"all_to_all"`` (and a local sum), ``"all_reduce"`` (ZeRO-1/2). ``"auto"``: reduce-scatter,
        all-to-all on gloo (whose reduce-scatter is an all-reduce underneath).
    overlap: issue each bucket's collective as soon as its gradients exist and wait as late as
        possible; off waits right after issuing.
    dump_dir / dump_ranks: where and from which ranks to write the graph dump (docs/dump-format.md).
    fault_timeout_s: how long a rank waits for its peers at the start of each backward before
        raising RankFaultError (a peer that raised, or whose compile failed); None: the process
        group's own timeout.
    lean_step: graphzero's optimizer step where the config allows (deepspeed_adapter/step/).
        None (default): on; False: DeepSpeed's own step.
    defer_param_gather: the lean step leaves the parameters' all-gather in flight, and their
        readers wait for it (deepspeed_adapter/step/deferred.py). None (default): off.
    Both need ``engines``, and are set once per engine (step.settle).
    disable_passes: optional passes (``passes.OPTIONAL_PASSES``: ``schedule_overlap``,
        ``write_into_bucket``) left out of the backward pipeline, for debugging; gradients are the same.
    """

    engines: tuple[tuple[str, Any], ...] = ()
    inner: str = "inductor"
    bucket_size: int | None = None
    collective: str = "auto"
    overlap: bool = True
    dump_dir: str | None = None
    dump_ranks: str = "0"
    fault_timeout_s: float | None = None
    lean_step: bool | None = None
    defer_param_gather: bool | None = None
    disable_passes: tuple[str, ...] = ()

    @property
    def step_settings(self) -> dict[str, bool | None]:
        """The options that set the listed engines' optimizer step (deepspeed_adapter.attach)."""
        return {"lean_step": self.lean_step, "defer_param_gather": self.defer_param_gather}

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> Options:
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise OptionError(
                f"unknown graphzero option(s) {unknown}; known options are {sorted(known)}")
        engines = _parse_engines(options.pop("engines", None))
        inner = options.get("inner", "inductor")
        if inner not in INNER_COMPILERS:
            raise OptionError(f"option 'inner' must be one of {INNER_COMPILERS}, got {inner!r}")
        bucket_size = options.get("bucket_size")
        if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, int)
                                        or bucket_size <= 0):
            raise OptionError(f"option 'bucket_size' must be a positive int (elements), got {bucket_size!r}")
        collective = options.get("collective", "auto")
        if collective not in COLLECTIVES:
            raise OptionError(f"option 'collective' must be one of {COLLECTIVES}, got {collective!r}")
        overlap = options.get("overlap", True)
        if not isinstance(overlap, bool):
            raise OptionError(f"option 'overlap' must be True or False, got {overlap!r}")
        dump_dir = options.get("dump_dir") or os.environ.get("GRAPHZERO_DUMP_DIR") or None
        dump_ranks = str(options.get("dump_ranks", os.environ.get("GRAPHZERO_DUMP_RANKS", "0")))
        if dump_ranks not in DUMP_RANKS:
            raise OptionError(f"option 'dump_ranks' must be one of {DUMP_RANKS}, got {dump_ranks!r}")
        fault_timeout_s = options.get("fault_timeout_s")
        if fault_timeout_s is not None and (isinstance(fault_timeout_s, bool)
                                            or not isinstance(fault_timeout_s, (int, float)) or fault_timeout_s <= 0):
            raise OptionError(f"option 'fault_timeout_s' must be a positive number of seconds, got {fault_timeout_s!r}")
        lean_step = _optional_bool(options, "lean_step")
        defer_param_gather = _optional_bool(options, "defer_param_gather")
        if lean_step is False and defer_param_gather:
            raise OptionError("option 'defer_param_gather'=True needs option 'lean_step' (the deferred all-gather "
                              "is part of graphzero's lean optimizer step); got lean_step=False")
        disable_passes = _parse_disable_passes(options.get("disable_passes", ()))
        if (lean_step is not None or defer_param_gather is not None) and not engines:
            raise OptionError("options 'lean_step' and 'defer_param_gather' set the step of the engines listed with "
                              "them, and none are: give them where the engines are attached (options['engines'], "
                              "graphzero.backend(...), graphzero.attach(..., lean_step=...))")
        return cls(engines=engines, inner=inner, bucket_size=bucket_size, collective=collective,
                   overlap=overlap, dump_dir=str(dump_dir) if dump_dir else None, dump_ranks=dump_ranks,
                   fault_timeout_s=None if fault_timeout_s is None else float(fault_timeout_s),
                   lean_step=lean_step, defer_param_gather=defer_param_gather, disable_passes=disable_passes)


def _optional_bool(options: Mapping[str, Any], name: str) -> bool | None:
    value = options.get(name)
    if value is not None and not isinstance(value, bool):
        raise OptionError(f"option {name!r} must be True, False or None, got {value!r}")
    return value


def _parse_disable_passes(names: Any) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, (list, tuple, set, frozenset)) \
            or not all(isinstance(n, str) for n in names):
        raise OptionError(f"option 'disable_passes' must be a list of pass names, got {names!r}")
    known = {p.__name__ for p in JOINT_PIPELINE + FORWARD_PIPELINE + ZERO3_BACKWARD + PIPELINE}
    for name in names:
        if name not in OPTIONAL_PASSES:
            what = "pass" if name in known else "unknown pass"
            raise OptionError(f"option 'disable_passes': {what} {name!r} cannot be disabled; the optional "
                              f"passes are {sorted(OPTIONAL_PASSES)}")
    return tuple(sorted(set(names)))


def _parse_engines(engines: Any) -> tuple[tuple[str, Any], ...]:
    if engines is None:
        return ()
    if isinstance(engines, Mapping):
        pairs = list(engines.items())
        for name, _ in pairs:
            if not isinstance(name, str) or not name:
                raise OptionError(f"option 'engines': names must be non-empty strings, got {name!r}")
    elif isinstance(engines, (list, tuple)):
        pairs = [(DefaultName(f"engine{i}"), e) for i, e in enumerate(engines)]
    else:
        raise OptionError("option 'engines' must be a list of DeepSpeed engines or a {name: engine} dict, "
                          f"got {type(engines).__name__}")
    seen: dict[int, str] = {}
    for name, engine in pairs:
        if id(engine) in seen:
            raise OptionError(f"option 'engines': the same engine is listed twice, as {seen[id(engine)]!r} "
                              f"and {name!r}")
        seen[id(engine)] = name
    return tuple(pairs)
