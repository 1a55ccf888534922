"""The report of ``graphzero-compare``: the JSON result (rank 0 merges every rank's records), the
table printed at the end, and the optional bar chart. The notes explain every column.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import platform
import shlex
import statistics
from dataclasses import asdict
from typing import Any

import torch

from .bench_runners import RUNNERS
from .units import human_bytes

log = logging.getLogger("graphzero.compare")

#: Tolerance on max |param - reference param| for "params match", per dtype. fp32: reduction order
#: differs between runners (and Adam magnifies differences on near-zero gradients); bf16: the
#: torch runners compute under autocast / FSDP2 mixed precision, not in pure bf16 like DeepSpeed.
DEFAULT_TOL = {"fp32": 1e-4, "bf16": 5e-2}
#: Keys every runner entry of the JSON has (None where not applicable or failed).
RUNNER_KEYS = (
    "status", "error", "failed_at", "setup_s", "step_ms", "ratio_vs_ddp", "ratio_vs_ds_plain_backward",
    "compile_s", "first_step_ms", "grad_bytes", "optim_bytes", "grad_bytes_per_rank",
    "optim_bytes_per_rank", "peak_rss_mib", "step_rss_growth_mib", "peak_device_mib", "collectives_per_step",
    "bytes_reduced_per_step", "bytes_gathered_per_step", "collectives_by_op", "max_abs_param_diff",
    "params_match", "final_loss", "losses", "graphs", "graph_breaks", "timed_graphs",
    "phase_ms", "ratio_vs_torch_compile_fused", "gathered_peak_bytes", "gathered_peak_source",
    "reductions_per_step", "eager_safety_net_per_step", "collective_ms", "exposed_ms", "hidden_fraction",
    "overlap_per_rank",
)
#: Ratio columns: (baseline runner, JSON key, table header).
RATIOS = (("ddp", "ratio_vs_ddp", "x ddp"), ("ds-plain-backward", "ratio_vs_ds_plain_backward", "x ds-plain"),
          ("torch-compile-fused", "ratio_vs_torch_compile_fused", "x ideal"))
PHASES = ("forward", "backward", "step")
NOTES = [
    ("step ms: wall time of one optimizer step (gas micro-batches + optimizer), slowest rank, after a "
     "barrier; median [min, max] over the timed rounds. Ratios divide medians from this same run."),
    ("fwd / bwd / opt ms: the step's phases, each the median over the timed rounds of the slowest "
     "rank (so they need not add up to the step): forward and backward summed over the gas "
     "micro-batches (graphzero: the compiled forward / backward graphs, the gradient reduction inside "
     "the backward; DeepSpeed's non-boundary engine.step() counts as backward), opt the optimizer step "
     "(DeepSpeed engine.step() per engine, ZeRO-1/2 parameter all-gather included; torch: clip + "
     "AdamW). CUDA events on a GPU, wall clock on CPU."),
    ("compile s: first step minus median step (includes compilation for compiled runners, first-step "
     "allocation for the others)."),
    ("grad / optim: bytes per rank (max over ranks) of live tensors, deduplicated by storage, parameter "
     "storages excluded. grad is counted after the last backward, before the optimizer; optim after it "
     "(DeepSpeed: the ZeRO optimizer's tensors, fp32 master partitions included in optim; torch: p.grad "
     "and optimizer.state). Tensors held only inside C++ (e.g. DDP's reducer beyond the bucket views) "
     "are not seen."),
    ("peak RSS: the process's high-water mark during this runner's memory round, one untimed step "
     "between the measurement round and the timed ones (reset via /proc/self/clear_refs after "
     "malloc_trim; the timed steps are not trimmed, as no training loop is); it includes every other "
     "runner's resident memory in the same process. +step: that peak minus the RSS at the step's start. With CUDA the JSON also "
     "has peak_device_mib (torch.cuda.max_memory_allocated over the timed steps, max over ranks), "
     "also the table's 'peak device MiB' column."),
    ("collectives/step and reduced/step: from torch.profiler over the measurement round, counting the "
     "process-group backend's events (gloo:* / nccl:*), which eager, DeepSpeed, DDP, FSDP2 and compiled "
     "(_c10d_functional) collectives all reach; reduced = input bytes of all_reduce / reduce_scatter / "
     "reduce / all_to_all (graphzero's reduce-scatter on gloo). Collectives that bypass the process group (e.g. DeepSpeed's shm ops) are not counted."),
    ("gathered peak fwd / bwd (ZeRO-3 only): the most bytes of gathered (unsharded) parameters held at "
     "once on a rank in the forward / the backward. (m) measured in the measurement step: before "
     "every aten op, the distinct storages of the parameters held in full (DeepSpeed ZeRO-3: "
     "parameters whose data is not released; FSDP2: parameters registered unsharded), so it is exact "
     "at op granularity. (s) graphzero's compiled schedule, from its dump summary "
     "(gathered_peak_bytes_fwd/bwd): the liveness of the all_gather outputs in the compiled graph, "
     "derived, not measured (inductor may free buffers earlier). Full parameter bytes per rank are "
     "in the title."),
    ("reduced/step (reductions): bytes into, and the number of, all_reduce / reduce_scatter / reduce "
     "/ all_to_all collectives in the measurement step, i.e. per optimizer step (gas micro-batches included). "
     "safety net (graphzero only): gradients that eager autograd accumulated into an engine's parameter "
     "(ZeRO-3: shard) in the measurement step, each one call of graphzero's eager safety net (0 when "
     "every gradient goes through the compiled graphs)."),
    ("coll ms (hidden %): per optimizer step in the measurement round, the slowest rank's time with a "
     "collective in flight (the union of the backend's ranges, gloo:* on its worker threads) and the "
     "share of it that ran while the step thread computed (its innermost operator and inductor-kernel "
     "ranges, waits excluded); exposed = the rest: waiting, or Python between operators. Per rank, with "
     "each rank's timeline, in the JSON (overlap_per_rank); --timeline draws them. CPU only: on CUDA "
     "the collectives run on the device and the column is n/a. On 2 CPU cores a transfer and compute "
     "share the cores, so hidden means overlapped in time, not free."),
    ("max abs dparam: max abs difference of the final full fp32 parameters from the reference runner "
     "(same initial weights and data); 'ok' when within the stated tolerance."),
]


def command_line(argv: list[str]) -> str:
    """The command as a user would retype it (``python -m graphzero_tools.compare`` for ``-m``)."""
    prog = os.path.basename(argv[0]) if argv else "graphzero-compare"
    head = "python -m graphzero_tools.compare" if prog in ("compare.py", "__main__.py", "-c") else prog
    return " ".join([head, *(shlex.quote(a) for a in argv[1:])])


def machine_info(device: torch.device | None = None) -> dict[str, Any]:
    from importlib import metadata

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    cpu_model = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "torch": torch.__version__,
        "deepspeed": version("deepspeed"),
        "graphzero": version("graphzero"),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None,
    }
    return info


def _median_ms(entry: dict[str, Any]) -> float | None:
    return (entry.get("step_ms") or {}).get("median")


def build_result(args, workload, world, backend, device, threads, per_rank: list[dict[str, dict]],
                 diffs: dict[str, float | None], ref_name: str | None, tol: float) -> dict[str, Any]:
    runners: dict[str, dict[str, Any]] = {}
    for name in args.runners:
        ranks = [r[name] for r in per_rank]
        r0 = ranks[0]
        status = next((r["status"] for r in ranks if r["status"] != "ok"), r0["status"])
        entry = {k: None for k in RUNNER_KEYS}
        entry.update(status=status, error=r0["error"], failed_at=r0["failed_at"],
                     setup_s=_round(max((r["setup_s"] or 0.0) for r in ranks), 3),
                     losses=r0["losses"], final_loss=r0["losses"][-1] if r0["losses"] else None,
                     graphs=r0["graphs"] if RUNNERS[name].compiled else None,
                     graph_breaks=r0["graph_breaks"] if RUNNERS[name].compiled else None,
                     timed_graphs=r0["timed_graphs"] if RUNNERS[name].compiled else None)
        if status == "ok":
            steps = [max(vals) * 1e3 for vals in zip(*(r["step_s"] for r in ranks))]
            median = statistics.median(steps)
            first = max(r["first_step_s"] for r in ranks) * 1e3
            coll = r0["collectives"] or {}
            entry.update(
                step_ms={"median": _round(median, 3), "min": _round(min(steps), 3),
                         "max": _round(max(steps), 3), "all": [_round(s, 3) for s in steps]},
                first_step_ms=_round(first, 3), compile_s=_round(max(0.0, first - median) / 1e3, 3),
                grad_bytes_per_rank=[r["grad_bytes"] for r in ranks],
                optim_bytes_per_rank=[r["optim_bytes"] for r in ranks],
                peak_rss_mib=_round(max(r["peak_rss"] for r in ranks) / 2**20, 1),
                step_rss_growth_mib=_round(max(r["rss_growth"] for r in ranks) / 2**20, 1),
                peak_device_mib=(_round(max(r["peak_device"] or 0 for r in ranks) / 2**20, 1)
                                 if r0["peak_device"] is not None else None),
                collectives_per_step=max((r["collectives"] or {}).get("count", 0) for r in ranks),
                bytes_reduced_per_step=max((r["collectives"] or {}).get("bytes_reduced", 0) for r in ranks),
                reductions_per_step=max((r["collectives"] or {}).get("reductions", 0) for r in ranks),
                eager_safety_net_per_step=max((r["safety_net"] for r in ranks if r["safety_net"] is not None),
                                              default=None),
                bytes_gathered_per_step=max((r["collectives"] or {}).get("bytes_gathered", 0) for r in ranks),
                collectives_by_op=coll.get("by_op"),
                phase_ms=_phase_medians([r["phase_s"] for r in ranks]),
                gathered_peak_bytes=next((r["gathered_peak"] for r in ranks if r["gathered_peak"]), None),
                gathered_peak_source=next((r["gathered_source"] for r in ranks if r["gathered_source"]), None),
                overlap_per_rank=[r.get("overlap") for r in ranks],
                max_abs_param_diff=diffs.get(name),
                params_match=None if diffs.get(name) is None else bool(diffs[name] <= tol),
            )
            gb = [b for b in entry["grad_bytes_per_rank"] if b is not None]
            ob = [b for b in entry["optim_bytes_per_rank"] if b is not None]
            entry["grad_bytes"] = max(gb) if gb else None
            entry["optim_bytes"] = max(ob) if ob else None
            overlaps = [o for o in entry["overlap_per_rank"] if o]
            if overlaps and len(overlaps) == len(ranks):
                slowest = max(overlaps, key=lambda o: o["collective_ms"])
                entry.update(collective_ms=slowest["collective_ms"], exposed_ms=max(o["exposed_ms"] for o in overlaps),
                             hidden_fraction=min((o["hidden_fraction"] for o in overlaps
                                                  if o["hidden_fraction"] is not None), default=None))
        runners[name] = entry
    for name, entry in runners.items():
        for base, key, _ in RATIOS:
            mine, theirs = _median_ms(entry), _median_ms(runners.get(base, {}))
            entry[key] = _round(mine / theirs, 3) if mine and theirs else None
    return {
        "schema": 1,
        "command": command_line(args.argv),
        "argv": args.argv,
        "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "workload": {"model": args.model, "description": workload.description, "size": asdict(workload.size),
                     "parts": workload.numel(), "param_bytes": _param_bytes(workload, args.dtype), "stage": args.stage, "dtype": args.dtype, "gas": args.gas,
                     "world_size": world, "backend": backend, "device": device.type,
                     "threads_per_rank": threads, "warmup": args.warmup, "steps": args.steps,
                     "rounds": args.warmup + 2 + args.steps, "seed": args.seed, "lr": args.lr,
                     "malloc": getattr(args, "malloc", "default")},
        "reference": ref_name,
        "tolerance": tol,
        "notes": NOTES,
        "runners": runners,
    }


def _phase_medians(per_rank: list[list[dict[str, float]]]) -> dict[str, float | None]:
    """Per phase: the median over timed rounds of the slowest rank's seconds, in ms."""
    out: dict[str, float | None] = {}
    for phase in PHASES:
        rounds = [max(step.get(phase, 0.0) for step in steps) for steps in zip(*per_rank)]
        out[phase] = _round(statistics.median(rounds) * 1e3, 3) if rounds else None
    return out


