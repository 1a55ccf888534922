"""HF Accelerate with several DeepSpeed models in one loss: ``graphzero.accelerate.enable``.

Real accelerate, real DeepSpeed engines, 2 gloo ranks; the Accelerator is created inside each
scenario on each rank (AcceleratorState is a process singleton: reset before and after). Numbers
are checked against a single-process PyTorch reference (scenario_utils.Reference): every gradient
at each accumulation boundary (``safe_get_full_grad``), each engine's pre-clip global norm
(``get_global_grad_norm``) and every parameter after each of 3 optimizer steps.

Tolerances as in test_multi_engine.py: fp32 gradients rtol 1e-4 / atol 1e-6, parameters rtol 1e-4 /
atol 1e-5, norms rtol 1e-4 / atol 1e-6.

On CPU Accelerate reports num_processes=1 (it picks no distributed backend for a CPU DeepSpeed
launch); the scenarios take rank and world size from torch.distributed.
"""

from __future__ import annotations

import contextlib

import accelerate
import pytest
import torch
import torch.distributed as dist
from torch import nn

import graphzero
from scenario_utils import (
    GRAD_TOL,
    LR,
    PARAM_TOL,
    ReductionCounter,
    Reference,
    assert_grads_close,
    assert_no_full_grads,
    assert_params_close,
    data,
    ds_config,
    full_grads,
    gan_loss,
    mlp,
    rank_world,
)

NORM_TOL = {"rtol": 1e-4, "atol": 1e-6}


# -- helpers (run on the ranks) -------------------------------------------------------------------


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def plugin_config(stage: int, *, gas=1, optimizer: bool = False) -> dict:
    """A DeepSpeed config for a plugin; the optimizer comes from the script (torch AdamW) unless
    ``optimizer``; gas may be "auto" (filled from the Accelerator)."""
    cfg = ds_config(stage)
    cfg["gradient_accumulation_steps"] = gas
    if not optimizer:
        del cfg["optimizer"]
    return cfg


def make_accelerator(configs: dict[str, dict] | None, gas: int = 1):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    if configs is None:  # a second Accelerator: shares the first one's plugins (Accelerate's design)
        return Accelerator()
    plugins = {name: DeepSpeedPlugin(hf_ds_config=cfg) for name, cfg in configs.items()}
    return Accelerator(deepspeed_plugins=plugins, gradient_accumulation_steps=gas)


def prepare(accelerator, name: str, model: nn.Module, with_optimizer: bool = True):
    accelerator.state.select_deepspeed_plugin(name)
    if not with_optimizer:
        return accelerator.prepare(model), None
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    return accelerator.prepare(model, opt)


@contextlib.contextmanager
def fresh_accelerate():
    reset_accelerate()
    try:
        yield
    finally:
        reset_accelerate()


def check_boundary(t: int, engines: dict, ref: Reference) -> None:
    for name, eng in engines.items():
        assert_grads_close(full_grads(eng), ref.grads(name), **GRAD_TOL, what=f"step {t} {name}")


def check_after_step(t: int, engines: dict, ref: Reference) -> None:
    for name, eng in engines.items():
        torch.testing.assert_close(
            float(eng.get_global_grad_norm()),
            ref.norms[name],
            **NORM_TOL,
            msg=lambda m, name=name: f"step {t} {name} grad norm: {m}",
        )
        assert_params_close(eng, ref.models[name], **PARAM_TOL, what=f"step {t} {name}")


# -- scenarios ------------------------------------------------------------------------------------


