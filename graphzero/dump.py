"""The graph dump (docs/dump-format.md): graph code before/after each pass and summary.json.

Passes record what they did in the PassContext; this module only collects and writes, and emits
each stage as a ``trace_structured`` artifact for tlparse.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import fx
from torch._logging import trace_structured

from .options import Options
from .ownership import Ownership
from .passes import PassContext

log = logging.getLogger("graphzero")

FORMAT_VERSION = 1
_RUN_ID = uuid.uuid4().hex  # tells this process's summary.json apart from a stale one


def graph_code(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class GraphDump:
    """Writes one compiled graph's stages; `summary.json` once its backward is done."""

    def __init__(self, root: Path | None, graph_id: str, inner: str) -> None:
        self.root = root
        self.graph_id = graph_id
        self.inner = inner
        self.passes: list[dict[str, Any]] = []
        self.breaks_at_compile = _graph_breaks()
        self._stage = 0
        self.extra: dict[str, Any] = {}

    @classmethod
    def for_graph(cls, opts: Options, graph_id: str) -> GraphDump:
        root = None
        if opts.dump_dir:
            rank = _rank()
            if opts.dump_ranks == "all":
                root = Path(opts.dump_dir) / f"rank{rank}"
            elif rank == 0:
                root = Path(opts.dump_dir)
        return cls(root, graph_id, opts.inner)

    def variant(self, label: str) -> GraphDump:
        """The dump of one backward variant of this graph, as graph ``<graph id>-<label>``."""
        dump = GraphDump(self.root, f"{self.graph_id}-{label}", self.inner)
        dump.breaks_at_compile = self.breaks_at_compile
        dump.extra = {"variant": label, "variant_of": self.graph_id}
        return dump

    def _write(self, rel: str, gm: fx.GraphModule) -> None:
        # Printing a graph costs compile time: only when tracing (tlparse) or dumping asks for it.
        trace_structured("artifact", metadata_fn=lambda: {"name": f"graphzero_{self.graph_id}_{rel}",
                                                          "encoding": "string"}, payload_fn=lambda: graph_code(gm))
        if self.root is None:
            return
        path = self.root / self.graph_id / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(graph_code(gm))
        except OSError as e:  # only rank 0 writes: an error here must not desync the ranks
            log.warning("graphzero dump: cannot write %s: %s", path, e)

    def forward(self, gm: fx.GraphModule) -> None:
        self._write("forward/000_input.py", gm)

    def forward_stage(self, name: str, gm: fx.GraphModule) -> None:
        self._write(f"forward/001_{name}.py", gm)

    def backward_stage(self, name: str, gm: fx.GraphModule) -> None:
        rel = f"backward/{self._stage:03d}_{name}.py"
        self._write(rel, gm)
        if self._stage > 0:
            inserted = [{"node": n.name, "engine": n.meta["graphzero"]["engine"], "op": str(n.target),
                         "why": n.meta["graphzero"]["why"]}
                        for n in gm.graph.nodes if n.meta.get("graphzero", {}).get("pass") == name]
            self.passes.append({"name": name, "file": rel, "inserted": inserted})
        self._stage += 1

    def finish(self, ctx: PassContext, ownership: Ownership) -> dict[str, Any]:
        engines = {}
        for ps in ownership.param_sets:
            owned = [o for o in ownership.inputs.values() if o.param_set is ps]
            stats = ctx.stats.get(ps, {})
            name = ps.name if ps.name not in engines else f"{ps.name}#{len(engines)}"
            engines[name] = {
                "stage": ps.stage, "frozen": not ps.groups, "params": len(owned), "numel": sum(_full_numel(o) for o in owned),
                **{k: stats.get(k, 0) for k in ("buckets", "reduce_scatter", "all_reduce")},
                "all_gather": stats.get("all_gather_fwd", 0) + stats.get("all_gather_bwd", 0),
                # ZeRO-3 gathers per step, their bytes and peak alive; ZeRO-1 gas > 1 local accumulation
                **{k: stats.get(k, 0) for k in (
                    "all_gather_fwd", "all_gather_bwd", "all_gather_bytes_fwd", "all_gather_bytes_bwd",
                    "gathered_peak_bytes_fwd", "gathered_peak_bytes_bwd", "fp32_accumulate", "local_accumulate",
                    "comm_bytes_per_step")},
                "comm_bytes_by_dtype": stats.get("comm_bytes_by_dtype", {}),
                "grad_dtype": str(owned[0].param.dtype).removeprefix("torch.") if owned else None,
                "comm_dtype": str(ps.comm_dtype).removeprefix("torch."),
                "accum_dtype": str(ps.accum_dtype).removeprefix("torch."),
                "world_size": ps.world_size, "collective_group": ps.group_name,
            }
        record = {"id": self.graph_id, "graph_breaks": self.breaks_at_compile, "inner": self.inner,
                  "passes": self.passes, "engines": engines, **self.extra}
        for name, e in engines.items():
            log.info("graph %s engine %r: %d params, %d buckets, %d reduce-scatter, %d all-reduce, %d B/step",
                     self.graph_id, name, e["params"], e["buckets"], e["reduce_scatter"], e["all_reduce"],
                     e["comm_bytes_per_step"])
        if self.root is not None:
            try:
                self._update_summary(record)
            except OSError as e:
                log.warning("graphzero dump: cannot write the summary under %s: %s", self.root, e)
        return record

    def _update_summary(self, record: dict[str, Any]) -> None:
        path = self.root / "summary.json"
        summary = None
        if path.exists():
            try:
                summary = json.loads(path.read_text())
            except ValueError:
                summary = None
        if not summary or summary.get("run_id") != _RUN_ID:
            summary = {"format": FORMAT_VERSION, "graphzero_version": _version(), "run_id": _RUN_ID,
                       "world_size": _world(), "rank": _rank(), "graphs": []}
        summary["graphs"] = [g for g in summary["graphs"] if g["id"] != record["id"]] + [record]
        summary["graph_breaks"] = _graph_breaks()
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, path)
        log.info("graphzero dump: %s", path)


def _graph_breaks() -> int:
    """Dynamo's graph breaks so far in this process (since the last ``torch._dynamo.utils.counters.clear()``)."""
    import torch
    return int(sum(torch._dynamo.utils.counters["graph_break"].values()))


def _full_numel(owned) -> int:
    """Elements of the owned parameter (ZeRO-3: its full size, not its empty placeholder)."""
    group = owned.param_set.groups[owned.group]
    if group.presharded and group.full_numels:
        return group.full_numels[owned.position]
    return owned.param.numel()


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("graphzero")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "0+unknown"
