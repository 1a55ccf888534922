"""graphzero-dump: inspect the dump directory that the graphzero backend writes.

The directory layout and `summary.json` schema are specified in docs/dump-format.md. This module only
reads files (and, for `run`, starts a subprocess): it must not import torch or graphzero, so that it
starts fast and works while the backend is broken.
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

log = logging.getLogger(__name__)

PROG = "graphzero-dump"
SUPPORTED_FORMAT = 1
INPUT_FILE = "backward/000_input.py"
COUNT_FIELDS = ("params", "numel", "buckets", "reduce_scatter", "all_reduce", "all_gather", "fp32_accumulate")
TABLE_HEADERS = ("engine", "stage", *COUNT_FIELDS, "bytes/step")
RANK_DIR = re.compile(r"rank(\d+)")
# `name = ...` or `name: "f32[4]" = ...` (GraphModule.print_readable) at the start of a code line.
NODE_DEFINITION = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)")

EXAMPLES = """\
examples:
  graphzero-dump ./dump                        engine table of every graph
  graphzero-dump ./dump --json                 the same as JSON
  graphzero-dump ./dump --rank 1               one rank of a dump_ranks="all" dump
  graphzero-dump ./dump --pass bucket          backward code after pass "bucket" (only graph)
  graphzero-dump ./dump --graph g1 --pass bucket --diff
                                               what pass "bucket" changed in graph g1
  graphzero-dump ./dump --html report.html     self-contained HTML report
  graphzero-dump run train.py --epochs 1       run a script with dumping on, then the table
  graphzero-dump run -n 2 --dump-dir d train.py
                                               the same with torch.distributed.run, 2 processes

A dump directory that is literally called "run" must be given as ./run.
"""

RUN_EXAMPLES = """\
Options of graphzero-dump go before SCRIPT; everything after SCRIPT is passed to the script.
The script runs with GRAPHZERO_DUMP_DIR set; with -n > 1 it is started by
`python -m torch.distributed.run --nproc-per-node N --standalone SCRIPT ARGS`.
A non-zero exit code of the script is returned by graphzero-dump.

examples:
  graphzero-dump run train.py --lr 1e-3
  graphzero-dump run -n 2 --dump-dir ./dump train.py
  graphzero-dump run --html report.html train.py
"""


class DumpError(Exception):
    """A problem with the user's input or run: reported as one line on stderr, then exit `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(" ".join(message.split()))
        self.code = code


# ----------------------------------------------------------------------------------------------
# Model of a dump
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InsertedNode:
    """A node a pass inserted, from `passes[].inserted`."""

    node: str
    engine: str
    op: str
    why: str


@dataclass(frozen=True)
class PassInfo:
    """One graph pass: its name, its code file (relative to the graph dir) and what it changed."""

    name: str
    file: str
    inserted: tuple[InsertedNode, ...]
    erased: tuple[str, ...]


@dataclass(frozen=True)
class EngineStats:
    """What graphzero did for one engine in one graph."""

    name: str
    stage: int | None
    counts: Mapping[str, int]
    comm_bytes_per_step: int
    comm_bytes_by_dtype: Mapping[str, int]

    def as_json(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "stage": self.stage,
            **self.counts,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "comm_bytes_by_dtype": dict(self.comm_bytes_by_dtype),
        }


@dataclass(frozen=True)
class GraphInfo:
    """One compiled Dynamo graph of a dump."""

    id: str
    dir: Path
    inner: str
    graph_breaks: int | None
    passes: tuple[PassInfo, ...]
    engines: tuple[EngineStats, ...]


@dataclass(frozen=True)
class Dump:
    """One dump directory (the dump of one rank)."""

    root: Path
    label: str | None
    format: int
    version: str | None
    world_size: int | None
    rank: int | None
    graph_breaks: int | None
    graphs: tuple[GraphInfo, ...]


_MISSING = object()


