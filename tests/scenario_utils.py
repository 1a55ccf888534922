"""What the multi-rank scenarios share: models, DeepSpeed configs, data, the reference trainer,
and a counter proving DeepSpeed's own reduction paths stayed idle.

The reference is plain single-process PyTorch: the loss is the mean of every rank's loss on that
rank's data, gradients are averaged over gradient-accumulation micro-batches, each model is
clipped by its own global norm (DeepSpeed clips per engine), and the optimizer is torch AdamW with
DeepSpeed's hyperparameters.
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

LR = 1e-2
# fp32 tolerances against the reference: the reduction order differs; Adam amplifies near-zero
# gradients a little in the parameters.
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-4, "atol": 1e-5}


def gan_loss(models, z, real):
    """The GAN loss of most scenarios: the discriminator called twice in one loss."""
    gen, disc = models["gen"], models["disc"]
    return -disc(gen(z)).mean() + disc(real).mean()


def two_engine_loss(models, x, with_critic: bool):
    """Actor, plus the critic where with_critic (rank-dependent in the rank-agreement tests)."""
    loss = models["actor"](x).square().mean()
    if with_critic:  # rank-dependent Python: a different graph on one rank
        loss = loss + models["critic"](x).square().mean()
    return loss


def mlp(width_in: int, hidden: int, width_out: int, depth: int = 2) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(width_in, hidden), nn.GELU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(hidden, hidden), nn.GELU()]
    layers.append(nn.Linear(hidden, width_out))
    return nn.Sequential(*layers)


def ds_config(stage: int, *, gas: int = 1, dtype: str = "fp32", clip: float = 1.0, micro_batch: int = 4,
              bucket: int | None = None, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "timers": {"throughput": {"enabled": False}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bucket is not None:
        cfg["zero_optimization"]["reduce_bucket_size"] = bucket
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    cfg.update(extra)
    return cfg


def engine(model: nn.Module, config: dict):
    import deepspeed
    eng, *_ = deepspeed.initialize(model=model, config=config,
                                   model_parameters=[p for p in model.parameters() if p.requires_grad])
    return eng


def rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def data(step: int, rank: int, *shapes: Sequence[int], dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


class Reference:
    """Single-process copies of the models, trained the way DeepSpeed defines it."""

    def __init__(self, models: dict[str, nn.Module], clip: float = 1.0, dtype=torch.float32) -> None:
        self.models = {k: copy.deepcopy(m).to(dtype) for k, m in models.items()}
        self.opts = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
                     for k, m in self.models.items()}
        self.clip = clip
        self.norms: dict[str, float] = {}

    def accumulate(self, loss_fn: Callable[..., torch.Tensor], per_rank_inputs: list[list[torch.Tensor]],
                   gas: int = 1) -> None:
        """Add d(mean over ranks of loss)/gas to .grad."""
        world = len(per_rank_inputs)
        for inputs in per_rank_inputs:
            (loss_fn(self.models, *inputs) / (world * gas)).backward()

    def grads(self, name: str) -> list[torch.Tensor]:
        """Zeros for a parameter no loss reached (DeepSpeed's flat gradient holds zeros there)."""
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for p in self.models[name].parameters() if p.requires_grad]

    def step(self) -> None:
        for k, m in self.models.items():
            params = [p for p in m.parameters() if p.requires_grad and p.grad is not None]
            if self.clip > 0:
                self.norms[k] = float(torch.nn.utils.clip_grad_norm_(params, self.clip))
            self.opts[k].step()
            self.opts[k].zero_grad(set_to_none=True)


def clone_models(**models: nn.Module) -> dict[str, nn.Module]:
    return {k: copy.deepcopy(m) for k, m in models.items()}


REDUCTION_METHODS = ("average_tensor", "reduce_ipg_grads", "reduce_independent_p_g_buckets_and_remove_grads",
                     "reduce_gradients", "overlapping_partition_gradients_reduce_epilogue",
                     "buffered_allreduce_fallback", "allreduce_gradients", "allreduce_bucket")


