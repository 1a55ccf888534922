"""ZeRO-3 engines under graphzero: the parameter gather in the forward graph, the reduce-scatter in
the backward graph, the fp32 shard in the stage-3 optimizer's partition buffer; mixed with ZeRO-1.

Against a single-process PyTorch reference (see scenario_utils.Reference). Tolerances as in
test_multi_engine.py: fp32 gradients rtol 1e-4 / atol 1e-6, parameters rtol 1e-4 / atol 1e-5,
norms rtol 1e-4; bf16 as in test_bf16.py (3% relative L2 on gradients, 2e-2 on parameters, 5% norms).
"""
from __future__ import annotations

import pytest
import torch

import graphzero
from scenario_utils import (
    ReductionCounter,
    Reference,
    assert_grads_close,
    assert_rel_l2_close,
    data,
    ds_config,
    engine,
    full_grads,
    full_params,
    mlp,
    rank_world,
)

GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide: later test modules
    # get fresh ranks.
    yield
    ranks.close()


def z3_config(stage: int, *, threshold: int = 0, **kw) -> dict:
    cfg = ds_config(stage, **kw)
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=threshold)
    return cfg


class Zero3Counter:
    """Counts DeepSpeed's own ZeRO-3 fetch/release (the parameter coordinator) and stage-3
    reductions; graphzero must leave them idle."""

    METHODS = ("fetch_sub_module", "release_sub_module", "release_and_reset_all_except_persistent")
    OPT_METHODS = ("reduce_ready_partitions_and_remove_grads", "independent_gradient_partition_epilogue",
                   "reduce_independent_p_g_buckets_and_remove_grads", "partition_grads")

    def __init__(self, *engines) -> None:
        self.calls: dict[str, int] = {}
        for eng in engines:
            opt = eng.optimizer
            if not hasattr(opt, "parameter_offload"):
                continue
            coordinator = opt.parameter_offload.get_param_coordinator()
            for owner, names in ((coordinator, self.METHODS), (opt, self.OPT_METHODS)):
                for name in names:
                    if hasattr(owner, name):
                        self._wrap(owner, name)

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def assert_params_match(eng, ref_model, *, what: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    for i, (p, q) in enumerate(zip(full_params(eng), ref_model.parameters())):
        torch.testing.assert_close(p, q.detach().float(), rtol=rtol, atol=atol, msg=lambda m, i=i: f"{what}: param {i}: {m}")


def assert_released(*engines) -> None:
    """After backward: no gathered full parameter, no full-size gradient, no shard .grad."""
    for eng in engines:
        for name, p in eng.module.named_parameters():
            assert p.grad is None, f"{name} holds a full .grad after backward"
            if eng.zero_optimization_stage() == 3:
                persistent = getattr(p, "ds_persist", False)
                assert persistent or p.numel() == 0, f"{name} is still gathered ({p.numel()} elements)"
                assert p.ds_tensor.grad is None, f"{name}'s shard holds a .grad"


def gan_loss(models, z, real):
    return -models["disc"](models["gen"](z)).mean() + models["disc"](real).mean()


def gan_scenario(gen_stage: int, disc_stage: int, inner: str = "inductor", steps: int = 3, hidden: int = 16,
                 threshold: int = 0, dtype: str = "fp32", param_groups: bool = False,
                 attach_first: bool = True) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    G, D = mlp(8, hidden, 8), mlp(8, hidden, 1)
    if dtype == "bf16":
        G, D = G.to(torch.bfloat16), D.to(torch.bfloat16)
    ref = Reference({"gen": G, "disc": D}, dtype=torch.float32)
    engines = {}
    for name, model, stage in (("gen", G, gen_stage), ("disc", D, disc_stage)):
        cfg = z3_config(stage, threshold=threshold, dtype=dtype)
        if param_groups:
            import deepspeed
            groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
                      {"params": [p for n, p in model.named_parameters() if n.endswith("bias")]}]
            engines[name], *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=groups)
        else:
            engines[name] = engine(model, cfg)
    gen, disc = engines["gen"], engines["disc"]
    counter, z3counter = ReductionCounter(gen, disc), Zero3Counter(gen, disc)
    if attach_first:
        graphzero.attach(**engines)
    # Otherwise graphzero attaches the engines named in options before Dynamo traces (early_attach).
    step = torch.compile(gan_loss, backend="graphzero", options={"engines": engines, "inner": inner})
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    for t in range(steps):
        z, real = data(t, rank, (4, 8), (4, 8), dtype=tdtype)
        step(engines, z, real).backward()
        assert_released(gen, disc)
        ref.accumulate(gan_loss, [[a.float() for a in data(t, r, (4, 8), (4, 8), dtype=tdtype)] for r in range(world)])
        for name, eng in engines.items():
            if dtype == "bf16":
                assert_rel_l2_close(full_grads(eng), ref.grads(name), tol=3e-2, what=f"step {t} {name}")
            else:
                assert_grads_close(full_grads(eng), ref.grads(name), **GRAD_TOL, what=f"step {t} {name}")
        gen.step()
        disc.step()
        ref.step()
        for name, eng in engines.items():
            if dtype == "bf16":
                torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name], rtol=5e-2, atol=1e-3)
                assert_params_match(eng, ref.models[name], rtol=2e-2, atol=2e-2, what=f"step {t} {name}")
            else:
                torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name], rtol=1e-4, atol=1e-6)
                assert_params_match(eng, ref.models[name], what=f"step {t} {name}")
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    assert z3counter.total == 0, f"DeepSpeed's own ZeRO-3 fetch/release/reduction ran: {z3counter.calls}"
    # Outside the compiled step (evaluation), the module sees the current parameters.
    z, _ = data(99, rank, (4, 8), (4, 8), dtype=tdtype)
    with torch.no_grad():
        torch.testing.assert_close(gen(z).float(), ref.models["gen"](z.float()), rtol=2e-2 if dtype == "bf16" else 1e-4,
                                   atol=2e-2 if dtype == "bf16" else 1e-5)
    return {"kinds": sorted(type(e.optimizer).__name__ for e in engines.values())}


