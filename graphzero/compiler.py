"""The ``graphzero`` torch.compile backend.

Data flow: Dynamo FX graph -> ownership (graph inputs -> engine layouts) -> AOT autograd -> the
pass pipelines (passes/__init__.py) -> inner compiler -> the run time (graphzero/runtime/).
See docs/architecture.md.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import deepspeed_adapter, early_attach
from .dump import GraphDump
from .errors import AttachTooLateError, GraphZeroError, UnsupportedConfigError
from .inductor_config import inductor_patch, register_lowerings
from .inductor_guards import backward_patches as inductor_guard_patches
from .inductor_guards import device_type_of
from .options import Options
from .ownership import Ownership, ParamSet
from .passes import FORWARD_PIPELINE, JOINT_PIPELINE, Mode, PassContext, backward_pipeline, run_pipeline
from .runtime import Backward, CountForwards, EngineState, ForwardWithAgreement, GraphBackward, Modes, label

log = logging.getLogger("graphzero")


def graphzero_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None,
                      **_unused: Any):
    """torch.compile backend entry point (``backend="graphzero"``)."""
    opts = Options.parse(options)
    early_attach.install()
    if torch._dynamo.config.compiled_autograd:
        # Compiled autograd traces AOT's untransformed backward module: graphzero's passes would
        # never run and every owned gradient would take the slow eager safety net.
        raise UnsupportedConfigError("torch._dynamo.config.compiled_autograd=True is not supported with graphzero")
    if opts.engines:
        late = [name for name, engine in opts.engines if deepspeed_adapter.binding_of(engine) is None]
        if late:
            # Engines not attached before tracing: Dynamo may have run parts of this first call
            # through DeepSpeed's own hooks. Refuse, on every rank.
            raise AttachTooLateError(
                f"engine(s) {late} in options['engines'] were not attached before Dynamo traced the step "
                "(graphzero's compile-start callback is not installed). Use torch.compile(step, "
                "backend=graphzero.backend(...engines..., **options)), or call graphzero.attach(...) before the "
                "first call")
        bindings = deepspeed_adapter.attach(opts.engines, **opts.step_settings)
    else:
        bindings = []
    # Engines attached earlier whose parameters this graph uses are reduced here too (e.g. a GAN's
    # G-step graph that lists only the generator but runs through the discriminator).
    bindings += [b for b in _attached_bindings(example_inputs) if b not in bindings]
    ownership = Ownership.build(example_inputs, [b.param_set for b in bindings])
    graph_id = _graph_id()
    deepspeed_adapter.warn_unattached_zero3(example_inputs, graph_id)
    dump = GraphDump.for_graph(opts, graph_id)
    if not ownership.inputs:
        log.info("graph %s uses no engine-owned parameters; compiling it unchanged", graph_id)
    used = {id(ps) for ps in ownership.param_sets}
    unused = [b.name for b in bindings[:len(opts.engines)] if id(b.param_set) not in used and b.trains]
    if unused and ownership.inputs:
        log.warning("graph %s does not use engine(s) %s listed in options['engines']: this graph leaves their "
                    "gradient shards untouched", graph_id, unused)
    states = {b.param_set: b.state for b in bindings if b.param_set in ownership.param_sets}
    transform = BackwardTransform(ownership, states, opts, dump, graph_id)
    # An AOT-autograd cache hit would replay a backward without the sink arguments the runtime
    # wrapper supplies, so this backend's graphs never go through that cache.
    with torch._functorch.config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
        if opts.inner == "eager":
            return _compile_eager(gm, example_inputs, transform)
        return _compile_inductor(gm, example_inputs, transform)


def _attached_bindings(example_inputs: Sequence[Any]) -> list:
    bindings = []
    for x in example_inputs:
        # a parameter, or (ZeRO-3) a parameter's shard
        b = deepspeed_adapter.binding_of(x) if isinstance(x, torch.Tensor) else None
        if b is not None and b not in bindings:
            bindings.append(b)
    return bindings


def _graph_id() -> str:
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None:
        return "g0"
    text = str(compile_id).replace("/", "_").replace("[", "").replace("]", "").replace(" ", "")
    return "g" + text.removesuffix("_0")


class BackwardTransform:
    """Runs the pass pipelines on one graph's joint, forward and backward graphs and wraps the
    compiled backward."""

    def __init__(self, ownership: Ownership, states: dict[ParamSet, EngineState], opts: Options, dump: GraphDump,
                 graph_id: str) -> None:
        self.ownership = ownership
        self.states = states
        self.opts = opts
        self.dump = dump
        self.graph_id = graph_id
        # ZeRO-3 shards among the inputs (owned, or frozen): the joint and forward graphs get passes too
        self.gathers = any(o.shard for o in ownership.inputs.values()) or bool(ownership.frozen)
        self.forward_ctx: PassContext | None = None

    def _context(self, example_inputs: Sequence[Any], modes: Modes | None = None) -> PassContext:
        strangers = [ps.name for ps in modes or {} if not any(ps is q for q in self.ownership.param_sets)]
        if strangers:
            # the passes match engines by identity: a variant keyed otherwise would silently reduce
            raise GraphZeroError(f"internal error: graph {self.graph_id}'s variant names engine layouts {strangers} "
                                 "that its ownership does not hold; please report it")
        fake_mode = detect_fake_mode(example_inputs)
        if fake_mode is None:
            fake_mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
        return PassContext(self.ownership, fake_mode, overlap=self.opts.overlap, collective=self.opts.collective,
                           bucket_size=self.opts.bucket_size,
                           modes={ps: m for ps, m in (modes or {}).items() if m is not Mode.REDUCE},
                           folds_norm=frozenset(ps for ps, state in self.states.items() if state.norm is not None))

    def joint(self, gm: fx.GraphModule) -> None:
        """Before the partitioner splits the joint graph (ZeRO-3: gathers are recomputed, not saved)."""
        if not self.gathers:
            return
        vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
        self.forward_ctx = self._context(vals)
        run_pipeline(gm, self.forward_ctx, pipeline=JOINT_PIPELINE)

    def forward(self, gm: fx.GraphModule) -> fx.GraphModule:
        self.dump.forward(gm)
        if self.forward_ctx is None and any(not o.shard for o in self.ownership.inputs.values()):
            # ZeRO-1/2 parameters: the wait_params pass (a deferred all-gather)
            self.forward_ctx = self._context([n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")])
        if self.forward_ctx is not None:
            gm = run_pipeline(gm, self.forward_ctx, after_pass=self.dump.forward_stage, pipeline=FORWARD_PIPELINE)
        return gm

    def wrap_forward(self, compiled, training: bool):
        """ZeRO-3: the ranks agree on the forward's gathers before running it; a training forward
        counts itself for the engines whose gradients it will produce (runtime/scope.py)."""
        if training and self.ownership.trained:
            compiled = CountForwards(compiled, {self.states[ps]: pos for ps, pos in self.positions().items()})
        plan = self.forward_ctx.zero3_plan if self.forward_ctx is not None else []
        if not plan:
            return compiled
        groups = list({ps.group_name: ps.process_group for ps in self.ownership.param_sets
                       if any(p[2] == ps.group_name for p in plan)}.items())
        what = f"graph {self.graph_id} forward (engines {sorted({p[1] for p in plan})})"
        return ForwardWithAgreement(compiled, plan, groups, what, self.opts.fault_timeout_s)

    def positions(self) -> dict[ParamSet, tuple[tuple[int, int], ...]]:
        """Per engine, the (group, position) of each of its parameters this graph reaches."""
        return {ps: tuple(sorted({(o.group, o.position) for o in self.ownership.inputs.values() if o.param_set is ps}))
                for ps in self.ownership.trained}

    def transform(self, gm: fx.GraphModule, example_inputs: Sequence[Any], modes: Modes | None = None,
                  dump: GraphDump | None = None) -> tuple[fx.GraphModule, PassContext]:
        ctx = self._context(example_inputs, modes)
        dump = dump or self.dump
        dump.backward_stage("input", gm)
        if self.ownership.inputs:
            pipeline = backward_pipeline(self.gathers, self.opts.disable_passes)
            gm = run_pipeline(gm, ctx, after_pass=dump.backward_stage, pipeline=pipeline)
        if self.forward_ctx is not None:
            for ps, stats in self.forward_ctx.stats.items():
                for key, value in stats.items():
                    ctx.stats[ps].setdefault(key, value)
        dump.finish(ctx, self.ownership)
        return gm, ctx

    def backward(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 compile_fn: Callable[[fx.GraphModule, list[Any], PassContext], Any]):
        """Transform, compile and wrap the backward (``compile_fn(gm, inputs, ctx)`` runs the inner
        compiler): one variant per mode of its engines (runtime/backward.py), each compiled when
        first needed; the plain one now, unless a ZeRO-1 window makes it unlikely to run."""
        def compile_variant(gm: fx.GraphModule, modes: Modes | None = None, dump: GraphDump | None = None,
                            variant: bool = True):
            gm, ctx = self.transform(gm, example_inputs, modes, dump)
            compiled = compile_fn(gm, list(example_inputs) + self.runtime_example_inputs(gm, ctx), ctx)
            return self.wrap(compiled, ctx, variant)

        positions = {self.states[ps]: pos for ps, pos in self.positions().items()}
        if not positions:
            return compile_variant(gm, variant=False)
        pristine = copy.deepcopy(gm)
        deferred = any(state.defers_reduction() for state in positions)
        compiled = {} if deferred else {(Mode.REDUCE,) * len(positions): compile_variant(gm)}
        layouts = {self.states[ps]: ps for ps in self.positions()}
        return Backward(positions, layouts, lambda modes: compile_variant(copy.deepcopy(pristine), modes,
                                                                 self.dump.variant(label(modes))), compiled)

    def runtime_example_inputs(self, gm: fx.GraphModule, ctx: PassContext) -> list[Any]:
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        return [ph.meta["val"] for ph in placeholders[len(placeholders) - len(ctx.runtime_inputs):]]

    def wrap(self, compiled, ctx: PassContext, variant: bool):
        # A variant of a Backward is one even when it has nothing of its engines' to reduce (their
        # parameters frozen in this micro-step, or reduced outside the graph by their tensor hooks)
        if not ctx.runtime_inputs and not variant:
            return compiled
        return GraphBackward(compiled, ctx, self.states, self.graph_id, self.opts.fault_timeout_s)


def _compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], t: BackwardTransform):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    register_lowerings()

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
        if not kwargs.get("is_backward"):
            with torch._inductor.config.patch(inductor_patch(backward=False, overlap=t.opts.overlap, gathers=t.gathers)):
                return t.wrap_forward(compile_fx_inner(t.forward(graph), inputs, **kwargs),
                                      training=not kwargs.get("is_inference", False))

        def compile_backward(graph: fx.GraphModule, inputs: list[Any], ctx: PassContext):
            overlap = t.opts.overlap and bool(ctx.runtime_inputs)
            patches = {**inductor_guard_patches(device_type=device_type_of(inputs)),
                       **inductor_patch(backward=True, overlap=overlap, gathers=t.gathers)}
            with torch._inductor.config.patch(patches):
                return compile_fx_inner(graph, inputs, **kwargs)

        return t.backward(graph, inputs, compile_backward)

    joint = {"joint_custom_pre_pass": _JointPass(t)} if t.gathers else {}
    with torch._inductor.config.patch(joint):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


class _JointPass(CustomGraphPass):
    """Inductor's hook on the joint graph, before its partitioner (``joint_custom_pre_pass``)."""

    def __init__(self, t: BackwardTransform) -> None:
        self.t = t

    def __call__(self, graph: fx.Graph) -> None:
        self.t.joint(graph.owning_module)

    def uuid(self) -> None:
        return None   # never cached: the pass depends on this graph's ownership


def _compile_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], t: BackwardTransform):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw_compiler(graph: fx.GraphModule, inputs: Sequence[Any]):
        return t.wrap_forward(make_boxed_func(t.forward(graph).forward), training=True)

    def inference_compiler(graph: fx.GraphModule, inputs: Sequence[Any]):
        return t.wrap_forward(make_boxed_func(t.forward(graph).forward), training=False)

    def bw_compiler(graph: fx.GraphModule, inputs: Sequence[Any]):
        return t.backward(graph, inputs, lambda graph, _inputs, _ctx: make_boxed_func(graph.forward))

    kwargs = {}
    if t.gathers:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def partition_fn(joint: fx.GraphModule, joint_inputs, **kw: Any):
            t.joint(joint)
            # min-cut, not the default partitioner: it honours the release pass's recompute tags
            return min_cut_rematerialization_partition(joint, joint_inputs, compiler="eager", **kw)

        kwargs["partition_fn"] = partition_fn
    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=inference_compiler,
                        **kwargs)(gm, example_inputs)


# How early_attach recognises this backend without importing this module (no import circle).
graphzero_backend.is_graphzero_backend = True
