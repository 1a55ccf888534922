"""One engine's run-time state: everything about its gradient that changes between the compiled
backward and its optimizer step, and the one place that changes it.

The compiled backward asks an `EngineState` for the mode (`mode`), its run-time inputs
(`before_graph`) and reports the run (`after_graph`); the backward's scope ends it
(`end_backward`); the adapter's ``step()`` and ``zero_grad()`` call `before_step` / `after_step` /
`zero_grad`. What the optimizer reads is behind `EngineBinding`, implemented by the adapter.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import Counter
from collections.abc import Collection, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from .. import rank_agreement
from ..errors import NoGradientError
from ..ownership import ParamSet
from ..passes import Mode, RuntimeInput, Slot
from .norm import FoldedNorm
from .partial import PartialSums, Position

log = logging.getLogger("graphzero")

# Engines are created (attached) in the same order on every rank: ends and flushes follow it.
_ATTACH_ORDER = itertools.count()


class EngineBinding(Protocol):
    """What the run time needs from the adapter that owns the engine (deepspeed_adapter/base.py)."""

    def sinks(self) -> list[torch.Tensor]:
        """Per param group, the buffer the optimizer's ``step()`` reads this rank's shard from."""

    def drop_sinks(self) -> None:
        """Forget the accumulated shards (``zero_grad``): the next write starts from zeros."""

    def mark_present(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Tell the optimizer these parameters received a gradient."""

    def runtime_scale(self) -> float:
        """This backward's factor for the engine's summed gradient (normally 1/(world x gas))."""

    def at_boundary(self) -> bool:
        """Whether this micro-step ends the engine's gradient-accumulation window."""

    def backward_ended(self) -> None:
        """An autograd backward that reached the engine ended; its gradients are complete."""

    def gradient_accumulation_steps(self) -> int:
        """The engine's gas (read per call: it may change between steps)."""


@dataclasses.dataclass
class GraphCall:
    """One engine's part of one call of a compiled backward: its run-time inputs, and what
    `EngineState.after_graph` needs to know about them."""

    mode: Mode
    positions: tuple[Position, ...]
    accumulating: bool
    scale: torch.Tensor
    sinks: list[torch.Tensor] | None = None
    squares: torch.Tensor | None = None
    writes: int | None = None   # the folded norm's write count after this call's sink write
    partial: dict[object, torch.Tensor] = dataclasses.field(default_factory=dict)

    def tensor(self, slot: RuntimeInput) -> torch.Tensor:
        if slot.kind is Slot.SINK:
            return self.sinks[slot.key]
        if slot.kind is Slot.SCALE:
            return self.scale
        if slot.kind is Slot.NORM:
            return self.squares
        return self.partial[slot.key]


