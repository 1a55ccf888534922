"""Tests of the `graphzero-dump` CLI (tools/dump_cli.py and the dump_* modules it uses) on synthetic
dumps that follow docs/dump-format.md.

The CLI runs in a subprocess (`python -m graphzero_tools.dump_cli`), as a user runs it; nothing here
needs torch or the graphzero backend.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "graphzero_tools.dump_cli"]
CHROMIUM = Path("/usr/bin/chromium")

# ------------------------------------------------------------------------------------------------
# A synthetic dump: graph g0 (engines gen, stage 1, and disc, stage 2; three passes) and graph g1.
# ------------------------------------------------------------------------------------------------

G0_INPUT = [
    "mm = torch.ops.aten.mm.default(tangents_1, permute_2)",
    "permute_3 = torch.ops.aten.permute.default(tangents_1, [1, 0])",
    "mm_1 = torch.ops.aten.mm.default(permute_3, relu)",
    "sum_1 = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True)",
    "view_2 = torch.ops.aten.view.default(sum_1, [1])",
    "threshold_backward = torch.ops.aten.threshold_backward.default(mm, relu, 0)",
    "permute_5 = torch.ops.aten.permute.default(threshold_backward, [1, 0])",
    "mm_3 = torch.ops.aten.mm.default(permute_5, primals_1)",
    "sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True)",
]
G0_BUCKET = [
    "view_4 = torch.ops.aten.view.default(mm_1, [-1])",
    "cat = torch.ops.aten.cat.default([view_4, view_2])",
    "reduce_scatter_tensor = torch.ops._c10d_functional.reduce_scatter_tensor.default(cat, 'sum', 2, '0')",
    "wait_tensor = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor)",
    "view_5 = torch.ops.aten.view.default(mm_3, [-1])",
    "cat_1 = torch.ops.aten.cat.default([view_5, sum_2])",
    "all_reduce = torch.ops._c10d_functional.all_reduce.default(cat_1, 'sum', '0')",
    "wait_tensor_1 = torch.ops._c10d_functional.wait_tensor.default(all_reduce)",
]
G0_ACCUMULATE = [
    "_to_copy = torch.ops.aten._to_copy.default(wait_tensor, dtype = torch.float32)",
    "add_ = torch.ops.aten.add_.Tensor(primals_7, _to_copy)",
    "_to_copy_1 = torch.ops.aten._to_copy.default(wait_tensor_1, dtype = torch.float32)",
    "add__1 = torch.ops.aten.add_.Tensor(primals_8, _to_copy_1)",
]
G0_RETURN_BEFORE = "return (mm_3, sum_2, mm_1, view_2, None)"
G0_RETURN_AFTER = "return (None, None, None, None, None)"

DISC, GEN = "disc", "gen"
# (node, engine, op, why) per pass of g0
G0_BUCKET_INSERTED = [
    ("view_4", DISC, "aten.view.default", "flatten grad of disc.0.weight for bucket 0"),
    ("cat", DISC, "aten.cat.default", "bucket 0 of disc (2 params)"),
    ("reduce_scatter_tensor", DISC, "_c10d_functional.reduce_scatter_tensor.default",
     "ZeRO-2: reduce-scatter bucket 0 of disc"),
    ("wait_tensor", DISC, "_c10d_functional.wait_tensor.default", "wait for bucket 0 of disc"),
    ("view_5", GEN, "aten.view.default", "flatten grad of gen.0.weight for bucket 0"),
    ("cat_1", GEN, "aten.cat.default", "bucket 0 of gen (2 params)"),
    ("all_reduce", GEN, "_c10d_functional.all_reduce.default", "ZeRO-1: all-reduce bucket 0 of gen"),
    ("wait_tensor_1", GEN, "_c10d_functional.wait_tensor.default", "wait for bucket 0 of gen"),
]
G0_ACCUMULATE_INSERTED = [
    ("_to_copy", DISC, "aten._to_copy.default", "upcast disc grad shard to fp32"),
    ("add_", DISC, "aten.add_.Tensor", "accumulate into disc fp32 grad shard"),
    ("_to_copy_1", GEN, "aten._to_copy.default", "upcast gen grads to fp32"),
    ("add__1", GEN, "aten.add_.Tensor", "accumulate into gen fp32 grads"),
]

GEN_STATS = {"stage": 1, "params": 2, "numel": 144, "buckets": 1, "reduce_scatter": 0, "all_reduce": 1,
             "all_gather": 0, "fp32_accumulate": 2, "comm_bytes_per_step": 576,
             "comm_bytes_by_dtype": {"float32": 576}, "grad_dtype": "float32", "comm_dtype": "float32",
             "accum_dtype": "float32"}
DISC_STATS = {"stage": 2, "params": 4, "numel": 1234, "buckets": 1, "reduce_scatter": 1, "all_reduce": 0,
              "all_gather": 0, "fp32_accumulate": 4, "comm_bytes_per_step": 4936,
              "comm_bytes_by_dtype": {"float32": 4936}, "grad_dtype": "float32", "comm_dtype": "float32",
              "accum_dtype": "float32"}
G1_DISC_STATS = {**DISC_STATS, "params": 1, "numel": 32, "fp32_accumulate": 0, "comm_bytes_per_step": 128,
                 "comm_bytes_by_dtype": {"float32": 128}}
# Totals of g0: gen + disc
G0_TOTALS = {"params": 6, "numel": 1378, "buckets": 2, "reduce_scatter": 1, "all_reduce": 1, "all_gather": 0,
             "fp32_accumulate": 6, "comm_bytes_per_step": 5512, "all_gather_fwd": 0, "all_gather_bytes_fwd": 0,
             "all_gather_bwd": 0, "all_gather_bytes_bwd": 0}


G0_ARGS = "self, primals_1, primals_7, primals_8, permute_2, relu, tangents_1"


def fx_code(body: list[str], ret: str, args: str = G0_ARGS) -> str:
    """Readable FX code around `body` lines, as `GraphModule.code` prints it."""
    lines = [f"def forward({args}):", *(f"    {line}" for line in body), f"    {ret}"]
    return "\n\n\n" + "\n".join(lines) + "\n    "


def inserted(rows: list[tuple[str, str, str, str]]) -> list[dict[str, str]]:
    return [{"node": n, "engine": e, "op": o, "why": w} for n, e, o, w in rows]


def write_graph(root: Path, graph_id: str, versions: list[tuple[str, str]]) -> None:
    """Write forward/000_input.py and backward/<file> for each (file, code) of `versions`."""
    (root / graph_id / "forward").mkdir(parents=True)
    (root / graph_id / "backward").mkdir()
    forward = fx_code(["relu = torch.ops.aten.relu.default(x)"], "return (relu,)", "self, x")
    (root / graph_id / "forward" / "000_input.py").write_text(forward)
    for file, code in versions:
        (root / graph_id / file).write_text(code)


def make_summary(rank: int = 0) -> dict[str, Any]:
    g0_passes = [
        {"name": "annotate_owner", "file": "backward/001_annotate_owner.py", "inserted": [], "erased": []},
        {"name": "bucket_grads", "file": "backward/002_bucket_grads.py",
         "inserted": inserted(G0_BUCKET_INSERTED), "erased": []},
        {"name": "accumulate_fp32", "file": "backward/003_accumulate_fp32.py",
         "inserted": inserted(G0_ACCUMULATE_INSERTED), "erased": ["view_2"]},
    ]
    g1_passes = [{"name": "bucket_grads", "file": "backward/001_bucket_grads.py",
                  "inserted": inserted([G0_BUCKET_INSERTED[2]]), "erased": []}]
    return {
        "format": 1, "graphzero_version": "0.1.0", "world_size": 2, "rank": rank, "graph_breaks": 1,
        "graphs": [
            {"id": "g0", "graph_breaks": 0, "inner": "inductor", "passes": g0_passes,
             "engines": {GEN: GEN_STATS, DISC: DISC_STATS}},
            {"id": "g1", "graph_breaks": 1, "inner": "eager", "passes": g1_passes,
             "engines": {DISC: G1_DISC_STATS}},
        ],
    }


def write_dump(root: Path, rank: int = 0) -> Path:
    """A complete synthetic dump of rank `rank` in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    after_bucket = [*G0_INPUT, *G0_BUCKET]
    after_accumulate = [line for line in after_bucket if not line.startswith("view_2 ")] + G0_ACCUMULATE
    write_graph(root, "g0", [
        ("backward/000_input.py", fx_code(G0_INPUT, G0_RETURN_BEFORE)),
        ("backward/001_annotate_owner.py", fx_code(G0_INPUT, G0_RETURN_BEFORE)),
        ("backward/002_bucket_grads.py", fx_code(after_bucket, G0_RETURN_AFTER)),
        ("backward/003_accumulate_fp32.py", fx_code(after_accumulate, G0_RETURN_AFTER)),
    ])
    g1_input = "view = torch.ops.aten.view.default(tangents_1, [-1])"
    g1_reduce = G0_BUCKET[2].replace("(cat,", "(view,")
    g1_args = "self, tangents_1"
    write_graph(root, "g1", [
        ("backward/000_input.py", fx_code([g1_input], "return (view,)", g1_args)),
        ("backward/001_bucket_grads.py", fx_code([g1_input, g1_reduce], "return (None,)", g1_args)),
    ])
    (root / "summary.json").write_text(json.dumps(make_summary(rank), indent=2))
    return root


