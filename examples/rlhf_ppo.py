"""PPO for a language model (RLHF) with four DeepSpeed engines: the actor and the critic trained from
one clipped PPO loss in one compiled step, a frozen reference model inside that step (the KL term),
a frozen reward model, and greedy ``generate`` with left-padded prompts between steps. graphzero's
one added line is the backend of ``torch.compile``:

    torchrun --nproc_per_node 2 examples/rlhf_ppo.py                      # ZeRO-3 actor, critic, reference, reward
    torchrun --nproc_per_node 2 examples/rlhf_ppo.py --zero-stage 2       # trained engines ZeRO-2 (frozen ones ZeRO-3)
    torchrun --nproc_per_node 2 examples/rlhf_ppo.py --lora               # actor = LoRA adapters (peft) over a frozen base

    step = torch.compile(ppo_loss, backend="graphzero",
                         options={"engines": {"actor": actor, "critic": critic, "reference": reference, "reward": reward}})

The reference and reward engines have no optimizer: graphzero attaches them frozen, so the
reference's ZeRO-3 gathers are part of the compiled loss (one graph, no graph break).

Without graphzero the loss would need ``actor.backward(loss); critic.backward(loss)`` (DeepSpeed
refuses the second backward through the shared graph) or two losses. Tiny GPT-2 models built from a
config (no downloads); CPU runs use gloo (``DS_ACCELERATOR=cpu`` is set when there is no GPU).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from torch import nn

LR = 1e-3
CLIP = 1.0
VOCAB, PAD = 64, 0
BATCH, PROMPT, NEW_TOKENS = 2, 4, 3
CLIP_RATIO, VALUE_CLIP, KL_COEF, VF_COEF = 0.2, 0.2, 0.05, 0.5


def gpt2_config():
    from transformers import GPT2Config

    # initializer_range 0.5, not GPT-2's 0.02: a random model with near-flat logits makes greedy
    # decoding flip on rounding differences; these logits are decisive.
    # no dropout: the rollout and the loss must be deterministic (a reference replays them)
    return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, initializer_range=0.5,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=PAD)


class ValueModel(nn.Module):
    """GPT-2 body with a scalar head: the critic (per token) and the reward model (last token)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Model

        self.body = GPT2Model(gpt2_config())
        self.head = nn.Linear(16, 1)

    def forward(self, input_ids, attention_mask, position_ids):
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.head(hidden.last_hidden_state).squeeze(-1)


