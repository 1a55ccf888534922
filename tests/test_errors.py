"""Bad input gets a GraphZeroError at the first call, before any collective, naming what is at
fault. Each scenario runs on both ranks; both must raise the same error (no rank may hang)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

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


def unsupported_key_scenario(key: str) -> str:
    torch.manual_seed(0)
    zero = {"stage": 2}
    if key in ("zero_quantized_gradients", "zero_quantized_weights"):
        zero[key] = True
    elif key == "zero_hpz_partition_size":
        zero[key] = 2
    model = mlp(4, 8, 2)
    if key == "PipelineModule":
        from deepspeed.pipe import PipelineModule
        model = PipelineModule(layers=[nn.Linear(4, 4), nn.Linear(4, 2)], num_stages=1, loss_fn=nn.MSELoss())
    elif key == "MoE layers":
        from deepspeed.moe.layer import MoE

        class WithExperts(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.moe = MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, ep_size=1)

            def forward(self, x):
                return self.moe(x)[0]

        model = WithExperts()
    config = ds_config(2)
    config["zero_optimization"] = zero
    if key == "PipelineModule":
        config["zero_optimization"] = {"stage": 1}  # DeepSpeed allows pipelines with ZeRO-1 only
    eng = engine(model, config)
    return expect_error({"policy": eng}, graphzero.UnsupportedConfigError, "'policy'", key)


# fp16 is refused too ("fp16.enabled"), but DeepSpeed itself refuses fp16 on CPU before any
# engine exists, so it cannot be exercised here.
# Offload: tests/test_offload.py (optimizer offload to the CPU is supported, parameter offload refused).
@pytest.mark.parametrize("key", ["zero_quantized_gradients", "zero_quantized_weights",
                                 "zero_hpz_partition_size", "PipelineModule", "MoE layers"])
def test_each_unsupported_config_key_is_named(ranks, key):
    try:
        ranks.run(unsupported_key_scenario, key)
    finally:
        if key in ("PipelineModule", "MoE layers"):
            ranks.close()  # both create DeepSpeed process groups of their own


def bad_option_types_scenario() -> list[str]:
    eng = engine(mlp(4, 8, 2), ds_config(1))
    return [expect_error({"m": eng}, graphzero.OptionError, "'overlap'", "'yes'", overlap="yes"),
            expect_error({"m": eng}, graphzero.OptionError, "'collective'", collective="ring"),
            expect_error({"m": eng}, graphzero.OptionError, "'dump_ranks'", dump_ranks="1"),
            expect_error({"m": eng}, graphzero.OptionError, "'bucket_size'", bucket_size=2.5),
            single_engine_not_in_a_list(eng)]


def single_engine_not_in_a_list(eng) -> str:
    """``options={"engines": engine}``: a common slip, named with what to write instead."""
    rank, _ = rank_world()
    step = torch.compile(lambda m, x: m(x).sum(), backend="graphzero", options={"engines": eng})
    with pytest.raises(graphzero.OptionError, match="'engines'.*DeepSpeedEngine"):
        step(eng, *data(0, rank, (2, 4)))
    dist.barrier()
    return "ok"


def test_options_with_wrong_types(ranks):
    ranks.run(bad_option_types_scenario)


def unused_engine_scenario() -> dict:
    """A step whose loss does not use a listed engine: a warning naming it, its shard untouched."""
    import logging
    rank, _ = rank_world()
    torch.manual_seed(0)
    used, idle = engine(mlp(4, 8, 2), ds_config(2)), engine(mlp(4, 8, 2), ds_config(2))
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logging.getLogger("graphzero").addHandler(handler)
    try:
        step = torch.compile(lambda m, x: m(x).square().mean(), backend="graphzero",
                             options={"engines": {"used": used, "idle": idle}, "inner": "eager"})
        step(used, *data(0, rank, (2, 4))).backward()
    finally:
        logging.getLogger("graphzero").removeHandler(handler)
    used.step()
    with pytest.raises(graphzero.NoGradientError, match="'idle'"):
        idle.step()
    return {"warned": any("'idle'" in r and "does not use" in r for r in records),
            "idle_untouched": all(v is None for v in idle.optimizer.averaged_gradients.values())}


def test_loss_that_does_not_use_a_listed_engine(ranks):
    results = ranks.run(unused_engine_scenario)
    assert all(r == {"warned": True, "idle_untouched": True} for r in results), results


def backend_object_misuse_scenario() -> list[str]:
    """graphzero.backend(...): a keyword that is neither an option nor an engine, engines given two
    ways, an option given to both the object and torch.compile, and an engine detached after the
    object was made: each a named error on every rank, before anything runs."""
    rank, _ = rank_world()
    eng = engine(mlp(4, 8, 2), ds_config(2))
    messages = []
    with pytest.raises(graphzero.OptionError) as info:
        graphzero.backend(critic=eng, bucket_sise=1000)
    messages.append(str(info.value))
    with pytest.raises(graphzero.OptionError) as info:
        graphzero.backend(eng, engines=[eng])
    messages.append(str(info.value))
    be = graphzero.backend(critic=eng, inner="eager")
    assert graphzero.deepspeed_adapter.binding_of(eng) is not None  # attached by the constructor
    step = torch.compile(loss_of, backend=be, options={"inner": "inductor"})
    with pytest.raises(graphzero.OptionError) as info:
        step({"critic": eng}, *data(0, rank, (2, 4)))
    messages.append(str(info.value))
    torch._dynamo.reset()
    graphzero.detach(eng)
    with pytest.raises(graphzero.AttachTooLateError) as info:
        torch.compile(loss_of, backend=be)({"critic": eng}, *data(0, rank, (2, 4)))
    messages.append(str(info.value))
    dist.barrier()
    return messages


def test_backend_object_misuse_is_named(ranks):
    for messages in ranks.run(backend_object_misuse_scenario):
        assert "bucket_sise=int" in messages[0] and "neither a DeepSpeed engine nor an option" in messages[0]
        assert "engines=" in messages[1]
        assert "'inner'" in messages[2] and "torch.compile(options=...)" in messages[2]
        assert "['critic']" in messages[3] and "detached" in messages[3]


def name_clash_scenario() -> list[str]:
    """An explicit name that an engine listed without a name in the same call keeps (the name an
    earlier attach gave it): OwnershipError naming both, from graphzero.attach and from
    graphzero.backend, with nothing attached by the failed call."""
    torch.manual_seed(0)
    disc = engine(mlp(4, 8, 1), ds_config(2))
    gen = engine(mlp(4, 8, 4), ds_config(2))
    held = "the disc"   # not an engineK: graphzero.backend refuses a keyword equal to a positional label
    graphzero.attach(**{held: disc})
    messages = []
    with pytest.raises(graphzero.OwnershipError) as info:
        graphzero.attach(disc, **{held: gen})
    messages.append(str(info.value))
    with pytest.raises(graphzero.OwnershipError) as info:
        graphzero.backend(disc, **{held: gen})
    messages.append(str(info.value))
    assert graphzero.deepspeed_adapter.binding_of(gen) is None
    assert graphzero.deepspeed_adapter.binding_of(disc).name == held
    dist.barrier()
    return [held, *messages]


def test_engine_name_clash_is_named(ranks):
    for held, *messages in ranks.run(name_clash_scenario):
        for message in messages:
            assert f"engine name {held!r}" in message and "keeps it as its name" in message, message
            # both engines described: the generator (4 outputs: 76 elements) and the discriminator (49)
            assert "76 elements" in message and "49 elements" in message, message


def foreign_engine_backward_scenario() -> str:
    """DeepSpeed's own engine.backward of an engine graphzero does not own, on a loss that also
    reaches an attached one: the attached engine cannot get its own 1/gas back (the other's gas is
    unknown), so the backward raises a named AutogradUsageError on every rank."""
    rank, _ = rank_world()
    torch.manual_seed(0)
    owned = engine(mlp(4, 8, 2), ds_config(2))
    foreign = engine(mlp(4, 8, 2), ds_config(2, gas=2))
    graphzero.attach(critic=owned)
    (x,) = data(0, rank, (4, 4))
    loss = owned(x).square().mean() + foreign(x).square().mean()
    with pytest.raises(graphzero.AutogradUsageError) as info:
        foreign.backward(loss)
    dist.barrier()
    return str(info.value)


def test_engine_backward_of_a_foreign_engine_is_named(ranks):
    for message in ranks.run(foreign_engine_backward_scenario):
        assert "engine 'critic'" in message and "engine.backward()" in message, message
        assert "does not own" in message, message


def step_settings_scenario() -> list[str]:
    """``lean_step`` / ``defer_param_gather`` are settings of the engine: the first attach or compile
    that gives a value sets it (an attached engine's step is chosen again); one that leaves them out
    or gives the same value keeps the step as it is; another value later is an OptionError naming the
    engine and the option (on every rank, nothing changed); step options without engines are refused;
    detach and attach again to change them."""
    from graphzero.deepspeed_adapter import binding_of
    rank, _ = rank_world()
    torch.manual_seed(0)
    eng = engine(mlp(4, 8, 2), ds_config(2))
    graphzero.attach(net=eng)
    assert eng.optimizer.__dict__["step"].deferred is None

    def compiled(options):
        return torch.compile(lambda models, x: loss_of(models, x), backend="graphzero",
                             options={"inner": "eager", **options})

    x = data(0, rank, (4, 4))
    lean = None
    for options in ({"engines": {"net": eng}, "defer_param_gather": True}, {"engines": {"net": eng}}, {}):
        compiled(options)({"net": eng}, *x).backward()
        eng.step()
        lean = lean or eng.optimizer.__dict__["step"]
        assert eng.optimizer.__dict__["step"] is lean and lean.deferred is not None, options
    graphzero.attach(eng, lean_step=True, defer_param_gather=True)   # the same values: nothing changes
    assert eng.optimizer.__dict__["step"] is lean and binding_of(eng).step.lean_step is lean
    messages = []
    for make in (lambda: compiled({"engines": {"net": eng}, "lean_step": False})({"net": eng}, *x),
                 lambda: graphzero.backend(net=eng, defer_param_gather=False),
                 lambda: graphzero.attach(eng, defer_param_gather=False),
                 lambda: compiled({"lean_step": True})({"net": eng}, *x)):
        with pytest.raises(graphzero.OptionError) as info:
            make()
        messages.append(str(info.value))
    assert eng.optimizer.__dict__["step"] is lean
    graphzero.wait_params(eng)
    graphzero.detach(eng)
    graphzero.attach(net=eng, lean_step=False)
    assert "step" not in eng.optimizer.__dict__ and binding_of(eng).step.reason == "option lean_step=False"
    graphzero.detach(eng)
    dist.barrier()
    return messages


def test_step_options_are_engine_settings(ranks):
    for messages in ranks.run(step_settings_scenario):
        for message, (option, given) in zip(messages, [("lean_step", False), ("defer_param_gather", False),
                                                       ("defer_param_gather", False)]):
            assert "engine 'net'" in message and f"option {option!r}" in message, message
            assert f"{option}={given}" in message and "graphzero.detach" in message, message
        assert "'lean_step'" in messages[3] and "engines" in messages[3], messages[3]