@pytest.fixture(scope="session", autouse=True)
def cli_importable() -> None:
    if importlib.util.find_spec("graphzero_tools") is None:
        pytest.fail("graphzero_tools is not installed: run `.venv/bin/pip install -e . --no-deps`")


@pytest.fixture
def dump_cli() -> ModuleType:
    """The CLI module itself, for in-process tests of small helpers."""
    return importlib.import_module("graphzero_tools.dump_cli")


@pytest.fixture
def dump_views() -> ModuleType:
    """The text views behind the CLI, for in-process tests of small helpers."""
    return importlib.import_module("graphzero_tools.dump_views")


@pytest.fixture
def dump(tmp_path: Path) -> Path:
    return write_dump(tmp_path / "dump")


@pytest.fixture
def rank_dump(tmp_path: Path) -> Path:
    """A dump_ranks="all" dump: rank0/ and rank1/, no summary.json at the top."""
    root = tmp_path / "ranks"
    for rank in (0, 1):
        write_dump(root / f"rank{rank}", rank)
    return root


def run_cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [*CLI, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def ok(*args: str | Path, cwd: Path | None = None) -> str:
    """stdout of a CLI call that must succeed silently on stderr."""
    result = run_cli(*args, cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("graphzero-dump: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def table_row(output: str, first_cell: str) -> list[str]:
    """The cells of the github-table row whose first cell is `first_cell` (first match)."""
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{output}")


# ------------------------------------------------------------------------------------------------
# Table view
# ------------------------------------------------------------------------------------------------

def test_table_rows_and_totals(dump: Path) -> None:
    out = ok(dump)
    assert "graph g0  inner: inductor  graph breaks: 0" in out
    assert "graph g1  inner: eager  graph breaks: 1" in out
    header = table_row(out, "engine")
    assert header == ["engine", "stage", "params", "numel", "buckets", "reduce_scatter", "all_reduce",
                      "gathers fwd", "gather bytes fwd", "gathers bwd", "gather bytes bwd", "fp32_accumulate",
                      "bytes/step"]
    no_gathers = ["0", "0 B", "0", "0 B"]
    assert table_row(out, "gen") == ["gen", "1", "2", "144", "1", "0", "1", *no_gathers, "2", "576 B"]
    assert table_row(out, "disc") == ["disc", "2", "4", "1234", "1", "1", "0", *no_gathers, "4", "4.8 KiB (4936)"]
    assert table_row(out, "total") == ["total", "", "6", "1378", "2", "1", "1", *no_gathers, "6", "5.4 KiB (5512)"]
    assert "gathered peak" not in out   # no ZeRO-3 engine


def test_table_zero3_gather_columns_and_peak(tmp_path: Path) -> None:
    """ZeRO-3 engines: gathers and their bytes per step, forward and backward, next to the
    reduce-scatters; the graph's gathered peak in its header (and in --json)."""
    root = tmp_path / "d"
    root.mkdir()
    z3 = {"stage": 3, "params": 12, "numel": 20832, "reduce_scatter": 3, "all_gather": 6,
          "all_gather_fwd": 3, "all_gather_bytes_fwd": 83328, "all_gather_bwd": 3, "all_gather_bytes_bwd": 57344,
          "gathered_peak_bytes_fwd": 33280, "gathered_peak_bytes_bwd": 32768, "fp32_accumulate": 12}
    z1 = {"stage": 1, "params": 2, "numel": 144, "all_reduce": 1, "fp32_accumulate": 2, "comm_bytes_per_step": 576}
    summary = {"graphs": [{"id": "g0", "engines": {"net": z3, "head": z1}}]}
    (root / "summary.json").write_text(json.dumps(summary))
    out = ok(root)
    assert "gathered peak: fwd 32.5 KiB (33280), bwd 32.0 KiB (32768)" in out
    assert table_row(out, "net")[5:11] == ["3", "0", "3", "81.4 KiB (83328)", "3", "56.0 KiB (57344)"]
    assert table_row(out, "head")[5:11] == ["0", "1", "0", "0 B", "0", "0 B"]
    assert table_row(out, "total")[7:11] == ["3", "81.4 KiB (83328)", "3", "56.0 KiB (57344)"]
    g0 = json.loads(ok(root, "--json"))["graphs"][0]
    net = next(e for e in g0["engines"] if e["engine"] == "net")
    assert {k: net[k] for k in z3} == z3
    assert (g0["gathered_peak_bytes_fwd"], g0["gathered_peak_bytes_bwd"]) == (33280, 32768)
    assert g0["totals"]["all_gather_bytes_fwd"] == 83328


def test_table_graph_filter(dump: Path) -> None:
    out = ok(dump, "--graph", "g1")
    assert "graph g1" in out and "graph g0" not in out
    assert table_row(out, "total")[-1] == "128 B"


def test_table_json(dump: Path) -> None:
    data = json.loads(ok(dump, "--json"))
    assert data["world_size"] == 2 and data["rank"] == 0 and data["graph_breaks"] == 1
    g0 = data["graphs"][0]
    assert g0["id"] == "g0" and g0["inner"] == "inductor"
    engines = {e["engine"]: e for e in g0["engines"]}
    for name, stats in ((GEN, GEN_STATS), (DISC, DISC_STATS)):
        for key in ("stage", "params", "numel", "buckets", "reduce_scatter", "all_reduce", "all_gather",
                    "fp32_accumulate", "comm_bytes_per_step", "comm_bytes_by_dtype"):
            assert engines[name][key] == stats[key], (name, key)
    assert g0["totals"] == G0_TOTALS


def test_engines_as_list_and_missing_counts(tmp_path: Path) -> None:
    """Engines given as a list are named engine0, engine1, ...; absent counts are 0."""
    root = tmp_path / "d"
    root.mkdir()
    summary = {"graphs": [{"id": "g0", "engines": [{"stage": 3, "params": 1}, {"stage": 1, "numel": 5}]}]}
    (root / "summary.json").write_text(json.dumps(summary))
    out = ok(root)
    assert table_row(out, "engine0")[:4] == ["engine0", "3", "1", "0"]
    assert table_row(out, "engine1")[:4] == ["engine1", "1", "0", "5"]


# ------------------------------------------------------------------------------------------------
# Pass views
# ------------------------------------------------------------------------------------------------

def added_lines(diff: str) -> list[str]:
    return [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]


def test_diff_shows_added_lines_with_engine_markers(dump: Path) -> None:
    out = ok(dump, "--graph", "g0", "--pass", "bucket_grads", "--diff")
    assert "--- g0/backward/001_annotate_owner.py" in out
    assert "+++ g0/backward/002_bucket_grads.py" in out
    added = added_lines(out)
    for line, (node, engine, _, _) in zip(G0_BUCKET, G0_BUCKET_INSERTED, strict=True):
        assert f"    {line} # [graphzero:{engine}]" in added, node
    assert f"    {G0_RETURN_AFTER}" in added  # changed but not an inserted node: no marker
    assert f"-    {G0_RETURN_BEFORE}" in out.splitlines()
    # below the diff: the inserted nodes with engine and why
    assert table_row(out, "reduce_scatter_tensor")[1:] == list(G0_BUCKET_INSERTED[2][1:])
    assert table_row(out, "all_reduce")[1] == GEN


def test_diff_first_pass_is_against_input(dump: Path) -> None:
    out = ok(dump, "--graph", "g1", "--pass", "bucket_grads", "--diff")
    assert "--- g1/backward/000_input.py" in out
    assert "reduce_scatter_tensor.default(view, 'sum', 2, '0') # [graphzero:disc]" in out


def test_diff_of_pass_without_change(dump: Path) -> None:
    out = ok(dump, "--graph", "g0", "--pass", "annotate_owner", "--diff")
    assert "did not change the code" in out and "inserted no nodes" in out


def test_diff_json(dump: Path) -> None:
    data = json.loads(ok(dump, "--graph", "g0", "--pass", "accumulate_fp32", "--diff", "--json"))
    assert set(data) == {"graph", "pass", "diff", "inserted"}
    assert (data["graph"], data["pass"]) == ("g0", "accumulate_fp32")
    assert data["inserted"] == inserted(G0_ACCUMULATE_INSERTED)
    assert "-    view_2 = torch.ops.aten.view.default(sum_1, [1])" in data["diff"].splitlines()
    assert f"    {G0_ACCUMULATE[1]} # [graphzero:{DISC}]" in added_lines(data["diff"])


def test_pass_code_view(dump: Path) -> None:
    out = ok(dump, "--graph", "g0", "--pass", "accumulate_fp32")
    lines = out.splitlines()
    assert "def forward(self, primals_1, primals_7, primals_8, permute_2, relu, tangents_1):" in lines
    assert f"    {G0_ACCUMULATE[3]} # [graphzero:{GEN}]" in lines
    assert f"    {G0_BUCKET[2]} # [graphzero:{DISC}]" in lines  # inserted by an earlier pass: marked too
    assert f"    {G0_INPUT[0]}" in lines  # original node: no marker
    assert not out.startswith("---")


def test_pass_code_view_json_and_file_stem(dump: Path) -> None:
    data = json.loads(ok(dump, "--graph", "g0", "--pass", "002_bucket_grads", "--json"))
    assert data["pass"] == "bucket_grads" and data["file"] == "backward/002_bucket_grads.py"
    assert data["code"] == (dump / "g0" / "backward" / "002_bucket_grads.py").read_text()


def test_pass_defaults_to_only_graph(tmp_path: Path) -> None:
    root = write_dump(tmp_path / "d")
    summary = json.loads((root / "summary.json").read_text())
    summary["graphs"] = summary["graphs"][1:]
    (root / "summary.json").write_text(json.dumps(summary))
    assert "+++ g1/backward/001_bucket_grads.py" in ok(root, "--pass", "bucket_grads", "--diff")


# ------------------------------------------------------------------------------------------------
# dump_ranks="all"
# ------------------------------------------------------------------------------------------------

def test_rank_dirs_show_every_rank(rank_dump: Path) -> None:
    out = ok(rank_dump)
    assert f"dump dir: {rank_dump / 'rank0'}  (" in out and f"dump dir: {rank_dump / 'rank1'}  (" in out
    assert "rank 1 of world size 2" in out
    assert out.count("| total") == 4  # 2 ranks x 2 graphs


def test_rank_option(rank_dump: Path) -> None:
    out = ok(rank_dump, "--rank", "1")
    assert "rank 1 of world size 2" in out and "rank 0 of" not in out
    data = json.loads(ok(rank_dump, "--json"))
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["ranks"][1]["graphs"][0]["totals"] == G0_TOTALS
    diff = ok(rank_dump, "--rank", "0", "--graph", "g0", "--pass", "bucket_grads", "--diff")
    assert "+++ g0/backward/002_bucket_grads.py" in diff


# ------------------------------------------------------------------------------------------------
# Bad input: one line on stderr, exit 2, no traceback
# ------------------------------------------------------------------------------------------------

def corrupt(root: Path, text: str) -> Path:
    (root / "summary.json").write_text(text)
    return root


BAD_SUMMARIES = {
    "truncated JSON": ('{"graphs": [', "invalid JSON"),
    "not an object": ("[1, 2]", "expected a JSON object"),
    "no graphs": ('{"format": 1}', "missing 'graphs'"),
    "graphs not a list": ('{"graphs": 3}', "'graphs' must be list"),
    "graph without id": ('{"graphs": [{"engines": {}}]}', "missing 'id'"),
    "count not a number": ('{"graphs": [{"id": "g0", "engines": {"gen": {"params": "four"}}}]}',
                           "engines.gen: 'params' must be int"),
    "newer format": ('{"format": 99, "graphs": []}', "dump format 99"),
}


@pytest.mark.parametrize("case", sorted(BAD_SUMMARIES))
def test_bad_summary(dump: Path, case: str) -> None:
    text, fragment = BAD_SUMMARIES[case]
    assert_one_line_error(run_cli(corrupt(dump, text)), 2, fragment)


def test_missing_directory(tmp_path: Path) -> None:
    assert_one_line_error(run_cli(tmp_path / "nope"), 2, "no such directory")


def test_directory_without_summary(tmp_path: Path) -> None:
    (tmp_path / "g0").mkdir()
    assert_one_line_error(run_cli(tmp_path), 2, "no summary.json", "not a graphzero dump")


@pytest.mark.parametrize("args, fragments", [
    pytest.param(["--graph", "g7"], ["unknown graph 'g7'", "g0, g1"], id="unknown graph"),
    pytest.param(["--graph", "g7", "--pass", "bucket_grads"], ["unknown graph 'g7'"], id="graph of pass"),
    pytest.param(["--graph", "g0", "--pass", "nope", "--diff"],
                 ["unknown pass 'nope'", "annotate_owner, bucket_grads"], id="unknown pass"),
    pytest.param(["--pass", "bucket_grads"], ["2 graphs", "--graph"], id="pass needs graph"),
    pytest.param(["--rank", "3"], ["rank 0 only"], id="unknown rank"),
])
def test_bad_selection(dump: Path, args: list[str], fragments: list[str]) -> None:
    assert_one_line_error(run_cli(dump, *args), 2, *fragments)


def test_missing_code_file(dump: Path) -> None:
    (dump / "g0" / "backward" / "002_bucket_grads.py").unlink()
    result = run_cli(dump, "--graph", "g0", "--pass", "bucket_grads", "--diff")
    assert_one_line_error(result, 2, "002_bucket_grads.py does not exist")


def test_bad_rank_selection(rank_dump: Path) -> None:
    assert_one_line_error(run_cli(rank_dump, "--rank", "5"), 2, "no rank5/", "ranks: 0, 1")
    result = run_cli(rank_dump, "--graph", "g0", "--pass", "bucket_grads")
    assert_one_line_error(result, 2, "2 ranks", "--rank")


def test_broken_rank_summary(rank_dump: Path) -> None:
    corrupt(rank_dump / "rank1", "{")
    assert_one_line_error(run_cli(rank_dump), 2, "rank1", "invalid JSON")
    assert "rank 0 of" in ok(rank_dump, "--rank", "0")


def test_help_has_examples() -> None:
    out = ok("--help")
    assert "examples:" in out and "--diff" in out and "graphzero-dump run" in out
    assert "torch.distributed.run" in ok("run", "--help")


# ------------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------------

TRAIN_SCRIPT = """\
    # A stand-in for a training script: writes a minimal valid dump like the backend would.
    import json, os, pathlib, sys

    engine = sys.argv[sys.argv.index("--engine") + 1]
    code = int(sys.argv[sys.argv.index("--exit") + 1]) if "--exit" in sys.argv else 0
    print("training step 1")
    if code:
        sys.exit(code)
    if "--no-dump" not in sys.argv:
        root = pathlib.Path(os.environ["GRAPHZERO_DUMP_DIR"])
        stats = {"stage": 2, "params": 3, "numel": 300, "buckets": 1, "reduce_scatter": 1,
                 "comm_bytes_per_step": 1200}
        graph = {"id": "g0", "inner": "inductor", "graph_breaks": 0, "passes": [], "engines": {engine: stats}}
        summary = {"format": 1, "world_size": 1, "rank": 0, "graph_breaks": 0, "graphs": [graph]}
        (root / "summary.json").write_text(json.dumps(summary))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(TRAIN_SCRIPT))
    return path


def test_run_with_dump_dir(tmp_path: Path, script: Path) -> None:
    dump_dir = tmp_path / "out"
    result = run_cli("run", "--dump-dir", dump_dir, script, "--engine", "policy")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "training step 1" in result.stdout  # the script's own output passes through
    assert table_row(result.stdout, "policy")[:4] == ["policy", "2", "3", "300"]
    assert table_row(result.stdout, "total")[-1] == "1.2 KiB (1200)"
    assert (dump_dir / "summary.json").is_file()


def test_run_default_temp_dir_and_json(script: Path) -> None:
    result = run_cli("run", "--json", script, "--engine", "critic")
    assert result.returncode == 0, result.stderr
    line = result.stderr.strip().splitlines()[0]
    assert line.startswith("graphzero-dump: dump directory: ")
    dump_dir = Path(line.split(": ", 2)[2])
    try:
        assert (dump_dir / "summary.json").is_file()
        assert "training step 1" in result.stderr  # script stdout moved off stdout under --json
        data = json.loads(result.stdout)
        assert data["dump_dir"] == str(dump_dir)
        assert data["graphs"][0]["engines"][0]["engine"] == "critic"
    finally:
        shutil.rmtree(dump_dir)


def test_run_failing_script_propagates_exit_code(tmp_path: Path, script: Path) -> None:
    result = run_cli("run", "--dump-dir", tmp_path / "out", script, "--engine", "x", "--exit", "3")
    assert_one_line_error(result, 3, f"{script} exited with code 3")


def test_run_script_without_dump(tmp_path: Path, script: Path) -> None:
    result = run_cli("run", "--dump-dir", tmp_path / "out", script, "--engine", "x", "--no-dump")
    assert_one_line_error(result, 1, "left no usable dump")


def test_run_missing_script(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("run", "--dump-dir", tmp_path, tmp_path / "nope.py"), 1, "no such script")


# ------------------------------------------------------------------------------------------------
# In-process unit tests of small helpers (the module imports neither torch nor graphzero)
# ------------------------------------------------------------------------------------------------

def test_build_run_command(dump_cli: ModuleType) -> None:
    assert dump_cli.build_run_command(1, "t.py", ["--lr", "1"]) == [sys.executable, "t.py", "--lr", "1"]
    assert dump_cli.build_run_command(4, "t.py", ["-x"]) == [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone", "t.py", "-x"]
    assert dump_cli.exit_status(-int(signal.SIGKILL)) == (137, "was killed by SIGKILL")


def test_helpers(dump_views: ModuleType) -> None:
    assert [dump_views.human_bytes(n) for n in (0, 1023, 4936, 3 * 2**20, 2**50)] == [
        "0 B", "1023 B", "4.8 KiB", "3.0 MiB", "1024.0 TiB"]
    assert dump_views.defined_node('    view_3: "f32[1234]" = torch.ops.aten.view.default(x, [-1])') == "view_3"
    assert dump_views.defined_node("    return (a, b)") is None
    assert dump_views.defined_node("    foo(dim=0)") is None


def test_cli_does_not_import_torch() -> None:
    code = "import sys, graphzero_tools.dump_cli; print('torch' in sys.modules, 'graphzero' in sys.modules)"
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.stdout.split() == ["False", "False"], result.stderr


# ------------------------------------------------------------------------------------------------
# HTML report
# ------------------------------------------------------------------------------------------------

def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk of a PNG file."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


def screenshot(html: Path, png: Path, profile: Path, size: tuple[int, int] = (1200, 900)) -> None:
    """Render `html` with headless chromium into `png`; the whole process group dies on timeout."""
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking", "--disable-component-update",
               "--disable-sync",
               f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={size[0]},{size[1]}",
               html.resolve().as_uri()]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("chromium did not finish the screenshot within 60 s")


def test_html_report(dump: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    assert ok(dump, "--html", report) == ""
    text = report.read_text()
    assert "<title>graphzero dump report</title>" in text
    # engine table rows of g0 (engine names are labels), with the totals row
    num = '<td class="num">{}</td>'.format
    gathers = num(0) + "<td>0 B</td>" + num(0) + "<td>0 B</td>"   # no ZeRO-3 engine
    assert ('<tr><td><span class="chip e0">gen</span></td>' + "".join(map(num, [1, 2, 144, 1, 0, 1])) + gathers
            + num(2) + "<td>576 B</td></tr>") in text
    assert ('<tr><td><span class="chip e1">disc</span></td>' + "".join(map(num, [2, 4, 1234, 1, 1, 0])) + gathers
            + num(4) + "<td>4.8 KiB (4936)</td></tr>") in text
    assert ("<tr><td>total</td><td></td>" + "".join(map(num, [6, 1378, 2, 1, 1])) + gathers
            + num(6) + "<td>5.4 KiB (5512)</td></tr>") in text
    # diffs: added/removed lines coloured; final code: inserted nodes highlighted with their engine
    assert '<span class="l add">+    reduce_scatter_tensor = ' in text
    assert '<span class="l del">-    view_2 = ' in text
    assert ('<span class="l e0">    add__1 = torch.ops.aten.add_.Tensor(primals_8, _to_copy_1)'
            '<span class="chip e0">gen</span></span>') in text
    # self-contained
    for needle in ("<script", "<link", "src=", "http://", "https://", "url("):
        assert needle not in text
    if not CHROMIUM.exists():
        pytest.skip("screenshot part skipped: /usr/bin/chromium is not installed (apt-get install chromium)")
    png = tmp_path / "report.png"
    screenshot(report, png, tmp_path / "chromium-profile")
    assert png.is_file() and png.stat().st_size > 5_000
    assert png_size(png) == (1200, 900)
    if os.environ.get("GRAPHZERO_KEEP_SCREENSHOT"):
        shutil.copy(png, os.environ["GRAPHZERO_KEEP_SCREENSHOT"])