def _field(
    obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = _MISSING
) -> Any:
    """`obj[key]` checked to be of `kind` (bool never counts as int); DumpError names `where`."""
    if key not in obj or obj[key] is None:
        if default is _MISSING:
            raise DumpError(f"{where}: missing '{key}'")
        return default
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise DumpError(f"{where}: '{key}' must be {names}, got {json.dumps(value)[:40]}")
    return value


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise DumpError(f"{where}: expected a JSON object")
    return value


def parse_engines(raw: Any, where: str) -> tuple[EngineStats, ...]:
    """`engines` is a dict name -> stats; a list of stats is named engine0, engine1, ..."""
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, list):
        items = [(f"engine{i}", stats) for i, stats in enumerate(raw)]
    else:
        raise DumpError(f"{where}: 'engines' must be an object or a list")
    engines = []
    for name, raw_stats in items:
        here = f"{where}.engines.{name}"
        stats = _mapping(raw_stats, here)
        by_dtype = _mapping(_field(stats, "comm_bytes_by_dtype", dict, here, {}), here)
        engines.append(
            EngineStats(
                name=str(name),
                stage=_field(stats, "stage", int, here, None),
                counts={key: _field(stats, key, int, here, 0) for key in COUNT_FIELDS},
                comm_bytes_per_step=_field(stats, "comm_bytes_per_step", int, here, 0),
                comm_bytes_by_dtype={str(k): _field(by_dtype, k, int, here) for k in by_dtype},
            )
        )
    return tuple(engines)


def parse_pass(raw: Any, index: int, where: str) -> PassInfo:
    """One entry of `passes` (index is 1-based, used for the default file name)."""
    raw = _mapping(raw, where)
    name = _field(raw, "name", str, where)
    inserted = []
    for i, raw_node in enumerate(_field(raw, "inserted", list, where, [])):
        here = f"{where}.inserted[{i}]"
        node = _mapping(raw_node, here)
        inserted.append(
            InsertedNode(
                node=_field(node, "node", str, here),
                engine=_field(node, "engine", str, here, "?"),
                op=_field(node, "op", str, here, ""),
                why=_field(node, "why", str, here, ""),
            )
        )
    return PassInfo(
        name=name,
        file=_field(raw, "file", str, where, f"backward/{index:03d}_{name}.py"),
        inserted=tuple(inserted),
        erased=tuple(str(e) for e in _field(raw, "erased", list, where, [])),
    )


def parse_graph(raw: Any, root: Path, where: str) -> GraphInfo:
    raw = _mapping(raw, where)
    graph_id = _field(raw, "id", str, where)
    where = f"{where} ({graph_id})"
    passes = _field(raw, "passes", list, where, [])
    return GraphInfo(
        id=graph_id,
        dir=root / graph_id,
        inner=_field(raw, "inner", str, where, "?"),
        graph_breaks=_field(raw, "graph_breaks", int, where, None),
        passes=tuple(parse_pass(p, i + 1, f"{where}.passes[{i}]") for i, p in enumerate(passes)),
        engines=parse_engines(_field(raw, "engines", (dict, list), where, {}), where),
    )


def parse_summary(data: Any, root: Path, label: str | None, where: str) -> Dump:
    """Validate a decoded summary.json into a Dump; every problem is a one-line DumpError."""
    data = _mapping(data, where)
    fmt = _field(data, "format", int, where, SUPPORTED_FORMAT)
    if fmt > SUPPORTED_FORMAT:
        raise DumpError(f"{where}: dump format {fmt} is newer than this {PROG} reads ({SUPPORTED_FORMAT})")
    graphs = _field(data, "graphs", list, where)
    return Dump(
        root=root,
        label=label,
        format=fmt,
        version=_field(data, "graphzero_version", str, where, None),
        world_size=_field(data, "world_size", int, where, None),
        rank=_field(data, "rank", int, where, None),
        graph_breaks=_field(data, "graph_breaks", int, where, None),
        graphs=tuple(parse_graph(g, root, f"{where}: graphs[{i}]") for i, g in enumerate(graphs)),
    )


