"""transformers' Trainer under graphzero in one line (``graphzero.hf.enable(trainer)``), against the
same Trainer on DeepSpeed eager: a tiny GPT-2 built from a config, 2 gloo ranks, the Trainer's own
loop (its 1/gas and ``scale_wrt_gas=False``, ``max_grad_norm`` clipping, the logged ``grad_norm``
and ``loss``, its LR scheduler), 5 optimizer steps; the parameters after training within 1e-4,
each step's logged grad_norm within 1e-4 relative and loss within 1e-4 relative or 1e-6 (the
distillation loss is a KL of about 4e-3, whose forward rounds differently through graphzero's
gathers); a frozen ZeRO-3 engine held by the
trainer (TRL's ``ref_model`` shape, built with ``deepspeed.initialize`` by the trainer, parameters
left requiring grad) attached frozen and read in the compiled loss; after ``train()`` every engine is
DeepSpeed's again.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from suite_sample import sample

import graphzero
from scenario_utils import rank_world

STEPS = 5


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide (see test_zero3.py).
    yield
    ranks.close()


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def dataset(rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(7 + rank)
    ids = torch.randint(0, 64, (64, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def ds_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "steps_per_print": 10**9, "wall_clock_breakdown": False}


def distill_trainer_class():
    from transformers import Trainer

    class WithReference(Trainer):
        """TRL's shape: a second model the trainer prepares itself as a DeepSpeed engine without an
        optimizer (trl/models/utils.py prepare_deepspeed), read under no_grad in compute_loss."""

        def __init__(self, *args, ref_model, **kwargs):
            super().__init__(*args, **kwargs)
            import deepspeed
            cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                   "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9}
            self.ref_model, *_ = deepspeed.initialize(model=ref_model, config=cfg)
            self.ref_model.eval()

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(input_ids=inputs["input_ids"])
            with torch.no_grad():
                ref = self.ref_model(input_ids=inputs["input_ids"]).logits
            logp = F.log_softmax(out.logits, -1)
            return F.kl_div(logp, F.log_softmax(ref, -1), log_target=True, reduction="batchmean")

    return WithReference


def run_trainer(trainer, under_graphzero: bool) -> dict:
    """Train (under graphzero or DeepSpeed eager); the trained parameters gathered, each logged step's
    (loss, grad_norm, learning_rate), the graphs and breaks Dynamo counted."""
    import deepspeed

    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    if under_graphzero:
        graphzero.hf.enable(trainer)
    trainer.train()
    engine = trainer.model_wrapped
    assert graphzero.deepspeed_adapter.binding_of(engine) is None   # given back at on_train_end
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        final = [p.detach().clone() for p in params]
    logs = [(entry["loss"], entry["grad_norm"], entry["learning_rate"])
            for entry in trainer.state.log_history if "loss" in entry]
    reset_accelerate()
    return {"params": final, "logs": logs, "graphs": counters["stats"]["unique_graphs"],
            "breaks": {k[:160]: v for k, v in counters["graph_break"].items()},
            "global_step": trainer.state.global_step}


def train_scenario(under_graphzero: bool, stage: int, gas: int, with_reference: bool, out: str) -> dict:
    from transformers import Trainer, TrainingArguments

    rank, _ = rank_world()
    reset_accelerate()
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    with torch.no_grad():   # the reference differs from the start
        for p in reference.parameters():
            p.mul_(0.9)
    args = TrainingArguments(
        output_dir=f"{out}/{'gz' if under_graphzero else 'ds'}", per_device_train_batch_size=2,
        gradient_accumulation_steps=gas, max_steps=STEPS, learning_rate=1e-3, warmup_steps=2,
        lr_scheduler_type="linear", max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[],
        deepspeed=ds_config(stage), seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
        use_cpu=True)
    kwargs = {"ref_model": reference} if with_reference else {}
    cls = distill_trainer_class() if with_reference else Trainer
    trainer = cls(model=model, args=args, train_dataset=dataset(rank), **kwargs)
    result = run_trainer(trainer, under_graphzero)
    if with_reference:
        assert graphzero.deepspeed_adapter.binding_of(trainer.ref_model) is None
    return result


def assert_same_runs(eager: list[dict], mine: list[dict]) -> None:
    """Per rank: STEPS optimizer steps on both sides; each logged loss, grad_norm and learning rate;
    the parameters after training within 1e-4; the loss ran compiled."""
    for rank, (e, g) in enumerate(zip(eager, mine)):
        assert e["global_step"] == g["global_step"] == STEPS
        assert len(g["logs"]) == STEPS, g["logs"]
        for t, (le, lg) in enumerate(zip(e["logs"], g["logs"])):
            assert lg[0] == pytest.approx(le[0], rel=1e-4, abs=1e-6), f"rank {rank} step {t} loss"
            assert lg[1] == pytest.approx(le[1], rel=1e-4), f"rank {rank} step {t} grad_norm"
            assert lg[2] == le[2], f"rank {rank} step {t} learning rate"
        for i, (a, b) in enumerate(zip(g["params"], e["params"])):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, i=i, rank=rank: f"rank {rank} param {i}: {m}")
        assert g["graphs"] >= 1


@pytest.mark.parametrize("stage,gas,with_reference", [(2, 2, False), (3, 1, True)],
                         ids=["zero2-gas2", "zero3-frozen-reference"])
def test_trainer_same_as_deepspeed_eager(ranks, tmp_path, stage, gas, with_reference):
    eager = ranks.run(train_scenario, False, stage, gas, with_reference, str(tmp_path))
    mine = ranks.run(train_scenario, True, stage, gas, with_reference, str(tmp_path))
    assert_same_runs(eager, mine)
    for g in mine:
        if with_reference:   # the trained and the frozen engine in one graph, the reference's gathers in it
            assert (g["graphs"], g["breaks"]) == (1, {}), g


def tiny_tokenizer(directory: str):
    """A word-level tokenizer built in code (no hub), saved and loaded as a user's would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return fast


