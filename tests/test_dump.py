"""The graph dump of a real 2-rank run: summary counts and bytes checked against the models, the
steady state is one graph without breaks, and the CLI renders it (table, --json, --diff)."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from scenario_utils import data, ds_config, engine, mlp, rank_world


def gan_loss(models, z, real):
    return -models["disc"](models["gen"](z)).mean() + models["disc"](real).mean()


def dumped_run_scenario(collective: str, dump_ranks: str, steps: int = 3) -> dict:
    rank, _ = rank_world()
    path = [tempfile.mkdtemp(prefix="graphzero-dump-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    torch.manual_seed(0)
    G, D = mlp(8, 16, 8), mlp(8, 16, 1)
    gen, disc = engine(G, ds_config(1)), engine(D, ds_config(2))
    step = torch.compile(gan_loss, backend="graphzero",
                         options={"engines": {"generator": gen, "critic": disc}, "dump_dir": path[0],
                                  "collective": collective, "dump_ranks": dump_ranks})
    for t in range(steps):
        step({"gen": gen, "disc": disc}, *data(t, rank, (4, 8), (4, 8))).backward()
        gen.step()
        disc.step()
    dist.barrier()
    return {"dir": path[0], "numel": {"generator": sum(p.numel() for p in G.parameters()),
                                      "critic": sum(p.numel() for p in D.parameters())},
            "params": {"generator": len(list(G.parameters())), "critic": len(list(D.parameters()))}}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphzero_tools.dump_cli", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_dump_summary_matches_models_and_cli_renders_it(ranks):
    run = ranks.run(dumped_run_scenario, "reduce_scatter", "0")[0]
    root = Path(run["dir"])
    summary = json.loads((root / "summary.json").read_text())
    assert summary["world_size"] == 2
    # The first call attaches the engines and re-traces once: the steady state is one graph.
    assert len(summary["graphs"]) == 1, [g["id"] for g in summary["graphs"]]
    graph = summary["graphs"][0]
    assert graph["graph_breaks"] == 0 and summary["graph_breaks"] == 0
    engines = graph["engines"]
    assert set(engines) == {"generator", "critic"}
    for name, stage in (("generator", 1), ("critic", 2)):
        e, numel, params = engines[name], run["numel"][name], run["params"][name]
        assert e["stage"] == stage and e["params"] == params and e["numel"] == numel
        assert e["reduce_scatter"] >= 1 and e["all_reduce"] == 0 and e["all_gather"] == 0
        assert e["fp32_accumulate"] == params            # one fp32 accumulation per parameter
        # fp32, one reduce-scatter input of the (padded) flat gradient per step: 4 bytes/element.
        assert 2 * numel <= e["comm_bytes_per_step"] <= 8 * numel, e
        assert 4 * numel <= e["comm_bytes_per_step"] < 4 * numel + 4 * 64, e
        assert e["comm_bytes_by_dtype"] == {"float32": e["comm_bytes_per_step"]}
    passes = [p["name"] for p in graph["passes"]]
    assert passes == ["annotate_owner", "bucket", "local_accumulate", "insert_reduce_scatter", "fp32_accumulate",
                      "fold_norm", "schedule_overlap", "lower_reduce_scatter", "write_into_bucket"]
    inserted = {n["engine"] for p in graph["passes"] for n in p["inserted"]}
    assert inserted == {"generator", "critic"}
    code = (root / graph["id"] / "backward" / "007_schedule_overlap.py").read_text()
    assert code.count("reduce_scatter_tensor") >= 2 and "graphzero_sink_critic_0" in code

    table = cli(str(root))
    assert table.returncode == 0, table.stderr
    assert "generator" in table.stdout and "critic" in table.stdout
    as_json = json.loads(cli(str(root), "--json").stdout)
    assert "generator" in json.dumps(as_json)
    diff = cli(str(root), "--graph", graph["id"], "--pass", "insert_reduce_scatter", "--diff")
    assert diff.returncode == 0, diff.stderr
    assert "+" in diff.stdout and "reduce_scatter_tensor" in diff.stdout and "[graphzero:critic]" in diff.stdout


def test_dump_every_rank_with_all_reduce(ranks):
    run = ranks.run(dumped_run_scenario, "all_reduce", "all")[0]
    root = Path(run["dir"])
    for rank in (0, 1):
        summary = json.loads((root / f"rank{rank}" / "summary.json").read_text())
        assert summary["rank"] == rank
        engines = summary["graphs"][-1]["engines"]
        assert all(e["all_reduce"] >= 1 and e["reduce_scatter"] == 0 for e in engines.values())
    assert cli(str(root)).returncode == 0
