"""graphzero's lean ZeRO-1/2 optimizer step (option ``lean_step``) against DeepSpeed's own step.

Two copies of the same engines, same seeds and data, both reduced by graphzero: one steps with
the lean step, the other with DeepSpeed's ``DeepSpeedZeroOptimizer.step()`` (``lean_step=False``).
After every optimizer step (3 or more):

- fp32 parameters (and the fp32 master partitions) within atol 1e-6, rtol 0: the norm and the clip
  are DeepSpeed's operations, the fused Adam kernel rounds differently from torch's for-loop
  AdamW by about 1 ulp per step; DeepSpeed's FusedAdam runs its own kernel: bitwise equal;
- ``get_global_grad_norm()`` equal to DeepSpeed's (rtol 1e-6), and above ``gradient_clipping``
  (0.01) at the first step, so the clip is exercised;
- the LR scheduler (WarmupLR) advanced to the same learning rate, ``global_steps`` equal;
- bf16 (ZeRO-2, fp32 master weights): masters within 1e-6, bf16 parameters within one bf16 ulp;
- fp32: each lean engine's fp32 master is its partition of the flat parameter buffer
  (step/lean.py: alias_masters), DeepSpeed's own keeps a copy; ``safe_get_full_fp32_param`` reads the
  parameters' values on both; after ``detach`` the master has its own storage, same values.

ZeRO-3 (``lean_step`` there fuses DeepSpeed's clip and torch Adam call, step/zero3_update.py): the same
engines with and without it, 3 steps: norms rtol 1e-6, fp32 partitions and parameter shards atol
1e-6; ``detach`` puts DeepSpeed's methods back.

Checkpoints: saved under graphzero's lean step and loaded into DeepSpeed eager engines, and the
other way round, restore bitwise-identical parameters, fp32 masters and Adam state, and both
continue the same run (parameters within rtol 1e-4 / atol 1e-5: eager reduces in another order).
"""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from scenario_utils import LR, data, ds_config, engine, gan_loss, mlp, rank_world

CLIP = 0.01   # below every engine's first-step norm here (about 0.05): the clip bites
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 10}}


def _config(stage: int, *, gas: int = 1, dtype: str = "fp32", fused_adam: bool = False) -> dict:
    cfg = ds_config(stage, gas=gas, dtype=dtype, clip=CLIP, scheduler=SCHEDULER)
    if fused_adam:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01}}
    else:
        cfg["optimizer"]["params"]["weight_decay"] = 0.01
    return cfg


