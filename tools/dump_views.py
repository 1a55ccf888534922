"""The text and JSON views of graphzero-dump: the per-engine table of each graph, the backward code
after a pass and the diff a pass made, with the nodes graphzero inserted marked by engine.
The HTML report (dump_html.py) builds on the same tables and code entries.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from .dump_model import (
    COUNT_FIELDS,
    GATHER_FIELDS,
    PEAK_FIELDS,
    Dump,
    GraphInfo,
    PassInfo,
    file_before,
    graphs_of,
    inserted_engines,
    read_code,
)
from .units import human_bytes

# the reduce-scatters, then the ZeRO-3 gathers per step (forward, backward), then the rest
_COUNTS_BEFORE_GATHERS = ("params", "numel", "buckets", "reduce_scatter", "all_reduce")
_COUNTS_AFTER_GATHERS = ("fp32_accumulate",)
GATHER_HEADERS = ("gathers fwd", "gather bytes fwd", "gathers bwd", "gather bytes bwd")
TABLE_HEADERS = ("engine", "stage", *_COUNTS_BEFORE_GATHERS, *GATHER_HEADERS, *_COUNTS_AFTER_GATHERS, "bytes/step")
# `name = ...` or `name: "f32[4]" = ...` (GraphModule.print_readable) at the start of a code line.
NODE_DEFINITION = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)")

# A line of code or diff together with the engine of the graphzero node it defines (or None).
Entry = tuple[str, str | None]


def defined_node(code_line: str) -> str | None:
    """The name a line of FX code assigns to, if any."""
    match = NODE_DEFINITION.match(code_line)
    return match.group(1) if match else None


def code_entries(code: str, engines: Mapping[str, str]) -> list[Entry]:
    """The lines of `code` (blank lines around it dropped), each with the engine of the node it defines."""
    lines = code.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return [(line, engines.get(defined_node(line) or "")) for line in lines]


def diff_entries(graph: GraphInfo, index: int) -> list[Entry]:
    """Unified diff of the backward code before/after pass `index`; added node definitions get engines."""
    before_rel, after_rel = file_before(graph, index), graph.passes[index].file
    lines = difflib.unified_diff(
        read_code(graph, before_rel).splitlines(),
        read_code(graph, after_rel).splitlines(),
        fromfile=f"{graph.id}/{before_rel}",
        tofile=f"{graph.id}/{after_rel}",
        lineterm="",
    )
    engines = inserted_engines(graph.passes[index : index + 1])
    entries: list[Entry] = []
    for n, line in enumerate(lines):
        is_added_code = n >= 2 and line.startswith("+")  # lines 0-1 are the ---/+++ file headers
        entries.append((line, engines.get(defined_node(line[1:]) or "") if is_added_code else None))
    return entries


def bytes_cell(n: int) -> str:
    """'4.8 KiB (4936)': human readable and exact."""
    return human_bytes(n) if abs(n) < 1024 else f"{human_bytes(n)} ({n})"


def totals(graph: GraphInfo) -> dict[str, int]:
    """Sums of the count and gather columns and of comm_bytes_per_step over the engines of `graph`."""
    sums = {key: sum(e.counts[key] for e in graph.engines) for key in COUNT_FIELDS + GATHER_FIELDS}
    sums["comm_bytes_per_step"] = sum(e.comm_bytes_per_step for e in graph.engines)
    return sums


def gathered_peaks(graph: GraphInfo) -> dict[str, int]:
    """The graph's peak bytes of gathered parameters, forward and backward (one value per graph)."""
    return {key: max((e.counts[key] for e in graph.engines), default=0) for key in PEAK_FIELDS}


def _row(name: str, stage: int | None, counts: Mapping[str, int], comm_bytes: int) -> list[Any]:
    fwd, fwd_bytes, bwd, bwd_bytes = (counts[k] for k in GATHER_FIELDS)
    return [name, stage, *(counts[k] for k in _COUNTS_BEFORE_GATHERS),
            fwd, bytes_cell(fwd_bytes), bwd, bytes_cell(bwd_bytes),
            *(counts[k] for k in _COUNTS_AFTER_GATHERS), bytes_cell(comm_bytes)]


def table_rows(graph: GraphInfo) -> list[list[Any]]:
    """One row per engine plus a totals row, in TABLE_HEADERS order (stage None = blank)."""
    rows = [_row(e.name, e.stage, e.counts, e.comm_bytes_per_step) for e in graph.engines]
    sums = totals(graph)
    rows.append(_row("total", None, sums, sums["comm_bytes_per_step"]))
    return rows


def or_unknown(value: Any) -> str:
    """A value of the summary, or "?" where the dump does not say."""
    return "?" if value is None else str(value)


