"""The DeepSpeed adapter's shared base: `DeepSpeedBinding` (hook install/uninstall, the eager
safety net); subclasses per optimizer family (zero12.py, bf16.py, zero3.py). A binding builds its engine's `ParamSet` (the flat gradient layout its ZeRO optimizer reads in
`step()`), binds that optimizer's partition buffers as the shard sinks, and switches off
DeepSpeed's own gradient handling for the parameters graphzero now owns:

- the optimizer's post-accumulate-grad hooks (``optimizer._grad_acc_hooks``), which would run
  DeepSpeed's bucketed reduction (``reduce_independent_p_g_buckets_and_remove_grads``...);
- the module forward pre/post hooks and ``engine.forward``'s output backward hooks, which run the
  backward prologue and divide gradients by gas at run time (graphzero applies 1/gas in-graph);
- ``engine.backward``'s prologue/epilogue (loss/gas and ``allreduce_gradients``), and the public
  ``engine.allreduce_gradients()``, which has nothing left to reduce.

Every change goes through the binding's `PatchLedger` (ledger.py): `detach`, and an install that
fails part-way, give the engine back exactly as found. State lives on the engine and its parameters
(``_graphzero_binding``, set last), not in a module-level registry.
"""
from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import devices, rank_agreement, runtime
from ..errors import AutogradUsageError, GraphZeroError, InstallError, UnsupportedConfigError
from ..ownership import FlatGroup, ParamSet, has_tensor_hooks
from .bound import BINDING_ATTR as _BINDING_ATTR
from .bound import binding_of
from .ds_internals import _deepspeed_version, _optimizer_kind, ds_attr
from .ledger import PatchLedger
from .step import Settings, StepInstall
from .step import install as install_step

log = logging.getLogger("graphzero")

def _noop(*_args) -> None:
    return None


def _reduced_in_graph(*_args, **_kwargs) -> None:
    return None


def _identity(grad):
    return grad