def test_gan_both_zero3_eager_inner(ranks):
    ranks.run(gan_scenario, 3, 3, "eager")


def test_gan_zero3_attached_from_options_only(ranks):
    # No graphzero.attach(): the engines named in options are attached before Dynamo traces the
    # first call, so it never traces DeepSpeed's own ZeRO-3 hooks.
    ranks.run(gan_scenario, 3, 1, "eager", attach_first=False)


def test_gan_both_zero3(ranks):
    results = ranks.run(gan_scenario, 3, 3)
    assert results[0]["kinds"] == ["DeepSpeedZeroOptimizer_Stage3"] * 2


def test_gan_zero3_generator_zero1_discriminator(ranks):
    results = ranks.run(gan_scenario, 3, 1)
    assert results[0]["kinds"] == ["DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"]


def test_gan_bf16_fp32_accumulation_zero3(ranks):
    ranks.run(gan_scenario, 3, 3, dtype="bf16", hidden=32)


def test_persistent_parameter_next_to_partitioned(ranks):
    # Biases (<= 16 elements) are below stage3_param_persistence_threshold: DeepSpeed keeps them
    # gathered; graphzero still gathers them in-graph from their shards.
    ranks.run(gan_scenario, 3, 3, threshold=16)


def persistent_gather_scenario(steps: int = 3) -> dict:
    """step() re-gathers the persistent parameters in one collective per engine (DeepSpeed issues
    one per parameter), and the gathered values are the updated parameters."""
    import torch.distributed as dist
    rank, _ = rank_world()
    torch.manual_seed(0)
    models = {"gen": mlp(8, 16, 8, depth=3), "disc": mlp(8, 16, 1)}
    ref = Reference(models)
    engines = {name: engine(m, z3_config(3, threshold=16)) for name, m in models.items()}
    graphzero.attach(**engines)
    step = torch.compile(gan_loss, backend="graphzero", options={"engines": engines})
    counted = {"calls": 0}
    # graphzero gathers under torch's current name (devices.all_gather_into looks it up per call)
    original = dist.all_gather_single

    def counting(*args, **kwargs):
        counted["calls"] += 1
        return original(*args, **kwargs)

    world = dist.get_world_size()
    for t in range(steps):
        step(engines, *data(t, rank, (4, 8), (4, 8))).backward()
        ref.accumulate(gan_loss, [data(t, r, (4, 8), (4, 8)) for r in range(world)])
        ref.step()
        for name, eng in engines.items():
            persistent = [p for p in eng.module.parameters() if p.ds_persist]
            assert len(persistent) >= 2, [p.ds_numel for p in persistent]
            counted["calls"] = 0
            dist.all_gather_single = counting
            try:
                eng.step()
            finally:
                dist.all_gather_single = original
            assert counted["calls"] == 1, f"step {t} {name}: {counted['calls']} all-gathers of persistent parameters"
            # DeepSpeed's resident copies, read directly (no GatheredParameters): the updated values
            for (n, p), q in zip(eng.module.named_parameters(), ref.models[name].parameters()):
                if p.ds_persist:
                    torch.testing.assert_close(p.detach(), q.detach(), **PARAM_TOL,
                                               msg=lambda m, w=f"step {t} {name}.{n}": f"{w}: {m}")
    return {}