class ReductionCounter:
    """Counts calls of DeepSpeed's own gradient-reduction methods on the given engines."""

    def __init__(self, *engines) -> None:
        self.calls: dict[str, int] = {}
        for eng in engines:
            for owner in (eng, eng.optimizer):
                for name in REDUCTION_METHODS:
                    if hasattr(owner, name):
                        self._wrap(owner, name, f"{type(owner).__name__}.{name}")

    def _wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.calls[label] = self.calls.get(label, 0) + 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def full_grads(eng) -> list[torch.Tensor]:
    """Every trainable parameter's averaged gradient as DeepSpeed reports it (collective)."""
    from deepspeed.utils import safe_get_full_grad
    return [safe_get_full_grad(p).float().clone() for p in eng.module.parameters() if p.requires_grad]


def full_params(eng) -> list[torch.Tensor]:
    """Every parameter at full shape (collective for ZeRO-3: DeepSpeed's GatheredParameters)."""
    import deepspeed
    params = list(eng.module.parameters())
    if eng.zero_optimization_stage() != 3:
        return [p.detach().float().clone() for p in params]
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def assert_params_close(eng, ref_model: nn.Module, *, rtol: float, atol: float, what: str) -> None:
    for (name, p), q in zip(eng.module.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{what}: parameter {name}: {m}")


def assert_grads_close(actual: list[torch.Tensor], expected: list[torch.Tensor], *, rtol: float, atol: float,
                       what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} grads vs {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e.float(), rtol=rtol, atol=atol, msg=lambda m, i=i: f"{what}: grad {i}: {m}")


def gan_engines(stage: int) -> tuple[dict, Reference]:
    """The small GAN (gen 8->16->8, disc 8->16->1, seed 0) as two DeepSpeed engines at ``stage``
    (ZeRO-3 with every parameter partitioned), attached to graphzero, and its reference."""
    import graphzero
    torch.manual_seed(0)
    models = {"gen": mlp(8, 16, 8), "disc": mlp(8, 16, 1)}
    ref = Reference(models)
    cfg = ds_config(stage)
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engines = {name: engine(m, cfg) for name, m in models.items()}
    graphzero.attach(**engines)
    return engines, ref


def check_gan_step(engines: dict, ref: Reference, t: int) -> None:
    """After step ``t``'s backward of ``gan_loss`` through ``engines``: the reference takes the same
    step over every rank's data, each engine's full gradients must match it, the engines step, and
    their gradient norms must match the reference's."""
    rank, world = rank_world()
    ref.accumulate(gan_loss, [data(t, r, (4, 8), (4, 8)) for r in range(world)])
    for name, eng in engines.items():
        assert_grads_close(full_grads(eng), ref.grads(name), **GRAD_TOL, what=f"rank {rank} step {t} {name}")
        eng.step()
    ref.step()
    for name, eng in engines.items():
        torch.testing.assert_close(float(eng.get_global_grad_norm()), ref.norms[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"step {t} {name} gradient norm: {m}")


def assert_no_full_grads(*engines) -> None:
    for eng in engines:
        for name, p in eng.module.named_parameters():
            assert p.grad is None, f"owned parameter {name} holds a full .grad after backward"


def compiled_graph_count(fn: Callable, *args) -> tuple[int, int]:
    """(graphs, graph breaks) Dynamo produces for one call of the compiled ``fn`` from a clean cache."""
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    fn(*args)
    return counters["stats"]["unique_graphs"], int(sum(counters["graph_break"].values()))


def assert_rel_l2_close(actual: list[torch.Tensor], expected: list[torch.Tensor], *, tol: float, what: str) -> None:
    """Per tensor, ||actual - expected|| <= tol * ||expected||: the bf16 criterion (elementwise
    bounds trip on a few near-zero elements, while a wrong scale or a missing rank is >= 50%)."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} tensors vs {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        a, e = a.float(), e.float()
        err = float((a - e).norm() / e.norm().clamp_min(1e-12))
        ratio = float((a * e).sum() / (e * e).sum().clamp_min(1e-30))
        assert err <= tol, f"{what}: tensor {i}: relative L2 error {err:.3g} > {tol} (projection ratio {ratio:.3g})"
