"""DeepSpeed's own unit tests of an engine's gradient path, ported to run twice on the same ranks:
once through DeepSpeed eager (``engine.backward(loss); engine.step()``), once through graphzero
(``torch.compile(forward, backend=graphzero.backend(model=engine))``, plain ``loss.backward()``,
``engine.step()``), from the same seed, data and config, compared step by step.

Upstream: github.com/deepspeedai/DeepSpeed, tests/unit (``Case.upstream`` names file::Class[params]).
The models are small re-implementations of upstream's (SimpleModel, AlbertLikeModel, the
EltwiseMultiplication networks, ...); nothing here imports DeepSpeed's test tree.

What is compared (``Twin``): the loss of every micro-step; every trainable parameter's full
gradient at each accumulation boundary (``safe_get_full_grad``, both sides); after each
``step()`` the gradient norm (``get_global_grad_norm``), the fp32 master parameters
(``safe_get_full_fp32_param``) and the module's parameters (gathered at ZeRO-3). Where upstream
asserts values (analytic gradients, expected activations, step counts), those are asserted too.

Tolerances. fp32: the two sides do the same arithmetic in a different reduction order, so
gradients, norms and parameters agree to rtol 1e-5 / atol 1e-6 (``FP32``). bf16: each forward
and backward runs in bf16 on both sides, but graphzero's compiled graph (inductor) fuses and
rounds differently from eager, so the sides drift apart by about bf16's own rounding; compared by
relative L2 per tensor (``BF16_REL``), set from the graphzero-vs-eager distances each scenario
reports (``Twin.worst``: losses 0.4-0.75%, i.e. about one bf16 ulp; gradients up to 1.6%; see
docs/reliability.md, "DeepSpeed parity suite"); a wrong scale or a missing rank is >= 50%.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16_REL = 2e-2          # relative L2 per tensor, graphzero vs eager, bf16 gradients and parameters
BF16_NORM_RTOL = 2e-2
UP = "tests/unit/v1/zero/test_zero.py"
UP_BF16 = "tests/unit/v1/half_precision/test_bf16.py"
UP_CKPT = "tests/unit/checkpoint/test_zero_optimizer.py"
UP_INIT = "tests/unit/runtime/test_ds_initialize.py"
UP_CLIP = "tests/unit/runtime/zero/test_zero_grad_clip.py"
UP_UNUSED = "tests/unit/runtime/zero/test_ignore_unused_parameters.py"


# -- upstream's models (tests/unit/simple_model.py, test_zero.py) ---------------------------------
class SimpleModel(nn.Module):
    def __init__(self, hidden_dim: int, empty_grad: bool = False, nlayers: int = 1) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        if empty_grad:
            self.linear2 = nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        return self.cross_entropy_loss(x, y)


class UnusedParametersModel(SimpleModel):
    def __init__(self, hidden_dim: int) -> None:
        super().__init__(hidden_dim)
        self.unused_linear = nn.Linear(hidden_dim, hidden_dim)


class AlbertLikeModel(nn.Module):
    """TestZero3RepeatForwardLoop: one layer run three times (a stack of forwards, then of backwards)."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        hidden = x
        for _ in range(3):
            hidden = hidden + self.linear(hidden)
        return self.cross_entropy_loss(hidden, y)


class ToFP32Model(nn.Module):
    """TestZeroToFP32: 4 layers of 3x3 (+ a 4->1 classifier in the one-group variant: 53 elements,
    uneven over the ranks), the first frozen where ``freeze``."""

    def __init__(self, n_layers: int, freeze: bool, classifier: bool) -> None:
        super().__init__()
        self.ll = nn.ModuleList(nn.Linear(3, 3) for _ in range(n_layers))
        if classifier:
            self.classifier = nn.Linear(4, 1)
        self.cross_entropy_loss = nn.CrossEntropyLoss()
        if freeze:
            self.ll[0].weight.requires_grad = False
            self.ll[0].bias.requires_grad = False

    def forward(self, x, y):
        hidden = x
        for layer in self.ll:
            hidden = layer(hidden)
        return self.cross_entropy_loss(hidden, y)