def _param_bytes(workload, dtype: str) -> int:
    """Bytes of all parameters, full, in the training dtype (what ZeRO-3 shards and gathers)."""
    return sum(workload.numel().values()) * (2 if dtype == "bf16" else 4)


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(float(x), nd)


def _bytes(n: int | None) -> str:
    return "n/a" if n is None else human_bytes(n)


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _phases(e: dict[str, Any]) -> str:
    ph = e.get("phase_ms") or {}
    return " / ".join(_num(ph.get(k), ".1f") for k in PHASES)


def _gathered(e: dict[str, Any]) -> str:
    peak = e.get("gathered_peak_bytes")
    if not peak:
        return "n/a"
    tag = {"measured": "m", "compiled schedule": "s"}.get(e.get("gathered_peak_source") or "", "?")
    return f"{_bytes(peak.get('forward'))} / {_bytes(peak.get('backward'))} ({tag})"


def _overlap(e: dict[str, Any]) -> str:
    if e.get("collective_ms") is None:
        return "n/a"
    hidden = e.get("hidden_fraction")
    return f"{e['collective_ms']:.1f} ({'-' if hidden is None else f'{100 * hidden:.0f}%'})"


def format_table(result: dict[str, Any]) -> str:
    """The rank-0 report: a tabulate table, then the failures and the notes. The "x ideal" column
    shows only when torch-compile-fused ran, the gathered-parameter peak only with ZeRO-3."""
    from tabulate import tabulate

    ref = result.get("reference")
    w = result["workload"]
    ents = result["runners"]
    ratios = [(key, head) for base, key, head in RATIOS
              if base != "torch-compile-fused" or (ents.get(base) or {}).get("status") == "ok"]
    zero3 = w.get("stage") == 3
    device = any((e.get("peak_device_mib") is not None) for e in ents.values() if e["status"] == "ok")
    headers = ["runner", "status", "step ms med [min, max]", *(h for _, h in ratios), "fwd / bwd / opt ms",
               "compile s", "grad", "optim", *(["gathered peak fwd / bwd"] if zero3 else []),
               "peak RSS MiB", "+step MiB", *(["peak device MiB"] if device else []), "colls/step", "reduced/step (reductions)", "coll ms (hidden %)", "safety net",
               "graphs/breaks (timed)",
               f"max abs dparam vs {ref or 'n/a'}"]
    rows, failures = [], []
    for name, e in ents.items():
        status = e["status"]
        if status != "ok":
            failures.append(f"[{len(failures) + 1}] {name}: {status}"
                            f"{' at ' + e['failed_at'] if e.get('failed_at') and status == 'failed' else ''}: "
                            f"{e['error']}")
            rows.append([name, f"{status} [{len(failures)}]"] + ["-"] * (len(headers) - 2))
            continue
        s = e["step_ms"]
        diff = e["max_abs_param_diff"]
        diff_s = "ref" if name == ref else "n/a" if diff is None else (
            f"{diff:.1e} {'ok' if e['params_match'] else 'DIFFERS'}")
        gb = "-" if e["graphs"] is None else f"{e['graphs']}/{e['graph_breaks']} ({e['timed_graphs']})"
        rows.append([name, "ok", f"{s['median']:.1f} [{s['min']:.1f}, {s['max']:.1f}]",
                     *(_num(e.get(key), ".2f") for key, _ in ratios), _phases(e),
                     _num(e["compile_s"], ".1f"), _bytes(e["grad_bytes"]), _bytes(e["optim_bytes"]),
                     *([_gathered(e)] if zero3 else []),
                     _num(e["peak_rss_mib"], ".0f"), _num(e["step_rss_growth_mib"], ".1f"),
                     *([_num(e.get("peak_device_mib"), ".0f")] if device else []),
                     e["collectives_per_step"], f"{_bytes(e['bytes_reduced_per_step'])} ({e['reductions_per_step']})",
                     _overlap(e),
                     "-" if e["eager_safety_net_per_step"] is None else e["eager_safety_net_per_step"], gb, diff_s])
    params = f", parameters {_bytes(w['param_bytes'])} in full" if w.get("param_bytes") else ""
    title = (f"graphzero-compare: {w['model']} ({w['description']}), ZeRO-{w['stage']}, {w['dtype']}, "
             f"gas {w['gas']}, {w['world_size']} ranks {w['backend']}/{w['device']}, "
             f"{w['steps']} timed steps after {w['warmup']} warm-up + 1 measurement + 1 memory round{params}"
             + (", malloc: retain" if w.get("malloc") == "retain" else ""))
    lines = [title, tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)]
    if failures:
        lines += ["", "not run / failed:"] + failures
    lines += ["", f"tolerance for 'ok' params: {result['tolerance']:g}"]
    lines += [f"- {n}" for n in result["notes"]]
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")
    log.info("wrote %s", path)