def preference_data(n: int = 32):
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)

    def text(k: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 61, (k,), generator=g))

    return Dataset.from_list([{"prompt": text(4), "chosen": text(3), "rejected": text(3)} for _ in range(n)])


def trl_args(config_cls, under_graphzero: bool, stage: int, gas: int, out: str, **extra):
    """A TRL config with TRL's defaults but fp32 (TRL's bf16 at ZeRO-3 is refused for now)."""
    return config_cls(
        output_dir=f"{out}/{'gz' if under_graphzero else 'ds'}", per_device_train_batch_size=2,
        gradient_accumulation_steps=gas, max_steps=STEPS, learning_rate=1e-3, max_grad_norm=0.5, logging_steps=1,
        save_strategy="no", report_to=[], deepspeed=ds_config(stage), seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0, use_cpu=True, bf16=False, **extra)


def dpo_scenario(under_graphzero: bool, stage: int, gas: int, out: str) -> dict:
    from transformers import PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    reset_accelerate()
    (path,) = saved_models(out, "model")   # TRL loads its reference from the policy's path, as from the hub
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    args = trl_args(DPOConfig, under_graphzero, stage, gas, out, beta=0.1)
    trainer = DPOTrainer(model=path, args=args, train_dataset=preference_data(), processing_class=tokenizer)
    return run_trainer(trainer, under_graphzero)


def prompts(n: int = 32):
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    return Dataset.from_list([{"prompt": " ".join(f"w{int(i)}" for i in torch.randint(0, 61, (4,), generator=g))}
                              for _ in range(n)])


def saved_models(out: str, *names: str) -> list[str]:
    """Tiny GPT-2s (the k-th with its weights x 0.9**k) and the tokenizer saved under ``out``, as from the hub; rank 0 writes."""
    paths = [f"{out}/{name}" for name in names]
    if rank_world()[0] == 0:
        for k, path in enumerate(paths):
            if not os.path.exists(f"{path}/config.json"):
                tokenizer = tiny_tokenizer(path)
                model = tiny_gpt2()
                with torch.no_grad():   # the k-th differs from the first
                    for p in model.parameters():
                        p.mul_(0.9**k)
                model.config.pad_token_id = tokenizer.pad_token_id
                model.config.eos_token_id = tokenizer.eos_token_id
                model.save_pretrained(path)
    dist.barrier()
    return paths


def distillation_scenario(under_graphzero: bool, stage: int, gas: int, out: str) -> dict:
    from transformers import PreTrainedTokenizerFast
    from trl import DistillationConfig, DistillationTrainer

    reset_accelerate()
    student, teacher = saved_models(out, "student", "teacher")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(student)
    args = trl_args(DistillationConfig, under_graphzero, stage, gas, out, max_completion_length=4)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=prompts(),
                                  processing_class=tokenizer)
    return run_trainer(trainer, under_graphzero)


def grpo_scenario(under_graphzero: bool, stage: int, gas: int, out: str) -> dict:
    from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    reset_accelerate()
    (policy,) = saved_models(out, "policy")
    reward = f"{out}/reward"
    if rank_world()[0] == 0 and not os.path.exists(f"{reward}/config.json"):
        tiny_tokenizer(reward)
        torch.manual_seed(1)
        GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                                 num_labels=1, pad_token_id=0)).save_pretrained(reward)
    dist.barrier()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(policy)
    args = trl_args(GRPOConfig, under_graphzero, stage, gas, out, max_completion_length=4, num_generations=2,
                    beta=0.04)
    trainer = GRPOTrainer(model=policy, reward_funcs=[reward], args=args, train_dataset=prompts(),
                          processing_class=tokenizer)
    return run_trainer(trainer, under_graphzero)


TRL_SCENARIOS = {"dpo": dpo_scenario, "distillation": distillation_scenario, "grpo": grpo_scenario}


@pytest.mark.parametrize("kind", sample(TRL_SCENARIOS, default=["dpo"]))
def test_trl_trainer_same_as_deepspeed_eager(ranks, tmp_path, kind):
    """TRL's trainers with their defaults (gradient checkpointing on, ds3_gather_for_generation=True,
    their own ZeRO-3 reference, teacher and reward engines) but fp32, ZeRO-3 policy, gas 2:
    DPOTrainer (reference loaded by TRL from the policy's path); DistillationTrainer (on-policy: the
    student generates between steps; a ZeRO-3 teacher); GRPOTrainer with a reward model and a KL
    reference (beta 0.04), completions generated between steps."""
    eager = ranks.run(TRL_SCENARIOS[kind], False, 3, 2, str(tmp_path))
    mine = ranks.run(TRL_SCENARIOS[kind], True, 3, 2, str(tmp_path))
    assert_same_runs(eager, mine)
    for rank, g in enumerate(mine):
        print(f"{kind} rank {rank}: {g['graphs']} graphs, breaks {g['breaks']}")
