"""The deferred parameter all-gather (option ``defer_param_gather``): nothing reads stale weights.

Two copies of the same GAN engines train on the same data with graphzero's lean step, one with the
all-gather deferred (the default), one waiting for it inside ``step()``. Rank 1 sleeps before each
``step()``, so rank 0's gather is still in flight when rank 0 reads its parameters next: a read
that does not wait sees the other rank's old half. Checked, exactly (rtol 0, atol 0; the same
arithmetic, only the time of the wait differs):

- after ``step()`` a gather is really pending (c10d's work registry is not empty);
- every compiled step's loss, the gradient norms and the final parameters;
- an uncompiled evaluation call between steps, and ``save_checkpoint`` between steps (loaded into
  fresh engines);
- a step with a graph break between the two engines (each graph waits for its own engine);
- with the waits removed (the ``wait_params`` pass and the module hooks), the same run reads stale
  weights: the checks above are sensitive to a missing wait.
"""
from __future__ import annotations

import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import graphzero
from graphzero.errors import OptionError
from graphzero.options import Options
from scenario_utils import data, ds_config, engine, mlp, rank_world


def _engines():
    torch.manual_seed(7)
    models = {"gen": mlp(8, 32, 8, depth=3), "disc": mlp(8, 32, 1, depth=3)}
    return {k: engine(m, ds_config(2, clip=0.01)) for k, m in models.items()}


def gan_step(models, z, real):
    return -models["disc"](models["gen"](z)).mean() + models["disc"](real).mean()


def gan_step_with_break(models, z, real):
    fake = models["gen"](z)
    torch._dynamo.graph_break()
    return -models["disc"](fake).mean() + models["disc"](real).mean()


def _registry_size() -> int:
    return torch._C._distributed_c10d._get_work_registry_size()


def _step_all(engines) -> None:
    if dist.get_rank() == 1:
        time.sleep(0.3)   # rank 0's gather stays in flight while it runs ahead
    for eng in engines.values():
        eng.step()


class _NoWaits:
    """Removes every wait on deferred parameters: the wait_params pass and the module hooks."""

    def __init__(self, engines) -> None:
        from graphzero import compiler as backend
        self.backend = backend
        self.pipeline = backend.FORWARD_PIPELINE
        backend.FORWARD_PIPELINE = tuple(p for p in self.pipeline if p.__name__ != "wait_params")
        self.hooks = []
        for eng in engines.values():
            module = eng.module
            for m in module.modules():
                for key, hook in list(m._forward_pre_hooks.items()):
                    if getattr(hook, "__name__", "") == "wait_own":
                        self.hooks.append((m, key, hook))
                        del m._forward_pre_hooks[key]

    def restore(self) -> None:
        self.backend.FORWARD_PIPELINE = self.pipeline
        for m, key, hook in self.hooks:
            m._forward_pre_hooks[key] = hook


def deferred_scenario(fn_name: str, remove_waits: bool = False, steps: int = 3) -> dict:
    rank, _ = rank_world()
    fn = {"gan_step": gan_step, "gan_step_with_break": gan_step_with_break}[fn_name]
    deferred, waited = _engines(), _engines()
    graphzero.attach(**deferred)   # installs the module hooks now, so _NoWaits can remove them
    step_d = torch.compile(fn, backend="graphzero", options={"engines": deferred, "defer_param_gather": True})
    step_w = torch.compile(fn, backend="graphzero", options={"engines": waited, "defer_param_gather": False})
    broken = _NoWaits(deferred) if remove_waits else None
    mismatches = []
    try:
        for t in range(steps):
            z, real = data(t, rank, (4, 8), (4, 8))
            loss_d, loss_w = step_d(deferred, z, real), step_w(waited, z, real)
            if not torch.equal(loss_d, loss_w):
                mismatches.append(f"step {t}: loss {loss_d.item()} vs {loss_w.item()}")
            loss_d.backward()
            loss_w.backward()
            _step_all(waited)
            _step_all(deferred)
            assert _registry_size() > 0, "no all-gather pending after step(): the gather was not deferred"
            for name in deferred:
                if float(deferred[name].get_global_grad_norm()) != float(waited[name].get_global_grad_norm()):
                    mismatches.append(f"step {t}: {name} norm")
            if t == 0:
                # an uncompiled evaluation call between steps
                with torch.no_grad():
                    eval_d, eval_w = deferred["gen"](z), waited["gen"](z)
                if not torch.equal(eval_d, eval_w):
                    mismatches.append("eval call after step 0")
            if t == 1 and not remove_waits:
                mismatches += _checkpoint_mismatches(deferred, waited)
    finally:
        if broken is not None:
            broken.restore()
        graphzero.wait_params(*deferred.values())
    assert _registry_size() == 0, "a deferred all-gather was never waited for"
    for name in deferred:
        for (pname, a), b in zip(deferred[name].module.named_parameters(), waited[name].module.parameters()):
            if not torch.equal(a, b):
                mismatches.append(f"final {name}.{pname}")
    return {"mismatches": mismatches}


