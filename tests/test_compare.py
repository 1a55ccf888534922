"""Smoke tests for ``graphzero-compare`` (tools/compare.py and the bench_* modules it drives): tiny
workloads on 2 CPU ranks (gloo), checked for the report's shape, not for timings."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from suite_sample import FULL

from graphzero_tools import bench_metrics, bench_overlap, bench_report, compare
from graphzero_tools.bench_models import build_workload, resolve_size

TOP_KEYS = {"schema", "command", "argv", "args", "date", "machine", "workload", "reference",
            "tolerance", "notes", "runners"}
MACHINE_KEYS = {"platform", "python", "cpu_count", "torch", "deepspeed"}
MLP_RUNNERS = ["ddp", "ds-plain-backward", "fsdp2", "graphzero-eager", "deepcompile"]
STEPS = 2


def _compare(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "graphzero_tools.compare", "--tiny", "--world-size", "2",
           "--warmup", "1", "--no-progress", "--timeout", "60", *args]
    proc = subprocess.run(cmd, check=False, cwd=tmp, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        print(proc.stdout[-5000:], proc.stderr[-5000:], sep="\n")
    return proc


def _graphzero_import_error() -> str | None:
    try:
        importlib.import_module("graphzero")
    except Exception as e:  # noqa: BLE001  (any import failure: the runner must then report it)
        return f"{type(e).__name__}"
    return None


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare_mlp")
    proc = _compare(tmp, "--model", "mlp", "--stage", "2", "--steps", str(STEPS),
                    "--runners", ",".join(MLP_RUNNERS), "--json", "out.json", "--plot", "out.png",
                    "--timeline", "timeline.png")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SimpleNamespace(proc=proc, tmp=tmp, result=json.loads((tmp / "out.json").read_text()))


def test_json_schema(mlp_run):
    res = mlp_run.result
    assert TOP_KEYS <= set(res)
    assert MACHINE_KEYS <= set(res["machine"])
    assert res["workload"]["model"] == "mlp" and res["workload"]["world_size"] == 2
    assert res["workload"]["steps"] == STEPS and res["workload"]["backend"] in ("gloo", "nccl")
    assert res["reference"] == "ddp"
    assert "graphzero_tools.compare" in res["command"]
    assert list(res["runners"]) == MLP_RUNNERS
    for name, entry in res["runners"].items():
        assert set(bench_report.RUNNER_KEYS) <= set(entry), name
        assert entry["status"] in ("ok", "failed", "skipped"), name


def test_ok_runners_have_metrics(mlp_run):
    runners = mlp_run.result["runners"]
    for name in ("ddp", "ds-plain-backward", "fsdp2"):
        e = runners[name]
        assert e["status"] == "ok", (name, e["error"])
        s = e["step_ms"]
        assert s["min"] <= s["median"] <= s["max"] and len(s["all"]) == STEPS
        assert e["compile_s"] >= 0 and e["first_step_ms"] > 0
        assert e["grad_bytes"] > 0 and e["optim_bytes"] > 0 and len(e["grad_bytes_per_rank"]) == 2
        assert e["peak_rss_mib"] > 0
        assert e["collectives_per_step"] >= 1 and e["bytes_reduced_per_step"] > 0
        assert e["collectives_by_op"]
        assert e["max_abs_param_diff"] is not None and e["params_match"] is not None
        assert len(e["losses"]) == 1 + 2 + STEPS and e["final_loss"] == e["losses"][-1]
        assert set(e["phase_ms"]) == set(bench_report.PHASES) and all(v > 0 for v in e["phase_ms"].values())
        assert max(e["phase_ms"].values()) <= s["max"], (name, e["phase_ms"], s)  # each phase within a step
        assert e["gathered_peak_bytes"] is None  # ZeRO-2: nothing is gathered per module
        assert 1 <= e["reductions_per_step"] <= e["collectives_per_step"]
        assert e["eager_safety_net_per_step"] is None  # graphzero runners only
        if mlp_run.result["workload"]["device"] == "cpu":   # collective time, hidden and exposed, per rank
            assert len(e["overlap_per_rank"]) == 2 and e["collective_ms"] > 0, name
            for ov in e["overlap_per_rank"]:
                assert ov["hidden_ms"] + ov["exposed_ms"] == pytest.approx(ov["collective_ms"], abs=2e-3)
                assert 0 <= ov["hidden_fraction"] <= 1 and ov["timeline"]["collectives"], name
                assert ov["compute_ms"] > 0 and ov["span_ms"] >= ov["collective_ms"], name
    assert runners["ddp"]["ratio_vs_ddp"] == 1.0 and runners["ddp"]["max_abs_param_diff"] == 0.0
    assert runners["ds-plain-backward"]["ratio_vs_ds_plain_backward"] == 1.0
    # Same weights and data: DeepSpeed ZeRO-2 and FSDP2 land on DDP's parameters (fp32, tiny model).
    assert runners["ds-plain-backward"]["params_match"], runners["ds-plain-backward"]["max_abs_param_diff"]
    assert runners["fsdp2"]["params_match"], runners["fsdp2"]["max_abs_param_diff"]


def test_graphzero_runner_reported(mlp_run):
    e = mlp_run.result["runners"]["graphzero-eager"]
    import_error = _graphzero_import_error()
    if import_error is not None:
        assert e["status"] == "failed" and e["failed_at"] == "setup"
        assert e["error"].startswith(import_error), e["error"]
    elif e["status"] == "failed":  # graphzero imports but this runner raised: the error is reported
        assert e["error"] and ": " in e["error"] and e["failed_at"]
    else:
        assert e["status"] == "ok"
        assert e["graphs"] >= 1 and e["step_ms"]["median"] > 0 and e["max_abs_param_diff"] is not None
        assert e["eager_safety_net_per_step"] == 0  # every gradient went through the compiled graph


def test_deepcompile_skipped_without_cuda(mlp_run):
    e = mlp_run.result["runners"]["deepcompile"]
    if mlp_run.result["workload"]["device"] == "cpu":
        assert e["status"] == "skipped" and e["error"] == "needs CUDA"
        assert e["step_ms"] is None


def test_table_printed(mlp_run):
    out = mlp_run.proc.stdout
    assert "| runner" in out and "step ms med [min, max]" in out
    for name in MLP_RUNNERS:
        assert f"| {name} " in out, name
    assert "skipped: needs CUDA" in out or mlp_run.result["workload"]["device"] != "cpu"


def test_plot_written(mlp_run):
    pytest.importorskip("matplotlib")
    for name in ("out.png", "timeline.png"):
        png = mlp_run.tmp / name
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


ZERO3_RUNNERS = ["graphzero-eager", "ds-engine-backward", "fsdp2", "ddp"]


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare_zero3")
    proc = _compare(tmp, "--model", "mlp", "--stage", "3", "--steps", "1", "--reduce-bucket-size", "10000",
                    "--runners", ",".join(ZERO3_RUNNERS), "--json", "z3.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SimpleNamespace(proc=proc, result=json.loads((tmp / "z3.json").read_text()))


def test_zero3_gathered_peak(zero3_run):
    """--stage 3: DeepSpeed eager and FSDP2 (one unit per Linear) have a measured gathered-parameter
    peak, graphzero the one of its compiled schedule; a peak is never more than all parameters."""
    res = zero3_run.result
    full = res["workload"]["param_bytes"]
    assert full == 4 * sum(res["workload"]["parts"].values())
    runners = res["runners"]
    for name in ("ds-engine-backward", "fsdp2"):
        e = runners[name]
        assert e["status"] == "ok", (name, e["error"])
        assert e["gathered_peak_source"] == "measured", name
        peak = e["gathered_peak_bytes"]
        assert 0 < peak["forward"] <= full and 0 < peak["backward"] <= full, (name, peak)
        assert e["params_match"], (name, e["max_abs_param_diff"])
    # FSDP2 reshards each Linear after use: less than the whole model is ever gathered at once
    assert runners["fsdp2"]["gathered_peak_bytes"]["forward"] < full
    assert runners["ddp"]["gathered_peak_bytes"] is None
    gz = runners["graphzero-eager"]
    if gz["status"] == "ok":
        assert gz["gathered_peak_source"] == "compiled schedule"
        assert 0 < gz["gathered_peak_bytes"]["forward"] <= full
        assert gz["eager_safety_net_per_step"] == 0
    out = zero3_run.proc.stdout
    assert "gathered peak fwd / bwd" in out and "(m)" in out and "fwd / bwd / opt ms" in out


def test_failing_runner_is_reported(tmp_path):
    """The GAN calls the discriminator engine twice in one loss: DeepSpeed eager with a plain
    loss.backward() raises KeyError: 0 in engine.step(); it is reported, the others continue."""
    proc = _compare(tmp_path, "--model", "gan", "--steps", "1", "--runners", "ddp,ds-plain-backward",
                    "--json", "gan.json", "--malloc", "retain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gan.json").read_text())
    # (the allocator policy rides along: glibc took it, and the report says so)
    assert result["workload"]["malloc"] == "retain" and "mallopt refused" not in proc.stderr
    assert "malloc: retain" in proc.stdout
    runners = result["runners"]
    bad = runners["ds-plain-backward"]
    assert bad["status"] == "failed" and bad["error"].startswith("KeyError"), bad["error"]
    assert bad["failed_at"].startswith("step 0") and bad["step_ms"] is None
    assert runners["ddp"]["status"] == "ok" and runners["ddp"]["step_ms"]["median"] > 0
    assert "failed [1]" in proc.stdout and "ds-plain-backward: failed at step 0" in proc.stdout


FLAKY_SCRIPT = """
import sys, torch, torch.distributed as dist
from graphzero_tools import bench_runners, compare

