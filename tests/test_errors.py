"""Bad input gets a GraphZeroError at the first call, before any collective, naming what is at
fault. Each scenario runs on both ranks; both must raise the same error (no rank may hang)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import graphzero
from scenario_utils import data, ds_config, engine, mlp, rank_world


def loss_of(models, x):
    return sum(m(x).square().mean() for m in models.values())


def expect_error(engines, error: type, *needles: str, **options) -> str:
    rank, _ = rank_world()
    step = torch.compile(loss_of, backend="graphzero", options={"engines": engines, **options})
    models = engines if isinstance(engines, dict) else {f"m{i}": e for i, e in enumerate(engines)}
    with pytest.raises(error) as info:
        step(models, *data(0, rank, (2, 4)))
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in error message {message!r}"
    assert isinstance(info.value, graphzero.GraphZeroError)
    dist.barrier()  # both ranks got here: nothing is stuck in a collective
    return message


def not_an_engine_scenario() -> str:
    return expect_error([nn.Linear(4, 4)], graphzero.NotAnEngineError, "engine0", "torch.nn.modules.linear.Linear",
                        "deepspeed.initialize")


def shared_parameter_scenario() -> str:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    a = engine(nn.Sequential(shared, nn.Linear(4, 2)), ds_config(2))
    b = engine(nn.Sequential(shared, nn.Linear(4, 3)), ds_config(2))
    return expect_error({"teacher": a, "student": b}, graphzero.OwnershipError, "owned by two engines",
                        "'teacher'", "'student'", "0.weight")


def unsupported_stage_scenario(stage: int) -> str:
    eng = engine(mlp(4, 8, 2), ds_config(stage))
    return expect_error({"critic": eng}, graphzero.UnsupportedConfigError, "'critic'",
                        f"zero_optimization.stage={stage}")


class SoloDataParallel:
    """A model-parallel unit (DeepSpeed's `mpu` interface) in which every rank is its own
    data-parallel group: the engine averages over 1 rank instead of 2."""

    def __init__(self) -> None:
        rank, world = rank_world()
        self.groups = [dist.new_group([r]) for r in range(world)]
        self.rank = rank

    def get_data_parallel_group(self):
        return self.groups[self.rank]

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_group(self):
        return dist.group.WORLD

    def get_model_parallel_world_size(self):
        return dist.get_world_size()

    def get_model_parallel_rank(self):
        return self.rank


def mismatched_world_scenario() -> str:
    import deepspeed
    a = engine(mlp(4, 8, 2), ds_config(2))
    model = mlp(4, 8, 2)
    b, *_ = deepspeed.initialize(model=model, config=ds_config(2, micro_batch=4), mpu=SoloDataParallel(),
                                 model_parameters=model.parameters())
    return expect_error({"actor": a, "critic": b}, graphzero.WorldMismatchError, "'actor': 2", "'critic': 1")


def bad_option_scenario() -> list[str]:
    eng = engine(mlp(4, 8, 2), ds_config(1))
    return [expect_error({"m": eng}, graphzero.OptionError, "bucket_sise", bucket_sise=10),
            expect_error({"m": eng}, graphzero.OptionError, "'inner'", "'tensorrt'", inner="tensorrt"),
            expect_error({"m": eng}, graphzero.OptionError, "'bucket_size'", bucket_size=0)]


def test_not_a_deepspeed_engine(ranks):
    ranks.run(not_an_engine_scenario)


def test_parameter_owned_by_two_engines(ranks):
    ranks.run(shared_parameter_scenario)


def test_unsupported_config_is_named(ranks):
    ranks.run(unsupported_stage_scenario, 0)


def unsupported_zero3_scenario() -> str:
    # ZeRO-3 bf16 is supported only with fp32 gradient accumulation.
    cfg = ds_config(3, dtype="bf16")
    cfg["data_types"] = {"grad_accum_dtype": "bf16"}
    eng = engine(mlp(4, 8, 2).to(torch.bfloat16), cfg)
    return expect_error({"critic": eng}, graphzero.UnsupportedConfigError, "'critic'", "zero_optimization.stage=3",
                        "grad_accum_dtype")


def test_unsupported_zero3_config_is_named(ranks):
    try:
        ranks.run(unsupported_zero3_scenario)
    finally:
        # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide: later
        # scenarios get fresh ranks.
        ranks.close()


def test_engines_on_mismatched_worlds(ranks):
    try:
        ranks.run(mismatched_world_scenario)
    finally:
        ranks.close()  # an engine built with an mpu leaves DeepSpeed's global groups changed


def test_bad_options(ranks):
    messages = ranks.run(bad_option_scenario)[0]
    assert "unknown graphzero option" in messages[0]
