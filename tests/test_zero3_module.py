"""A ZeRO-3 engine's module stays itself under graphzero: HF ``generate`` (left-padded prompts),
``inspect.signature``, a custom method and a submodule called by the compiled loss, an instance-level
forward wrapper, and PEFT LoRA (ZeRO-3 and ZeRO-2) with only the adapters owned.

Against a single-process reference (scenario_utils.Reference), 3 optimizer steps, gradients, norms
and parameters at the tolerances of test_zero3.py; generated tokens exactly.
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
import pathlib

import pytest
import torch
from test_zero3 import GRAD_TOL, assert_params_match, assert_released, z3_config
from torch import nn

import graphzero
from graphzero.deepspeed_adapter.base import binding_of
from scenario_utils import (
    Reference,
    assert_grads_close,
    data,
    engine,
    full_grads,
    full_params,
    mlp,
    rank_world,
)


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide (see test_zero3.py).
    yield
    ranks.close()


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    # initializer_range 0.5: logits that depend on position, so lost position_ids change the tokens
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     initializer_range=0.5)
    return GPT2LMHeadModel(cfg)


def left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (3, 7), generator=g)
    mask = (torch.arange(7) >= torch.tensor([[3], [0], [5]])).long()
    return ids * mask, mask


def generate(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)


def assert_nothing_gathered(eng) -> None:
    for name, p in eng.module.named_parameters():
        assert getattr(p, "ds_persist", False) or p.numel() == 0, f"{name} left gathered ({p.numel()} elements)"


def lm_loss(models, ids):
    return models["lm"](input_ids=ids, labels=ids).loss


def generate_scenario(steps: int = 2) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = tiny_gpt2()
    ref = Reference({"lm": model})
    ds_eager = engine(copy.deepcopy(model), z3_config(3))
    gz = engine(model, z3_config(3))
    prompts, mask = left_padded_prompts()
    want = generate(ref.models["lm"], prompts, mask)
    eager = generate(ds_eager.module, prompts, mask)
    signature = inspect.signature(gz.module.forward)
    graphzero.attach(lm=gz)
    assert inspect.signature(gz.module.forward) == signature and "position_ids" in signature.parameters
    assert "forward" not in gz.module.__dict__
    got = generate(gz.module, prompts, mask)
    assert_nothing_gathered(gz)
    step = torch.compile(lm_loss, backend="graphzero", options={"engines": {"lm": gz}, "inner": "eager"})
    for t in range(steps):
        ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(100 * t + rank))
        step({"lm": gz}, ids).backward()
        assert_released(gz)
        ref.accumulate(lm_loss, [[torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(100 * t + r))]
                                 for r in range(world)])
        assert_grads_close(full_grads(gz), ref.grads("lm"), **GRAD_TOL, what=f"step {t}")
        gz.step()
        ref.step()
        torch.testing.assert_close(float(gz.get_global_grad_norm()), ref.norms["lm"], rtol=1e-4, atol=1e-6)
    # generate after training: the current parameters, nothing left gathered
    trained_want, trained_got = generate(ref.models["lm"], prompts, mask), generate(gz.module, prompts, mask)
    assert_nothing_gathered(gz)
    graphzero.detach(gz)
    assert inspect.signature(gz.module.forward) == signature
    return {"want": want.tolist(), "eager": eager.tolist(), "got": got.tolist(),
            "trained_want": trained_want.tolist(), "trained_got": trained_got.tolist()}


def test_generate_left_padded_same_tokens_as_plain_and_deepspeed_eager(ranks):
    results = ranks.run(generate_scenario)
    for r in results:
        assert r["got"] == r["want"], r
        assert r["eager"] == r["want"], r
        assert r["trained_got"] == r["trained_want"], r


def checkpointing_scenario(use_reentrant: bool, steps: int = 3) -> dict:
    """HF gradient checkpointing at ZeRO-3: the gathers now sit inside the checkpointed blocks."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = tiny_gpt2()
    ref = Reference({"lm": model})
    kwargs = {"use_reentrant": use_reentrant}
    ref.models["lm"].gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    gz = engine(model, z3_config(3))
    graphzero.attach(lm=gz)
    step = torch.compile(lm_loss, backend="graphzero", options={"engines": {"lm": gz}, "inner": "eager"})
    batch = lambda t, r: [torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(100 * t + r))]
    for t in range(steps):
        step({"lm": gz}, *batch(t, rank)).backward()
        assert_released(gz)
        ref.accumulate(lm_loss, [batch(t, r) for r in range(world)])
        assert_grads_close(full_grads(gz), ref.grads("lm"), **GRAD_TOL, what=f"step {t}")
        gz.step()
        ref.step()
        torch.testing.assert_close(float(gz.get_global_grad_norm()), ref.norms["lm"], rtol=1e-4, atol=1e-6)
        # Each step's gradient from the same weights: the attention key bias's gradient is zero in
        # exact arithmetic, and its fp32 rounding noise (1e-8, either sign) is an Adam step of +-lr,
        # so the two trajectories part by 3e-3 after two steps whenever rounding differs at 1e-7
        # (the traced backward against eager autograd; another CPU's kernels showed it)
        with torch.no_grad():
            for q, p in zip(ref.models["lm"].parameters(), full_params(gz)):
                q.copy_(p)
    return {}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hf_gradient_checkpointing(ranks, use_reentrant):
    ranks.run(checkpointing_scenario, use_reentrant)


