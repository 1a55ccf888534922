"""TRL's shapes under graphzero, with TRL's own code: the fused LM head
(``trl.trainer.utils.maybe_gather_lm_head_ctx`` asking a ZeRO-3 parameter its ``ds_status``), a
frozen ZeRO-3 reference prepared as TRL prepares it (``requires_grad`` left on), and generation
between steps with TRL's default ``ds3_gather_for_generation=True``: TRL gathers the policy,
removes DeepSpeed's hooks (``trl.models.utils.remove_hooks``), generates and re-registers them
(``add_hooks``). The re-registered hooks must stay out of the compiled step (traced, they trained
the policy wrong from the second step).

Against a single-process reference (scenario_utils.Reference): the policy's gradients and norm at
each of 4 optimizer steps, its "generation" output; no graph compiled after the first step.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from test_zero3 import GRAD_TOL, z3_config
from torch import nn

import graphzero
from scenario_utils import Reference, assert_grads_close, data, engine, full_grads, mlp, rank_world


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide (see test_zero3.py).
    yield
    ranks.close()


class FusedHeadLM(nn.Module):
    """The forward TRL's fused LM head gives a model: it reads ``lm_head.weight`` directly, inside
    ``maybe_gather_lm_head_ctx``, instead of calling the head."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.lm_head = mlp(8, 16, 8), nn.Linear(8, 12)
        self.under_deepspeed = True   # the single-process reference's copies say False

    def get_output_embeddings(self) -> nn.Module:   # as an HF model answers: where TRL looks for the head
        return self.lm_head

    def forward(self, x, labels):
        from trl.trainer.utils import maybe_gather_lm_head_ctx
        h = self.body(x)
        weight, bias = self.lm_head.weight, self.lm_head.bias
        with maybe_gather_lm_head_ctx(weight, bias) if self.under_deepspeed else contextlib.nullcontext():
            logits = F.linear(h, weight, bias)
        return F.cross_entropy(logits, labels, reduction="none")


def dpo_like_loss(models, x, labels):
    with torch.no_grad():
        ref = models["reference"](x, labels)
    policy = models["policy"](x, labels)
    return -F.logsigmoid(0.1 * (ref - policy)).mean()


def batch(t: int, rank: int):
    (x,) = data(t, rank, (4, 8))
    return x, torch.randint(0, 12, (4,), generator=torch.Generator().manual_seed(1000 * t + rank))


def trl_generation_scenario(steps: int = 4) -> dict:
    import deepspeed
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config
    from trl.models.utils import add_hooks, remove_hooks

    rank, world = rank_world()
    torch.manual_seed(0)
    models = {"policy": FusedHeadLM(), "reference": FusedHeadLM()}
    ref = Reference(models)
    ref.models["reference"].requires_grad_(False)
    for m in ref.models.values():
        m.under_deepspeed = False
    cfg = z3_config(3)
    hf_config = HfDeepSpeedConfig(cfg)   # is_deepspeed_zero3_enabled() is True for TRL, as in a TRL run
    frozen_cfg = {k: v for k, v in cfg.items() if k not in ("optimizer", "gradient_clipping")}
    eng = {"policy": engine(models["policy"], cfg), "reference": engine(models["reference"], frozen_cfg)}
    assert all(p.requires_grad for p in eng["reference"].module.parameters())   # as TRL prepares it
    step = torch.compile(dpo_like_loss, backend=graphzero.backend(**eng))
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    graphs_after_first = None
    try:
        for t in range(steps):
            x, labels = batch(t, rank)
            step(eng, x, labels).backward()
            ref.accumulate(dpo_like_loss, [batch(t, r) for r in range(world)])
            assert_grads_close(full_grads(eng["policy"]), ref.grads("policy"), **GRAD_TOL, what=f"step {t}")
            eng["policy"].step()
            ref.step()
            torch.testing.assert_close(float(eng["policy"].get_global_grad_norm()), ref.norms["policy"],
                                       rtol=1e-4, atol=1e-6)
            if t == 0:
                graphs_after_first = counters["stats"]["unique_graphs"]
            # TRL's generation with ds3_gather_for_generation=True (trl/models/utils.py)
            policy = eng["policy"]
            with deepspeed.zero.GatheredParameters(policy.parameters()):
                remove_hooks(policy)
                with torch.no_grad():
                    generated = policy.module(x, labels)
                add_hooks(policy)
            with torch.no_grad():
                torch.testing.assert_close(generated, ref.models["policy"](x, labels), rtol=1e-5, atol=1e-6)
        hooked = [n for n, m in eng["policy"].module.named_modules() if m._forward_pre_hooks and any(
            getattr(h, "__module__", "").startswith("deepspeed.") for h in m._forward_pre_hooks.values())]
        result = {"graphs_after_first": graphs_after_first, "graphs": counters["stats"]["unique_graphs"],
                  "breaks": dict(counters["graph_break"]), "hooked": hooked}
    finally:
        for e in eng.values():
            graphzero.detach(e)
        unset_hf_deepspeed_config()
        del hf_config
    # detached, DeepSpeed's own hooks train the policy again
    x, labels = batch(99, rank)
    dpo_like_loss(eng, x, labels).backward()
    eng["policy"].step()
    return result


def test_fused_lm_head_frozen_reference_and_generation_between_steps(ranks):
    for r in ranks.run(trl_generation_scenario):
        assert r["hooked"] == [], r
        assert r["graphs"] == r["graphs_after_first"], r   # no recompile after the first step
        assert r["breaks"] == {}, r
