"""Distillation with two DeepSpeed engines: a frozen GPT-2-shaped teacher (ZeRO-3, no optimizer) and
a student (the whole model, or LoRA adapters with ``--lora``; ZeRO-2 or 3; gradient checkpointing),
trained on the reverse KL between their next-token distributions, 2 micro-steps per optimizer step:

    torchrun --nproc_per_node 2 examples/distill.py                      # student ZeRO-3
    torchrun --nproc_per_node 2 examples/distill.py --zero-stage 2       # student ZeRO-2 (teacher ZeRO-3)
    torchrun --nproc_per_node 2 examples/distill.py --lora               # student = LoRA adapters over its base
    torchrun --nproc_per_node 2 examples/distill.py --offload            # the teacher's parameters on the CPU
    accelerate launch --config_file examples/accelerate_configs/distill.yaml examples/distill.py

graphzero's added line is the backend of ``torch.compile``:

    step = torch.compile(distill_loss, backend="graphzero", options={"engines": {"student": s, "teacher": t}})

The teacher has no optimizer, so graphzero attaches it frozen: its ZeRO-3 gathers run inside the
compiled step next to the student's (prefetched in one schedule, released after their last use),
it gets no gradient, and nothing of either engine stays gathered after a backward. Tiny models built
from a config (no downloads); CPU runs use gloo (``DS_ACCELERATOR=cpu`` is set when there is no GPU).
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

LR, CLIP = 1e-3, 1.0
VOCAB, BATCH, SEQ, GAS = 64, 2, 8, 2


def gpt2_config(layers: int):
    from transformers import GPT2Config

    # no dropout: a reference replays the same loss
    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=layers, n_head=2, initializer_range=0.2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                      bos_token_id=None, eos_token_id=None)


def build_models(seed: int = 0, lora: bool = False) -> dict[str, torch.nn.Module]:
    """teacher (3 layers, frozen) and student (2 layers, gradient checkpointing); the same on every rank."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    teacher = GPT2LMHeadModel(gpt2_config(3)).requires_grad_(False).eval()
    student = GPT2LMHeadModel(gpt2_config(2))
    if lora:
        from peft import LoraConfig, get_peft_model

        student = get_peft_model(student, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                                     init_lora_weights="gaussian"))
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        # For PEFT models HF also makes the embeddings' output require grad (reentrant checkpointing
        # needs it, non-reentrant does not); its forward hook calling requires_grad_() would break
        # the compiled graph.
        student.base_model.model.disable_input_require_grads()
    student.train()
    return {"teacher": teacher, "student": student}


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask with right padding of different lengths."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, SEQ - 2:] = 0
    return ids, mask


def distill_loss(student, teacher, ids, mask):
    """Reverse KL(student || teacher) per token, averaged over the unpadded tokens."""
    logits = student(input_ids=ids, attention_mask=mask).logits.float()
    with torch.no_grad():
        target = teacher(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
    log_p = logits.log_softmax(-1)
    kl = (log_p.exp() * (log_p - target)).sum(-1)
    return (kl * mask).sum() / mask.sum()


def ds_config(stage: int, trained: bool, offload: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": GAS if trained else 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
    }
    if offload:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if trained:
        cfg["gradient_clipping"] = CLIP
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}
    return cfg


def engines(models: dict, stage: int, offload: bool = False) -> dict:
    """The student at ``stage`` with its optimizer; the teacher at ZeRO-3 without one (its
    parameters on the CPU with ``offload``)."""
    import deepspeed

    student = models["student"]
    params = [p for p in student.parameters() if p.requires_grad]
    s, *_ = deepspeed.initialize(model=student, model_parameters=params, config=ds_config(stage, True))
    t, *_ = deepspeed.initialize(model=models["teacher"], config=ds_config(3, False, offload))
    return {"student": s, "teacher": t}


def train(stage: int = 3, *, steps: int = 3, lora: bool = False, offload: bool = False, on_micro=None,
          on_boundary=None, log=print) -> list[float]:
    """``steps`` optimizer steps of GAS micro-steps each. ``on_micro(t, m, engines)`` runs after each
    backward, ``on_boundary(t, engines)`` before each optimizer step (tests)."""
    import torch.distributed as dist

    import graphzero

    rank, world = dist.get_rank(), dist.get_world_size()
    eng = engines(build_models(lora=lora), stage, offload)
    step = torch.compile(distill_loss, backend="graphzero", options={"engines": eng})
    losses = []
    for t in range(steps):
        total = torch.zeros(1)
        for m in range(GAS):
            loss = step(eng["student"], eng["teacher"], *batch(t, m, rank))
            loss.backward()
            total += loss.detach().float()
            if on_micro is not None:
                on_micro(t, m, eng)
            if m == GAS - 1 and on_boundary is not None:
                on_boundary(t, eng)
            eng["student"].step()   # DeepSpeed steps at the accumulation boundary
        dist.all_reduce(total)
        losses.append(float(total) / (world * GAS))
        log(f"step {t}: reverse KL {losses[-1]:.5f}  |grad| {float(eng['student'].get_global_grad_norm()):.4f}")
    for e in eng.values():
        graphzero.detach(e)
    return losses