def read_text(path: Path, what: str) -> str:
    """The text of `path`, or a DumpError saying which `what` is missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DumpError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: a NUL in the path
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise DumpError(f"cannot read {what} {path}: {reason}") from None


def load_dump(root: Path, label: str | None = None) -> Dump:
    """Read and validate `root/summary.json`."""
    path = root / "summary.json"
    text = read_text(path, "summary")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DumpError(f"{path}: invalid JSON: {exc}") from None
    log.debug("loaded %s", path)
    return parse_summary(data, root, label, str(path))


def find_rank_dirs(root: Path) -> list[tuple[int, Path]]:
    """The `rank<k>/` subdirectories of a dump_ranks="all" dump, by rank."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := RANK_DIR.fullmatch(p.name))]
    return sorted(found)


def open_dumps(root: Path, rank: int | None = None) -> list[Dump]:
    """The dump in `root`, or one per `rank<k>/` subdirectory (only rank `rank` when given)."""
    if not root.exists():
        raise DumpError(f"{root}: no such directory")
    if not root.is_dir():
        raise DumpError(f"{root}: not a directory")
    if (root / "summary.json").exists():
        dump = load_dump(root)
        if rank is not None and dump.rank not in (None, rank):
            raise DumpError(f"{root} holds the dump of rank {dump.rank} only, not rank {rank}")
        return [dump]
    ranks = find_rank_dirs(root)
    if not ranks:
        raise DumpError(f"{root}: no summary.json and no rank<k>/ directories: not a graphzero dump")
    if rank is not None:
        ranks = [(k, p) for k, p in ranks if k == rank]
        if not ranks:
            have = ", ".join(str(k) for k, _ in find_rank_dirs(root))
            raise DumpError(f"{root}: no rank{rank}/ directory (ranks: {have})")
    return [load_dump(path, label=f"rank {k}") for k, path in ranks]


# ----------------------------------------------------------------------------------------------
# Selecting graphs and passes, reading code
# ----------------------------------------------------------------------------------------------


def _names(items: Iterable[str]) -> str:
    return ", ".join(items) or "none"


def select_graph(dump: Dump, graph_id: str | None) -> GraphInfo:
    """The graph `graph_id`; without one, the only graph of the dump."""
    graph_ids = _names(g.id for g in dump.graphs)
    if graph_id is None:
        if len(dump.graphs) == 1:
            return dump.graphs[0]
        raise DumpError(f"{dump.root} has {len(dump.graphs)} graphs ({graph_ids}): pick one with --graph")
    for graph in dump.graphs:
        if graph.id == graph_id:
            return graph
    raise DumpError(f"unknown graph '{graph_id}' in {dump.root} (graphs: {graph_ids})")


def select_pass(graph: GraphInfo, name: str) -> int:
    """Position in `graph.passes` of the pass called `name` (or whose file stem is `name`)."""
    for i, p in enumerate(graph.passes):
        if name in (p.name, Path(p.file).stem):
            return i
    names = _names(p.name for p in graph.passes)
    raise DumpError(f"unknown pass '{name}' in graph {graph.id} (passes: {names})")


def select_dump(dumps: Sequence[Dump]) -> Dump:
    """The only dump; views of a single graph need --rank when a dump has several ranks."""
    if len(dumps) == 1:
        return dumps[0]
    raise DumpError(f"{dumps[0].root.parent} holds {len(dumps)} ranks: pick one with --rank")


def file_before(graph: GraphInfo, index: int) -> str:
    """The code file of the graph before pass `index`: the previous pass's, or the input."""
    return graph.passes[index - 1].file if index > 0 else INPUT_FILE


def read_code(graph: GraphInfo, rel: str) -> str:
    return read_text(graph.dir / rel, f"graph {graph.id} code file")


