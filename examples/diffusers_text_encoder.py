"""DreamBooth-shaped training of a diffusers UNet *and* its CLIP text encoder, each its own DeepSpeed
engine, through HF Accelerate, with one loss and a plain ``accelerator.backward(loss)``. graphzero's
one added line is ``graphzero.accelerate.enable(accelerator)``.

    accelerate launch --config_file examples/accelerate_configs/zero2.yaml examples/diffusers_text_encoder.py
    accelerate launch --config_file examples/accelerate_configs/zero2_zero1.yaml examples/diffusers_text_encoder.py
        --text-encoder-zero-stage 1   # (one command)
    accelerate launch --config_file examples/accelerate_configs/zero3.yaml examples/diffusers_text_encoder.py
    torchrun --nproc_per_node 2 examples/diffusers_text_encoder.py --unet-zero-stage 2 --text-encoder-zero-stage 1
    ... --bf16                      # both engines bf16 with fp32 gradient accumulation

The users' request since 2022 (diffusers #1815, #3342, #10925: "deepspeed doesn't work if we are
training text_encoder"): Accelerate wraps only the first DeepSpeed model, so with plain Accelerate
the text encoder is silently never stepped. With graphzero both engines are trained from one loss,
exactly as a single-process run would train them (tests/test_examples.py).

Tiny models built from configs (no downloads): UNet2DConditionModel with block_out_channels (8, 16),
cross-attention dim 16, 4 norm groups, 8x8 latents; CLIPTextModel with hidden size 16. The latents
are random (a real run encodes images with a frozen VAE first). Gradient accumulation 2 by default.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.nn.functional as F

LR = 1e-3
CLIP = 1.0
MICRO_BATCH, SEQ, VOCAB, TRAIN_TIMESTEPS = 2, 6, 64, 1000


def build_models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny UNet and text encoder (same weights for the same seed, on every rank)."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=4,
        attention_head_dim=2,
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            projection_dim=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=SEQ,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    return unet, text_encoder


def micro_batch(step: int, micro: int, rank: int, gas: int, dtype=torch.float32) -> dict:
    """One rank's micro-batch: latents, prompt ids, the noise and timesteps of the diffusion loss
    (drawn here, outside the compiled step, so that a reference can replay every rank's)."""
    from diffusers import DDPMScheduler

    g = torch.Generator().manual_seed(10_000 * (step * gas + micro) + rank)
    latents = torch.randn(MICRO_BATCH, 4, 8, 8, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    timesteps = torch.randint(0, TRAIN_TIMESTEPS, (MICRO_BATCH,), generator=g)
    input_ids = torch.randint(3, VOCAB, (MICRO_BATCH, SEQ), generator=g)
    noisy = DDPMScheduler(num_train_timesteps=TRAIN_TIMESTEPS).add_noise(latents, noise, timesteps)
    return {"noisy": noisy.to(dtype), "timesteps": timesteps, "input_ids": input_ids, "target": noise}


def diffusion_loss(text_encoder, unet, noisy, timesteps, input_ids, target) -> torch.Tensor:
    """DreamBooth's loss with the text encoder trained: epsilon prediction, MSE in fp32."""
    encoder_hidden_states = text_encoder(input_ids)[0]
    pred = unet(noisy, timesteps, encoder_hidden_states=encoder_hidden_states).sample
    return F.mse_loss(pred.float(), target.float())


def plugin(stage: int, gas: int, bf16: bool):
    from accelerate.utils import DeepSpeedPlugin

    # Keyword arguments, then the rest of the config on the plugin's dict: not hf_ds_config=dict.
    # Under `accelerate launch --config_file examples/accelerate_configs/*.yaml` the launch config's
    # deepspeed_config section (zero_stage, gradient_accumulation_steps, ...) and a plugin's own
    # config dict exclude each other: Accelerate raises "ValueError: When using
    # `deepspeed_config_file`, the following accelerate config variables will be ignored".
    p = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=gas, gradient_clipping=CLIP)
    cfg = p.deepspeed_config
    cfg.pop("train_batch_size", None)  # DeepSpeed derives it from its real world size
    cfg["train_micro_batch_size_per_gpu"] = MICRO_BATCH
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg["timers"] = {"throughput": {"enabled": False}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return p


def train(
    unet_stage: int = 2,
    text_stage: int | None = None,
    *,
    steps: int = 3,
    gas: int = 2,
    bf16: bool = False,
    options: dict | None = None,
    on_boundary=None,
    log=print,
) -> dict:
    """The training loop. ``on_boundary(t, {"unet": engine, "text_encoder": engine})`` runs at each
    accumulation boundary after the backward, before the optimizers step (tests read the
    gradients there). Returns the per-step loss and ``accelerator.clip_grad_norm_`` values."""
    import torch.distributed as dist
    from accelerate import Accelerator

    import graphzero.accelerate

    rank, world = dist.get_rank(), dist.get_world_size()
    text_stage = unet_stage if text_stage is None else text_stage
    dtype = torch.bfloat16 if bf16 else torch.float32
    plugins = {"unet": plugin(unet_stage, gas, bf16), "text_encoder": plugin(text_stage, gas, bf16)}
    accelerator = Accelerator(
        deepspeed_plugins=plugins, gradient_accumulation_steps=gas, mixed_precision="bf16" if bf16 else "no"
    )
    unet, text_encoder = build_models()
    opt_unet = torch.optim.AdamW(unet.parameters(), lr=LR, weight_decay=0.0)
    opt_text = torch.optim.AdamW(text_encoder.parameters(), lr=LR, weight_decay=0.0)
    accelerator.state.select_deepspeed_plugin("unet")
    unet, opt_unet = accelerator.prepare(unet, opt_unet)  # Accelerate + DeepSpeed: one model per prepare()
    accelerator.state.select_deepspeed_plugin("text_encoder")
    text_encoder, opt_text = accelerator.prepare(text_encoder, opt_text)

    graphzero.accelerate.enable(accelerator)  # the one added line

    step = torch.compile(diffusion_loss, backend="graphzero", options=options)
    history = {"loss": [], "clip_grad_norm": []}
    for t in range(steps):
        total = torch.zeros(())
        for micro in range(gas):
            batch = micro_batch(t, micro, rank, gas, dtype)
            with accelerator.accumulate(unet, text_encoder):
                loss = step(text_encoder, unet, **batch)
                accelerator.backward(loss)  # one plain backward: graphzero reduces both engines
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(
                        list(unet.parameters()) + list(text_encoder.parameters()), CLIP
                    )
                    history["clip_grad_norm"].append(norm)
                    if on_boundary is not None:
                        on_boundary(t, {"unet": unet, "text_encoder": text_encoder})
                opt_unet.step()
                opt_text.step()  # each steps its own engine, once per accumulation window
                opt_unet.zero_grad()
                opt_text.zero_grad()
            total += loss.detach().float().cpu() / gas
        dist.all_reduce(total)
        history["loss"].append(float(total) / world)
        log(f"step {t}: loss {history['loss'][-1]:.5f}  |grad| (unet + text encoder) {history['clip_grad_norm'][-1]:.5f}")
    graphzero.accelerate.disable(accelerator)
    return history


class Reference:
    """Single-process training of the same models: the loss is the mean over ranks and
    micro-batches, each model clipped by its own global norm (DeepSpeed clips per engine), torch
    AdamW. fp32 (from the bf16-rounded weights when ``bf16``)."""

    def __init__(self, bf16: bool = False) -> None:
        unet, text_encoder = build_models()
        if bf16:
            unet, text_encoder = unet.bfloat16().float(), text_encoder.bfloat16().float()
        self.models = {"unet": unet, "text_encoder": text_encoder}
        self.opts = {k: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0) for k, m in self.models.items()}
        self.bf16 = bf16

    def accumulate(self, t: int, world: int, gas: int) -> None:
        for micro in range(gas):
            for r in range(world):
                batch = micro_batch(t, micro, r, gas, torch.bfloat16 if self.bf16 else torch.float32)
                batch["noisy"] = batch["noisy"].float()
                loss = diffusion_loss(self.models["text_encoder"], self.models["unet"], **batch)
                (loss / (world * gas)).backward()

    def grads(self, name: str) -> list[torch.Tensor]:
        return [p.grad.detach().clone() for p in self.models[name].parameters()]

    def norm(self, name: str) -> float:
        return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in self.grads(name)])))

    def step(self) -> dict[str, float]:
        norms = {}
        for k, m in self.models.items():
            norms[k] = float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP))
            self.opts[k].step()
            self.opts[k].zero_grad(set_to_none=True)
        return norms

    def copy(self) -> Reference:
        return copy.deepcopy(self)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    parser.add_argument(
        "--gas",
        type=int,
        default=int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")),
        help="gradient accumulation steps (default: the launch config's, else 2)",
    )
    stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
    parser.add_argument("--unet-zero-stage", type=int, default=stage)
    parser.add_argument("--text-encoder-zero-stage", type=int, default=None,
                        help="default: $GRAPHZERO_TEXT_ENCODER_ZERO_STAGE, else the UNet's")
    parser.add_argument("--bf16", action="store_true", help="bf16 engines with fp32 gradient accumulation")
    args = parser.parse_args()
    text_stage = args.text_encoder_zero_stage
    if text_stage is None and "GRAPHZERO_TEXT_ENCODER_ZERO_STAGE" in os.environ:
        text_stage = int(os.environ["GRAPHZERO_TEXT_ENCODER_ZERO_STAGE"])

    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"world size {dist.get_world_size()}, UNet ZeRO-{args.unet_zero_stage}, text encoder "
        f"ZeRO-{text_stage if text_stage is not None else args.unet_zero_stage}, gas {args.gas}, "
        f"{'bf16' if args.bf16 else 'fp32'}", flush=True)
    history = train(args.unet_zero_stage, text_stage, steps=args.steps, gas=args.gas, bf16=args.bf16, log=say)
    say(f"loss {history['loss'][0]:.5f} -> {history['loss'][-1]:.5f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