class DeepSpeedBinding:
    """graphzero's hold on one DeepSpeed engine; subclasses bind one optimizer family. Implements
    `runtime.EngineBinding` for the engine's run-time state (``self.state``)."""

    #: False for an engine without an optimizer (frozen.py): no gradient, no optimizer step
    trains = True

    def __init__(self, engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.kind = _optimizer_kind(engine)
        self.ledger = PatchLedger(f"engine {name!r}")
        self._warned_eager = False
        self._logged_hooked: set[int] = set()
        # gradients the eager safety net reduced (compiled graphs deliver none): for benchmarks
        self.eager_gradients = 0
        self.offload_copy = None   # optimizer offload: the boundary copy (offload.py), set while attached
        # the engine's step options (attach: step.settle), and what install() put in its step
        self.settings = Settings()
        self.step: StepInstall | None = None
        self.param_set = self._build_param_set()
        # DeepSpeed eager ZeRO-1 (DeepSpeedZeroOptimizer and BF16_Optimizer alike) reduces only at the
        # gradient-accumulation boundary (engine.allreduce_gradients); ZeRO-2 and 3 every micro-step.
        self.state = runtime.EngineState(self.param_set, self, window=self.param_set.stage == 1)

    # -- layout and buffers: one subclass per optimizer family ---------------------------------
    def _flat_groups(self, names: dict[int, str]) -> tuple[list[FlatGroup], torch.dtype]:
        """The optimizer's flat gradient groups and its accumulation dtype."""
        raise NotImplementedError

    def sinks(self) -> list[torch.Tensor]:
        """Per group, the buffer to accumulate this rank's reduced gradient into."""
        raise NotImplementedError

    def drop_sinks(self) -> None:
        """Forget the accumulated shards (``zero_grad``): the next backward starts from zeros."""

    def mark_present(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Tell the optimizer these parameters received a gradient (only some optimizers need it)."""

    def at_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def backward_ended(self) -> None:
        """A backward that reached the engine ended (runtime/state.py): with optimizer offload, at the
        boundary, the copy into the CPU optimizer's gradient (offload.py)."""
        if self.offload_copy is not None and self.at_boundary():
            self.offload_copy()

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps()

    def _layout_extras(self) -> dict:
        """Layout fields only some optimizer families set (ZeRO-3: shard maps, gather plan)."""
        return {}

    def wait_params(self) -> None:
        """Wait for a deferred all-gather of this engine's parameters (only ZeRO-1/2 defers one)."""
        if self.step is not None and self.step.sync is not None:
            self.step.sync.wait()

    def configure(self, settings: Settings) -> None:
        """The engine's step settings from now on (attach); an attached engine's step is chosen again
        when they change."""
        changed, self.settings = settings != self.settings, settings
        if changed and self.installed and self.step is not None:
            log.info("engine %r: optimizer step settings now %s", self.name, settings)
            self.step.choose(settings)
            self._refold_norm()

    def _refold_norm(self) -> None:
        """A folded norm for the step just chosen where it reads one (a new one: the last is stale)."""
        self._unfold_norm()
        if self.step.folds_norm:
            self._fold_norm()

    def rename(self, name: str) -> None:
        """The engine's name from now on (attach: names.py decides it); graphs compiled earlier keep
        the old layout under the old name."""
        self.name = name
        self.param_set = self.state.layout = dataclasses.replace(self.param_set, name=name)
        self.ledger.owner = f"engine {name!r}"

    @property
    def installed(self) -> bool:
        return binding_of(self.engine) is self

    def _build_param_set(self) -> ParamSet:
        engine = self.engine
        names = {id(p): n for n, p in engine.module.named_parameters()}
        groups, accum_dtype = self._flat_groups(names)
        pgs = self._process_groups()
        pg = pgs[0]
        if any(g is not pg for g in pgs):
            raise UnsupportedConfigError(f"engine {self.name!r}: param groups on different process groups")
        world = dist.get_world_size(group=pg)
        rank = dist.get_rank(group=pg)
        if rank < 0:
            raise UnsupportedConfigError(f"engine {self.name!r}: this rank is not in its data-parallel group")
        device = devices.engine_device(engine.device, engine.module.parameters())
        if device.type not in devices.group_device_types(pg):
            raise UnsupportedConfigError(
                f"engine {self.name!r}: its parameters are on {device}, which its data-parallel group's backend "
                f"{dist.get_backend(pg)!r} cannot reduce (it takes {list(devices.group_device_types(pg))})")
        return ParamSet(
            name=self.name, stage=engine.zero_optimization_stage(), groups=tuple(groups), process_group=pg,
            group_name=pg.group_name if pg is not None else dist.group.WORLD.group_name,
            world_size=world, rank=rank, comm_dtype=engine.communication_data_type, accum_dtype=accum_dtype,
            bucket_numel=int(engine.zero_reduce_bucket_size()),
            grad_scale=1.0 / (world * engine.gradient_accumulation_steps()),
            backend=str(dist.get_backend(pg)), device=device, **self._layout_extras())

    def _process_groups(self) -> list:
        return list(self.engine.optimizer.real_dp_process_group)

    def runtime_scale(self) -> float:
        """This backward's factor for the engine's summed gradient: 1/(world*gas), unless DeepSpeed's own ``engine.backward`` of some engine E started it (a
        first call written as ``E.backward(step(...))`` looks up ``E.backward`` before graphzero
        attaches): that divided the loss by E's gas already, so the factor is
        gas(E)/(world*gas) (1/world for E itself). An E graphzero does not own is an error: its gas
        is unknown here."""
        from deepspeed.runtime.engine import _ENGINE_BACKWARD_GRAPH_TRACKER

        from . import names
        world = self.param_set.world_size
        # Read per call: set_train_batch_size() may change gas between steps.
        gas = self.engine.gradient_accumulation_steps()
        if not _ENGINE_BACKWARD_GRAPH_TRACKER.is_current_graph_registered():
            return 1.0 / (world * gas)
        if ds_attr(self.engine, "_running_engine_backward"):
            return 1.0 / world
        running = [e for e in names.attached_engines() if ds_attr(e, "_running_engine_backward")]
        if len(running) != 1:
            raise AutogradUsageError(
                f"engine {self.name!r}: this backward was started by DeepSpeed's own engine.backward() of "
                + ("an engine graphzero does not own" if not running else
                   f"several engines at once ({[binding_of(e).name for e in running]})")
                + f", which divided the loss by that engine's gradient_accumulation_steps; {self.name!r} "
                "averages over its own gas, which graphzero cannot restore here. Attach that engine to "
                "graphzero (its engine.backward then leaves each engine its own 1/gas), or call loss.backward()")
        return running[0].gradient_accumulation_steps() / (world * gas)

    # -- install / uninstall ------------------------------------------------------------------
    def install(self) -> None:
        """Take the engine over, through ``self.ledger``; on failure undo it all and raise (anything
        not a `GraphZeroError` as an `InstallError` naming the engine)."""
        try:
            self._install(self.ledger)
            if self.trains:
                self.ledger.on_undo(self._unfold_norm, "the folded norm")
                self.step = install_step(self, self.ledger, self.settings)
                self._refold_norm()
            # last: binding_of(engine) is this binding only for a complete install
            self.ledger.set_attr(self.engine, _BINDING_ATTR, self)
        except BaseException as exc:
            try:
                self.ledger.undo()
            except BaseException as undo_exc:  # noqa: BLE001 - the install error is the one to raise
                exc.add_note(f"graphzero: undoing the partial install of engine {self.name!r} failed too: "
                             f"{undo_exc!r}")
            if isinstance(exc, GraphZeroError) or not isinstance(exc, Exception):
                raise
            raise InstallError(
                f"engine {self.name!r}: graphzero could not attach to this {self.kind} engine (DeepSpeed "
                f"{_deepspeed_version()}, torch {torch.__version__}); everything it had changed is restored. "
                f"Cause: {type(exc).__name__}: {exc}") from exc
        log.info("%s", self.summary())

    def summary(self) -> str:
        ps = self.param_set
        return (f"graphzero owns engine {self.name!r}: ZeRO-{ps.stage}, {ps.num_params} params, {ps.numel} elements, "
                f"{self.kind}, world {ps.world_size}")

    def _install(self, ledger: PatchLedger) -> None:
        """The changes shared by every optimizer family; subclasses add theirs after these."""
        engine, opt = self.engine, self.engine.optimizer
        for h in opt._grad_acc_hooks:
            ledger.remove_hook(h)
        ledger.clear_list(opt._grad_acc_hooks)
        plain_forward(engine, ledger)
        ledger.set_attr(engine, "backward", types.MethodType(_graphzero_engine_backward, engine))
        # A DeepSpeed engine.forward already in flight when graphzero attaches (Dynamo runs the
        # first call's frames one by one until the backend is reached) still registers output
        # hooks; they look these up at call time and must do nothing (no 1/gas, no epilogue).
        ledger.set_attr(engine, "_backward_prologue", _noop)
        ledger.set_attr(engine, "_backward_prologue_per_tensor", _identity)
        ledger.set_attr(engine, "_backward_epilogue", _noop)
        ledger.set_attr(engine, "enable_backward_allreduce", False)
        # The public engine.allreduce_gradients() (called after engine.backward by code that turns
        # enable_backward_allreduce off, or by DeepSpeed's own tests) finishes the reduction of
        # DeepSpeed's hooks, which graphzero's graphs have already done. DeepSpeed's own would
        # rebuild averaged_gradients from .grad (None here) at ZeRO-1/2 and relist it at ZeRO-3.
        ledger.set_attr(engine, "allreduce_gradients", _reduced_in_graph)
        # zero_grad must clear what graphzero accumulated, as it clears .grad under DeepSpeed eager
        # (e.g. a two-phase GAN step whose generator loss also reached the discriminator).
        engine_zero_grad, optimizer_zero_grad = engine.zero_grad, opt.zero_grad

        def zero_engine(*args, **kwargs):
            engine_zero_grad(*args, **kwargs)
            self.state.zero_grad()

        def zero_optimizer(*args, **kwargs):
            optimizer_zero_grad(*args, **kwargs)
            self.state.zero_grad()

        engine_step = engine.step

        def step(*args, **kwargs):
            boundary = self.state.before_step()   # NoGradientError, partial sums reduced
            out = engine_step(*args, **kwargs)
            self.state.after_step(boundary)
            return out

        ledger.set_attr(engine, "zero_grad", zero_engine)
        ledger.set_attr(opt, "zero_grad", zero_optimizer)
        ledger.set_attr(engine, "step", step)
        for group in self.param_set.groups:
            for p in group.params:
                ledger.set_attr(p, _BINDING_ATTR, self)
                ledger.post_accumulate_grad_hook(p, self._reduce_eager_grad)

    def uninstall(self) -> None:
        """Give the engine back as ``install`` found it."""
        try:
            self.ledger.undo()
        finally:
            self.state.zero_grad()
            # Graphs compiled while attached still own these parameters: they refuse to run
            # (EngineState.detached), and Dynamo compiles the step again on its next call.
            self.state.detached = True
            torch._dynamo.reset_code_caches()

    def _fold_norm(self) -> None:
        """Graphs compiled from now on fold the squared gradient norm into the backward
        (runtime/norm.py); the subclass makes its optimizer step read it."""
        ps = self.param_set
        self.state.norm = runtime.FoldedNorm(len(ps.groups), ps.process_group, self.at_boundary)

    def _unfold_norm(self) -> None:
        """The optimizer step computes the norm itself again; a norm in flight is finished."""
        if self.state.norm is not None:
            self.state.norm.forget()
            self.state.norm = None

    # -- safety net for gradients computed outside graphzero's graphs ---------------------------
    @torch.no_grad()
    def _reduce_eager_grad(self, param: torch.nn.Parameter) -> None:
        """Reduce a gradient that reached ``param.grad`` through eager autograd: code Dynamo did not
        capture, and parameters with a tensor hook (ownership.py). One blocking all-reduce each."""
        if param.grad is None:
            return
        self.eager_gradients += 1
        ps = self.param_set
        g, k = ps.locate(param)
        group = ps.groups[g]
        if has_tensor_hooks(param):
            if id(param) not in self._logged_hooked:
                self._logged_hooked.add(id(param))
                log.info("engine %r: parameter %r has a tensor hook; its gradient is reduced after the hook, "
                         "outside the compiled graph (one all-reduce per backward)", self.name, group.names[k])
        elif not self._warned_eager:
            log.warning("engine %r: parameter gradients were computed outside a graphzero graph (eager code "
                        "or a skipped frame); reducing them eagerly, one all-reduce per parameter", self.name)
            self._warned_eager = True
        what = f"engine {self.name!r} parameter {group.names[k]!r} (eager safety net)"
        scale = self.runtime_scale()
        state = self.state
        backward = runtime.scope.current()
        backward.reach(state)   # the backward's end reduces pending sums
        # ZeRO-1 with gas > 1: as in the compiled graphs, keep non-boundary micro-steps local and
        # reduce the window's sum at the boundary. Ranks that ran different graphs keep it locally
        # too, and the backward's end reduces it (runtime/scope.py).
        window = state.defers_reduction()
        keep = window and not self.at_boundary()
        together = backward.agree(rank_agreement.fingerprint(("eager-local" if keep else "eager", self.name, g, k)),
                                  True, [(ps.group_name, ps.process_group)], what)
        if window or not together:
            start = group.offsets[k]
            mine = state.partial.buffer(g)[start:start + param.numel()]
            mine.add_(param.grad.detach().reshape(-1).to(mine.dtype), alpha=scale)
            if keep or not together:
                state.partial.keeping([(g, k)])
                state.received_gradient = True
                param.grad = None
                return
            grad, scale = mine.to(ps.comm_dtype, copy=True), 1.0
            state.partial.reduced([(g, k)])
        else:
            grad = param.grad.detach().to(ps.comm_dtype).reshape(-1).clone()
        with rank_agreement.collective_failures(what):
            dist.all_reduce(grad, group=ps.process_group)
        sink = self.state.write_sinks([param])[g]
        start, n = group.offsets[k], param.numel()
        lo = ps.rank * group.shard_numel(ps.world_size) if group.sharded else 0
        hi = lo + group.shard_numel(ps.world_size)
        a, b = max(start, lo), min(start + n, hi)
        if a < b:
            sink[a - lo:b - lo].add_(grad[a - start:b - start].to(sink.dtype), alpha=scale)
        param.grad = None


def plain_forward(engine, ledger: PatchLedger) -> None:
    """``engine.forward`` as the module itself: without engine.forward's output hooks (they divide
    by gas and run the backward prologue at run time) and without the timers that break graphs."""
    for attr in ("module_forward_pre_hook", "module_forward_post_hook"):
        handle = ds_attr(engine, attr)
        if handle is not None:
            ledger.remove_hook(handle)
            ledger.set_attr(engine, attr, None)
    module = engine.module

    def forward(*args, **kwargs):
        return module(*args, **kwargs)

    ledger.set_attr(engine, "forward", forward)


def _graphzero_engine_backward(engine, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
    """``engine.backward`` while graphzero owns the engine: a plain ``loss.backward()`` (1/gas and the
    reduction are in the compiled backward). ``scale_wrt_gas=False``: the caller divided the loss by
    the engine's gas already (transformers' Trainer), which the graphs' 1/gas then undoes."""
    gas = engine.gradient_accumulation_steps()
    (loss if scale_wrt_gas else loss * gas).backward(retain_graph=retain_graph)
    return loss / gas if scale_wrt_gas else loss