def final_file(graph: GraphInfo) -> str:
    """The backward code after the last pass."""
    return graph.passes[-1].file if graph.passes else INPUT_FILE


def inserted_engines(passes: Iterable[PassInfo]) -> dict[str, str]:
    """node name -> engine of every node the given passes inserted."""
    return {n.node: n.engine for p in passes for n in p.inserted}


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


# ----------------------------------------------------------------------------------------------
# Text and JSON views
# ----------------------------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; below 1 KiB plain bytes."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def bytes_cell(n: int) -> str:
    """'4.8 KiB (4936)': human readable and exact."""
    return human_bytes(n) if abs(n) < 1024 else f"{human_bytes(n)} ({n})"


def totals(graph: GraphInfo) -> dict[str, int]:
    """Sums of the count columns and of comm_bytes_per_step over the engines of `graph`."""
    sums = {key: sum(e.counts[key] for e in graph.engines) for key in COUNT_FIELDS}
    sums["comm_bytes_per_step"] = sum(e.comm_bytes_per_step for e in graph.engines)
    return sums


def table_rows(graph: GraphInfo) -> list[list[Any]]:
    """One row per engine plus a totals row, in TABLE_HEADERS order (stage None = blank)."""
    rows: list[list[Any]] = [
        [e.name, e.stage, *(e.counts[k] for k in COUNT_FIELDS), bytes_cell(e.comm_bytes_per_step)]
        for e in graph.engines
    ]
    sums = totals(graph)
    rows.append(["total", None, *(sums[k] for k in COUNT_FIELDS), bytes_cell(sums["comm_bytes_per_step"])])
    return rows


def _or_unknown(value: Any) -> str:
    return "?" if value is None else str(value)


def graph_header(graph: GraphInfo) -> str:
    return f"graph {graph.id}  inner: {graph.inner}  graph breaks: {_or_unknown(graph.graph_breaks)}"


def dump_header(dump: Dump) -> str:
    """One line about the dump as a whole."""
    who = f"rank {_or_unknown(dump.rank)} of world size {_or_unknown(dump.world_size)}"
    version = f"graphzero {dump.version}" if dump.version else "graphzero"
    return (
        f"dump dir: {dump.root}  ({version}, {who}, {len(dump.graphs)} graph(s), "
        f"graph breaks: {_or_unknown(dump.graph_breaks)})"
    )


def graphs_of(dump: Dump, graph_id: str | None) -> tuple[GraphInfo, ...]:
    """All graphs, or only `graph_id` when given."""
    return dump.graphs if graph_id is None else (select_graph(dump, graph_id),)


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


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by the view and `run` parsers."""
    parser.add_argument("--graph", metavar="ID", help="only graph ID (default: all; --pass: the only one)")
    parser.add_argument("--rank", metavar="K", type=int, help='only rank K of a dump_ranks="all" dump')
    parser.add_argument("--pass", dest="pass_name", metavar="NAME", help="the backward code after pass NAME")
    parser.add_argument("--diff", action="store_true", help="with --pass: unified diff before/after the pass")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    out.add_argument("--html", metavar="OUT", help="write a self-contained HTML report to OUT instead")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")


def build_view_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect a graphzero dump directory (see docs/dump-format.md). "
        f"To run a script with dumping on, use `{PROG} run --help`.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dir", metavar="DIR", help="dump directory (GRAPHZERO_DUMP_DIR, options['dump_dir'])")
    add_output_options(parser)
    return parser


def build_run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} run",
        description="Run a training script with graphzero dumping on, then show the dump.",
        epilog=RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", "--nproc", type=int, default=1, metavar="N", help="processes (default 1)")
    parser.add_argument("--dump-dir", metavar="D", help="dump directory (default: a new temporary one)")
    add_output_options(parser)
    parser.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="script arguments")
    return parser


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.diff and not args.pass_name:
        parser.error("--diff needs --pass NAME")
    if args.html and args.pass_name:
        parser.error("--html writes the whole report; it does not take --pass")


def show(args: argparse.Namespace, dumps: Sequence[Dump], root: Path) -> None:
    """Write the view the options ask for (table, code, diff, JSON or HTML)."""
    if args.html:
        from .dump_html import write_html  # the report's code loads only when asked for

        write_html(Path(args.html), dumps, args.graph)
        return
    if args.pass_name:
        graph = select_graph(select_dump(dumps), args.graph)
        index = select_pass(graph, args.pass_name)
        text = (diff_view if args.diff else code_view)(graph, index, args.json)
    elif args.json:
        text = json.dumps(tables_json(dumps, root, args.graph), indent=2)
    else:
        text = render_tables(dumps, args.graph)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def build_run_command(nproc: int, script: str, script_args: Sequence[str]) -> list[str]:
    """The command that runs `script`: plain Python, or torch.distributed.run for nproc > 1."""
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
        return [sys.executable, *launcher, script, *script_args]
    return [sys.executable, script, *script_args]


def exit_status(returncode: int) -> tuple[int, str]:
    """(exit code to propagate, how the script ended) for a subprocess return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return 128 - returncode, f"was killed by {name}"
    return returncode, f"exited with code {returncode}"


