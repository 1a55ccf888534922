"""The dump that the graphzero backend writes, as read by graphzero-dump: the data model
(`Dump`, `GraphInfo`, `PassInfo`, ...), loading and validating `summary.json` (docs/dump-format.md),
finding the per-rank dumps, and selecting a graph, a pass and its code files.

Reads files only; imports neither torch nor graphzero, so that graphzero-dump starts fast and works
while the backend is broken.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROG = "graphzero-dump"
SUPPORTED_FORMAT = 1
INPUT_FILE = "backward/000_input.py"
COUNT_FIELDS = ("params", "numel", "buckets", "reduce_scatter", "all_reduce", "all_gather", "fp32_accumulate")
# ZeRO-3 parameter gathers per step, forward and backward graph: collectives and their output bytes
GATHER_FIELDS = ("all_gather_fwd", "all_gather_bytes_fwd", "all_gather_bwd", "all_gather_bytes_bwd")
# the most bytes of gathered parameters alive at once in the forward / backward graph (per graph)
PEAK_FIELDS = ("gathered_peak_bytes_fwd", "gathered_peak_bytes_bwd")
RANK_DIR = re.compile(r"rank(\d+)")


class DumpError(Exception):
    """A problem with the user's input or run: reported as one line on stderr, then exit `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(" ".join(message.split()))
        self.code = code


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
                counts={key: _field(stats, key, int, here, 0) for key in COUNT_FIELDS + GATHER_FIELDS + PEAK_FIELDS},
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


def graphs_of(dump: Dump, graph_id: str | None) -> tuple[GraphInfo, ...]:
    """All graphs, or only `graph_id` when given."""
    return dump.graphs if graph_id is None else (select_graph(dump, graph_id),)
