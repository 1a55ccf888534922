"""Workloads for ``graphzero-compare``: models split into parts (one DeepSpeed engine, DDP wrapper
or FSDP2 root per part), a loss spanning the parts, and deterministic data.

Every workload is a :class:`Workload`: ``parts`` maps a part name to an ``nn.Module`` holding the
initial weights (identical on every rank: built from one seed), ``loss(m, *batch)`` computes the
scalar loss from ``m``, a dict of callables with the same keys (an engine, a DDP module, a compiled
module...), and ``make_batch(gen)`` draws one micro-batch from a ``torch.Generator``.

| model        | parts               | loss                                                           |
| ------------ | ------------------- | -------------------------------------------------------------- |
| mlp          | a, b                | ``mse(b(a(x)), y)``: each part called once                     |
| gan          | gen, disc           | ``-disc(gen(z)).mean() + disc(real).mean()``: disc called twice |
| gan-break    | gen, disc           | the same, with a Dynamo graph break between the two disc calls  |
| chain3       | a, b, c             | ``mse(c(b(a(x))), y)``                                         |
| transformer  | body, head          | ``cross_entropy(head(body(tokens)), next tokens)``             |

``mlp``/``chain3`` parts are ``depth`` x (Linear(width, width) + GELU); ``gan`` has a generator of
that shape and a discriminator of ``depth - 1`` such layers plus Linear(width, 1); ``transformer``
is a GPT-style stack: token + position embedding, ``depth`` pre-LN blocks (causal self-attention
with ``heads`` heads, 4x GELU MLP), a final LayerNorm (the ``body`` part), and an untied LM head
Linear(width, vocab) (the ``head`` part). Losses are computed in fp32 from the parts' outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("mlp", "gan", "gan-break", "chain3", "transformer", "diffusers", "rlhf")


@dataclass(frozen=True)
class ModelSize:
    """Sizes of a workload. ``batch`` is the micro-batch per rank; ``seq``, ``vocab`` and ``heads``
    are used by ``transformer`` only."""

    width: int
    depth: int
    batch: int
    seq: int = 64
    vocab: int = 1024
    heads: int = 4


#: The size fields, in order: each is also a ``graphzero-compare`` option (``--width``, ...).
SIZE_FIELDS = tuple(f.name for f in fields(ModelSize))

DEFAULT_SIZES: dict[str, ModelSize] = {
    "mlp": ModelSize(width=512, depth=6, batch=64),
    "gan": ModelSize(width=512, depth=6, batch=64),
    "gan-break": ModelSize(width=512, depth=6, batch=64),
    "chain3": ModelSize(width=512, depth=4, batch=64),
    "transformer": ModelSize(width=256, depth=2, batch=8, seq=64, vocab=1024, heads=4),
    # examples/diffusers_text_encoder.py's shape: width = the UNet's first block channels (the
    # second has 2x, the text encoder's hidden size), depth = text encoder layers, seq = prompt length
    "diffusers": ModelSize(width=32, depth=2, batch=4, seq=8, vocab=256, heads=4),
    # examples/rlhf_ppo.py's shape: GPT-2 width/depth/heads, seq = the rolled-out sequence length
    "rlhf": ModelSize(width=128, depth=3, batch=8, seq=32, vocab=256, heads=2),
}

TINY_SIZES: dict[str, ModelSize] = {
    "mlp": ModelSize(width=32, depth=2, batch=4),
    "gan": ModelSize(width=32, depth=2, batch=4),
    "gan-break": ModelSize(width=32, depth=2, batch=4),
    "chain3": ModelSize(width=32, depth=2, batch=4),
    "transformer": ModelSize(width=32, depth=1, batch=2, seq=8, vocab=64, heads=2),
    "diffusers": ModelSize(width=8, depth=2, batch=2, seq=6, vocab=64, heads=2),
    "rlhf": ModelSize(width=16, depth=1, batch=2, seq=8, vocab=64, heads=2),
}


def resolve_size(model: str, tiny: bool = False, **overrides: int | None) -> ModelSize:
    """The size for ``model``: defaults (or the tiny ones), with every non-None override applied."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    size = (TINY_SIZES if tiny else DEFAULT_SIZES)[model]
    size = replace(size, **{k: v for k, v in overrides.items() if v is not None})
    if min(size.width, size.depth, size.batch, size.seq, size.vocab, size.heads) < 1:
        raise ValueError(f"sizes must be positive: {size}")
    if model in ("gan", "gan-break") and size.depth < 2:
        raise ValueError(f"{model} needs depth >= 2")
    if model == "transformer" and size.width % size.heads:
        raise ValueError(f"transformer width {size.width} is not divisible by heads {size.heads}")
    if model == "rlhf" and size.width % size.heads:
        raise ValueError(f"rlhf width {size.width} is not divisible by heads {size.heads}")
    if model == "diffusers" and size.width % 4:
        raise ValueError(f"diffusers width {size.width} must be a multiple of 4 (the UNet's GroupNorm groups)")
    return size