def _checkpoint_mismatches(deferred, waited) -> list[str]:
    rank, _ = rank_world()
    path = [tempfile.mkdtemp(prefix="graphzero-deferred-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    deferred["gen"].save_checkpoint(path[0], tag="pending")   # right after step(): gather in flight
    fresh = _engines()["gen"]
    fresh.load_checkpoint(path[0], tag="pending")
    return [f"checkpoint saved after step: {name}" for (name, a), b in
            zip(fresh.module.named_parameters(), waited["gen"].module.parameters()) if not torch.equal(a, b)]


@pytest.mark.parametrize("fn_name", ["gan_step", "gan_step_with_break"])
def test_deferred_gather_never_reads_stale_weights(ranks, fn_name):
    results = ranks.run(deferred_scenario, fn_name)
    assert all(r["mismatches"] == [] for r in results), results


def test_missing_wait_is_detected(ranks):
    # The same checks with the waits removed must fail (on rank 0, which runs ahead).
    results = ranks.run(deferred_scenario, "gan_step", remove_waits=True)
    assert results[0]["mismatches"], "stale weights went unnoticed: the checks cannot see a missing wait"


@pytest.mark.parametrize("options,match", [({"lean_step": "yes"}, "'lean_step'"),
                                           ({"defer_param_gather": 1}, "'defer_param_gather'"),
                                           ({"lean_step": False, "defer_param_gather": True}, "needs option 'lean_step'")])
def test_step_options_are_validated(options, match):
    with pytest.raises(OptionError, match=match):
        Options.parse(options)


def unguarded_scenario() -> dict:
    """The reads docs/usage.md names as not guarded, right after ``step()`` on rank 0 (rank 1
    sleeps before its step, so rank 0's gather is still in flight): a parameter reached by
    attribute (``module[-1].weight``, through ``nn.Module.__getattr__``; the last layer lies in rank
    1's partition, so rank 0 receives it from the gather) and a parameter tensor kept from before
    ``step()``. Both still hold the pre-gather bytes until ``graphzero.wait_params``."""
    rank, _ = rank_world()
    deferred, waited = _engines(), _engines()
    step_d = torch.compile(gan_step, backend="graphzero", options={"engines": deferred, "defer_param_gather": True})
    step_w = torch.compile(gan_step, backend="graphzero", options={"engines": waited, "defer_param_gather": False})
    z, real = data(0, rank, (4, 8), (4, 8))
    step_d(deferred, z, real).backward()
    step_w(waited, z, real).backward()
    held = deferred["gen"].module[-1].weight            # kept from before step()
    _step_all(waited)
    _step_all(deferred)
    expected = waited["gen"].module[-1].weight.detach().clone()
    attribute = deferred["gen"].module[-1].weight.detach().clone()   # read at once, no wait
    kept = held.detach().clone()
    graphzero.wait_params(*deferred.values())
    after_wait = deferred["gen"].module[-1].weight.detach().clone()
    return {"attribute_stale": not torch.equal(attribute, expected), "held_stale": not torch.equal(kept, expected),
            "after_wait_exact": torch.equal(after_wait, expected)}


def test_unguarded_reads_are_the_documented_ones(ranks):
    # If one of these becomes guarded, this fails: update docs/usage.md's defer_param_gather row.
    first = ranks.run(unguarded_scenario)[0]
    assert first["attribute_stale"] and first["held_stale"], first
    assert first["after_wait_exact"], first