def script_stdout(as_json: bool) -> int | None:
    """With --json the script's stdout goes to our stderr so that stdout stays valid JSON."""
    if not as_json:
        return None
    try:
        return sys.stderr.fileno()
    except (AttributeError, io.UnsupportedOperation):
        return subprocess.DEVNULL


def run_script(args: argparse.Namespace) -> Path:
    """Run the user's script with GRAPHZERO_DUMP_DIR set; return the dump directory."""
    if not Path(args.script).is_file():
        raise DumpError(f"{args.script}: no such script", code=1)
    if args.dump_dir:
        dump_dir = Path(args.dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
    else:
        dump_dir = Path(tempfile.mkdtemp(prefix="graphzero-dump-"))
        print(f"{PROG}: dump directory: {dump_dir}", file=sys.stderr)
    command = build_run_command(args.nproc, args.script, args.script_args)
    log.debug("running %s with GRAPHZERO_DUMP_DIR=%s", shlex.join(command), dump_dir)
    env = {**os.environ, "GRAPHZERO_DUMP_DIR": str(dump_dir)}
    try:
        result = subprocess.run(command, env=env, stdout=script_stdout(args.json), check=False)
    except OSError as exc:
        raise DumpError(f"cannot start {command[0]}: {exc.strerror or exc}", code=1) from None
    if result.returncode != 0:
        code, how = exit_status(result.returncode)
        raise DumpError(f"{args.script} {how}", code=code)
    return dump_dir


def run_main(argv: Sequence[str]) -> None:
    """`graphzero-dump run ...`."""
    parser = build_run_parser()
    args = parser.parse_args(argv)
    check_options(parser, args)
    if args.nproc < 1:
        parser.error("-n must be at least 1")
    configure_logging(args.verbose)
    dump_dir = run_script(args)
    try:
        dumps = open_dumps(dump_dir, args.rank)
    except DumpError as exc:
        raise DumpError(f"{args.script} finished but left no usable dump: {exc}", code=1) from None
    show(args, dumps, dump_dir)


def view_main(argv: Sequence[str]) -> None:
    """`graphzero-dump DIR ...`."""
    parser = build_view_parser()
    args = parser.parse_args(argv)
    check_options(parser, args)
    configure_logging(args.verbose)
    root = Path(args.dir)
    show(args, open_dumps(root, args.rank), root)


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format=f"{PROG}: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `graphzero-dump` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["run"]:
            run_main(argv[1:])
        else:
            view_main(argv)
    except DumpError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:  # e.g. `graphzero-dump DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # e.g. an unreadable dump directory
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
