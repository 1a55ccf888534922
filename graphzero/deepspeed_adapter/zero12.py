"""ZeRO-1/2 with ``DeepSpeedZeroOptimizer`` (fp32, and bf16 ZeRO-2 with fp32 accumulation).

Layout: per param group, the flat order ``round_robin_bit16_groups[i]`` at
``round_robin_bit16_offsets[i]`` of a padded buffer of ``bit16_groups_flat[i].numel()`` elements,
split into one contiguous partition per data-parallel rank. ``step()`` reads this rank's
partition from ``averaged_gradients[i]``.

While attached, ``optimizer.step`` is graphzero's lean step (lean_step.py) where the config
allows (option ``lean_step``), with fp32 masters that are this rank's partition of the flat
parameter buffer (master_alias.py); otherwise DeepSpeed's own, with the reason logged once. With
``defer_param_gather`` the lean step leaves its all-gather in flight; param_sync.py makes every
reader of the parameters wait for it.
"""
from __future__ import annotations

import logging
import weakref

import torch

from ..ownership import FlatGroup
from . import lean_step, master_alias
from .base import DeepSpeedBinding
from .ds_internals import _deepspeed_version
from .ledger import PatchLedger
from .param_sync import ParamSync

log = logging.getLogger("graphzero")


class ZeroBinding(DeepSpeedBinding):
    def __init__(self, engine, name: str) -> None:
        # weak: a group step() consumed must not be kept alive until the next backward
        self._installed_groups: dict[int, weakref.ref] = {}
        self.want_lean_step = True
        # Off unless asked: a parameter list kept across step() is not guarded (param_sync.py).
        self.want_defer = False
        self._step_ledger = PatchLedger(f"engine {name!r} optimizer step")
        # lean_step.changed_mirrors() at the first install of the step (None: not yet checked)
        self._mirror_changes: list[str] | None = None
        super().__init__(engine, name)
        self.param_sync = ParamSync(engine, [p for g in self.param_set.groups for p in g.params])

    # -- the optimizer step ---------------------------------------------------------------------
    def configure_step(self, lean: bool | None, defer_param_gather: bool | None) -> None:
        if lean is not None:
            self.want_lean_step = lean
        if defer_param_gather is not None:
            self.want_defer = defer_param_gather
        if self.installed:
            self._install_step()

    @property
    def lean_step(self) -> lean_step.LeanStep | None:
        """The lean step standing in for ``optimizer.step``, if any."""
        step = self.engine.optimizer.__dict__.get("step")
        return step if isinstance(step, lean_step.LeanStep) else None

    def wait_params(self) -> None:
        self.param_sync.wait()

    def _install_step(self) -> None:
        opt = self.engine.optimizer
        if self.lean_step is not None:
            self.param_sync.wait()
        self._step_ledger.undo()
        self._unfold_norm()
        if not self.want_lean_step:
            return
        if self._mirror_changes is None:
            # once per binding: the warning below is logged once, and attach runs this per compile
            self._mirror_changes = lean_step.changed_mirrors()
            changed = self._mirror_changes
            if changed:
                log.warning("engine %r: DeepSpeed's own optimizer step: the DeepSpeed functions graphzero's lean step "
                            "re-implements are not the ones it was written against (DeepSpeed 0.19.8); changed: %s "
                            "(installed DeepSpeed %s)", self.name, ", ".join(changed), _deepspeed_version())
        if self._mirror_changes:
            return
        reason = lean_step.unsupported_reason(self.engine)
        if reason is not None:
            log.info("engine %r: DeepSpeed's own optimizer step (graphzero's lean step does not cover %s)",
                     self.name, reason)
            return
        self._fold_norm()
        step = lean_step.LeanStep(opt, self.name, self.param_sync if self.want_defer else None, self.state.norm)
        self._step_ledger.set_attr(opt, "step", step)
        master_alias.alias_masters(opt, step.rank, self._step_ledger)

    def _install(self, ledger: PatchLedger) -> None:
        super()._install(ledger)
        self.param_sync.install(ledger)
        # The step is re-chosen by configure_step while attached: its own ledger, undone first.
        ledger.on_undo(self._step_ledger.undo, "the optimizer step")
        self._install_step()

    def uninstall(self) -> None:
        self.param_sync.wait()   # a deferred all-gather writes the parameters: finish it first
        self._unfold_norm()
        super().uninstall()

    def _flat_groups(self, names: dict[int, str]) -> tuple[list[FlatGroup], torch.dtype]:
        opt = self.engine.optimizer
        groups = []
        for i, params in enumerate(opt.round_robin_bit16_groups):
            groups.append(FlatGroup(
                params=tuple(params), names=tuple(names.get(id(p), f"group{i}.param{k}") for k, p in enumerate(params)),
                offsets=tuple(int(o) for o in opt.round_robin_bit16_offsets[i]),
                numel=int(opt.bit16_groups_flat[i].numel()), sharded=True))
        return groups, opt.gradient_accumulation_dtype

    def sinks(self) -> list[torch.Tensor]:
        """Per group, the flat partition of a compact grad-partition buffer installed in
        ``averaged_gradients[i]`` (the same dict object: params' ``_hp_mapping`` reference it).
        ``step()`` clips it in place and then drops it (sets the entry to None), so a missing or
        replaced entry means "a step consumed it": install a fresh zeroed one.
        """
        opt = self.engine.optimizer
        out = []
        for i in range(len(self.param_set.groups)):
            group = opt.averaged_gradients.get(i)
            if group is None or group is not self._installed(i):
                group = opt._build_compact_grad_partition_buffer(i)
                opt.averaged_gradients[i] = group
                self._installed_groups[i] = weakref.ref(group)
            out.append(group.flat_partition)
        return out

    def _installed(self, i: int):
        ref = self._installed_groups.get(i)
        return ref() if ref is not None else None

    def drop_sinks(self) -> None:
        opt = self.engine.optimizer
        for i in list(self._installed_groups):
            if opt.averaged_gradients.get(i) is self._installed(i):
                opt.averaged_gradients[i] = None
        self._installed_groups.clear()