class Eltwise(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return self.weight * x


class EltwiseNet(nn.Module):
    """EltwiseMultiplicationTestNetwork_{Dict,NamedTuple,namedtuple,Tuple,List}: three elementwise
    layers and an L1Loss(reduction="none"), returning the activations in the given container.
    Upstream's ``_assert_partition_status`` checks inside forward test DeepSpeed's parameter
    coordinator (which graphzero replaces by in-graph gathers) and are left out."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layer1, self.layer2, self.layer3 = (Eltwise(nn.Parameter(torch.zeros(3, 5))) for _ in range(3))
        self.loss = nn.L1Loss(reduction="none")

    def forward(self, x, y):
        h1 = self.layer1(x)
        h2 = self.layer2(h1)
        y_hat = self.layer3(h2)
        loss = self.loss(y_hat, y)
        out = {"hidden1": h1, "hidden2": h2, "y_hat": y_hat, "loss": loss}
        if self.kind == "Dict":
            return out
        if self.kind == "NamedTuple":
            return EltwiseNamedTuple(**out)
        if self.kind == "namedtuple":
            return Eltwise_namedtuple(**out)
        if self.kind == "Tuple":
            return (h1, h2, y_hat, loss)
        return [h1, h2, y_hat, loss]


class EltwiseNamedTuple(NamedTuple):
    hidden1: torch.Tensor
    hidden2: torch.Tensor
    y_hat: torch.Tensor
    loss: torch.Tensor


Eltwise_namedtuple = collections.namedtuple("Eltwise_namedtuple", ["hidden1", "hidden2", "y_hat", "loss"])


def eltwise_outputs(out) -> dict:
    if isinstance(out, dict):
        return out
    if hasattr(out, "_asdict"):
        return out._asdict()
    return dict(zip(("hidden1", "hidden2", "y_hat", "loss"), out))


class LargeParamModel(nn.Module):
    """TestZero3ParamPartitioningLargeParam: one 8100-element parameter, initialised on rank 0 only
    (each rank's future partition filled with that rank's index)."""

    def __init__(self, size: int = 8100) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.zeros(size))
        if dist.get_rank() == 0:
            part = math.ceil(size / dist.get_world_size())
            with torch.no_grad():
                for r in range(dist.get_world_size()):
                    self.param[r * part:(r + 1) * part].fill_(r)

    def forward(self, x):
        return x * self.param


class ReturnsModel(nn.Module):
    """TestZero3DictFwd (``return_type``) and TestZeroFrozenWeights (``frozen``: l1, relu, frozen l2)."""

    def __init__(self, hidden_dim: int, return_type: str = "tuple", frozen: bool = False) -> None:
        super().__init__()
        self.return_type, self.frozen = return_type, frozen
        self.l1 = nn.Linear(hidden_dim, hidden_dim)
        if frozen:
            self.act = nn.ReLU()
            self.l2 = nn.Linear(hidden_dim, hidden_dim)
            self.l2.weight.requires_grad = False
            self.l2.bias.requires_grad = False
        self.cel = nn.CrossEntropyLoss()

    def forward(self, x, y):
        x = self.l1(x)
        if self.frozen:
            x = self.l2(self.act(x))
        loss = self.cel(x, y)
        if self.return_type == "dict":
            return {"a": x, "loss": loss, "b": 1, "c": None}
        if self.return_type == "list":
            return [x, loss]
        return (x, loss)


class LinearLoss(nn.Module):
    """TestGradientAllreduceOp: loss = weight . inputs, weight starting at zero."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))

    def forward(self, inputs):
        return (self.weight * inputs).sum()


class ScaleModel(nn.Module):
    """TestBF16OptimizerGradReduction: loss = (weight * x).sum(), weight starting at one."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (self.weight * x).sum()


# -- configs, data ------------------------------------------------------------------------------
def config(stage: int, *, micro: int = 2, gas: int = 1, dtype: str = "bf16", lr: float = 1e-3, optimizer: bool = True,
           clip: float | None = None, **zero) -> dict:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                           "steps_per_print": 10**9, "zero_optimization": {"stage": stage, **zero}}
    if optimizer:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": lr}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
        if stage == 3:   # graphzero refuses ZeRO-3 bf16 with bf16 gradient accumulation (docs/reliability.md)
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if clip is not None:
        cfg["gradient_clipping"] = clip
    return cfg


def torch_dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "bf16" else torch.float32


def batch(i: int, micro: int, hidden: int, dtype: torch.dtype, rank: int | None = None) -> tuple:
    """upstream's random_dataloader: x ~ N(0, 1), y uniform in [0, hidden); per rank and micro-step."""
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(7919 * i + rank)
    x = torch.randn(micro, hidden, generator=g).to(dtype)
    y = torch.randint(0, hidden, (micro,), generator=g)
    return x, y


# -- cases --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    id: str
    upstream: str
    model: Callable[[], nn.Module]
    cfg: dict
    drive: Callable[[Twin], None] | None = None   # default: train()
    zero_init: bool = False
    hidden: int = 4
    steps: int = 3
    params: Callable[[nn.Module], Any] | None = None    # model_parameters (param groups)
    client_optimizer: Callable[[Any], Any] | None = None
    before_micro: Callable[[nn.Module, int], None] | None = None   # on each side's module, before micro-step i
    loss_of: Callable[[Any], torch.Tensor] = lambda out: out
    xfail: str | None = None
    default: bool = False
    seed: int = 0

    @property
    def dtype(self) -> str:
        return "bf16" if self.cfg.get("bf16", {}).get("enabled") else "fp32"

    @property
    def stage(self) -> int:
        return self.cfg["zero_optimization"]["stage"]


class Twin:
    """Two engines from the same seed and config: ``eager`` (DeepSpeed alone) and ``gz`` (graphzero)."""

    def __init__(self, case: Case) -> None:
        import deepspeed

        import graphzero
        self.case = case
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # bf16 compute, or bf16 communication of fp32 gradients: rounding differs by an ulp
        self.bf16 = case.dtype == "bf16" or case.cfg.get("communication_data_type") == "bf16"
        self.dtype = torch_dtype(case.dtype)
        self.worst: dict[str, float] = collections.defaultdict(float)
        self.micro = 0       # micro-steps run (the data index)
        self.steps = 0       # optimizer steps compared
        engines = []
        for _ in range(2):
            torch.manual_seed(case.seed)
            with deepspeed.zero.Init(config_dict_or_path=case.cfg, enabled=case.zero_init, mem_efficient_linear=False):
                model = case.model()
            kwargs: dict[str, Any] = {}
            params = case.params(model) if case.params else [p for p in model.parameters()]
            if case.client_optimizer is not None:
                kwargs["optimizer"] = case.client_optimizer(params)
            eng, *_ = deepspeed.initialize(model=model, config=dict(case.cfg), model_parameters=params, **kwargs)
            engines.append(eng)
        self.eager, self.gz = engines
        # compared at each boundary: what trains at the start, also while a drive switches it off
        # (TestZeroUnbalancedGradients' parameter without a gradient in the boundary micro-step)
        self.trainable = [n for n, p in self.eager.module.named_parameters() if p.requires_grad]
        # outside every optimizer group: a plain .grad no step zeroes, so it accumulates over the run
        # (TestEmptyParameterGroup); in bf16 each boundary's increment is compared, since a sum that
        # cancels (|2.6| + 2.0 -> 0.65) magnifies the one-ulp difference of each increment
        grouped = grouped_ids(self.eager)
        self.accumulating = [] if grouped is None else [
            n for n, p in self.eager.module.named_parameters() if p.requires_grad and id(p) not in grouped]
        self._last_grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grad_scale: dict[str, float] = {}
        self.forward = torch.compile(_engine_forward, backend=graphzero.backend(model=self.gz))

    # -- running ------------------------------------------------------------------------------
    def sides(self):
        return (("eager", self.eager), ("graphzero", self.gz))

    def each(self, fn: Callable[[Any], Any]) -> list:
        return [fn(eng) for _, eng in self.sides()]

    def backward(self, *inputs, check: Callable[[dict], None] | None = None) -> tuple:
        """One micro-step on both sides; returns (eager outputs, graphzero outputs)."""
        if self.case.before_micro is not None:
            for _, eng in self.sides():
                self.case.before_micro(eng.module, self.micro)
        out_e = self.eager(*inputs)
        self.eager.backward(self.case.loss_of(out_e))
        out_g = self.forward(self.gz, *inputs)
        loss_g = self.case.loss_of(out_g)
        loss_g.backward()
        self.compare([self.case.loss_of(out_e).detach()], [loss_g.detach()], f"micro {self.micro} loss")
        self.micro += 1
        return out_e, out_g

    def step(self) -> None:
        before = self.eager.global_steps
        for _, eng in self.sides():
            eng.step()
        assert self.gz.global_steps == self.eager.global_steps, \
            f"global_steps: graphzero {self.gz.global_steps} vs eager {self.eager.global_steps}"
        if self.eager.global_steps != before:
            self.check_step()

    def check_step(self, norm: Callable[[Any], Any] = lambda eng: eng.get_global_grad_norm()) -> None:
        what = f"after optimizer step {self.steps}"
        ne, ng = float(norm(self.eager)), float(norm(self.gz))
        rtol = BF16_NORM_RTOL if self.bf16 else FP32["rtol"]
        err = abs(ng - ne) / max(abs(ne), 1e-12)
        self.worst["norm"] = max(self.worst["norm"], err)
        assert math.isfinite(ne) and abs(ng - ne) <= rtol * abs(ne) + 1e-6, \
            f"{what}: gradient norm graphzero {ng!r} vs eager {ne!r} (relative {err:.3g})"
        self.compare(fp32_params(self.eager), fp32_params(self.gz), f"{what} fp32 master", key="master")
        self.compare(module_params(self.eager), module_params(self.gz), f"{what} module parameter", key="param")
        self.steps += 1

    def check_grads(self, expected: dict[str, torch.Tensor] | None = None) -> None:
        """Full gradients at the boundary: eager vs graphzero (and vs upstream's expected values)."""
        ge, gg = full_grads(self.eager, self.trainable), full_grads(self.gz, self.trainable)
        assert list(ge) == list(gg), f"micro {self.micro}: gradients of {list(ge)} vs {list(gg)}"
        for name in ge:
            assert (ge[name] is None) == (gg[name] is None), \
                f"micro {self.micro}: {name}: eager grad {_desc(ge[name])}, graphzero grad {_desc(gg[name])}"
        names = [n for n in ge if ge[n] is not None]
        ce, cg = dict(ge), dict(gg)
        if self.bf16:
            for n in self.accumulating:
                if ge.get(n) is not None:
                    last_e, last_g = self._last_grads.get(n, (0, 0))
                    self._last_grads[n] = (ge[n], gg[n])
                    ce[n], cg[n] = ge[n] - last_e, gg[n] - last_g
        # bf16: relative to the largest gradient this tensor had so far, not only to this one: a
        # gradient summed over a batch that nearly cancels (|0.2| where it was |3|) magnifies one bf16
        # ulp per element to 5%; a wrong scale or a missing rank still shows at the first boundary
        for n in names:
            self._grad_scale[n] = max(self._grad_scale.get(n, 0.0), float(ce[n].norm()))
        self.compare([ce[n] for n in names], [cg[n] for n in names], f"micro {self.micro} grad", names=names, key="grad",
                     scales=[self._grad_scale[n] for n in names])
        for name, want in (expected or {}).items():
            for side, grads in (("eager", ge), ("graphzero", gg)):
                torch.testing.assert_close(grads[name], want.float(), rtol=0, atol=0,
                                           msg=lambda m, s=side, n=name: f"micro {self.micro} {s} {n} vs upstream: {m}")

    def compare(self, eager: list, gz: list, what: str, names: list[str] | None = None, key: str = "loss",
                scales: list[float] | None = None) -> None:
        """fp32: elementwise (FP32). bf16: relative L2 per tensor, relative to ``scales[i]`` where given
        (the larger of it and the eager tensor's norm)."""
        assert len(eager) == len(gz), f"{what}: {len(eager)} vs {len(gz)} tensors"
        for i, (a, b) in enumerate(zip(eager, gz)):
            name = names[i] if names else str(i)
            a, b = a.float(), b.float()
            diff = float((b - a).norm())
            scale = max(float(a.norm()), scales[i] if scales else 0.0)
            rel = diff / max(scale, 1e-12)
            self.worst[key] = max(self.worst[key], rel if scale > 1e-6 else diff)
            if self.bf16:
                assert rel <= BF16_REL or diff <= 1e-6, \
                    f"rank {self.rank} {what} {name}: relative L2 {rel:.3g} > {BF16_REL} (|eager| {float(a.norm()):.4g}, scale {scale:.4g})"
            else:
                torch.testing.assert_close(b, a, **FP32, msg=lambda m, n=name: f"rank {self.rank} {what} {n}: {m}")

    def report(self) -> dict:
        return {"worst": dict(self.worst), "steps": self.steps}


def _engine_forward(engine, *inputs):
    return engine(*inputs)


def _desc(t) -> str:
    return "None" if t is None else f"norm {float(t.float().norm()):.4g}"


def full_grads(eng, names: list[str]) -> dict[str, torch.Tensor | None]:
    from deepspeed.utils import safe_get_full_grad
    out = {}
    for name, p in eng.module.named_parameters():
        if name in names:
            g = safe_get_full_grad(p)
            out[name] = None if g is None else g.detach().float().clone()
    return out


def grouped_ids(eng) -> set[int] | None:
    """ids of the parameters in the engine's optimizer groups (None: the optimizer does not say)."""
    groups = getattr(eng.optimizer, "fp16_groups", None) or getattr(eng.optimizer, "bit16_groups", None)
    return None if groups is None else {id(p) for group in groups for p in group}


def fp32_params(eng) -> list[torch.Tensor]:
    """The fp32 master of every trainable parameter in an optimizer group (DeepSpeed keeps none for
    one outside every group: its ``safe_get_full_fp32_param`` raises ``KeyError`` at ZeRO-3, on
    either side; module_params compares those)."""
    from deepspeed.utils import safe_get_full_fp32_param
    grouped = grouped_ids(eng)
    out = []
    for p in eng.module.parameters():
        if p.requires_grad and (grouped is None or id(p) in grouped):
            q = safe_get_full_fp32_param(p)
            out.append(p.detach().float().clone() if q is None else q.detach().float().clone())
    return out


def module_params(eng) -> list[torch.Tensor]:
    import deepspeed
    params = list(eng.module.parameters())
    if eng.zero_optimization_stage() != 3:
        return [p.detach().float().clone() for p in params]
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


# -- drives: what one upstream test does, on both sides ------------------------------------------
def train(twin: Twin) -> None:
    """upstream's loop (forward, ``backward``, ``step`` per batch) for ``case.steps`` optimizer steps."""
    case, gas = twin.case, twin.eager.gradient_accumulation_steps()
    micro = twin.eager.train_micro_batch_size_per_gpu()
    for _ in range(case.steps * gas):
        twin.backward(*batch(twin.micro, micro, case.hidden, twin.dtype))
        if twin.eager.is_gradient_accumulation_boundary():
            twin.check_grads()
        twin.step()


def drop_some_gradients(module: nn.Module, i: int) -> None:
    """TestZeroUnbalancedGradients: before batch i, every other parameter trains (alternating)."""
    odd = (i + 1) % 2
    for k, p in enumerate(module.parameters()):
        p.requires_grad = (k % 2) == odd


def train_unbalanced(twin: Twin) -> None:
    try:
        train(twin)
    finally:
        for _, eng in twin.sides():
            for p in eng.module.parameters():
                p.requires_grad = True


def eltwise_drive(zero_grad: bool) -> Callable[[Twin], None]:
    """TestZero3ParamPartitioningBase._test: shards set to (i+1)*(1+rank) (here: the full weights,
    before initialize), three forward/backward on ones without a step (gradients accumulate unless
    ``zero_grad``), activations and gradients against upstream's numbers, ``optimizer.step()``;
    then three ordinary steps."""

    def drive(twin: Twin) -> None:
        x = torch.ones(3, 5, dtype=twin.dtype)
        expected = {"hidden1": [[1] * 5, [1, 1, 1, 2, 2], [2] * 5], "hidden2": [[2] * 5, [2, 2, 2, 8, 8], [8] * 5],
                    "y_hat": [[6] * 5, [6, 6, 6, 48, 48], [48] * 5], "loss": [[5] * 5, [5, 5, 5, 47, 47], [47] * 5]}
        for it in range(3):
            out_e, out_g = twin.backward(x, x)
            for side, out in (("eager", out_e), ("graphzero", out_g)):
                got = eltwise_outputs(out)
                for k, want in expected.items():
                    torch.testing.assert_close(got[k].float(), torch.tensor(want, dtype=torch.float32), rtol=0, atol=0,
                                               msg=lambda m, s=side, k=k, it=it: f"iteration {it} {s} {k}: {m}")
            mult = 1 if zero_grad else it + 1
            want = {f"layer{k}.weight": mult * torch.tensor([v] * 8 + [w] * 7, dtype=torch.float32).view(3, 5)
                    for k, v, w in ((3, 2, 8), (2, 3, 12), (1, 6, 24))}
            twin.check_grads(want)
            if zero_grad:
                twin.each(lambda e: e.optimizer.zero_grad())
        twin.each(lambda e: e.optimizer.step())
        twin.check_step(norm=lambda e: e.optimizer._global_grad_norm)   # engine.step() was not called
        assert twin.eager.optimizer._global_grad_norm != 0.0
        for _ in range(3):
            twin.backward(x, x)
            twin.check_grads()
            twin.step()

    return drive


def eltwise_model(kind: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = EltwiseNet(kind)
        with torch.no_grad():   # upstream: rank r's shard of weight i is (i+1)*(1+r); 15 elements -> 8 + 7
            for i, layer in enumerate((model.layer1, model.layer2, model.layer3)):
                layer.weight.view(-1)[:8] = i + 1
                layer.weight.view(-1)[8:] = 2 * (i + 1)
        return model
    return make


def large_param_drive(twin: Twin) -> None:
    """TestZero3ParamPartitioningLargeParam: three forward/backward + ``allreduce_gradients()``
    without a step; activations equal each partition's rank; gradients accumulate to (it+1)*1; then
    three ordinary steps."""
    size = 8100
    part = math.ceil(size / twin.world)
    x = torch.ones(size, dtype=torch.float16)
    for it in range(3):
        out_e, out_g = twin.backward(x)
        for side, act in (("eager", out_e), ("graphzero", out_g)):
            for r in range(twin.world):
                chunk = act[r * part:(r + 1) * part].float()
                torch.testing.assert_close(chunk, torch.full_like(chunk, r), msg=lambda m, s=side: f"{s}: {m}")
        twin.each(lambda e: e.allreduce_gradients())
        twin.check_grads({"param": torch.full((size,), float(it + 1))})
    for _ in range(3):
        twin.step()
        twin.backward(x)
        twin.check_grads()


def boundary_drive(twin: Twin) -> None:
    """TestBF16OptimizerGradReduction::test_boundary_microbatch_grad_is_reduced: two micro-steps with
    ``set_gradient_accumulation_boundary`` set by hand; the boundary gradient is the mean over ranks
    and micro-steps ([15, 17, 19, 21] for upstream's inputs); three steps (inputs shifted by 2 per step)."""
    for t in range(3):
        inputs = [torch.tensor(v, dtype=torch.float32) + 18 * twin.rank + 2 * t for v in ([1, 3, 5, 7], [11, 13, 15, 17])]
        for i, x in enumerate(inputs):
            last = i == len(inputs) - 1
            twin.each(lambda e, b=last: e.set_gradient_accumulation_boundary(b))
            twin.backward(x.to(torch.bfloat16))
        twin.check_grads({"weight": torch.tensor([15.0, 17, 19, 21]) + 2 * t})
        twin.step()
    # upstream reads BF16_Optimizer's flat fp32 gradient after the boundary: the eager side's was
    # the expected mean above (check_grads); graphzero's engine keeps the same buffer.


def allreduce_op_drive(twin: Twin) -> None:
    """TestGradientAllreduceOp (mean): SGD lr 1 from zero, inputs [1, 2]: after n steps weight = -n*inputs."""
    x = torch.tensor([1.0, 2.0])
    for t in range(3):
        twin.backward(x)
        twin.check_grads({"weight": x})
        twin.step()
        for side, eng in twin.sides():
            torch.testing.assert_close(eng.module.weight.detach(), -(t + 1) * x, msg=lambda m, s=side: f"{s}: {m}")


def allreduce_training_drive(twin: Twin) -> None:
    """TestGradientAllreduceOpTraining (mean side): SimpleModel(32, nlayers=2), 5 steps of AdamW,
    global batches split over the ranks (seed 999 + step)."""
    hidden, micro = 32, 4
    for step in range(5):
        g = torch.Generator().manual_seed(999 + step)
        gx = torch.randn(twin.world * micro, hidden, generator=g)
        gy = torch.randint(0, hidden, (twin.world * micro,), generator=g)
        s = twin.rank * micro
        twin.backward(gx[s:s + micro], gy[s:s + micro])
        twin.check_grads()
        twin.step()


def step_count_drive(twin: Twin) -> None:
    """TestZeroAdamOptimizerStepCount: every sub-group's Adam state has taken global_steps steps."""
    assert all(e.global_steps == 0 for e in (twin.eager, twin.gz))
    train(twin)
    for side, eng in twin.sides():
        opt = eng.optimizer
        if eng.zero_optimization_stage() == 3:
            counts = [opt.optimizer.state[opt.fp32_partitioned_groups_flat[i]]["step"] for i in range(len(opt.fp16_groups))]
        else:
            inner = getattr(opt, "optimizer", opt)
            counts = [inner.state[p]["step"] for g in inner.param_groups for p in g["params"]]
        counts = [int(c) for c in counts]
        assert counts and all(c == counts[0] for c in counts), f"{side}: step counts {counts}"
        assert eng.global_steps == counts[0] == twin.case.steps, f"{side}: global_steps {eng.global_steps}, {counts}"


def switch_modes_drive(twin: Twin) -> None:
    """TestZero3SwitchModes: train (2 steps of gas 2), then eval under no_grad, three times."""
    case = twin.case
    micro = twin.eager.train_micro_batch_size_per_gpu()
    for _ in range(3):
        for _, eng in twin.sides():
            eng.train()
        for _ in range(2 * twin.eager.gradient_accumulation_steps()):
            twin.backward(*batch(twin.micro, micro, case.hidden, twin.dtype))
            if twin.eager.is_gradient_accumulation_boundary():
                twin.check_grads()
            twin.step()
        outs = []
        for _, eng in twin.sides():
            eng.eval()
            with torch.no_grad():
                outs.append([eng(*batch(100 + k, micro, case.hidden, twin.dtype)).detach() for k in range(2)])
        twin.compare(outs[0], outs[1], "eval loss")


def partition_cache_drive(twin: Twin) -> None:
    """TestZeroPartitionCache[training=True]: train, ``empty_partition_cache()`` (the module's
    parameters then hold no elements), and train on."""
    train(twin)
    for side, eng in twin.sides():
        eng.empty_partition_cache()
        assert sum(p.numel() for p in eng.module.parameters()) == 0, f"{side}: parameters still hold elements"
    train(twin)


def grad_clip_drive(twin: Twin) -> None:
    """TestZeroGradClip[bf16-0.05-none]: between backward and step, every local gradient is clamped
    to +-0.05 with safe_get_local_grad / safe_set_local_grad; the norm DeepSpeed reports drops."""
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad
    g = torch.Generator().manual_seed(1670 + twin.rank)
    for t in range(3):
        x = torch.randn(8, 10, generator=g).to(twin.dtype)
        y = torch.randn(8, 10, generator=g).to(twin.dtype)
        twin.backward(x, y)
        pre = []
        for _, eng in twin.sides():
            pre.append(float(torch.linalg.vector_norm(torch.stack(eng.optimizer._get_norm_groups()))))
            for p in eng.module.parameters():
                grad = safe_get_local_grad(p)
                assert grad is not None
                safe_set_local_grad(p, torch.clamp(grad, -0.05, 0.05))
        twin.check_grads()
        twin.step()
        for (side, eng), before in zip(twin.sides(), pre):
            assert float(eng.get_global_grad_norm()) <= before, f"{side}: norm did not drop ({before})"


def checkpoint_drive(load_optimizer_states: bool = True, load_module_only: bool = False,
                     zero_to_fp32: bool = False) -> Callable[[Twin], None]:
    """TestZeROCheckpoint / TestZeroToFP32: train, save each side's checkpoint, train on, load it
    back (parameters equal the saved ones), train on comparing; optionally zero_to_fp32 equals the
    saved parameters."""

    def drive(twin: Twin) -> None:
        import deepspeed
        train(twin)
        paths = [tempfile.mkdtemp(prefix="graphzero-parity-") if twin.rank == 0 else None for _ in range(2)]
        dist.broadcast_object_list(paths, src=0)
        saved = []
        for (_, eng), path in zip(twin.sides(), paths):
            eng.save_checkpoint(path, tag="t")
            saved.append(module_params(eng))
        dist.barrier()
        if zero_to_fp32:
            from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
            for (side, eng), path, before in zip(twin.sides(), paths, saved):
                params = list(eng.module.parameters())
                with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=eng.zero_optimization_stage() == 3):
                    state = load_state_dict_from_zero_checkpoint(eng.module, path).state_dict()
                names = [n for n, _ in eng.module.named_parameters()]
                for n, b in zip(names, before):
                    torch.testing.assert_close(state[n].float(), b, rtol=0, atol=0,
                                               msg=lambda m, s=side, n=n: f"{s} zero_to_fp32 {n}: {m}")
        train(twin)
        loaded = []
        for (_, eng), path in zip(twin.sides(), paths):
            eng.load_checkpoint(path, tag="t", load_optimizer_states=load_optimizer_states,
                                load_module_only=load_module_only)
            loaded.append(module_params(eng))
        # Each side's parameters after the load against what it saved: graphzero's no further off
        # than eager's (DeepSpeed's load_module_only at ZeRO-3 bf16 itself comes back 1 ulp off).
        for i, (e, g, se, sg) in enumerate(zip(*loaded, *saved)):
            de, dg = float((e - se).abs().max()), float((g - sg).abs().max())
            assert dg <= de, f"after load, param {i}: graphzero {dg:.3g} from its saved values, eager {de:.3g}"
        twin.compare(loaded[0], loaded[1], "after load, module parameter", key="param")
        train(twin)

    return drive


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def two_groups(model: nn.Module) -> list[dict]:
    return [{"params": [m.weight for m in model.ll], "weight_decay": 0.01},
            {"params": [m.bias for m in model.ll], "weight_decay": 0.0}]


def sgd_tofp32(params):
    return torch.optim.SGD(params, lr=0.1)


def empty_group_params(empty_weight_group: bool) -> Callable[[nn.Module], list]:
    def groups(model: nn.Module) -> list[dict]:
        ws, bs = [m.weight for m in model.linears], [m.bias for m in model.linears]
        return [{"params": [] if empty_weight_group else ws, "weight_decay": 0.01},
                {"params": bs if empty_weight_group else [], "weight_decay": 0.0}]
    return groups


def adamw(params):
    return torch.optim.AdamW(params, lr=0.1)


def second(out):
    return out["loss"] if isinstance(out, dict) else out[1]


def eltwise_loss(out):
    return eltwise_outputs(out)["loss"].sum()


def _cases() -> list[Case]:
    cases: list[Case] = []
    # TestZeroUnbalancedGradients (upstream: world 1, bf16 on a bf16-capable accelerator)
    for stage in (1, 2, 3):
        for dtype in ("bf16", "fp32"):
            cases.append(Case(
                f"TestZeroUnbalancedGradients-z{stage}-{dtype}", f"{UP}::TestZeroUnbalancedGradients[zero_stage={stage}]",
                lambda: SimpleModel(4), config(stage, gas=2, dtype=dtype), drive=train_unbalanced,
                before_micro=drop_some_gradients,
                xfail=("DeepSpeed eager 0.19.8's ZeRO-3 is wrong here from the second accumulation window on: it "
                       "adds a parameter's gradient onto the previous window's when its first gradient of the window "
                       "comes after micro-step 0 (its partitions are copied into at micro-step 0 only); graphzero "
                       "agrees with eager at the first boundary and with plain PyTorch at every one "
                       "(test_deepspeed_parity_zero.py::test_upstream_alternating_pattern_matches_plain_pytorch_at_zero3)")
                if stage == 3 else None,
                default=(stage, dtype) == (1, "bf16")))
    # TestZero3RepeatForwardLoop[mics_enabled=False] (+ the same loop at ZeRO-1/2)
    for stage in (3, 1, 2):
        for dtype in ("bf16", "fp32"):
            cases.append(Case(
                f"TestZero3RepeatForwardLoop-z{stage}-{dtype}", f"{UP}::TestZero3RepeatForwardLoop[mics_enabled=False]"
                + ("" if stage == 3 else f" (at ZeRO-{stage})"),
                lambda: AlbertLikeModel(4), config(stage, gas=2, dtype=dtype, stage3_param_persistence_threshold=0),
                default=(stage, dtype) == (3, "bf16")))
    # TestZeroToFP32 (stage 2, 3 x freeze_params; zero_to_fp32 of each side's checkpoint)
    for stage in (2, 3):
        for freeze in (True, False):
            cases.append(Case(
                f"TestZeroToFP32-1group-z{stage}-freeze{freeze}",
                f"{UP}::TestZeroToFP32::test_1_param_group[freeze_params={freeze}-zero_stage={stage}]",
                lambda f=freeze: ToFP32Model(4, f, classifier=True),
                config(stage, gas=2, stage3_param_persistence_threshold=0), hidden=3,
                drive=checkpoint_drive(zero_to_fp32=True), steps=2))
            cases.append(Case(
                f"TestZeroToFP32-2groups-z{stage}-freeze{freeze}",
                f"{UP}::TestZeroToFP32::test_2_param_groups[freeze_params={freeze}-zero_stage={stage}]",
                lambda f=freeze: ToFP32Model(4, f, classifier=False),
                {**config(stage, gas=2, optimizer=False, stage3_param_persistence_threshold=0),
                 "zero_allow_untested_optimizer": True}, hidden=3,
                params=two_groups, client_optimizer=sgd_tofp32, drive=checkpoint_drive(zero_to_fp32=True), steps=2))
    # TestIncorectAllgatherBucketSize[1000] (1001 fails in deepspeed.initialize: not a gradient path)
    cases.append(Case("TestIncorectAllgatherBucketSize-1000", f"{UP}::TestIncorectAllgatherBucketSize[1000]",
                      lambda: SimpleModel(4), config(2, gas=2, allgather_bucket_size=1000)))
    # TestPartitionNcclAlignment's config (its assertion is on DeepSpeed's buffers; trained here)
    cases.append(Case("TestPartitionNcclAlignment-z2", f"{UP}::TestPartitionNcclAlignment",
                      lambda: SimpleModel(4), config(2, gas=2)))
    # TestZero3ParamPartitioningBase: upstream's default is prefetching=False
    # (stage3_prefetch_bucket_size 0, which graphzero refuses); the other parameters run with
    # prefetching on, so that they test what they name.
    base = {"contiguous_gradients": False, "prefetching": True, "reduce_scatter": False, "threshold": 0,
            "zero_grad": False, "kind": "Dict"}
    variants = ([("test_param_persistence_threshold", "threshold", v) for v in (0, 10)]
                + [("test_contiguous_gradients", "contiguous_gradients", v) for v in (True, False)]
                + [("test_zero_grad", "zero_grad", v) for v in (True, False)]
                + [("test_prefetching", "prefetching", v) for v in (True, False)]
                + [("test_reduce_scatter", "reduce_scatter", v) for v in (True, False)]
                + [("test_model_class", "kind", v) for v in ("Dict", "NamedTuple", "namedtuple", "Tuple", "List")]
                + [("test_fp16_enabled", "fp16", False)])
    for test, key, value in variants:
        p = {**base, key: value}
        upstream_param = {"threshold": "param_persistence_threshold", "kind": "model_class",
                          "fp16": "fp16_enabled"}.get(key, key)
        shown = f"EltwiseMultiplicationTestNetwork_{value}" if key == "kind" else value
        cfg = config(3, micro=1, lr=1.0, stage3_max_reuse_distance=0,
                     stage3_param_persistence_threshold=p["threshold"], contiguous_gradients=p["contiguous_gradients"],
                     stage3_prefetch_bucket_size=45 if p["prefetching"] else 0, reduce_scatter=p["reduce_scatter"])
        cases.append(Case(
            f"TestZero3ParamPartitioningBase-{test}-{value}",
            f"{UP}::TestZero3ParamPartitioningBase::{test}[{upstream_param}={shown}]"
            + ("" if key == "prefetching" else " (with prefetching=True)"),
            eltwise_model(p["kind"]), cfg, drive=eltwise_drive(p["zero_grad"]), loss_of=eltwise_loss,
            default=(test, value) == ("test_model_class", "NamedTuple")))
    # TestZero3ParamPartitioningLargeParam[init_context_manager x reduce_scatter]
    for init in (True, False):
        for rs in (True, False):
            cases.append(Case(
                f"TestZero3ParamPartitioningLargeParam-init{init}-rs{rs}",
                f"{UP}::TestZero3ParamPartitioningLargeParam[reduce_scatter={rs}-init_context_manager={init}]",
                LargeParamModel, config(3, micro=1, lr=1.0, stage3_max_reuse_distance=0, contiguous_gradients=True,
                                        overlap_comm=True, reduce_scatter=rs),
                zero_init=init, drive=large_param_drive, loss_of=lambda a: a.sum()))
    # TestZero3DictFwd[return_type]
    for rt in ("tuple", "list", "dict"):
        cases.append(Case(f"TestZero3DictFwd-{rt}", f"{UP}::TestZero3DictFwd[{rt}]",
                          lambda rt=rt: ReturnsModel(10, rt), config(3, micro=2), hidden=10, zero_init=True,
                          loss_of=second))
    # TestZeroFrozenWeights[zero_stage]
    for stage in (1, 2, 3):
        cases.append(Case(f"TestZeroFrozenWeights-z{stage}", f"{UP}::TestZeroFrozenWeights[zero_stage={stage}]",
                          lambda: ReturnsModel(10, frozen=True), config(stage, micro=2, lr=1e-4), hidden=10,
                          zero_init=stage == 3, loss_of=second))
    # TestZeroAdamOptimizerStepCount[zero_stage] (sub_group_size 4: many ZeRO-3 sub-groups)
    # In fp32: in bf16 the 12-layer residual stack's small bias gradients (norm 0.0127) drift 5-6%
    # (relative L2) between inductor's and eager's bf16 rounding by the third step, on every stage.
    for stage in (1, 2, 3):
        cases.append(Case(f"TestZeroAdamOptimizerStepCount-z{stage}", f"{UP}::TestZeroAdamOptimizerStepCount[zero_stage={stage}] (fp32)",
                          lambda: SimpleModel(4, nlayers=12),
                          config(stage, gas=2, dtype="fp32", stage3_param_persistence_threshold=0, sub_group_size=4),
                          drive=step_count_drive))
    # TestZeroPartitionCache[training=True] (training=False has no gradient path)
    cases.append(Case("TestZeroPartitionCache-training", f"{UP}::TestZeroPartitionCache[training=True]",
                      lambda: SimpleModel(10), {**config(3, micro=1, stage3_param_persistence_threshold=10),
                                                "optimizer": {"type": "Adam"}},
                      hidden=10, zero_init=True, drive=partition_cache_drive, steps=2))
    # TestEmptyParameterGroup[dtype x empty_weight_group x use_client_optimizer] (fp16 refused), trained
    for dtype in ("bf16", "fp32"):   # upstream: bf16 and fp16 (refused); fp32 added
        for empty_w in (True, False):
            for client in (True, False):
                cfg = config(3, micro=1, dtype=dtype, optimizer=False, stage3_param_persistence_threshold=0)
                if not client:
                    cfg["optimizer"] = {"type": "adamw"}
                cases.append(Case(
                    f"TestEmptyParameterGroup-{dtype}-emptyweight{empty_w}-client{client}",
                    f"{UP}::TestEmptyParameterGroup::test_empty_param_groups[{dtype}-{empty_w}-{client}]",
                    lambda: SimpleModel(4, nlayers=4), cfg, params=empty_group_params(empty_w),
                    client_optimizer=adamw if client else None))
    # TestZero3SwitchModes[prefetch_ratio]
    for ratio in (0.0, 0.5, 1.0):
        cases.append(Case(f"TestZero3SwitchModes-{ratio}", f"{UP}::TestZero3SwitchModes[{ratio}]",
                          lambda: SimpleModel(10), config(3, gas=2, stage3_prefetch_bucket_size=int(110 * ratio)),
                          hidden=10, drive=switch_modes_drive))
    # TestGradientAllreduceOp (mean; "sum" and stage 0 are refused)
    for stage in (1, 2):
        for rs, cg, pre, div in ((True, True, False, 1.0), (False, True, False, 2.0), (False, False, True, 1.0)):
            cases.append(Case(
                f"TestGradientAllreduceOp-z{stage}-rs{rs}-cg{cg}-pre{pre}-div{div:g}",
                f"{UP}::TestGradientAllreduceOp[{rs}-{cg}-{pre}-{div}-mean-1.0-{stage}]",
                LinearLoss, {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
                             "zero_allow_untested_optimizer": True, "gradient_allreduce_op": "mean",
                             "prescale_gradients": pre, "gradient_predivide_factor": div, "steps_per_print": 10**9,
                             "zero_optimization": {"stage": stage, "reduce_scatter": rs, "contiguous_gradients": cg}},
                client_optimizer=sgd, drive=allreduce_op_drive))
    # TestGradientAllreduceOpTraining[adamw-zero1/2] (the mean engine; Muon needs fp16)
    for stage in (1, 2):
        cases.append(Case(
            f"TestGradientAllreduceOpTraining-adamw-zero{stage}", f"{UP}::TestGradientAllreduceOpTraining[adamw-zero{stage}]",
            lambda: SimpleModel(32, nlayers=2),
            {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 10**9,
             "gradient_allreduce_op": "mean",
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
             "zero_optimization": {"stage": stage, "contiguous_gradients": True, "reduce_scatter": True}},
            drive=allreduce_training_drive, seed=1234, default=stage == 2))
    # TestBF16OptimizerGradReduction::test_boundary_microbatch_grad_is_reduced
    cases.append(Case(
        "TestBF16OptimizerGradReduction-boundary", f"{UP}::TestBF16OptimizerGradReduction::test_boundary_microbatch_grad_is_reduced",
        ScaleModel, {**config(1, micro=1, gas=2), "bf16": {"enabled": True, "immediate_grad_update": False},
                     "data_types": {"grad_accum_dtype": "fp32"}}, drive=boundary_drive))
    # half_precision/test_bf16.py
    for name, cfg in (("TestAdamBF16ZeroOneCycleCompatibility", {**config(2, micro=1, lr=0.00015), "scheduler": {
                          "type": "OneCycle", "params": {
                              "cycle_first_step_size": 16000, "cycle_first_stair_count": 8000, "decay_step_size": 16000,
                              "cycle_min_lr": 1e-06, "cycle_max_lr": 3e-05, "decay_lr_rate": 1e-07,
                              "cycle_min_mom": 0.85, "cycle_max_mom": 0.99, "decay_mom_rate": 0.0}}}),
                      ("TestZero2ReduceScatterOff", config(2, micro=2, lr=0.00015, clip=1.0, contiguous_gradients=True,
                                                           allgather_bucket_size=2000000000, reduce_bucket_size=200000000,
                                                           overlap_comm=False, reduce_scatter=False))):
        cases.append(Case(name, f"{UP_BF16}::{name}", lambda: SimpleModel(10), cfg, hidden=10))
    cases.append(Case("TestZeroEmptyGrad", f"{UP_BF16}::TestZeroEmptyGrad", lambda: SimpleModel(10),
                      config(2, micro=1, optimizer=False), hidden=10, client_optimizer=torch.optim.Adam))
    cases.append(Case("TestZeroSupportedClientOptimizer-Adam", f"{UP_BF16}::TestZeroSupportedClientOptimizer[Adam]",
                      lambda: SimpleModel(10), config(2, micro=2, optimizer=False), hidden=10,
                      client_optimizer=torch.optim.Adam))
    for comp in ("bf16", "fp32"):
        for comm in ("bf16", "default"):
            cfg = config(2, micro=2, dtype=comp, optimizer=False)
            if comm != "default":
                cfg["communication_data_type"] = comm
            cases.append(Case(f"TestZeroDtypeCocktail-{comp}-{comm}", f"{UP_BF16}::TestZeroDtypeCocktail[{comm}-{comp}]",
                              lambda: SimpleModel(10), cfg, hidden=10, client_optimizer=torch.optim.Adam,
                              default=(comp, comm) == ("fp32", "bf16")))
    # checkpoint/test_zero_optimizer.py::TestZeROCheckpoint (no offload)
    ckpt_cfg = {"optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.8, 0.999], "eps": 1e-8,
                                                         "weight_decay": 3e-7}}}
    for stage in (1, 2, 3):
        for test, drive in (("test_load_optimizer_state", checkpoint_drive(True)),
                            ("test_not_load_optimizer_state", checkpoint_drive(False)),
                            ("test_load_module_only", checkpoint_drive(load_module_only=True))):
            cases.append(Case(f"TestZeROCheckpoint-{test}-z{stage}", f"{UP_CKPT}::TestZeROCheckpoint::{test}[{stage}-False-Adam]",
                              lambda: SimpleModel(10), {**config(stage, micro=1), **ckpt_cfg}, hidden=10,
                              zero_init=stage == 3, drive=drive, steps=2,
                              default=(test, stage) == ("test_load_optimizer_state", 2)))
    # runtime/test_ds_initialize.py::TestClientOptimizer / TestConfigOptimizer (trained)
    cases.append(Case("TestClientOptimizer-Optimizer", f"{UP_INIT}::TestClientOptimizer[Optimizer]",
                      lambda: SimpleModel(10), {**config(1, micro=1, dtype="fp32", optimizer=False),
                                                "zero_allow_untested_optimizer": True},
                      hidden=10, client_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)))
    for client_params in (True, False):
        cases.append(Case(f"TestConfigOptimizer-client_parameters{client_params}",
                          f"{UP_INIT}::TestConfigOptimizer[{client_params}] (at ZeRO-1)",
                          lambda: SimpleModel(10), config(1, micro=1, dtype="fp32"), hidden=10,
                          params=None if client_params else (lambda m: list(m.parameters()))))
    # runtime/zero/test_zero_grad_clip.py::TestZeroGradClip[bf16-0.05-none]
    cases.append(Case("TestZeroGradClip-bf16-none", f"{UP_CLIP}::TestZeroGradClip[bf16-0.05-none]",
                      lambda: SimpleModel(10), config(3, micro=8, lr=1e-4, clip=1.0, contiguous_gradients=True,
                                                      overlap_comm=False),
                      hidden=10, drive=grad_clip_drive))
    # runtime/zero/test_ignore_unused_parameters.py, without cpu_offload (refused)
    cases.append(Case("TestStage2IgnoreUnusedParameters-True", f"{UP_UNUSED}::TestStage2IgnoreUnusedParameters[True] (no offload)",
                      lambda: UnusedParametersModel(4), config(2, gas=2, ignore_unused_parameters=True)))
    return cases


CASES: dict[str, Case] = {c.id: c for c in _cases()}


def run_case(case_id: str) -> dict:
    """The scenario the rank pool runs: one upstream case, both sides, compared."""
    case = CASES[case_id]
    twin = Twin(case)
    (case.drive or train)(twin)
    assert twin.steps >= 3, f"only {twin.steps} optimizer steps compared"
    return twin.report()


def run_cases(case_ids: list[str]) -> dict:
    """Several cases in one rank-pool call (each its own engines); the first failure stops it."""
    return {cid: run_case(cid) for cid in case_ids}
