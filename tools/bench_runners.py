"""The registry of ``graphzero-compare`` runners, by name, in the report's order: the interface is
bench_runner.py, the DeepSpeed-based runners bench_runners_deepspeed.py, the PyTorch ones
bench_runners_torch.py."""

from __future__ import annotations

from .bench_runner import Hyper, RunContext, Runner, RunnerSkipped
from .bench_runners_deepspeed import (
    DeepCompileRunner,
    DeepSpeedEngineBackward,
    DeepSpeedEngineBackwardOffload,
    DeepSpeedOffload,
    DeepSpeedPlainBackward,
    GraphZeroDeepSpeedStepRunner,
    GraphZeroDeferredRunner,
    GraphZeroEagerRunner,
    GraphZeroOffloadRunner,
    GraphZeroReduceScatterRunner,
    GraphZeroRunner,
)
from .bench_runners_torch import DDPRunner, FSDP2CompiledRunner, FSDP2Runner, TorchCompileFusedRunner

__all__ = ["RUNNERS", "DDPRunner", "DeepCompileRunner", "DeepSpeedEngineBackward", "DeepSpeedEngineBackwardOffload",
           "DeepSpeedOffload",
           "DeepSpeedPlainBackward", "FSDP2CompiledRunner", "FSDP2Runner", "GraphZeroDeepSpeedStepRunner", "GraphZeroDeferredRunner",
           "GraphZeroEagerRunner", "GraphZeroOffloadRunner", "GraphZeroReduceScatterRunner", "GraphZeroRunner", "Hyper",
           "RunContext", "Runner", "RunnerSkipped", "TorchCompileFusedRunner"]

RUNNERS: dict[str, type[Runner]] = {cls.name: cls for cls in (
    GraphZeroRunner, GraphZeroDeferredRunner, GraphZeroDeepSpeedStepRunner, GraphZeroReduceScatterRunner,
    GraphZeroEagerRunner, GraphZeroOffloadRunner, DeepSpeedEngineBackward, DeepSpeedPlainBackward, DeepSpeedOffload,
    DeepSpeedEngineBackwardOffload, DDPRunner, FSDP2Runner, FSDP2CompiledRunner, TorchCompileFusedRunner, DeepCompileRunner)}