def size_from_args(args: Any) -> ModelSize:
    """``resolve_size`` for parsed ``graphzero-compare`` options (``model``, ``tiny``, ``width``, ...)."""
    return resolve_size(args.model, args.tiny, **{k: getattr(args, k) for k in SIZE_FIELDS})


@dataclass
class Workload:
    name: str
    size: ModelSize
    parts: dict[str, nn.Module]
    loss: Callable[..., torch.Tensor]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    description: str
    # parts called inside the step but never trained (RLHF's reference and reward models)
    frozen: tuple[str, ...] = ()
    # plain inductor computes this workload's gradients wrong on some torch versions (the UNet:
    # docs/inductor-unet-miscompile.md); the ideal then compiles its backward as graphzero does
    inductor_backward_miscompiled: bool = False

    @property
    def trained(self) -> tuple[str, ...]:
        return tuple(k for k in self.parts if k not in self.frozen)

    def numel(self) -> dict[str, int]:
        return {name: sum(p.numel() for p in part.parameters()) for name, part in self.parts.items()}


def mlp_stack(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTBody(nn.Module):
    """Embedding + pre-LN blocks + final LayerNorm; returns hidden states [batch, seq, width]."""

    def __init__(self, size: ModelSize):
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.width)
        self.pos = nn.Embedding(size.seq, size.width)
        self.blocks = nn.Sequential(*[Block(size.width, size.heads) for _ in range(size.depth)])
        self.ln_f = nn.LayerNorm(size.width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.ln_f(self.blocks(self.tok(idx) + self.pos(pos)))


def _init_small(module: nn.Module) -> None:
    """GPT-2 style init for the transformer (normal(0, 0.02), zero biases)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y.float()).square().mean()


def loss_mlp(m, x, y):
    return _mse(m["b"](m["a"](x)), y)


def loss_chain3(m, x, y):
    return _mse(m["c"](m["b"](m["a"](x))), y)


def loss_gan(m, z, real):
    return -m["disc"](m["gen"](z)).float().mean() + m["disc"](real).float().mean()


def loss_gan_break(m, z, real):
    # two compiled graphs reach disc (a compiled runner's backward reduces it in both, or holds)
    fake = -m["disc"](m["gen"](z)).float().mean()
    torch._dynamo.graph_break()
    return fake + m["disc"](real).float().mean()


def loss_transformer(m, idx, targets):
    logits = m["head"](m["body"](idx)).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_diffusers(m, noisy, timesteps, input_ids, target):
    """DreamBooth's loss with the text encoder trained (examples/diffusers_text_encoder.py)."""
    hidden = m["text_encoder"](input_ids)[0]
    pred = m["unet"](noisy, timesteps, encoder_hidden_states=hidden).sample
    return F.mse_loss(pred.float(), target.float())


def _diffusers_workload(size: ModelSize) -> Workload:
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    w = size.width
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=size.vocab, hidden_size=2 * w, intermediate_size=4 * w, projection_dim=2 * w,
        num_hidden_layers=size.depth, num_attention_heads=size.heads, max_position_embeddings=size.seq,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(w, 2 * w),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=2 * w, norm_num_groups=4, attention_head_dim=2)
    scheduler = DDPMScheduler(num_train_timesteps=1000)

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        latents = torch.randn(size.batch, 4, 8, 8, generator=gen)
        noise = torch.randn(latents.shape, generator=gen)
        timesteps = torch.randint(0, 1000, (size.batch,), generator=gen)
        ids = torch.randint(3, size.vocab, (size.batch, size.seq), generator=gen)
        return scheduler.add_noise(latents, noise, timesteps), timesteps, ids, noise

    return Workload("diffusers", size, {"text_encoder": text_encoder, "unet": unet}, loss_diffusers, batch,
                    f"UNet2DConditionModel (channels {w}/{2 * w}, cross-attention) + CLIPTextModel ({size.depth} "
                    f"layers, hidden {2 * w}), both trained, loss mse(unet(noisy, t, text(ids)), noise)",
                    inductor_backward_miscompiled=True)