def plugin(stage: int, trained: bool, offload: bool = False):
    """One Accelerate DeepSpeed plugin (keyword arguments, then the rest on its dict, as in
    diffusers_text_encoder.py: a launch config's deepspeed_config and a plugin's own file exclude
    each other)."""
    from accelerate.utils import DeepSpeedPlugin

    p = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=GAS, gradient_clipping=CLIP if trained else None)
    cfg = p.deepspeed_config
    cfg.pop("train_batch_size", None)   # DeepSpeed derives it from its real world size
    cfg["train_micro_batch_size_per_gpu"] = BATCH
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if offload:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return p


def train_accelerate(stage: int = 3, *, steps: int = 3, lora: bool = False, offload: bool = False,
                     on_boundary=None, log=print) -> list[float]:
    """The same training under HF Accelerate: one Accelerator, a DeepSpeed plugin per model, the
    teacher prepared without an optimizer; ``graphzero.accelerate.enable`` attaches it frozen."""
    import torch.distributed as dist
    from accelerate import Accelerator

    import graphzero.accelerate

    rank, world = dist.get_rank(), dist.get_world_size()
    accelerator = Accelerator(deepspeed_plugins={"student": plugin(stage, True), "teacher": plugin(3, False, offload)},
                              gradient_accumulation_steps=GAS)
    models = build_models(lora=lora)
    opt = torch.optim.AdamW([p for p in models["student"].parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    accelerator.state.select_deepspeed_plugin("student")
    student, opt = accelerator.prepare(models["student"], opt)   # Accelerate + DeepSpeed: one model per prepare()
    accelerator.state.select_deepspeed_plugin("teacher")
    teacher = accelerator.prepare(models["teacher"])
    graphzero.accelerate.enable(accelerator)   # the one added line
    step = torch.compile(distill_loss, backend="graphzero")
    losses = []
    for t in range(steps):
        total = torch.zeros(1)
        for m in range(GAS):
            with accelerator.accumulate(student):
                loss = step(student, teacher, *batch(t, m, rank))
                accelerator.backward(loss)
                total += loss.detach().float()
                if accelerator.sync_gradients and on_boundary is not None:
                    on_boundary(t, {"student": student, "teacher": teacher})
                opt.step()
                opt.zero_grad()
        dist.all_reduce(total)
        losses.append(float(total) / (world * GAS))
        log(f"step {t}: reverse KL {losses[-1]:.5f}  |grad| {float(student.get_global_grad_norm()):.4f}")
    graphzero.accelerate.disable(accelerator)
    return losses


class Reference:
    """Single-process distillation over every rank's micro-batches: the mean loss, clipped, AdamW."""

    def __init__(self, lora: bool = False) -> None:
        self.models = build_models(lora=lora)
        self.params = [p for p in self.models["student"].parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.0)

    def accumulate(self, t: int, world: int) -> None:
        for m in range(GAS):
            for r in range(world):
                loss = distill_loss(self.models["student"], self.models["teacher"], *batch(t, m, r))
                (loss / (world * GAS)).backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    launched = "ACCELERATE_DEEPSPEED_ZERO_STAGE" in os.environ   # under accelerate launch --config_file ...
    parser.add_argument("--zero-stage", type=int, choices=(2, 3),
                        default=int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")),
                        help="the student's ZeRO stage (default: the launch config's, else 3)")
    parser.add_argument("--lora", action="store_true", help="the student is LoRA adapters (peft) over a frozen base")
    parser.add_argument("--offload", action="store_true",
                        help="the teacher's parameters on the CPU (offload_param; CPU ranks only so far)")
    args = parser.parse_args()
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    say(f"world size {dist.get_world_size()}, student ZeRO-{args.zero_stage}{' LoRA' if args.lora else ''}, "
        f"teacher ZeRO-3 frozen{', parameters offloaded' if args.offload else ''}"
        f"{', under accelerate launch' if launched else ''}", flush=True)
    run = train_accelerate if launched else train
    losses = run(args.zero_stage, steps=args.steps, lora=args.lora, offload=args.offload, log=say)
    say(f"reverse KL {losses[0]:.5f} -> {losses[-1]:.5f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
