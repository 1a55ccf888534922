"""The self-contained HTML report of ``graphzero-dump --html``: per graph the engine table, every
pass's diff (added lines green, removed red) and the final backward code with graphzero's nodes
highlighted per engine. No external resources, no JavaScript."""
from __future__ import annotations

import html
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .dump_model import (
    Dump,
    DumpError,
    GraphInfo,
    PassInfo,
    final_file,
    graphs_of,
    inserted_engines,
    read_code,
)
from .dump_views import TABLE_HEADERS, Entry, code_entries, diff_entries, dump_header, or_unknown, table_rows

log = logging.getLogger(__name__)

# (light background of inserted code, strong colour of the engine label)
ENGINE_COLORS = (
    ("#dbeafe", "#1d4ed8"),
    ("#fef3c7", "#b45309"),
    ("#ede9fe", "#6d28d9"),
    ("#cffafe", "#0e7490"),
    ("#fce7f3", "#be185d"),
    ("#e5e7eb", "#374151"),
)

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; color: #1f2328;
       margin: 0; background: #f6f8fa; }
main { max-width: 1140px; margin: 0 auto; padding: 20px 24px 48px; background: #fff; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 28px 0 6px; padding-top: 10px; border-top: 2px solid #d0d7de; }
h3 { font-size: 16px; margin: 20px 0 6px; }
.meta { color: #57606a; margin: 2px 0 10px; }
nav a { margin-right: 10px; }
table { border-collapse: collapse; margin: 6px 0 10px; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d0d7de; padding: 3px 9px; }
th { background: #f6f8fa; text-align: left; }
td.num { text-align: right; }
table.engines tbody tr:last-child td { font-weight: 600; background: #f6f8fa; border-top: 2px solid #8c959f; }
pre { font: 12.5px/1.4 "DejaVu Sans Mono", Menlo, Consolas, monospace; background: #f6f8fa;
      border: 1px solid #d0d7de; border-radius: 6px; padding: 8px 0; overflow-x: auto; }
pre .l { display: block; padding: 0 12px; min-height: 1.4em; white-space: pre; }
.add { background: #dafbe1; } .del { background: #ffebe9; } .hunk { color: #0550ae; background: #ddf4ff; }
.file { color: #57606a; font-weight: 600; }
.chip { display: inline-block; border-radius: 9px; padding: 0 8px; margin-left: 10px; color: #fff;
        font: 600 11px/1.6 system-ui, "DejaVu Sans", sans-serif; vertical-align: 1px; }
details { margin: 8px 0; } summary { cursor: pointer; font-weight: 600; }
.legend .chip, td .chip { margin: 0 6px 0 0; }
"""


def engine_palette(dumps: Sequence[Dump]) -> dict[str, int]:
    """Colour index of every engine named in any table or inserted node, in order of appearance."""
    palette: dict[str, int] = {}
    for dump in dumps:
        for graph in dump.graphs:
            names = [e.name for e in graph.engines] + [n.engine for p in graph.passes for n in p.inserted]
            for name in names:
                palette.setdefault(name, len(palette) % len(ENGINE_COLORS))
    return palette


def palette_css(colors: Sequence[tuple[str, str]] = ENGINE_COLORS) -> str:
    """One class per colour: `.eK` for inserted lines, `.chip.eK` for labels."""
    rules = (f".e{i} {{ background: {bg}; }} .chip.e{i} {{ background: {fg}; }}"
             for i, (bg, fg) in enumerate(colors))
    return "\n".join(rules) + "\n"


class Html(str):
    """A string that is already HTML (not escaped again by html_cell)."""


def chip(engine: str, palette: Mapping[str, int]) -> Html:
    """The coloured label of an engine."""
    return Html(f'<span class="chip e{palette.get(engine, 0)}">{html.escape(engine)}</span>')


def html_cell(value: Any) -> str:
    """A <td>: numbers right-aligned, None blank, text escaped unless it is Html."""
    if value is None:
        return "<td></td>"
    if isinstance(value, int):
        return f'<td class="num">{value}</td>'
    return f"<td>{value if isinstance(value, Html) else html.escape(str(value))}</td>"


def html_table(rows: Sequence[Sequence[Any]], headers: Sequence[str], css_class: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(html_cell(c) for c in row) + "</tr>\n" for row in rows)
    return f'<table class="{css_class}"><thead><tr>{head}</tr></thead>\n<tbody>{body}</tbody></table>'


def html_engine_table(graph: GraphInfo, palette: Mapping[str, int]) -> str:
    rows = table_rows(graph)
    for row in rows[:-1]:
        row[0] = chip(row[0], palette)
    return html_table(rows, TABLE_HEADERS, "engines")


def html_inserted_table(p: PassInfo, palette: Mapping[str, int]) -> str:
    if not p.inserted:
        return '<p class="meta">inserted no nodes</p>'
    rows = [[n.node, chip(n.engine, palette), n.op, n.why] for n in p.inserted]
    table = html_table(rows, ("node", "engine", "op", "why"), "inserted")
    erased = f'<p class="meta">erased: {html.escape(", ".join(p.erased))}</p>' if p.erased else ""
    return table + erased


def diff_class(line: str, n: int) -> str:
    """CSS class of line `n` of a unified diff."""
    if n < 2:
        return "file"
    return {"+": "add", "-": "del", "@": "hunk"}.get(line[:1], "ctx")


def html_pre(entries: Sequence[Entry], classes: Sequence[str], palette: Mapping[str, int]) -> str:
    """Lines in a <pre>, each a block with its CSS class and, for inserted nodes, an engine label."""
    parts = []
    for (line, engine), css_class in zip(entries, classes, strict=True):
        label = "" if engine is None else chip(engine, palette)
        parts.append(f'<span class="l {css_class}">{html.escape(line)}{label}</span>')
    return "<pre>" + "".join(parts) + "</pre>"


def html_pass(graph: GraphInfo, index: int, palette: Mapping[str, int]) -> str:
    p = graph.passes[index]
    entries = diff_entries(graph, index)
    classes = [diff_class(line, n) for n, (line, _) in enumerate(entries)]
    diff = html_pre(entries, classes, palette) if entries else '<p class="meta">no change to the code</p>'
    title = f'pass {index + 1}: {html.escape(p.name)} <span class="meta">({len(p.inserted)} inserted)</span>'
    return f"<details open><summary>{title}</summary>{html_inserted_table(p, palette)}{diff}</details>"


def html_final_code(graph: GraphInfo, palette: Mapping[str, int]) -> str:
    entries = code_entries(read_code(graph, final_file(graph)), inserted_engines(graph.passes))
    classes = ["ctx" if engine is None else f"e{palette.get(engine, 0)}" for _, engine in entries]
    return html_pre(entries, classes, palette)


def html_graph(dump: Dump, graph: GraphInfo, palette: Mapping[str, int]) -> str:
    anchor = html.escape(graph_anchor(dump, graph))
    where = f"{html.escape(dump.label)}, " if dump.label else ""
    passes = "".join(html_pass(graph, i, palette) for i in range(len(graph.passes)))
    passes = passes or '<p class="meta">no passes</p>'
    return (
        f'<h2 id="{anchor}">graph {html.escape(graph.id)}</h2>'
        f'<p class="meta">{where}inner compiler: {html.escape(graph.inner)}, '
        f"graph breaks: {or_unknown(graph.graph_breaks)}</p>"
        f"{html_engine_table(graph, palette)}"
        f"<h3>passes</h3>{passes}"
        f'<h3>final backward graph <span class="meta">({html.escape(final_file(graph))})</span></h3>'
        f"{html_final_code(graph, palette)}"
    )


def graph_anchor(dump: Dump, graph: GraphInfo) -> str:
    """HTML id of a graph's section: g0, or rank1-g0."""
    return f"{dump.label.replace(' ', '')}-{graph.id}" if dump.label else graph.id


def graph_title(dump: Dump, graph: GraphInfo) -> str:
    return f"{dump.label} {graph.id}" if dump.label else graph.id


def render_html(dumps: Sequence[Dump], graph_id: str | None) -> str:
    """The whole self-contained report (inline CSS, no scripts, no external resources)."""
    palette = engine_palette(dumps)
    selected = [(d, g) for d in dumps for g in graphs_of(d, graph_id)]
    links = (f'<a href="#{html.escape(graph_anchor(d, g))}">{html.escape(graph_title(d, g))}</a>'
             for d, g in selected)
    nav = " ".join(links)
    legend = " ".join(chip(name, palette) for name in palette)
    heads = "".join(f'<p class="meta">{html.escape(dump_header(d))}</p>' for d in dumps)
    body = "".join(html_graph(d, g, palette) for d, g in selected)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>graphzero dump report</title>"
        f"<style>{CSS}{palette_css()}</style></head>\n<body><main>"
        f"<h1>graphzero dump report</h1>{heads}"
        f'<p class="legend">engines: {legend}</p><nav>graphs: {nav}</nav>'
        f"{body}</main></body></html>\n"
    )


def write_html(path: Path, dumps: Sequence[Dump], graph_id: str | None) -> None:
    text = render_html(dumps, graph_id)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise DumpError(f"cannot write {path}: {exc.strerror or exc}") from None
    log.info("wrote %s (%d bytes)", path, len(text))