def write_plot(result: dict[str, Any], path: str) -> bool:
    """Bar chart per runner: step time (median, min-max whiskers), gradient + optimizer-state bytes per
    rank, and RSS growth within a step (peak RSS is process-wide, so nearly equal for all)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    names = list(result["runners"])
    ents = [result["runners"][n] for n in names]
    ok = [e["status"] == "ok" for e in ents]
    x = list(range(len(names)))
    fig, axes = plt.subplots(1, 3, figsize=(max(9, 1.6 * len(names) * 1.5), 4.2))
    med = [e["step_ms"]["median"] if k else 0 for e, k in zip(ents, ok)]
    lo = [e["step_ms"]["median"] - e["step_ms"]["min"] if k else 0 for e, k in zip(ents, ok)]
    hi = [e["step_ms"]["max"] - e["step_ms"]["median"] if k else 0 for e, k in zip(ents, ok)]
    axes[0].bar(x, med, yerr=[lo, hi], capsize=3, color="tab:blue")
    axes[0].set_ylabel("step time, ms (median, min-max)")
    mib = 2**20
    grad = [(e["grad_bytes"] or 0) / mib if k else 0 for e, k in zip(ents, ok)]
    opt = [(e["optim_bytes"] or 0) / mib if k else 0 for e, k in zip(ents, ok)]
    axes[1].bar(x, grad, label="gradients", color="tab:orange")
    axes[1].bar(x, opt, bottom=grad, label="optimizer state", color="tab:green")
    axes[1].set_ylabel("MiB per rank")
    axes[1].legend(fontsize=8)
    axes[2].bar(x, [(e["step_rss_growth_mib"] or 0) if k else 0 for e, k in zip(ents, ok)], color="tab:gray")
    axes[2].set_ylabel("RSS growth within a step, MiB")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        for i, k in enumerate(ok):
            if not k:
                ax.text(i, 0, ents[i]["status"], rotation=90, ha="center", va="bottom", fontsize=8, color="red")
    w = result["workload"]
    fig.suptitle(f"{w['model']} ZeRO-{w['stage']} {w['dtype']} gas {w['gas']}, {w['world_size']} ranks "
                 f"{w['backend']} ({result['date'][:10]})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote %s", path)
    return True