def build_models(seed: int = 0, lora: bool = False) -> dict[str, nn.Module]:
    """actor, critic, reference (a frozen copy of the initial actor), reward; the same on every rank."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    actor = GPT2LMHeadModel(gpt2_config())
    reference = copy.deepcopy(actor).requires_grad_(False)
    critic, reward = ValueModel(), ValueModel().requires_grad_(False)
    if lora:
        from peft import LoraConfig, get_peft_model

        actor = get_peft_model(actor, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                                 init_lora_weights="gaussian"))
    return {"actor": actor, "critic": critic, "reference": reference, "reward": reward}


def prompts(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths: ids and attention mask."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(3, VOCAB, (BATCH, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    for row in range(BATCH):
        pad = int(torch.randint(0, PROMPT - 1, (), generator=g))
        ids[row, :pad], mask[row, :pad] = PAD, 0
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def token_logp(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seq[:, 1:, None]).squeeze(-1)


@torch.no_grad()
def generate(actor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return actor.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=PAD)


@torch.no_grad()
def rollout(models: dict, ids: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor | None = None) -> dict:
    """Generate (unless ``seq`` is given), then score: old log-probs and values (this policy, no
    grad), the reward of each sequence, advantages (reward - value, the same for every generated
    token: gamma = lambda = 1)."""
    actor = models["actor"]
    if seq is None:
        seq = generate(actor, ids, mask)
    attn = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1]:])], 1)
    pos = positions(attn)
    action = torch.zeros_like(seq[:, 1:], dtype=torch.float32)
    action[:, ids.shape[1] - 1:] = 1.0   # generated tokens
    old_logp = token_logp(actor(input_ids=seq, attention_mask=attn, position_ids=pos).logits, seq)
    old_values = models["critic"](seq, attn, pos)[:, :-1].float()
    score = models["reward"](seq, attn, pos)[:, -1].float()
    returns = score[:, None].expand_as(old_values)
    advantages = (returns - old_values) * action
    return {"seq": seq, "attn": attn, "pos": pos, "action": action, "old_logp": old_logp,
            "old_values": old_values, "advantages": advantages, "returns": returns}


def ppo_loss(actor, critic, reference, seq, attn, pos, action, old_logp, old_values, advantages, returns):
    """Clipped PPO policy loss + KL to the frozen reference + clipped value loss, one scalar."""
    logp = token_logp(actor(input_ids=seq, attention_mask=attn, position_ids=pos).logits, seq)
    with torch.no_grad():
        ref_logp = token_logp(reference(input_ids=seq, attention_mask=attn, position_ids=pos).logits, seq)
    ratio = torch.exp(logp - old_logp)
    policy = -torch.min(ratio * advantages, ratio.clamp(1 - CLIP_RATIO, 1 + CLIP_RATIO) * advantages)
    kl = logp - ref_logp
    values = critic(seq, attn, pos)[:, :-1].float()
    clipped = old_values + (values - old_values).clamp(-VALUE_CLIP, VALUE_CLIP)
    value = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    n = action.sum()
    return ((policy + KL_COEF * kl) * action).sum() / n + VF_COEF * (value * action).sum() / n


def ds_config(stage: int, trained: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "timers": {"throughput": {"enabled": False}},
        "steps_per_print": 10**9,
    }
    if trained:
        cfg["gradient_clipping"] = CLIP
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}
    return cfg


def engines(models: dict, stage: int) -> dict:
    """DeepSpeed engines: actor and critic at ``stage``, the frozen reference and reward at ZeRO-3."""
    import deepspeed

    out = {}
    for name, model in models.items():
        trained = name in ("actor", "critic")
        params = [p for p in model.parameters() if p.requires_grad] if trained else None
        out[name], *_ = deepspeed.initialize(model=model, model_parameters=params,
                                             config=ds_config(stage if trained else 3, trained))
    return out


def train(stage: int = 3, *, steps: int = 3, lora: bool = False, options: dict | None = None,
          on_boundary=None, log=print) -> dict:
    """PPO iterations: a rollout, then one compiled loss and one optimizer step per engine.
    ``on_boundary(t, engines, rollout)`` runs after the backward, before the step (tests)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    eng = engines(build_models(lora=lora), stage)
    modules = {name: e.module for name, e in eng.items()}
    trained = {"actor": eng["actor"], "critic": eng["critic"]}
    # The reference and reward engines have no optimizer: graphzero attaches them frozen, so the
    # reference's ZeRO-3 gathers run inside the compiled loss (no DeepSpeed hook, no graph break)
    # and the reward model's eager rollout calls gather as under DeepSpeed.
    step = torch.compile(ppo_loss, backend="graphzero", options={"engines": eng, **(options or {})})
    history = {"loss": [], "sequences": []}
    for t in range(steps):
        ids, mask = prompts(t, rank)
        batch = rollout(modules, ids, mask)   # generate and score between steps, outside the compiled loss
        history["sequences"].append(batch["seq"].tolist())
        loss = step(eng["actor"], eng["critic"], eng["reference"], **batch)
        loss.backward()                       # graphzero reduces the actor's and the critic's gradients
        if on_boundary is not None:
            on_boundary(t, trained, batch)
        eng["actor"].step()
        eng["critic"].step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        history["loss"].append(float(total) / world)
        log(f"step {t}: loss {history['loss'][-1]:.5f}  |grad| actor {float(eng['actor'].get_global_grad_norm()):.4f} "
            f"critic {float(eng['critic'].get_global_grad_norm()):.4f}")
    import graphzero

    for e in eng.values():
        graphzero.detach(e)
    return history


class Reference:
    """Single-process PPO on every rank's prompts: the loss is the mean over ranks, each model
    clipped by its own norm (as DeepSpeed does per engine), torch AdamW."""

    def __init__(self, lora: bool = False) -> None:
        self.models = build_models(lora=lora)
        self.opts = {k: torch.optim.AdamW([p for p in self.models[k].parameters() if p.requires_grad],
                                          lr=LR, weight_decay=0.0) for k in ("actor", "critic")}

    def accumulate(self, t: int, world: int, sequences: list | None = None) -> list:
        """Every rank's loss / world into .grad; each rank's rollout generated here, or, given
        ``sequences`` (per rank), scored from those. Returns the reference's own greedy tokens."""
        own = []
        for r in range(world):
            ids, mask = prompts(t, r)
            own.append(generate(self.models["actor"], ids, mask).tolist())
            seq = torch.tensor(sequences[r] if sequences is not None else own[r])
            batch = rollout(self.models, ids, mask, seq)
            loss = ppo_loss(self.models["actor"], self.models["critic"], self.models["reference"], **batch)
            (loss / world).backward()
        return own

    def grads(self, name: str) -> list[torch.Tensor]:
        return [p.grad.detach().clone() for p in self.models[name].parameters() if p.requires_grad]

    def step(self) -> None:
        for k, opt in self.opts.items():
            torch.nn.utils.clip_grad_norm_([p for p in self.models[k].parameters() if p.requires_grad], CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--zero-stage", type=int, default=3, help="the actor's and critic's ZeRO stage")
    parser.add_argument("--lora", action="store_true", help="the actor is LoRA adapters over a frozen base (peft)")
    args = parser.parse_args()

    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    say(f"world size {dist.get_world_size()}, actor/critic ZeRO-{args.zero_stage}, reference/reward ZeRO-3"
        f"{', LoRA actor' if args.lora else ''}", flush=True)
    history = train(args.zero_stage, steps=args.steps, lora=args.lora, log=say)
    say(f"loss {history['loss'][0]:.5f} -> {history['loss'][-1]:.5f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