def gan_scenario(per_model_accelerators: bool, steps: int = 3) -> dict:
    """Generator (ZeRO-2) and discriminator (ZeRO-1), the discriminator called twice in one loss;
    one Accelerator with two plugins, or one Accelerator per model."""
    rank, world = rank_world()
    with fresh_accelerate():
        torch.manual_seed(0)
        G, D = mlp(8, 16, 8), mlp(8, 16, 1)
        ref = Reference({"gen": G, "disc": D})
        configs = {"gen": plugin_config(2), "disc": plugin_config(1)}
        acc_g = make_accelerator(configs)
        acc_d = make_accelerator(None) if per_model_accelerators else acc_g
        gen, opt_g = prepare(acc_g, "gen", G)
        disc, opt_d = prepare(acc_d, "disc", D)
        attached = graphzero.accelerate.enable(*{id(a): a for a in (acc_g, acc_d)}.values())
        assert sorted(attached) == ["disc", "gen"], attached
        engines = {"gen": gen, "disc": disc}
        counter = ReductionCounter(gen, disc)
        step = torch.compile(gan_loss, backend="graphzero")
        for t in range(steps):
            z, real = data(t, rank, (4, 8), (4, 8))
            with acc_g.accumulate(gen, disc):
                loss = step(engines, z, real)
                # per-model form: the loss spans both accelerators' models; one backward (either's)
                (acc_d if per_model_accelerators and t % 2 else acc_g).backward(loss)
                assert_no_full_grads(gen, disc)
                ref.accumulate(gan_loss, [data(t, r, (4, 8), (4, 8)) for r in range(world)])
                check_boundary(t, engines, ref)
                opt_g.step()
                opt_d.step()
                opt_g.zero_grad()
                opt_d.zero_grad()
            ref.step()
            check_after_step(t, engines, ref)
        assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"
        assert gen.global_steps == disc.global_steps == steps
        if per_model_accelerators:
            # The natural mistake with one Accelerator per model: each one's backward of the same loss.
            z, real = data(99, rank, (4, 8), (4, 8))
            loss = step(engines, z, real)
            acc_g.backward(loss)
            with pytest.raises(graphzero.AccelerateError, match="already reduced"):
                acc_d.backward(loss)
        return {"num_processes": acc_g.num_processes}


def chain_loss(models, x):
    return models["head"](models["body"](x)).square().mean()


def chain_scenario(steps: int = 3, gas: int = 2, trainer_style: bool = False) -> None:
    """body (ZeRO-2) -> head (ZeRO-1) with Accelerate's gradient accumulation 2; the plugins say
    gradient_accumulation_steps "auto". The ZeRO-1 plugin is selected last, so Accelerate's
    accumulate() would call DeepSpeed's no_sync() on the ZeRO-2 engine, which refuses it.
    ``trainer_style``: the loop of transformers' Trainer under DeepSpeed: the loss divided by gas
    before ``accelerator.backward(loss, scale_wrt_gas=False)``, the optimizers stepped and zeroed
    only at the accumulation boundary."""
    from accelerate.state import PartialState

    rank, world = rank_world()
    with fresh_accelerate():
        torch.manual_seed(1)
        B, H = mlp(8, 16, 8), mlp(8, 8, 2)
        ref = Reference({"body": B, "head": H})
        acc = make_accelerator(
            {"body": plugin_config(2, gas="auto"), "head": plugin_config(1, gas="auto")}, gas=gas
        )
        body, opt_b = prepare(acc, "body", B)
        head, opt_h = prepare(acc, "head", H)
        # Accelerate on CPU reports one process, and then never calls no_sync(); on GPUs it reports
        # the real count: make it so here, so that accumulate() takes the no_sync path.
        PartialState._shared_state["num_processes"] = world
        assert acc.use_distributed and acc.state.deepspeed_plugin.zero_stage == 1
        # What accumulate() would run on the ZeRO-2 engine without graphzero.accelerate:
        with pytest.raises(AssertionError, match="no_sync context manager is incompatible"), acc.no_sync(body):
            pass
        graphzero.accelerate.enable(acc)
        engines = {"body": body, "head": head}
        assert body.gradient_accumulation_steps() == head.gradient_accumulation_steps() == gas
        counter = ReductionCounter(body, head)
        step = torch.compile(chain_loss, backend="graphzero")
        for t in range(steps):
            for micro in range(gas):
                i = t * gas + micro
                (x,) = data(i, rank, (4, 8))
                with acc.accumulate(body, head):
                    assert acc.sync_gradients == (micro == gas - 1)
                    if trainer_style:
                        acc.backward(step(engines, x) / gas, scale_wrt_gas=False)
                    else:
                        acc.backward(step(engines, x))
                    assert_no_full_grads(body, head)
                    ref.accumulate(chain_loss, [data(i, r, (4, 8)) for r in range(world)], gas=gas)
                    if acc.sync_gradients:
                        check_boundary(t, engines, ref)
                    if acc.sync_gradients or not trainer_style:
                        opt_b.step()
                        opt_h.step()
                        opt_b.zero_grad()
                        opt_h.zero_grad()
            ref.step()
            check_after_step(t, engines, ref)
            assert body.global_steps == head.global_steps == t + 1
        assert counter.total == 0, f"DeepSpeed's own reduction ran: {counter.calls}"


