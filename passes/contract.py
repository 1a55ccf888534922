"""Pass contracts: what each pass requires from the passes before it and provides to those after
it, as named facts (a fact holds until a pass invalidates it). The pipelines in ``__init__.py``
are checked at import; a misordered one raises `PipelineOrderError`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from ..errors import PipelineOrderError

FACTS = {
    "gathers tagged": "release tagged the ZeRO-3 gathers (the partitioner copies the tags into both graphs)",
    "gather waits at first use": "each tagged gather's wait sits before its parameter's first use, in that order",
    "gathers bucketed": "one all-gather per gather bucket; ctx.zero3_plan lists them",
    "param waits": "every read of an owned ZeRO-1/2 parameter waits for its deferred all-gather",
    "one reduce-scatter per shard grad": "a ZeRO-3 parameter's gradients in this graph are reduced as one sum",
    "kept shard grads out": "the ZeRO-3 shard gradients another graph of this backward reduces are kept, not reduced here",
    "shard grads bucketed": "one reduce-scatter per bucket of ZeRO-3 shard gradients",
    "grads": "ctx.grads: each owned gradient among the outputs, as a node of the graph",
    "buckets": "ctx.buckets: the collectives planned for the ZeRO-1/2 gradients",
    "flat partial sums": "ctx.grads and ctx.buckets include the ZeRO-1/2 partial sums of the variant (ctx.modes)",
    "reduced": "ctx.reduced: each bucket's collective, waited for, as this rank's chunk",
    "bucket cats": "each bucket's input is a cat tagged insert_reduce_scatter",
    "accumulated": "reduced shards added into the sinks (runtime inputs); ctx.accumulated(_pieces)",
    "owned grads out of outputs": "the graph returns None for every owned gradient",
    "waits scheduled": "the bucket waits stand where they stay (before their first user with overlap)",
    "reduce-scatters lowered": "gloo (or collective='all_to_all'): each reduce-scatter is an all-to-all + sum",
    "norm folded": "ctx.runtime_inputs has the folded squared norms of the engines that fold one",
}


@dataclasses.dataclass(frozen=True)
class Contract:
    requires: frozenset[str]
    provides: frozenset[str]
    invalidates: frozenset[str]
    optional: bool   # may be left out (option ``disable_passes``): nothing requires what it provides


def pass_contract(requires: Iterable[str] = (), provides: Iterable[str] = (), invalidates: Iterable[str] = (),
                  optional: bool = False) -> Callable:
    """Decorator: record the pass's contract on it as ``fn.contract``."""
    contract = Contract(frozenset(requires), frozenset(provides), frozenset(invalidates), optional)
    unknown = (contract.requires | contract.provides | contract.invalidates) - FACTS.keys()
    if unknown:
        raise ValueError(f"unknown fact(s) {sorted(unknown)}: name them in passes/contract.py's FACTS")

    def mark(fn: Callable) -> Callable:
        fn.contract = contract
        return fn
    return mark


def check_pipeline(pipeline: tuple[Callable, ...], given: Iterable[str] = ()) -> frozenset[str]:
    """Raise `PipelineOrderError` at the first pass that requires a fact not holding at that point;
    return the facts that hold after the pipeline (``given`` hold before it)."""
    facts, gone = set(given), {}
    for i, p in enumerate(pipeline):
        for fact in sorted(p.contract.requires - facts):
            later = [q.__name__ for q in pipeline[i + 1:] if fact in q.contract.provides]
            why = (f"{gone[fact]} invalidated it" if fact in gone else
                   f"{later[0]} provides it later" if later else "no pass before it provides it")
            raise PipelineOrderError(f"pass {p.__name__} requires {fact!r} ({FACTS[fact]}), but {why}: "
                                     f"{' -> '.join(q.__name__ for q in pipeline)}", pass_name=p.__name__, fact=fact)
        facts |= p.contract.provides
        facts -= p.contract.invalidates
        gone.update((f, p.__name__) for f in p.contract.invalidates)
        for f in p.contract.provides:
            gone.pop(f, None)
    return frozenset(facts)
