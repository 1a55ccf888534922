"""Bytes on the wire per optimizer step: graphzero (``collective="reduce_scatter"``, the NCCL choice)
vs DeepSpeed eager vs DeepCompile's ZeRO-1/2 scheme vs DDP, per ZeRO stage.

Usage::

    python -m graphzero_tools.wire_bytes --models gan,transformer --stages 1,2,3 --json wire.json

For each (model, stage) it runs ``graphzero-compare`` with the runners ``graphzero-rs``,
``ds-engine-backward`` and ``ddp`` for one measured round on 2 gloo ranks. graphzero's row is
counted from its traced graphs (the dump summary: each collective it inserted and its input bytes;
gloo itself runs a reduce-scatter as an all-reduce, so its profiler events would not show the
NCCL choice; graphzero's gloo default, an all-to-all, sends what this row's wire column says) plus the lean step's all-gather of the updated parameters (ZeRO-1/2); the folded
norm's all-reduce (4 bytes per param group) and the rank-agreement exchange (8 bytes) are left
out. DeepSpeed's and DDP's rows are their collectives from the torch.profiler events of that round
(bench_metrics.summarize_collectives). DeepCompile runs on CUDA only, so its ZeRO-1/2
row is counted from its scheme instead (deepspeed/ops/csrc/compile/z1.cpp and z2.cpp:
``ncclAllReduce`` of every gradient bucket, each rank keeping its slice, then DeepSpeed's
``step()`` all-gathers the updated bit16 partitions), with the parameter count of the workload.

Two numbers per row: *payload* (the bytes handed to collectives: input bytes of all-reduce and
reduce-scatter, output bytes of all-gather) and *wire* (what a ring algorithm sends per rank:
all-reduce ``2(w-1)/w`` x payload, reduce-scatter and all-gather ``(w-1)/w`` x payload): the
figure that sets communication time on NCCL. Control collectives of the harness and of
graphzero's rank agreement (8 bytes) are included where the profiler sees them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

RUNNERS = ("graphzero-rs", "ds-engine-backward", "ddp")
LABELS = {"graphzero-rs": "graphzero (reduce_scatter)", "ds-engine-backward": "DeepSpeed eager",
          "ddp": "DDP", "deepcompile-scheme": "DeepCompile ZeRO-1/2 scheme (counted)"}


def wire_factor(op: str, world: int) -> float:
    """Bytes a ring algorithm sends per rank, per payload byte."""
    if world <= 1:
        return 0.0
    if "all_reduce" in op or op == "allreduce":
        return 2.0 * (world - 1) / world
    return (world - 1) / world


def _payload(op: str, entry: dict[str, int], world: int) -> int:
    # summarize_collectives sums the input shapes the profiler records: for a gather that is the
    # shard, whose output is world times it (bench_metrics: bytes_gathered)
    return entry["bytes"] * world if "gather" in op else entry["bytes"]


def runner_row(entry: dict[str, Any], world: int) -> dict[str, Any]:
    by_op = entry.get("collectives_by_op") or {}
    payload = wire = 0.0
    ops = {}
    for op, e in by_op.items():
        p = _payload(op, e, world)
        ops[op] = {"count": e["count"], "payload_bytes": p}
        payload += p
        wire += p * wire_factor(op, world)
    return {"collectives": entry.get("collectives_per_step"), "by_op": ops, "payload_bytes": int(payload),
            "wire_bytes": int(wire), "step_ms": (entry.get("step_ms") or {}).get("median")}


def deepcompile_row(param_bytes: int, comm_bytes: int, world: int) -> dict[str, Any]:
    """DeepCompile ZeRO-1/2: all-reduce every gradient (comm dtype) + all-gather the parameters."""
    ops = {"all_reduce": {"count": None, "payload_bytes": comm_bytes},
           "all_gather": {"count": None, "payload_bytes": param_bytes}}
    wire = comm_bytes * wire_factor("all_reduce", world) + param_bytes * wire_factor("all_gather", world)
    return {"collectives": None, "by_op": ops, "payload_bytes": comm_bytes + param_bytes, "wire_bytes": int(wire),
            "step_ms": None}


def graphzero_row(summary: dict[str, Any], stage: int, param_bytes: int, world: int) -> dict[str, Any]:
    """From the traced graphs (the dump's summary: every collective graphzero inserted, with its
    input bytes) plus, at ZeRO-1/2, the lean step's one all-gather of the updated parameters."""
    ops: dict[str, dict[str, int]] = {}

    def add(op: str, count: int, nbytes: int) -> None:
        if count:
            entry = ops.setdefault(op, {"count": 0, "payload_bytes": 0})
            entry["count"] += count
            entry["payload_bytes"] += nbytes

    for graph in summary.get("graphs", []):
        for e in graph.get("engines", {}).values():
            reductions = e["reduce_scatter"] + e["all_reduce"]
            for op in ("reduce_scatter", "all_reduce"):
                # comm_bytes_per_step: input bytes of the engine's reductions (one kind per engine)
                add(op, e[op], e["comm_bytes_per_step"] * e[op] // max(1, reductions))
            add("all_gather", e["all_gather_fwd"] + e["all_gather_bwd"],
                e["all_gather_bytes_fwd"] + e["all_gather_bytes_bwd"])
    if stage in (1, 2):
        # the step's gather of the updated bit16 partitions: one per engine (one param group each here)
        engines = {name for graph in summary.get("graphs", []) for name in graph.get("engines", {})}
        add("all_gather", len(engines), param_bytes)
    payload = sum(e["payload_bytes"] for e in ops.values())
    wire = sum(e["payload_bytes"] * wire_factor(op, world) for op, e in ops.items())
    return {"collectives": sum(e["count"] for e in ops.values()), "by_op": ops, "payload_bytes": payload,
            "wire_bytes": int(wire), "step_ms": None, "source": "traced graphs"}


def measure(model: str, stage: int, extra: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "graphzero_tools.compare", "--model", model, "--stage", str(stage),
               "--runners", ",".join(RUNNERS), "--steps", "1", "--warmup", "1", "--json", path,
               "--no-progress", *extra]
        env = dict(os.environ, GRAPHZERO_COMPARE_DUMP_DIR=os.path.join(tmp, "dump"))
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        with open(path) as f:
            result = json.load(f)
        with open(os.path.join(tmp, "dump", "graphzero-rs", "summary.json")) as f:
            return result, json.load(f)


def rows_for(result: dict[str, Any], summary: dict[str, Any], stage: int) -> dict[str, Any]:
    world = result["workload"]["world_size"]
    rows = {name: runner_row(entry, world) for name, entry in result["runners"].items() if entry["status"] == "ok"}
    rows["graphzero-rs"] = graphzero_row(summary, stage, result["workload"]["param_bytes"], world)
    if stage in (1, 2):
        param_bytes = result["workload"]["param_bytes"]
        rows["deepcompile-scheme"] = deepcompile_row(param_bytes, param_bytes, world)
    return rows


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def format_table(report: dict[str, Any]) -> str:
    lines = ["| model | stage | scheme | collectives | payload / step | wire / rank / step | x graphzero wire |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for item in report["runs"]:
        base = item["rows"].get("graphzero-rs", {}).get("wire_bytes")
        for name, row in item["rows"].items():
            ratio = f"{row['wire_bytes'] / base:.2f}" if base else "-"
            lines.append(f"| {item['model']} | {item['stage']} | {LABELS.get(name, name)} | "
                         f"{row['collectives'] if row['collectives'] is not None else '-'} | "
                         f"{_mib(row['payload_bytes'])} | {_mib(row['wire_bytes'])} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gan,transformer")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--tiny", action="store_true", help="tiny workloads (a smoke run)")
    args = p.parse_args(argv)
    extra = ["--tiny"] if args.tiny else []
    runs = []
    for model in args.models.split(","):
        for stage in (int(s) for s in args.stages.split(",")):
            result, summary = measure(model, stage, extra)
            runs.append({"model": model, "stage": stage, "world_size": result["workload"]["world_size"],
                         "param_bytes": result["workload"]["param_bytes"],
                         "rows": rows_for(result, summary, stage)})
    report = {"schema": 1, "command": " ".join(["graphzero-wire-bytes", *(argv or sys.argv[1:])]), "runs": runs}
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