def _models(kind: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    torch.manual_seed(5)
    if kind == "gan":
        models = {"gen": mlp(8, 32, 8, depth=3), "disc": mlp(8, 32, 1, depth=3)}
    else:
        models = {"student": mlp(8, 32, 8), "proj": mlp(8, 16, 8), "head": mlp(8, 8, 2)}
    return {k: m.to(dtype) for k, m in models.items()}


def chain_loss(models, x, real):
    # x10: every engine's first-step gradient norm exceeds CLIP
    return 10 * models["head"](models["proj"](models["student"](x))).square().mean() + 0 * real.sum()


def _lean_kind(eng) -> str:
    return type(eng.optimizer.__dict__.get("step")).__name__


def lean_vs_deepspeed_scenario(kind: str, stage: int, gas: int, dtype: str, fused_adam: bool = False,
                               steps: int = 3) -> None:
    rank, _ = rank_world()
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    cfg = _config(stage, gas=gas, dtype=dtype, fused_adam=fused_adam)
    lean = {k: engine(m, cfg) for k, m in _models(kind, tdtype).items()}
    own = {k: engine(m, cfg) for k, m in _models(kind, tdtype).items()}
    loss_fn = gan_loss if kind == "gan" else chain_loss
    step_lean = torch.compile(loss_fn, backend="graphzero", options={"engines": lean, "lean_step": True,
                                                                       "defer_param_gather": True})
    step_own = torch.compile(loss_fn, backend="graphzero", options={"engines": own, "lean_step": False})
    lrs = []
    for t in range(steps):
        for micro in range(gas):
            z, real = data(t * gas + micro, rank, (4, 8), (4, 8), dtype=tdtype)
            step_lean(lean, z, real).backward()
            step_own(own, z, real).backward()
            for eng in (*lean.values(), *own.values()):
                eng.step()
        for name, a in lean.items():
            b = own[name]
            assert _lean_kind(a) == "LeanStep" and _lean_kind(b) == "NoneType", (_lean_kind(a), _lean_kind(b))
            what = f"step {t} {name}"
            norm = float(b.get_global_grad_norm())
            torch.testing.assert_close(float(a.get_global_grad_norm()), norm, rtol=1e-6, atol=0, msg=what)
            if t == 0:
                assert norm > CLIP, f"{what}: norm {norm} does not exceed the clip {CLIP}: clipping untested"
            assert a.get_lr() == b.get_lr() and a.global_steps == b.global_steps == t + 1, what
            exact = {"rtol": 0, "atol": 0} if fused_adam else {"rtol": 0, "atol": 1e-6}
            for ma, mb in zip(a.optimizer.single_partition_of_fp32_groups, b.optimizer.single_partition_of_fp32_groups):
                torch.testing.assert_close(ma, mb, **exact, msg=lambda m, what=what: f"{what} fp32 master: {m}")
            ulp = {"rtol": 2 ** -7, "atol": 1e-6} if dtype == "bf16" else exact
            _check_master_storage(a, aliased=dtype == "fp32", what=what)
            _check_master_storage(b, aliased=False, what=what)
            for (pname, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
                torch.testing.assert_close(pa, pb, **ulp, msg=lambda m, what=what, pname=pname: f"{what} {pname}: {m}")
        lrs.append(lean[next(iter(lean))].get_lr()[0])
    # the norm came from the compiled backward (runtime/norm.py), never from a blocking all-reduce
    from graphzero.deepspeed_adapter import binding_of
    for name, eng in lean.items():
        fold = binding_of(eng).state.norm
        assert fold is not None and (fold.folded, fold.blocking) == (steps, 0), (name, fold.folded, fold.blocking)
    assert lrs == sorted(lrs) and lrs[0] < lrs[-1], f"the LR scheduler did not advance: {lrs}"
    # detach gives each master a storage of its own again, with the trained values
    from graphzero import deepspeed_adapter
    for name, eng in lean.items():
        partitions = [opt_part.clone() for opt_part in _partitions(eng)]
        deepspeed_adapter.detach(eng)
        _check_master_storage(eng, aliased=False, what=f"{name} after detach")
        for i, (master, part) in enumerate(zip(eng.optimizer.single_partition_of_fp32_groups, partitions)):
            if dtype == "fp32":
                torch.testing.assert_close(master, part, rtol=0, atol=0, msg=f"{name} group {i} master after detach")


def _partitions(eng) -> list[torch.Tensor]:
    opt = eng.optimizer
    rank = dist.get_rank(group=opt.real_dp_process_group[0])
    return [opt.parallel_partitioned_bit16_groups[i][rank] for i in range(len(opt.single_partition_of_fp32_groups))]


def _check_master_storage(eng, aliased: bool, what: str) -> None:
    """fp32 under the lean step: each fp32 master is this rank's partition of the flat parameter
    buffer (step/lean.py: alias_masters), and DeepSpeed's fp32 fragments of each parameter
    (``safe_get_full_fp32_param``, re-made on its storage) read the parameter's values; otherwise the
    master has a storage of its own."""
    from deepspeed.utils import safe_get_full_fp32_param
    for i, (master, part) in enumerate(zip(eng.optimizer.single_partition_of_fp32_groups, _partitions(eng))):
        assert (master.data_ptr() == part.data_ptr()) == aliased, f"{what}: group {i} master aliased != {aliased}"
    for name, p in eng.module.named_parameters():
        torch.testing.assert_close(safe_get_full_fp32_param(p), p.detach().float(), rtol=0,
                                   atol=0 if aliased or p.dtype == torch.float32 else 2 ** -7 * p.abs().max().item(),
                                   msg=lambda m, name=name: f"{what} safe_get_full_fp32_param({name}): {m}")


@pytest.mark.parametrize("kind,stage,gas,dtype", [("gan", 2, 1, "fp32"), ("gan", 1, 1, "fp32"),
                                                  ("chain", 2, 2, "fp32"), ("gan", 2, 1, "bf16")])
def test_lean_step_matches_deepspeed_step(ranks, kind, stage, gas, dtype):
    ranks.run(lean_vs_deepspeed_scenario, kind, stage, gas, dtype)


def test_lean_step_with_deepspeed_fused_adam(ranks):
    ranks.run(lean_vs_deepspeed_scenario, "gan", 2, 1, "fp32", fused_adam=True)


# -- ZeRO-3: the fused update against DeepSpeed's step -----------------------------------------
def _zero3_real_elements(params, rank: int) -> torch.Tensor:
    """Mask of the elements of these ZeRO-3 parameters' concatenated shards that hold parameter
    values: DeepSpeed leaves the padding of the last ranks' shards uninitialised (torch.empty in
    partition_parameters.py), so two engines built alike differ there."""
    pieces = []
    for p in params:
        size = p.partition_numel()
        real = min(max(p.ds_numel - rank * size, 0), size)
        pieces += [torch.ones(real, dtype=torch.bool), torch.zeros(size - real, dtype=torch.bool)]
    return torch.cat(pieces)


def zero3_fused_vs_deepspeed_scenario(steps: int = 3) -> None:
    from graphzero import deepspeed_adapter
    from graphzero.deepspeed_adapter import binding_of
    rank, _ = rank_world()
    cfg = _config(3)
    fused = {k: engine(m, cfg) for k, m in _models("gan", torch.float32).items()}
    own = {k: engine(m, cfg) for k, m in _models("gan", torch.float32).items()}
    step_fused = torch.compile(gan_loss, backend="graphzero", options={"engines": fused})
    step_own = torch.compile(gan_loss, backend="graphzero", options={"engines": own, "lean_step": False})
    for t in range(steps):
        z, real = data(t, rank, (4, 8), (4, 8))
        step_fused(fused, z, real).backward()
        step_own(own, z, real).backward()
        for eng in (*fused.values(), *own.values()):
            eng.step()
        for name, a in fused.items():
            b, what = own[name], f"step {t} {name}"
            assert binding_of(a).step.fused_update is not None and binding_of(b).step.fused_update is None, what
            assert "_optimizer_step" not in b.optimizer.__dict__, what
            norm = float(b.get_global_grad_norm())
            torch.testing.assert_close(float(a.get_global_grad_norm()), norm, rtol=1e-6, atol=0, msg=what)
            if t == 0:
                assert norm > CLIP, f"{what}: norm {norm} does not exceed the clip {CLIP}: clipping untested"
            assert a.get_lr() == b.get_lr() and a.global_steps == b.global_steps == t + 1, what
            for i, (ma, mb) in enumerate(zip(a.optimizer.fp32_partitioned_groups_flat,
                                              b.optimizer.fp32_partitioned_groups_flat)):
                real = _zero3_real_elements(a.optimizer.fp16_groups[i], rank)
                assert real.numel() == ma.numel() and real.any(), what
                torch.testing.assert_close(ma[real], mb[real], rtol=0, atol=1e-6,
                                           msg=lambda m, what=what: f"{what} fp32: {m}")
            for (pname, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
                real = _zero3_real_elements([pa], rank)
                torch.testing.assert_close(pa.ds_tensor[real], pb.ds_tensor[real], rtol=0, atol=1e-6,
                                           msg=lambda m, what=what, pname=pname: f"{what} {pname} shard: {m}")
    for name, eng in fused.items():
        deepspeed_adapter.detach(eng)
        assert not {"_optimizer_step", "unscale_and_clip_grads"} & set(eng.optimizer.__dict__), name


def test_zero3_fused_update_matches_deepspeed_step(ranks):
    ranks.run(zero3_fused_vs_deepspeed_scenario)


# -- checkpoints across runtimes ------------------------------------------------------------------
# One engine: DeepSpeed eager runs it with engine.backward (several engines in one eager loss
# follow DeepSpeed's own multi-engine rules, which are not what this test is about).
def single_loss(models, x):
    return 10 * models["m"](x).square().mean()


def _train(engines, compiled, t0: int, t1: int) -> None:
    rank, _ = rank_world()
    eng = engines["m"]
    for t in range(t0, t1):
        (x,) = data(t, rank, (4, 8))
        if compiled is None:
            eng.backward(single_loss(engines, x))
        else:
            compiled(engines, x).backward()
        eng.step()


def _state(engines) -> list[torch.Tensor]:
    out = []
    for eng in engines.values():
        out += [p.detach().clone() for p in eng.module.parameters()]
        opt = eng.optimizer
        for master in opt.single_partition_of_fp32_groups:
            out.append(master.detach().clone())
            st = opt.optimizer.state[master]
            out += [st["exp_avg"].clone(), st["exp_avg_sq"].clone(), torch.as_tensor(float(st["step"]))]
        out.append(torch.as_tensor(float(eng.get_lr()[0])))
    return out


def checkpoint_across_runtimes_scenario(save_with: str) -> None:
    rank, _ = rank_world()
    cfg = _config(2)
    gz_opts = {"lean_step": True, "defer_param_gather": True, "inner": "eager"}
    torch.manual_seed(6)
    saving = {"m": engine(mlp(8, 32, 8, depth=3), cfg)}
    fn = None
    if save_with == "graphzero":
        fn = torch.compile(single_loss, backend="graphzero", options={"engines": saving, **gz_opts})
    _train(saving, fn, 0, 2)
    path = [tempfile.mkdtemp(prefix="graphzero-lean-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    for name, eng in saving.items():
        eng.save_checkpoint(f"{path[0]}/{name}", tag="t2")
    saved = _state(saving)
    _train(saving, fn, 2, 4)
    uninterrupted = [p.detach().clone() for e in saving.values() for p in e.module.parameters()]

    torch.manual_seed(6)
    loading = {"m": engine(mlp(8, 32, 8, depth=3), cfg)}
    for name, eng in loading.items():
        eng.load_checkpoint(f"{path[0]}/{name}", tag="t2")
    for i, (a, b) in enumerate(zip(_state(loading), saved)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"restored state tensor {i}: {m}")
    fn = None
    if save_with == "deepspeed":
        fn = torch.compile(single_loss, backend="graphzero", options={"engines": loading, **gz_opts})
    _train(loading, fn, 2, 4)
    if save_with == "deepspeed":
        assert all(_lean_kind(e) == "LeanStep" for e in loading.values())
    resumed = [p.detach().clone() for e in loading.values() for p in e.module.parameters()]
    for i, (a, b) in enumerate(zip(resumed, uninterrupted)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"resumed parameter {i}: {m}")


@pytest.mark.parametrize("save_with", ["graphzero", "deepspeed"])
def test_checkpoint_between_lean_step_and_deepspeed_eager(ranks, save_with):
    ranks.run(checkpoint_across_runtimes_scenario, save_with)