class Flaky(bench_runners.DDPRunner):
    name = "flaky"

    def step(self, micro, **kwargs):
        if dist.get_rank() == 1:
            raise ValueError("boom")          # rank 1 fails, rank 0 waits in a collective
        dist.all_reduce(torch.ones(3))
        return super().step(micro, **kwargs)

compare.RUNNERS["flaky"] = Flaky
sys.exit(compare.main(sys.argv[1:]))
"""


def test_one_rank_failure_does_not_hang_under_torchrun(tmp_path):
    """Run under torchrun (no self-spawn): a runner that raises on one rank while the other waits in
    a collective is reported failed once the process-group timeout expires; the run still ends."""
    script = tmp_path / "flaky_compare.py"
    script.write_text(FLAKY_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), "--model", "mlp", "--tiny", "--runners", "flaky", "--steps", "1", "--warmup", "1",
           "--timeout", "5", "--no-progress", "--json", "flaky.json"]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entry = json.loads((tmp_path / "flaky.json").read_text())["runners"]["flaky"]
    assert entry["status"] == "failed" and entry["failed_at"] == "step 0 (warmup)"
    assert "rank 1: ValueError: boom" in entry["error"], entry["error"]


EAGER_AFTER_ATTACH_SCRIPT = """
import sys
from graphzero_tools import bench_runners, compare