class Encoder(nn.Module):
    """A model whose loss calls a method other than forward and a submodule directly."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = mlp(8, 16, 8)
        self.head = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x) * self.scale      # a parameter of this module read directly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(x))


def doubled(forward):
    """An instance-level forward wrapper (as Accelerate's or PEFT's): changes the result, so the
    reference agrees only if the compiled step called it."""
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        return 2 * forward(*args, **kwargs)
    return wrapped


def encode_loss(models, x):
    net = models["net"]
    net = getattr(net, "module", net)      # the engine's module, or the reference's plain module
    return net.encode(x).square().mean() + net.head(x).sin().mean() + net(x).mean()


def encode_scenario(inner: str = "inductor", steps: int = 3) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = Encoder()
    ref = Reference({"net": model})
    ref.models["net"].forward = doubled(ref.models["net"].forward)
    model.forward = wrapper = doubled(model.forward)
    gz = engine(model, z3_config(3))
    signatures = {m: inspect.signature(getattr(gz.module, m)) for m in ("forward", "encode")}
    graphzero.attach(net=gz)
    assert gz.module.__dict__["forward"] is wrapper, "the instance forward was replaced"
    assert {m: inspect.signature(getattr(gz.module, m)) for m in signatures} == signatures
    step = torch.compile(encode_loss, backend="graphzero", options={"engines": {"net": gz}, "inner": inner})
    for t in range(steps):
        (x,) = data(t, rank, (4, 8))
        step({"net": gz}, x).backward()
        assert_released(gz)
        ref.accumulate(encode_loss, [data(t, r, (4, 8)) for r in range(world)])
        assert_grads_close(full_grads(gz), ref.grads("net"), **GRAD_TOL, what=f"step {t}")
        gz.step()
        ref.step()
        torch.testing.assert_close(float(gz.get_global_grad_norm()), ref.norms["net"], rtol=1e-4, atol=1e-6)
        assert_params_match(gz, ref.models["net"], what=f"step {t}")
    # eager, outside the compiled step: the forward (through the wrapper) and a submodule
    (x,) = data(99, rank, (4, 8))
    with torch.no_grad():
        torch.testing.assert_close(gz.module(x), ref.models["net"](x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gz.module.enc(x), ref.models["net"].enc(x), rtol=1e-4, atol=1e-5)
    assert_nothing_gathered(gz)
    graphzero.detach(gz)
    assert gz.module.__dict__["forward"] is wrapper and type(gz.module) is Encoder
    assert {m: inspect.signature(getattr(gz.module, m)) for m in signatures} == signatures
    return {}


def test_compiled_loss_calls_a_method_a_submodule_and_an_instance_forward(ranks):
    ranks.run(encode_scenario)


# -- PEFT LoRA ---------------------------------------------------------------------------------
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.value = mlp(16, 16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.value(self.embed(ids)).squeeze(-1)


def lora_actor():
    from peft import LoraConfig, get_peft_model
    return get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                                  fan_in_fan_out=True, lora_dropout=0.0, init_lora_weights=False))


def ppo_like_loss(models, ids, adv, ret):
    logits = models["actor"](input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    values = models["critic"](ids)
    return -(logp * adv).mean() + 0.5 * (values - ret).square().mean()


def lora_batch(t: int, rank: int):
    g = torch.Generator().manual_seed(1000 * t + rank)
    return [torch.randint(3, 64, (4, 8), generator=g), torch.randn(4, 7, generator=g), torch.randn(4, 8, generator=g)]


def lora_scenario(stage: int, dump_dir: str | None = None, steps: int = 3) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    actor, critic = lora_actor(), Critic()
    ref = Reference({"actor": actor, "critic": critic})
    engines = {"actor": engine(actor, z3_config(stage)), "critic": engine(critic, z3_config(stage))}
    graphzero.attach(**engines)
    owned = {n for g in binding_of(engines["actor"]).param_set.groups for n in g.names}
    adapters = {n for n, p in engines["actor"].module.named_parameters() if p.requires_grad}
    assert owned == adapters and all(".lora_" in n for n in owned), owned
    if stage == 3:
        # one gathering class per (class, ZeRO-3 parameter names), shared across layers and engines
        # whether a module's parameters are owned (adapters, the critic) or frozen (a LoRA base)
        classes: dict[tuple, set[type]] = {}
        for m in (m for eng in engines.values() for m in eng.module.modules()):
            if isinstance(m, (nn.Linear, nn.Embedding)):
                names = tuple(n for n, p in m._parameters.items() if p is not None)
                classes.setdefault((type(m).__mro__[1], names), set()).add(type(m))
        assert len(classes) == 3 and all(len(c) == 1 for c in classes.values()), classes
    step = torch.compile(ppo_like_loss, backend="graphzero",
                         options={"engines": engines, "inner": "eager", "dump_dir": dump_dir})
    for t in range(steps):
        step(engines, *lora_batch(t, rank)).backward()
        if stage == 3:
            assert_released(*engines.values())
        for n, p in engines["actor"].module.named_parameters():
            assert p.grad is None, f"{n} has a .grad"
        ref.accumulate(ppo_like_loss, [lora_batch(t, r) for r in range(world)])
        for name, eng in engines.items():
            assert_grads_close(full_grads(eng), ref.grads(name), **GRAD_TOL, what=f"step {t} {name}")
        for eng in engines.values():
            eng.step()
        ref.step()
        for name, eng in engines.items():
            torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name], rtol=1e-4, atol=1e-6)
            assert_params_match(eng, ref.models[name], what=f"step {t} {name}")
    summary = None
    if dump_dir is not None and rank == 0:
        summary = json.loads((pathlib.Path(dump_dir) / "summary.json").read_text())["graphs"][-1]["engines"]
    return {"owned": len(owned), "summary": summary}


@pytest.mark.parametrize("stage", [3, 2])
def test_peft_lora_actor_full_critic_one_loss(ranks, stage, tmp_path):
    results = ranks.run(lora_scenario, stage, str(tmp_path))
    assert results[0]["owned"] == 8     # lora_A and lora_B of c_attn and c_fc in 2 layers
    actor = results[0]["summary"]["actor"]
    if stage == 3:
        # The frozen base (13x the adapters' bytes) is gathered in the graph with the adapters, in
        # one bucket, and kept for backward as DeepSpeed's default look-ahead keeps it (not gathered
        # again: test_zero3_once_per_step.py has the config that re-gathers).
        adapter_bytes = 4 * actor["numel"]
        assert actor["all_gather_fwd"] == 1 and actor["all_gather_bytes_fwd"] > 10 * adapter_bytes, actor
        assert actor["all_gather_bytes_bwd"] == 0, actor


# -- gathering classes (no DeepSpeed) ---------------------------------------------------------------
def fake_zero3(module: nn.Module) -> nn.Module:
    """Parameters that look like ZeRO-3 ones to install(): a ``ds_tensor`` shard each."""
    for p in module.parameters():
        p.ds_tensor = p.detach().reshape(-1).clone()
    return module


def test_identical_modules_share_one_gathering_class_and_detach_restores_them():
    from graphzero.deepspeed_adapter import zero3_module
    from graphzero.deepspeed_adapter.ledger import PatchLedger
    blocks = nn.Sequential(*(fake_zero3(nn.Linear(4, 4)) for _ in range(2)), fake_zero3(nn.Linear(4, 4, bias=False)),
                           nn.Linear(4, 4))
    blocks[1].weight.requires_grad_(False)     # frozen: decided per read, not by the class
    other = fake_zero3(nn.Linear(4, 4))        # another engine's module, on another group
    ledger, other_ledger = PatchLedger("blocks"), PatchLedger("other")
    assert zero3_module.install(blocks, 2, "0", ledger) == 3
    assert zero3_module.install(other, 4, "1", other_ledger) == 1
    a, b, no_bias, plain = blocks
    assert type(a) is type(b) is type(other) and type(a).__name__ == "Linear" and type(a) is not nn.Linear
    assert type(no_bias) is not type(a) and isinstance(no_bias, nn.Linear)   # other parameter names
    assert type(plain) is nn.Linear                                           # no ZeRO-3 parameter
    assert a._graphzero_read is b._graphzero_read and other._graphzero_read is not a._graphzero_read
    # outside a module call or a trace a read is the DeepSpeed parameter itself
    assert b.weight is b._parameters["weight"] and other.bias is other._parameters["bias"]
    other_ledger.undo()
    ledger.undo()
    for m in (*blocks, other):
        assert type(m) is nn.Linear and "_graphzero_read" not in vars(m)