def distill_loss(models, x):
    with torch.no_grad():
        target = models["teacher"](x)
    return (models["head"](models["student"](x)) - target).square().mean()


def teacher_scenario(steps: int = 3) -> None:
    """A teacher prepared without an optimizer (inference only, under no_grad) next to two trained
    models, student (ZeRO-2) and head (ZeRO-2)."""
    rank, world = rank_world()
    with fresh_accelerate():
        torch.manual_seed(2)
        T, S, H = mlp(8, 16, 4), mlp(8, 16, 8), mlp(8, 8, 4)
        ref = Reference({"student": S, "head": H})
        ref_teacher = __import__("copy").deepcopy(T)
        # The teacher's plugin: no ZeRO (DeepSpeed refuses ZeRO-1/2 without an optimizer).
        acc = make_accelerator(
            {"student": plugin_config(2), "head": plugin_config(2), "teacher": plugin_config(0)}
        )
        student, opt_s = prepare(acc, "student", S)
        head, opt_h = prepare(acc, "head", H)
        teacher, _ = prepare(acc, "teacher", T, with_optimizer=False)
        attached = graphzero.accelerate.enable(acc)
        # the teacher (ZeRO-0, no optimizer) is attached frozen: nothing to reduce or step
        assert sorted(attached) == ["head", "student", "teacher"], attached
        engines = {"student": student, "head": head}
        step = torch.compile(distill_loss, backend="graphzero")
        for t in range(steps):
            (x,) = data(t, rank, (4, 8))
            with acc.accumulate(student, head):
                acc.backward(step({**engines, "teacher": teacher}, x))
                assert all(p.grad is None for p in teacher.parameters()), "the teacher got gradients"
                ref.accumulate(
                    lambda m, x: distill_loss({**m, "teacher": ref_teacher}, x),
                    [data(t, r, (4, 8)) for r in range(world)],
                )
                check_boundary(t, engines, ref)
                opt_s.step()
                opt_h.step()
                opt_s.zero_grad()
                opt_h.zero_grad()
            ref.step()
            check_after_step(t, engines, ref)
        for p, q in zip(teacher.module.parameters(), T.parameters()):
            assert torch.equal(p.detach(), q.detach()), "the teacher changed"


def d_loss(models, z, real):
    gen, disc = models["gen"], models["disc"]
    return nn.functional.softplus(disc(gen(z).detach())).mean() + nn.functional.softplus(-disc(real)).mean()


def g_loss(models, z):
    return nn.functional.softplus(-models["disc"](models["gen"](z))).mean()


def ref_step_one(ref: Reference, name: str) -> None:
    params = [p for p in ref.models[name].parameters() if p.grad is not None]
    ref.norms[name] = float(torch.nn.utils.clip_grad_norm_(params, ref.clip))
    ref.opts[name].step()
    ref.opts[name].zero_grad(set_to_none=True)