class EagerAfterAttach(bench_runners.GraphZeroEagerRunner):
    name = "gz-then-eager"   # the first call compiles (and attaches); later calls run the loss eagerly

    def compute_loss(self, batch):
        self.calls = getattr(self, "calls", 0) + 1
        return super().compute_loss(batch) if self.calls == 1 else self.ctx.workload.loss(self.engines, *batch)

compare.RUNNERS["gz-then-eager"] = EagerAfterAttach
if __name__ == "__main__":
    sys.exit(compare.main(sys.argv[1:]))
"""


def test_safety_net_counted(tmp_path):
    """The safety-net column counts graphzero's eager reductions: one per parameter per step when the
    loss runs eagerly on attached engines, none when it runs compiled."""
    # No skip when graphzero fails to import: this repository is graphzero, so that is a failure.
    script = tmp_path / "eager_after_attach.py"
    script.write_text(EAGER_AFTER_ATTACH_SCRIPT)
    cmd = [sys.executable, str(script), "--model", "mlp", "--tiny", "--runners", "gz-then-eager,graphzero-eager",
           "--steps", "1", "--warmup", "1", "--no-progress", "--timeout", "60", "--json", "sn.json"]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runners = json.loads((tmp_path / "sn.json").read_text())["runners"]
    n_params = 2 * 2 * 2  # tiny mlp: 2 parts x 2 Linear x (weight, bias)
    assert runners["gz-then-eager"]["eager_safety_net_per_step"] == n_params, runners["gz-then-eager"]
    assert runners["graphzero-eager"]["eager_safety_net_per_step"] == 0
    assert runners["graphzero-eager"]["params_match"] and "safety net" in proc.stdout  # same numbers either way


# --------------------------------------------------------------------- pure functions (no processes)


def test_summarize_collectives():
    ev = [SimpleNamespace(name="gloo:all_reduce", input_shapes=[[10]], input_dtypes=["float"]),
          SimpleNamespace(name="gloo:all_gather", input_shapes=[[4]], input_dtypes=["c10::BFloat16"]),
          SimpleNamespace(name="gloo:all_reduce", input_shapes=[[]], input_dtypes=["double"]),
          SimpleNamespace(name="gloo:all_to_all", input_shapes=[[6]], input_dtypes=["float"]),
          SimpleNamespace(name="c10d::allreduce_", input_shapes=[[], []], input_dtypes=[]),
          SimpleNamespace(name="aten::add", input_shapes=[[3]], input_dtypes=["float"])]
    s = bench_metrics.summarize_collectives(ev, world_size=2)
    assert s["count"] == 4
    assert s["by_op"]["all_reduce"] == {"count": 2, "bytes": 48}
    # graphzero's reduce-scatter on gloo is an all-to-all: a reduction
    assert s["bytes_reduced"] == 48 + 24 and s["reductions"] == 3 and s["bytes_gathered"] == 16
    # the lean step's parameter all-gather of a gloo pair is an all-to-all inside its profiler range
    span = SimpleNamespace(start=100, end=200)
    ev = [SimpleNamespace(name="graphzero.param_all_gather", input_shapes=[], input_dtypes=[], time_range=span),
          SimpleNamespace(name="gloo:all_to_all", input_shapes=[[6]], input_dtypes=["float"],
                          time_range=SimpleNamespace(start=150, end=260)),
          SimpleNamespace(name="gloo:all_to_all", input_shapes=[[6]], input_dtypes=["float"],
                          time_range=SimpleNamespace(start=20, end=90))]
    s = bench_metrics.summarize_collectives(ev, world_size=2)
    assert s["by_op"] == {"all_gather": {"count": 1, "bytes": 24}, "all_to_all": {"count": 1, "bytes": 24}}
    assert s["bytes_reduced"] == 24 and s["reductions"] == 1 and s["bytes_gathered"] == 48


def _event(name, thread, start, end, children=()):
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end),
                           cpu_children=list(children))


def test_step_overlap():
    kernel_a, wait, kernel_b = (_event("graph_0_cpp_fused_0", 1, 0, 10), _event("_c10d_functional::wait_tensor", 1, 10, 20),
                                _event("aten::mm", 1, 20, 30))
    events = [_event("## Call CompiledFxGraph ##", 1, 0, 30, [kernel_a, wait, kernel_b]), kernel_a, wait, kernel_b,
              _event("_c10d_functional::all_to_all_single", 1, 4, 5),   # the launch: on the step thread, not compute
              _event("gloo:all_to_all", 7, 5, 25), _event("gloo:all_reduce", 8, 22, 40)]
    ov = bench_overlap.step_overlap(events)
    # collectives 5-40 (35 µs); the step thread computes 0-10 and 20-30: 5-10 and 20-30 hidden
    assert ov["collective_ms"] == pytest.approx(0.035) and ov["hidden_ms"] == pytest.approx(0.015)
    assert ov["exposed_ms"] == pytest.approx(0.020) and ov["hidden_fraction"] == pytest.approx(15 / 35, abs=1e-3)
    assert ov["timeline"]["collectives"] == [[5, 40]] and ov["timeline"]["compute"] == [[0, 10], [20, 30]]
    assert bench_overlap.step_overlap([]) is None
    assert bench_overlap.intersect([(0, 2), (5, 9)], [(1, 6), (8, 20)]) == [(1, 2), (5, 6), (8, 9)]


def test_storage_bytes_dedupes_views_and_excludes():
    import torch

    flat = torch.zeros(100)
    other = torch.zeros(10)
    n, keys = bench_metrics.storage_bytes([flat[:10], flat[50:], other])
    assert n == 440 and len(keys) == 2
    n, _ = bench_metrics.storage_bytes([flat[:10], other], exclude={bench_metrics.storage_key(flat)})
    assert n == 40


def test_param_diff():
    import torch

    a = {"w": torch.zeros(3), "b": torch.ones(1)}
    assert bench_metrics.param_diff(a, {"w": torch.tensor([0.0, 0.5, 0.0]), "b": torch.ones(1)}) == 0.5
    assert bench_metrics.param_diff(a, {"w": torch.zeros(3)}) == float("inf")
    assert bench_metrics.param_diff(a, {"w": torch.tensor([0.0, float("nan"), 0.0]), "b": torch.ones(1)}) == float("inf")


def test_parse_args_validates():
    with pytest.raises(SystemExit):
        compare.parse_args(["--runners", "ddp,nope"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--warmup", "0"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--model", "transformer", "--width", "30", "--heads", "4"])
    args = compare.parse_args(["--model", "gan", "--runners", "ddp,ddp,fsdp2"])
    assert args.runners == ["ddp", "fsdp2"] and args.stage == 2 and args.world_size == 2


@pytest.mark.parametrize("model", ["mlp", "gan", "chain3", "transformer"])
def test_workloads_build_and_run(model):
    import torch

    wl = build_workload(model, resolve_size(model, tiny=True))
    batch = wl.make_batch(torch.Generator().manual_seed(0))
    loss = wl.loss(wl.parts, *batch)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for part in wl.parts.values() for p in part.parameters())
    again = build_workload(model, resolve_size(model, tiny=True))
    for name, part in wl.parts.items():
        for p, q in zip(part.parameters(), again.parts[name].parameters()):
            assert torch.equal(p, q)


def test_phase_timer_and_gathered_probe():
    """The probe samples, before every aten op, the bytes of what gathered_params() returns."""
    import torch

    from graphzero_tools.bench_runner import Runner

    class Holder(Runner):
        def gathered_params(self):
            return self.held

    runner = Holder(ctx=None)
    runner.held = []
    timer = bench_metrics.PhaseTimer(torch.device("cpu"))
    probe = bench_metrics.GatheredParamProbe(runner, timer)
    with probe:
        with timer("forward"):
            runner.held = [torch.ones(256)]           # 1 KiB "gathered"
            torch.mm(torch.ones(2, 2), torch.ones(2, 2))
            runner.held = []
        with timer("backward"):
            flat = torch.zeros(512)
            runner.held = [flat[:256], flat[256:]]    # views of one 2 KiB buffer: counted once
            torch.add(flat, 1)
    assert probe.peak["forward"] == 1024 and probe.peak["backward"] == 2048
    totals = timer.totals()
    assert set(totals) == {"forward", "backward"} and all(v >= 0 for v in totals.values())


def test_shard_units():
    from torch import nn

    from graphzero_tools.bench_runners_torch import shard_units

    mlp = build_workload("mlp", resolve_size("mlp", tiny=True))
    assert [type(u) for u in shard_units(mlp.parts["a"])] == [nn.Linear, nn.Linear]
    gpt = build_workload("transformer", resolve_size("transformer", tiny=True))
    units = shard_units(gpt.parts["body"])
    assert [type(u).__name__ for u in units] == ["Embedding", "Embedding", "Block"]
    assert shard_units(gpt.parts["head"]) == []


def test_format_table_lists_failures():
    entry = dict.fromkeys(bench_report.RUNNER_KEYS)
    ok = dict(entry, status="ok", step_ms={"median": 2.0, "min": 1.0, "max": 3.0, "all": [1, 2, 3]},
              ratio_vs_ddp=1.0, compile_s=0.1, grad_bytes=2048, optim_bytes=4096, peak_rss_mib=100.0,
              step_rss_growth_mib=1.0, collectives_per_step=2, bytes_reduced_per_step=2048,
              max_abs_param_diff=0.0, params_match=True)
    bad = dict(entry, status="failed", error="KeyError: 0", failed_at="step 0 (warmup)")
    result = {"reference": "ddp", "tolerance": 1e-4, "notes": ["a note"],
              "workload": {"model": "gan", "description": "d", "stage": 2, "dtype": "fp32", "gas": 1,
                           "world_size": 2, "backend": "gloo", "device": "cpu", "steps": 3, "warmup": 1},
              "runners": {"ddp": ok, "ds-plain-backward": bad}}
    text = bench_report.format_table(result)
    assert "| ddp " in text and "2.0 [1.0, 3.0]" in text and "2.0 KiB" in text
    assert "failed [1]" in text and "[1] ds-plain-backward: failed at step 0 (warmup): KeyError: 0" in text
    assert "- a note" in text
    assert "x ideal" not in text and "gathered peak" not in text  # no torch-compile-fused, ZeRO-2
    ideal = dict(ok, ratio_vs_torch_compile_fused=1.0, phase_ms={"forward": 1.0, "backward": 0.5, "step": 0.25},
                 gathered_peak_bytes={"forward": 1024, "backward": 2048}, gathered_peak_source="measured")
    result["workload"]["stage"] = 3
    result["runners"] = {"ddp": ok, "torch-compile-fused": ideal}
    text = bench_report.format_table(result)
    assert "x ideal" in text and "1.0 / 0.5 / 0.2" in text and "1.0 KiB / 2.0 KiB (m)" in text


def test_client_workloads_and_offload_runners(tmp_path):
    """The diffusers and RLHF client workloads (tiny; RLHF with its frozen reference and reward in
    every runner) and the opt-in offload runners (ZeRO-3 mlp, tiny): each ok, with its parameters
    within tolerance of DDP's."""
    # fsdp2-compiled (a per-block inductor compile of the GPT-2 models) only in the full suite
    rlhf = "graphzero-eager,ds-plain-backward,fsdp2," + ("fsdp2-compiled," if FULL else "") + "ddp"
    # the ideal on the UNet (inductor with graphzero's miscompile guard: plain inductor trains it wrong
    # on torch < 2.15 CPU) only in the full suite too
    diffusers = "graphzero-eager," + ("torch-compile-fused," if FULL else "") + "ddp"
    checks = (("diffusers", "2", diffusers),
              ("rlhf", "3", rlhf),
              ("mlp", "3", "graphzero-offload,ds-offload,ds-engine-backward-offload,ddp"))
    for model, stage, runners in checks:
        proc = _compare(tmp_path, "--model", model, "--tiny", "--stage", stage, "--steps", "1", "--warmup", "1",
                        "--runners", runners, "--json", f"{model}.json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads((tmp_path / f"{model}.json").read_text())
        for name in runners.split(","):
            entry = result["runners"][name]
            assert entry["status"] == "ok", (model, name, entry.get("error"))
            assert entry["params_match"] or name == "ddp", (model, name, entry["max_abs_param_diff"])
    assert not {"ds-offload", "ds-engine-backward-offload"} & set(compare.parse_args([]).runners)   # opt-in
    # --frozen-stage 0: the reference and reward replicated (ZeRO-0 inference engines, as DDP has them),
    # so graphzero's ZeRO-2 step gathers only the trained parameters (half of them per rank), none frozen
    proc = _compare(tmp_path, "--model", "rlhf", "--tiny", "--stage", "2", "--frozen-stage", "0", "--steps", "1",
                    "--warmup", "1", "--runners", "graphzero-eager,ds-engine-backward,ddp", "--json", "frozen0.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "frozen0.json").read_text())
    for name in ("graphzero-eager", "ds-engine-backward"):
        entry = result["runners"][name]
        assert entry["status"] == "ok" and entry["params_match"], (name, entry.get("error"), entry["max_abs_param_diff"])
    trained = sum(n for part, n in result["workload"]["parts"].items() if part in ("actor", "critic"))
    gathered = result["runners"]["graphzero-eager"]["collectives_by_op"]["all_gather"]["bytes"]
    assert gathered <= 1.01 * trained * 4 / 2, (gathered, trained)
    assert "fsdp2-compiled" not in compare.parse_args([]).runners


def test_ideal_runner_at_two_ranks(tmp_path):
    """torch-compile-fused on 2 ranks (gas 2): one flat all-reduce per optimizer step, DDP's
    parameters, and the "x ideal" ratios."""
    proc = _compare(tmp_path, "--model", "mlp", "--stage", "2", "--gas", "2", "--steps", "2",
                    "--runners", "ddp,torch-compile-fused", "--json", "ideal.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "ideal.json").read_text())
    ideal = result["runners"]["torch-compile-fused"]
    assert ideal["status"] == "ok", ideal["error"]
    assert ideal["params_match"], ideal["max_abs_param_diff"]
    assert ideal["collectives_per_step"] == 1 and ideal["reductions_per_step"] == 1
    assert ideal["ratio_vs_torch_compile_fused"] == 1.0 and result["runners"]["ddp"]["ratio_vs_torch_compile_fused"]