class ValueModel(nn.Module):
    """GPT-2 body with a scalar head: the critic (per token) and the reward model (last token)."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import GPT2Model
        self.body = GPT2Model(config)
        self.head = nn.Linear(config.n_embd, 1)

    def forward(self, input_ids, attention_mask, position_ids):
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.head(hidden.last_hidden_state).squeeze(-1)


def _token_logp(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seq[:, 1:, None]).squeeze(-1)


def loss_rlhf(m, seq, attn, action, old_logp, old_values):
    """examples/rlhf_ppo.py's clipped PPO loss, with the frozen models inside the step: the
    reference's log-probabilities (KL term) and the reward model's score (the returns)."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logp = _token_logp(m["actor"](input_ids=seq, attention_mask=attn, position_ids=pos).logits, seq)
    with torch.no_grad():
        ref_logp = _token_logp(m["reference"](input_ids=seq, attention_mask=attn, position_ids=pos).logits, seq)
        returns = m["reward"](seq, attn, pos)[:, -1:].float().expand_as(old_values)
    advantages = (returns - old_values) * action
    ratio = torch.exp(logp - old_logp)
    policy = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    values = m["critic"](seq, attn, pos)[:, :-1].float()
    clipped = old_values + (values - old_values).clamp(-0.2, 0.2)
    value = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    n = action.sum()
    return ((policy + 0.05 * (logp - ref_logp)) * action).sum() / n + 0.5 * (value * action).sum() / n


def _rlhf_workload(size: ModelSize) -> Workload:
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=size.vocab, n_positions=size.seq, n_embd=size.width, n_layer=size.depth,
                        n_head=size.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=None, eos_token_id=None)
    actor = GPT2LMHeadModel(config)
    parts = {"actor": actor, "critic": ValueModel(config), "reference": copy.deepcopy(actor).requires_grad_(False),
             "reward": ValueModel(config).requires_grad_(False)}
    prompt = size.seq // 2

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        seq = torch.randint(0, size.vocab, (size.batch, size.seq), generator=gen)
        attn = torch.ones_like(seq)
        attn[0, : prompt // 2] = 0   # a left-padded prompt
        action = torch.zeros(size.batch, size.seq - 1)
        action[:, prompt - 1:] = 1.0   # the generated tokens
        old_logp = -torch.rand(size.batch, size.seq - 1, generator=gen) * 4
        old_values = torch.randn(size.batch, size.seq - 1, generator=gen) * 0.1
        return seq, attn, action, old_logp, old_values

    return Workload("rlhf", size, parts, loss_rlhf, batch,
                    f"PPO: GPT-2 actor + critic trained, reference + reward frozen inside the step ({size.depth} "
                    f"layers, width {size.width}, seq {size.seq})", frozen=("reference", "reward"))


def build_workload(model: str, size: ModelSize, seed: int = 0) -> Workload:
    """Build the reference parts from ``seed`` (call on every rank: weights come out identical)."""
    torch.manual_seed(seed)
    w, b = size.width, size.batch

    def gaussian_pair(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, w, generator=gen), torch.randn(b, w, generator=gen)

    if model == "mlp":
        parts = {"a": mlp_stack(w, size.depth), "b": mlp_stack(w, size.depth)}
        return Workload(model, size, parts, loss_mlp, gaussian_pair,
                        f"2 parts x {size.depth} x (Linear({w},{w})+GELU), loss mse(b(a(x)), y)")
    if model == "chain3":
        parts = {k: mlp_stack(w, size.depth) for k in ("a", "b", "c")}
        return Workload(model, size, parts, loss_chain3, gaussian_pair,
                        f"3 parts x {size.depth} x (Linear({w},{w})+GELU), loss mse(c(b(a(x))), y)")
    if model in ("gan", "gan-break"):
        disc = nn.Sequential(*mlp_stack(w, size.depth - 1), nn.Linear(w, 1))
        parts = {"gen": mlp_stack(w, size.depth), "disc": disc}
        broken = model == "gan-break"
        return Workload(model, size, parts, loss_gan_break if broken else loss_gan, gaussian_pair,
                        f"gen {size.depth} x (Linear({w},{w})+GELU), disc {size.depth - 1} x (...) + "
                        f"Linear({w},1), loss -disc(gen(z)).mean() + {'<graph break> ' if broken else ''}"
                        "disc(real).mean()")
    if model == "transformer":
        body, head = GPTBody(size), nn.Linear(w, size.vocab, bias=False)
        _init_small(body)
        _init_small(head)

        def tokens(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            seq = torch.randint(0, size.vocab, (b, size.seq + 1), generator=gen)
            return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

        return Workload(model, size, {"body": body, "head": head}, loss_transformer, tokens,
                        f"GPT body (vocab {size.vocab}, seq {size.seq}, width {w}, {size.depth} blocks, "
                        f"{size.heads} heads) + LM head, loss cross_entropy(head(body(t)), next t)")
    if model == "diffusers":
        return _diffusers_workload(size)
    if model == "rlhf":
        return _rlhf_workload(size)
    raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")


def batch_generator(seed: int, rank: int, round_idx: int, micro: int) -> torch.Generator:
    """A generator seeded from (seed, rank, round, micro-batch): every runner sees the same data."""
    mixed = (seed * 1_000_003 + rank * 7_919 + round_idx * 104_729 + micro * 15_485_863) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def bf16_round_(module: nn.Module) -> None:
    """Round weights to bf16-representable fp32 values, so that a bf16 DeepSpeed engine and an fp32
    master copy start from exactly the same numbers."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())