def two_phase_gan_scenario(steps: int = 3) -> None:
    """The usual GAN loop: a D-step, then a G-step whose loss also reaches D. Each optimizer's
    step() steps only its own engine (stepping every engine inside accelerator.backward would step
    D a second time, on the generator's loss); opt_d.zero_grad() drops D's gradient from the G-step."""
    rank, world = rank_world()
    with fresh_accelerate():
        torch.manual_seed(3)
        G, D = mlp(8, 16, 8), mlp(8, 16, 1)
        ref = Reference({"gen": G, "disc": D})
        acc = make_accelerator({"gen": plugin_config(2), "disc": plugin_config(1)})
        gen, opt_g = prepare(acc, "gen", G)
        disc, opt_d = prepare(acc, "disc", D)
        graphzero.accelerate.enable(acc)
        engines = {"gen": gen, "disc": disc}
        step_d = torch.compile(d_loss, backend="graphzero")
        step_g = torch.compile(g_loss, backend="graphzero")
        for t in range(steps):
            z, real = data(t, rank, (4, 8), (4, 8))
            with acc.accumulate(gen, disc):
                opt_d.zero_grad()
                ref.opts["disc"].zero_grad(set_to_none=True)
                acc.backward(step_d(engines, z, real))
                ref.accumulate(d_loss, [data(t, r, (4, 8), (4, 8)) for r in range(world)])
                check_boundary(t, {"disc": disc}, ref)
                opt_d.step()
                ref_step_one(ref, "disc")
                opt_g.zero_grad()
                acc.backward(step_g(engines, z))
                ref.accumulate(g_loss, [data(t, r, (4, 8))[:1] for r in range(world)])
                check_boundary(t, {"gen": gen}, ref)
                opt_g.step()
                ref_step_one(ref, "gen")
            check_after_step(t, engines, ref)
        assert gen.global_steps == disc.global_steps == steps


def without_graphzero_scenario(steps: int = 2) -> dict:
    """The same GAN loop with Accelerate alone: accelerator.backward runs the first engine's
    engine.backward + engine.step; the discriminator's optimizer step is a no-op."""
    rank, _ = rank_world()
    with fresh_accelerate():
        torch.manual_seed(0)
        G, D = mlp(8, 16, 8), mlp(8, 16, 1)
        acc = make_accelerator({"gen": plugin_config(2), "disc": plugin_config(1)})
        gen, opt_g = prepare(acc, "gen", G)
        disc, opt_d = prepare(acc, "disc", D)
        before = {
            k: [p.detach().clone() for p in m.module.parameters()] for k, m in (("gen", gen), ("disc", disc))
        }
        for t in range(steps):
            z, real = data(t, rank, (4, 8), (4, 8))
            with acc.accumulate(gen, disc):
                acc.backward(gan_loss({"gen": gen, "disc": disc}, z, real))
                opt_g.step()
                opt_d.step()
                opt_g.zero_grad()
                opt_d.zero_grad()
        changed = {
            k: any(not torch.equal(a, p.detach()) for a, p in zip(before[k], m.module.parameters()))
            for k, m in (("gen", gen), ("disc", disc))
        }
        return {"changed": changed, "steps": {"gen": gen.global_steps, "disc": disc.global_steps}}