def graph_header(graph: GraphInfo) -> str:
    text = f"graph {graph.id}  inner: {graph.inner}  graph breaks: {or_unknown(graph.graph_breaks)}"
    peaks = gathered_peaks(graph)
    if any(peaks.values()):
        text += (f"  gathered peak: fwd {bytes_cell(peaks['gathered_peak_bytes_fwd'])}, "
                 f"bwd {bytes_cell(peaks['gathered_peak_bytes_bwd'])}")
    return text


def dump_header(dump: Dump) -> str:
    """One line about the dump as a whole."""
    who = f"rank {or_unknown(dump.rank)} of world size {or_unknown(dump.world_size)}"
    version = f"graphzero {dump.version}" if dump.version else "graphzero"
    return (
        f"dump dir: {dump.root}  ({version}, {who}, {len(dump.graphs)} graph(s), "
        f"graph breaks: {or_unknown(dump.graph_breaks)})"
    )


def render_tables(dumps: Sequence[Dump], graph_id: str | None) -> str:
    """The engine tables of every (selected) graph of every dump."""
    blocks = []
    for dump in dumps:
        blocks.append(dump_header(dump))
        for graph in graphs_of(dump, graph_id):
            table = tabulate(table_rows(graph), headers=TABLE_HEADERS, tablefmt="github", missingval="")
            blocks.append(f"{graph_header(graph)}\n{table}")
    return "\n\n".join(blocks) + "\n"


def dump_json(dump: Dump, graph_id: str | None) -> dict[str, Any]:
    return {
        "dump_dir": str(dump.root),
        "format": dump.format,
        "graphzero_version": dump.version,
        "world_size": dump.world_size,
        "rank": dump.rank,
        "graph_breaks": dump.graph_breaks,
        "graphs": [
            {
                "id": g.id,
                "inner": g.inner,
                "graph_breaks": g.graph_breaks,
                "engines": [e.as_json() for e in g.engines],
                "totals": totals(g),
                **gathered_peaks(g),
            }
            for g in graphs_of(dump, graph_id)
        ],
    }


def tables_json(dumps: Sequence[Dump], root: Path, graph_id: str | None) -> dict[str, Any]:
    """The table data; a dump_ranks="all" directory gives {"dump_dir", "ranks": [...]}."""
    if len(dumps) == 1 and dumps[0].root == root:
        return dump_json(dumps[0], graph_id)
    return {"dump_dir": str(root), "ranks": [dump_json(d, graph_id) for d in dumps]}


def marked(entry: Entry) -> str:
    """A code/diff line with the ` # [graphzero:<engine>]` marker when it defines an inserted node."""
    line, engine = entry
    return line if engine is None else f"{line} # [graphzero:{engine}]"


def inserted_json(p: PassInfo) -> list[dict[str, str]]:
    return [{"node": n.node, "engine": n.engine, "op": n.op, "why": n.why} for n in p.inserted]


def render_inserted(p: PassInfo) -> str:
    """The nodes pass `p` inserted (and the names it erased) as text."""
    if not p.inserted:
        text = f"pass {p.name} inserted no nodes"
    else:
        rows = [[n.node, n.engine, n.op, n.why] for n in p.inserted]
        table = tabulate(rows, headers=("node", "engine", "op", "why"), tablefmt="github")
        text = f"pass {p.name} inserted {len(p.inserted)} node(s):\n{table}"
    if p.erased:
        text += f"\npass {p.name} erased: {', '.join(p.erased)}"
    return text


def diff_view(graph: GraphInfo, index: int, as_json: bool) -> str:
    """`--pass NAME --diff`: the diff before/after the pass and the nodes it inserted."""
    p = graph.passes[index]
    diff = "\n".join(marked(e) for e in diff_entries(graph, index))
    if as_json:
        payload = {"graph": graph.id, "pass": p.name, "diff": diff, "inserted": inserted_json(p)}
        return json.dumps(payload, indent=2)
    body = diff or f"(pass {p.name} did not change the code)"
    return f"{body}\n\n{render_inserted(p)}"


def code_view(graph: GraphInfo, index: int, as_json: bool) -> str:
    """`--pass NAME`: the backward code after the pass, nodes inserted so far marked."""
    p = graph.passes[index]
    code = read_code(graph, p.file)
    if as_json:
        payload = {"graph": graph.id, "pass": p.name, "file": p.file, "code": code}
        payload["inserted"] = inserted_json(p)
        return json.dumps(payload, indent=2)
    engines = inserted_engines(graph.passes[: index + 1])
    return "\n".join(marked(e) for e in code_entries(code, engines))