class EngineState:
    """Per attached engine: its partial sums, folded norm, pending-forward counts and whether it
    received a gradient since its last optimizer step."""

    def __init__(self, layout: ParamSet, binding: EngineBinding, window: bool = False) -> None:
        self.layout = layout
        self.binding = binding
        # ZeRO-1: with gas > 1 a window's micro-steps stay local until its boundary
        self.window = window
        self.partial = PartialSums(layout)
        # set while the engine's optimizer step reads a norm folded into the backward (norm.py)
        self.norm: FoldedNorm | None = None
        # training forwards reaching each parameter whose backward has not run (runtime/scope.py)
        self.forwards: Counter[Position] = Counter()
        self.received_gradient = False
        # bumped by every write to (or drop of) the shard buffers: a copy made of them since is stale
        self.sink_writes = 0
        # set by detach: graphs compiled while attached must not run any more
        self.detached = False
        self.attach_order = next(_ATTACH_ORDER)
        # backwards in which the ranks ran different graphs (runtime/scope.py): reduced at their end
        self.backwards_apart = 0
        # such a backward inside an open ZeRO-1 window: the ranks' pending sums may differ until the
        # window's flush, which then exchanges on every rank
        self.apart_in_window = False
        self._scales: dict[float, torch.Tensor] = {}

    @property
    def name(self) -> str:
        return self.layout.name

    def defers_reduction(self) -> bool:
        """Whether non-boundary micro-steps keep their gradients local (read when a graph is
        compiled, and per backward)."""
        return self.window and self.binding.gradient_accumulation_steps() > 1

    # -- per backward ---------------------------------------------------------------------------
    def forward_ran(self, positions: Collection[Position]) -> None:
        self.forwards.update(positions)

    def backward_reaches(self, positions: Collection[Position]) -> None:
        """Once per backward of a graph reaching ``positions``, before `mode`: takes that graph's
        forward off the count."""
        for p in positions:
            if self.forwards[p] > 0:
                self.forwards[p] -= 1

    def mode(self, positions: Collection[Position]) -> Mode:
        """The mode of a graph whose gradients reach ``positions`` in this backward: keep them
        (a ZeRO-1 window's micro-step, or another graph of this backward reaches them all again),
        reduce them together with their partial sums, or reduce them."""
        if self.window and not self.binding.at_boundary():
            return Mode.KEEP
        again = bool(positions) and all(self.forwards[p] > 0 for p in positions)
        # a flat partial is the engine's whole flat gradient: worth keeping only for a graph reaching all of it
        if again and (self.partial.per_param or len(positions) == self.layout.num_params):
            return Mode.KEEP
        if self.partial.pending.intersection(positions) or self.defers_reduction():
            return Mode.REDUCE_PARTIAL
        return Mode.REDUCE

    def before_graph(self, slots: Sequence[RuntimeInput], mode: Mode, positions: tuple[Position, ...],
                     present: Sequence[torch.nn.Parameter], accumulating: bool) -> GraphCall:
        """The tensors for this engine's run-time inputs of one compiled backward call. When the
        backward does not accumulate into the engine (``autograd.grad``, ``backward(inputs=...)``
        without it) they are scratch: the collectives still run on every rank, nothing is kept."""
        device, scale = self.layout.device, self.binding.runtime_scale()
        call = GraphCall(mode, positions, accumulating, self.scale_tensor(scale))
        kinds = {s.kind for s in slots}
        if Slot.NORM in kinds:
            # the squares of this backward's final shards; scratch if nothing reads them
            fold = self.norm if accumulating else None
            call.squares = fold.buffer(device) if fold is not None else torch.zeros(len(self.layout.groups),
                                                                                    device=device)
        if Slot.SINK in kinds:
            call.sinks = self.write_sinks(present) if accumulating else self.layout.scratch_sinks()
            if accumulating and call.squares is not None and self.norm is not None:
                call.writes = self.norm.writes
        for s in slots:
            if s.kind is Slot.PARTIAL:
                call.partial[s.key] = self.partial.buffer(s.key) if accumulating else self.partial.scratch(s.key)
        if accumulating and mode is Mode.KEEP:
            self.partial.keeping(positions, scale)
        return call

    def after_graph(self, call: GraphCall) -> None:
        if call.writes is not None:
            self.norm.issue(call.writes, call.squares)
        if not call.accumulating:
            return
        if call.mode is Mode.KEEP:
            self.received_gradient = True   # a kept gradient is still a gradient for step()
        elif call.mode is Mode.REDUCE_PARTIAL:
            self.partial.reduced(call.positions)

    def scale_tensor(self, value: float) -> torch.Tensor:
        # on the engine's device, as the graph's other inputs; a fill, not a host-to-device copy
        if value not in self._scales:
            self._scales[value] = torch.full((), value, dtype=torch.float32, device=self.layout.device)
        return self._scales[value]

    def write_sinks(self, present: Sequence[torch.nn.Parameter] = ()) -> list[torch.Tensor]:
        """The shard buffers, for a write: the engine now has a gradient to step on, and a norm
        folded before this write is stale."""
        self.received_gradient = True
        self.sink_writes += 1
        if self.norm is not None:
            self.norm.wrote()
        if present:
            self.binding.mark_present(present)
        return self.binding.sinks()

    def ran_apart(self) -> None:
        """A backward in which the ranks ran different graphs reached the engine: its gradients were
        kept locally and are reduced at the backward's end, without overlap."""
        if not self.backwards_apart:
            log.warning("engine %r: the ranks ran different graphs in one backward (rank-dependent Python, a graph "
                        "break or an eager frame on some ranks); its gradients are kept locally and reduced once at "
                        "the end of the backward, without overlap with compute", self.name)
        self.backwards_apart += 1
        self.apart_in_window = self.apart_in_window or not self.flushes_at_end()

    def flushes_at_end(self) -> bool:
        """Whether the end of a backward reduces the partial sums: not inside a ZeRO-1 window."""
        return not (self.window and not self.binding.at_boundary())

    def end_backward(self, every_rank: bool = False) -> None:
        """The autograd backward ended: reduce what no graph reduced, unless a ZeRO-1 window is still
        open, so that the gradients are complete when the backward returns, as after DeepSpeed's.
        ``every_rank``: the ranks ran different graphs; flush even with nothing pending here."""
        self.forwards.clear()
        if self.flushes_at_end():
            self.flush(every_rank or self.apart_in_window)
        self.binding.backward_ended()

    def backward_abandoned(self, diverged: bool = False) -> None:
        """A backward that reached the engine raised (its end never ran): per-parameter sums kept
        for its later graphs are dropped (its ``.grad`` would be as incomplete under eager
        autograd); a window's flat sums stay theirs, unless the ranks ran different graphs
        (``diverged``): then no rank's sums can be reduced and all are dropped."""
        if (self.partial.per_param or diverged) and self.partial.pending:
            log.warning("engine %r: dropping the partial gradient sums of %d parameter(s) kept by a backward that "
                        "did not finish", self.name, len(self.partial.pending))
            self.partial.clear()

    # -- optimizer step -------------------------------------------------------------------------
    def before_step(self) -> bool:
        """``engine.step()`` is about to run; returns whether it is at the boundary. DeepSpeed would
        fail deep in its optimizer on a missing gradient: say so first, on every rank."""
        boundary = self.binding.at_boundary()
        if boundary and not self.received_gradient:
            raise NoGradientError(
                f"engine {self.name!r}: step() at a gradient-accumulation boundary, but no backward since its "
                "last optimizer step reached its parameters; skip this engine's step() when the loss does not "
                "use it")
        if boundary:
            self.flush(self.apart_in_window)
        return boundary

    def after_step(self, boundary: bool) -> None:
        if boundary:
            self.received_gradient = False

    def zero_grad(self) -> None:
        """Drop the shards, partial sums and folded norm, as DeepSpeed eager drops ``.grad``."""
        self.binding.drop_sinks()
        self.sink_writes += 1
        if self.norm is not None:
            self.norm.forget()
        self.partial.clear()
        self.apart_in_window = False
        self.received_gradient = False

    @torch.no_grad()
    def flush(self, every_rank: bool = False) -> None:
        """Reduce every rank's pending partial sums into the shards, eagerly (usually nothing is
        pending): ZeRO-1/2 one all-reduce per flat group, ZeRO-3 one reduce-scatter per parameter.
        The ranks reduce the union of their pending parameters (they differ after rank-dependent
        graphs, runtime/scope.py); a rank without a sum for one adds zeros. ``every_rank``: some
        rank may hold sums where this one holds none (else all or none hold some)."""
        layout, partial = self.layout, self.partial
        if not partial.pending and not every_rank:
            return
        self.apart_in_window = False
        what = f"engine {self.name!r}: partial gradient sums left at the end of a backward or window"
        pending = self._union_pending(what)
        if not pending:
            return
        if partial.per_param and not partial.pending:
            partial.scale = self.binding.runtime_scale()
        partial.keeping(pending - partial.pending, partial.scale)
        pending = sorted(pending)
        sinks = self.write_sinks([layout.groups[g].params[k] for g, k in pending])
        with rank_agreement.collective_failures(what):
            if partial.per_param:
                for g, k in pending:
                    group, start = layout.groups[g], layout.groups[g].offsets[k]
                    shard = torch.empty(group.shard_numel_of(k), dtype=partial.dtype, device=layout.device)
                    dist.reduce_scatter_tensor(shard, partial.buffer((g, k)), group=layout.process_group)
                    sinks[g][start:start + shard.numel()].add_(shard.to(sinks[g].dtype), alpha=partial.scale)
            else:
                for g in sorted({g for g, _ in pending}):
                    # ranges reduced earlier in the window were zeroed then: the whole buffer can go
                    flat, group = partial.buffer(g).to(layout.comm_dtype), layout.groups[g]
                    dist.all_reduce(flat, group=layout.process_group)
                    shard = group.shard_numel(layout.world_size)
                    lo = layout.rank * shard if group.sharded else 0
                    sinks[g].add_(flat[lo:lo + shard].to(sinks[g].dtype))
        partial.reduced(pending)

    def _union_pending(self, what: str) -> set[Position]:
        """The parameters any rank holds a partial sum for (one exchange; a rank flushing another
        engine raises RankDisagreementError on every rank)."""
        positions = [(g, k) for g, group in enumerate(self.layout.groups) for k in range(len(group.params))]
        # the engine first (fixed size), then the bitmap, whose length is the engine's
        rank_agreement.agree(rank_agreement.fingerprint(("partial-flush", self.name, len(positions))),
                             self.layout.process_group, what)
        every = rank_agreement.exchange([int(p in self.partial.pending) for p in positions],
                                        self.layout.process_group, what)
        return {p for i, p in enumerate(positions) if any(row[i] for row in every)}