def test_persistent_parameters_gathered_in_one_collective_after_step(ranks):
    ranks.run(persistent_gather_scenario)


def test_two_param_groups_zero3(ranks):
    ranks.run(gan_scenario, 3, 3, param_groups=True)


def chain_scenario(stages: dict[str, int], gas: int = 2, steps: int = 2, inner: str = "inductor") -> dict:
    """test_multi_engine's chain (student -> frozen -> proj -> head, plus an unowned side module)
    with per-engine ZeRO stages; the middle engine is called through ``engine.module``."""
    from test_multi_engine import train_chain
    torch.manual_seed(1)
    models = {"student": mlp(8, 16, 8), "proj": mlp(8, 16, 8), "head": mlp(8, 8, 2)}
    frozen, side = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    ref = Reference(models)
    engines = {name: engine(m, z3_config(stages[name], gas=gas)) for name, m in models.items()}
    counter, z3counter = ReductionCounter(*engines.values()), Zero3Counter(*engines.values())
    graphzero.attach(**engines)
    train_chain(engines, ref, frozen, side, gas=gas, steps=steps, inner=inner,
                after_backward=assert_released, params_close=assert_params_match)
    assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
    assert z3counter.total == 0, f"DeepSpeed's own ZeRO-3 fetch/release/reduction ran: {z3counter.calls}"
    return {}


def test_chain_of_three_engines_gas2_middle_zero3(ranks):
    ranks.run(chain_scenario, {"student": 2, "proj": 3, "head": 1})


def checkpoint_scenario(path: str, steps_before: int = 2, steps_after: int = 2) -> dict:
    """Save mid-training, load into fresh engines, continue: identical to the uninterrupted run."""
    rank, _ = rank_world()

    def build():
        torch.manual_seed(0)
        engines = {"gen": engine(mlp(8, 16, 8), z3_config(3)), "disc": engine(mlp(8, 16, 1), z3_config(3))}
        graphzero.attach(**engines)
        return engines, torch.compile(gan_loss, backend="graphzero", options={"engines": engines})

    def train(engines, step, first: int, count: int) -> None:
        for t in range(first, first + count):
            step(engines, *data(t, rank, (4, 8), (4, 8))).backward()
            for eng in engines.values():
                eng.step()

    engines, step = build()
    train(engines, step, 0, steps_before)
    for name, eng in engines.items():
        eng.save_checkpoint(path, tag=name)
    train(engines, step, steps_before, steps_after)
    expected = {name: full_params(eng) for name, eng in engines.items()}
    fresh, fresh_step = build()
    for name, eng in fresh.items():
        eng.load_checkpoint(path, tag=name)
    train(fresh, fresh_step, steps_before, steps_after)
    for name, eng in fresh.items():
        for i, (a, e) in enumerate(zip(full_params(eng), expected[name])):
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m, i=i, name=name: f"{name} param {i}: {m}")
    return {}