def errors_scenario() -> dict:
    """Each error of graphzero.accelerate, raised on every rank before any collective."""
    from accelerate.state import GradientState

    rank, _ = rank_world()
    messages = {}

    def gan_setup(gas: int = 1, disc_gas=None):
        torch.manual_seed(0)
        acc = make_accelerator(
            {"gen": plugin_config(2, gas=gas), "disc": plugin_config(1, gas=disc_gas or gas)}, gas=gas
        )
        gen, opt_g = prepare(acc, "gen", mlp(8, 8, 8))
        disc, opt_d = prepare(acc, "disc", mlp(8, 8, 1))
        return acc, {"gen": gen, "disc": disc}, opt_g, opt_d

    def expect(key: str, fn, *needles: str) -> None:
        with pytest.raises(graphzero.AccelerateError) as info:
            fn()
        for needle in needles:
            assert needle in str(info.value), f"{key}: {needle!r} not in {info.value}"
        messages[key] = str(info.value)
        dist.barrier()  # nothing is stuck in a collective

    # A model prepared without DeepSpeed (prepare_model) next to DeepSpeed engines.
    with fresh_accelerate():
        acc, engines, *_ = gan_setup()
        acc.prepare_model(nn.Linear(8, 8))
        expect(
            "plain_model",
            lambda: graphzero.accelerate.enable(acc),
            "torch.nn.modules.linear.Linear",
            "without DeepSpeed",
        )

    # Plugins whose gradient_accumulation_steps differ from the Accelerator's (Accelerate takes the
    # last prepared plugin's value).
    with fresh_accelerate():
        acc, engines, opt_g, opt_d = gan_setup(gas=1, disc_gas=2)
        expect(
            "gas",
            lambda: graphzero.accelerate.enable(acc),
            "'gen'",
            "gradient_accumulation_steps=1",
            "over 2",
        )

    # A model prepared after enable() (checked before any collective: an eager loss is enough).
    with fresh_accelerate():
        acc = make_accelerator({"gen": plugin_config(2), "disc": plugin_config(1)})
        gen, opt_g = prepare(acc, "gen", mlp(8, 8, 8))
        graphzero.accelerate.enable(acc)
        disc, opt_d = prepare(acc, "disc", mlp(8, 8, 1))
        z, real = data(0, rank, (4, 8), (4, 8))
        expect(
            "prepared_after_enable",
            lambda: acc.backward(gan_loss({"gen": gen, "disc": disc}, z, real)),
            "prepared after graphzero.accelerate.enable()",
            "torch.nn.modules.container.Sequential",
        )
        graphzero.accelerate.disable(acc)

    with fresh_accelerate():
        acc, engines, opt_g, opt_d = gan_setup()
        graphzero.accelerate.enable(acc)
        step = torch.compile(gan_loss, backend="graphzero")
        # A second backward of a loss already reduced (autograd's own error would be a less clear
        # "backward through the graph a second time"; compiled graphs refuse retain_graph=True).
        loss = step(engines, *data(0, rank, (4, 8), (4, 8)))
        acc.backward(loss)
        expect("second_backward", lambda: acc.backward(loss), "already reduced", "'disc'", "'gen'")
        opt_g.step()
        # A second step() without a backward in between (DeepSpeed itself: TypeError).
        expect("double_step", lambda: opt_g.step(), "'gen'", "no gradient since its last step")
        # disc's optimizer was never stepped: relying on Accelerate-DeepSpeed's backward stepping.
        expect(
            "not_stepped",
            lambda: acc.backward(step(engines, *data(1, rank, (4, 8), (4, 8)))),
            "['disc']",
            "optimizer.step()",
        )
        opt_d.step()
        assert GradientState().sync_gradients
        graphzero.accelerate.disable(acc)
    return messages


def version_scenario() -> str:

    with fresh_accelerate():
        acc, *_ = (make_accelerator({"gen": plugin_config(2)}),)
        saved = accelerate.__version__
        accelerate.__version__ = "2.1.0"
        try:
            with pytest.raises(graphzero.AccelerateError, match="2.1.0") as info:
                graphzero.accelerate.enable(acc)
        finally:
            accelerate.__version__ = saved
        return str(info.value)


# -- tests ----------------------------------------------------------------------------------------


def test_gan_two_plugins_one_accelerator(ranks):
    results = ranks.run(gan_scenario, False)
    # The measured CPU quirk the scenarios work around (a GPU launch reports 2).
    assert all(r["num_processes"] in (1, 2) for r in results), results


def test_gan_one_accelerator_per_model(ranks):
    ranks.run(gan_scenario, True)


def test_chain_gradient_accumulation_2(ranks):
    ranks.run(chain_scenario)


def test_chain_trainer_style_loss_scaled_by_gas_before_backward(ranks):
    ranks.run(chain_scenario, trainer_style=True)


def test_two_phase_gan_each_optimizer_steps_its_engine(ranks):
    ranks.run(two_phase_gan_scenario)


def test_teacher_no_grad_and_two_trained_models(ranks):
    ranks.run(teacher_scenario)


def test_without_graphzero_the_second_model_stays_untrained(ranks):
    # Documents the bug graphzero.accelerate fixes (accelerate 1.16, deepspeed 0.19.8): no error,
    # the discriminator simply never trains.
    results = ranks.run(without_graphzero_scenario)
    for r in results:
        assert r["changed"] == {"gen": True, "disc": False}, r
        assert r["steps"] == {"gen": 2, "disc": 0}, r


def test_errors(ranks):
    results = ranks.run(errors_scenario)
    assert results[0].keys() == {
        "plain_model",
        "gas",
        "prepared_after_enable",
        "second_backward",
        "double_step",
        "not_stepped",
    }
    assert results[0] == results[1]


def test_unknown_accelerate_version(ranks):
    messages = ranks.run(version_scenario)
    assert "not a version graphzero.accelerate understands" in messages[0]