def test_checkpoint_save_load_continue(ranks, tmp_path):
    ranks.run(checkpoint_scenario, str(tmp_path))


def gather_release_scenario(path: str) -> dict:
    """A 6-layer MLP at ZeRO-3 with one parameter per bucket (``bucket_size=1``): every parameter is
    gathered once in forward; with DeepSpeed's look-ahead set to nothing, only the weights whose input
    gradient backward needs are gathered again there (nothing full-size is saved for backward but the
    last parameter used, DeepSpeed's next use), and the gathered bytes alive at once stay
    well below the whole model. Bucketing itself: test_zero3_buckets.py."""
    from scenario_utils import compiled_graph_count
    rank, _ = rank_world()
    torch.manual_seed(0)
    cfg = z3_config(3)
    # no look-ahead: DeepSpeed would release every parameter but the last used after its forward use
    cfg["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=1)
    eng = engine(mlp(32, 64, 32, depth=6), cfg)
    graphzero.attach(net=eng)
    loss = torch.compile(lambda m, x: m["net"](x).square().mean(), backend="graphzero",
                         options={"engines": {"net": eng}, "dump_dir": path, "bucket_size": 1})
    (x,) = data(0, rank, (4, 32))
    loss({"net": eng}, x).backward()
    assert_released(eng)
    graphs, breaks = compiled_graph_count(loss, {"net": eng}, x)
    import json
    summary = json.loads((__import__("pathlib").Path(path) / "summary.json").read_text()) if rank == 0 else None
    model_bytes = sum(p.ds_numel * 4 for p in eng.module.parameters())
    return {"graphs": graphs, "breaks": breaks, "summary": summary, "model_bytes": model_bytes}


def test_gathers_released_and_regathered_in_backward(ranks, tmp_path):
    results = ranks.run(gather_release_scenario, str(tmp_path))
    assert all((r["graphs"], r["breaks"]) == (1, 0) for r in results), results
    (graph,) = results[0]["summary"]["graphs"][-1:]
    net = graph["engines"]["net"]
    assert net["all_gather_fwd"] == 12, net          # 6 weights + 6 biases
    assert net["all_gather_bwd"] == 5, net           # the weights of layers 2..6 (input gradients)
    # one reduce-scatter per shard gradient (the gathers' backward), no ZeRO-1/2 bucket
    assert net["reduce_scatter"] == 12 and net["buckets"] == 0, net
    model_bytes = results[0]["model_bytes"]
    assert net["numel"] * 4 == model_bytes, net
    # one gather ahead of the layer computing: at most two weights (and biases) alive at once
    assert 0 < net["gathered_peak_bytes_fwd"] <= 2 * (64 * 64 + 64) * 4 + 2 * 64 * 4, net
    assert net["gathered_peak_bytes_fwd"] < model_bytes / 2, net


def eager_interop_scenario(path: str) -> dict:
    """Checkpoints across graphzero and DeepSpeed eager ZeRO-3, both directions, then detach: the
    engine trains under DeepSpeed eager again (its ZeRO-3 hooks are back)."""
    rank, _ = rank_world()
    loss_of = lambda m, z: m["gen"](z).square().mean()

    def build(attached: bool, options: bool = True):
        torch.manual_seed(0)
        eng = engine(mlp(8, 16, 8), z3_config(3))
        if not attached:
            return eng, None
        graphzero.attach(gen=eng)
        if not options:   # the graph finds the attached engine through its shards
            return eng, torch.compile(loss_of, backend="graphzero")
        return eng, torch.compile(loss_of, backend="graphzero", options={"engines": {"gen": eng}})

    def train(eng, step, first: int, count: int) -> None:
        for t in range(first, first + count):
            (z,) = data(t, rank, (4, 8))
            if step is None:
                eng.backward(loss_of({"gen": eng}, z))
            else:
                step({"gen": eng}, z).backward()
            eng.step()

    gz, gz_step = build(True)
    train(gz, gz_step, 0, 2)
    gz.save_checkpoint(path, tag="graphzero")
    train(gz, gz_step, 2, 2)
    expected = full_params(gz)
    ds, _ = build(False)
    train(ds, None, 0, 2)
    ds.save_checkpoint(path, tag="eager")
    # saved under graphzero, continued under DeepSpeed eager
    to_eager, _ = build(False)
    to_eager.load_checkpoint(path, tag="graphzero")
    train(to_eager, None, 2, 2)
    # saved under DeepSpeed eager, continued under graphzero
    to_gz, to_gz_step = build(True, options=False)
    to_gz.load_checkpoint(path, tag="eager")
    train(to_gz, to_gz_step, 2, 2)
    for what, eng in (("graphzero -> eager", to_eager), ("eager -> graphzero", to_gz)):
        for i, (a, e) in enumerate(zip(full_params(eng), expected)):
            torch.testing.assert_close(a, e, **PARAM_TOL, msg=lambda m, i=i, what=what: f"{what}: param {i}: {m}")
    # DeepSpeed's reduce bucket (reduce_bucket_size elements) is freed while graphzero reduces ...
    buckets = list(gz.optimizer.ipg_buckets.values())
    assert buckets and all(b.buffer is None for b in buckets), "DeepSpeed's ZeRO-3 reduce bucket kept while attached"
    graphzero.detach(gz)
    # ... and allocated again for DeepSpeed's own reduction, which the eager step below runs
    assert all(b.buffer is not None and b.buffer.numel() == gz.optimizer.reduce_bucket_size for b in buckets)
    before = full_params(gz)
    train(gz, None, 4, 1)
    assert any(not torch.equal(a, b) for a, b in zip(full_params(gz), before)), "eager step after detach changed nothing"
    return {}


def test_checkpoints_across_graphzero_and_deepspeed_eager_then_detach(ranks, tmp_path):
    ranks.run(eager_interop_scenario, str(tmp_path))


def test_gan_world_size_3_uneven_partitions():
    # 3 ranks: odd sizes (13 hidden units) leave padding in the last shard of most parameters.
    from rankpool import RankPool
    pool = RankPool(world_size=3)
    try:
        pool.run(gan_scenario, 3, 1, hidden=13)
    finally:
        pool.close()


def torch_linear_scenario() -> dict:
    """DeepSpeed's ZeRO-3 init replaces torch.nn.functional.linear process-wide; while graphzero owns
    a ZeRO-3 engine the user's other models (and graphzero's graphs) get torch's back; detach
    returns DeepSpeed's."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    torch.manual_seed(0)
    eng = engine(mlp(8, 16, 4), z3_config(3))
    wrapped = torch.nn.functional.linear is zero3_linear_wrap
    graphzero.attach(policy=eng)
    during = torch.nn.functional.linear
    other = torch.nn.Linear(4, 4)
    out = other(torch.randn(2, 4))
    graphzero.detach(eng)
    return {"wrapped_before": wrapped, "torch_during": during is torch._C._nn.linear,
            "plain_autograd": type(out.grad_fn).__name__,
            "wrapped_after": torch.nn.functional.linear is zero3_linear_wrap}


def test_torch_linear_while_a_zero3_engine_is_attached(ranks):
    for r in ranks.run(torch_linear_scenario):
        assert r == {"wrapped_before": True, "torch_during": True, "plain_autograd": "AddmmBackward0",
                     "wrapped_after": True}, r
