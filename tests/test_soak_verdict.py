"""graphzero-soak's verdict: the issue's criterion (RSS after warm-up within 5%, the forced compiles
and nothing else, exact final gradients), each failed check named. The samples are the shape
`run_rank` gathers; the figures are those of the recorded 5000-step ZeRO-3 soak (docs/reliability.md)."""
from __future__ import annotations

from graphzero_tools.soak import _verdict, build_parser, format_table

ARGS = ["--steps", "5000", "--stage", "3", "--recompile-every", "500", "--sample-every", "250", "--warmup", "500"]


def _samples(rss_at_end: float, graphs: int = 10, recompiles: int = 0) -> list[dict]:
    # 418.5 MiB at the end of warm-up, the growth in the first half, flat after
    rss = {500: 418.5, 1000: 427.0, 2500: 436.9, 5000: rss_at_end}
    samples = [{"step": step, "rss_mib": mib, "graphs": 1 + (step - 1) // 500, "recompiles": recompiles,
                "graph_breaks": 0, "seconds": step / 10} for step, mib in rss.items()]
    samples[-1]["graphs"] = graphs
    return samples


def test_the_recorded_soak_passes_on_the_percentage_alone():
    result = _verdict(build_parser().parse_args(ARGS), [(_samples(437.1), None)] * 2)
    assert result["ok"], format_table(result)
    rank = result["ranks"][0]
    assert round(rank["rss_growth_pct"], 1) == 4.4 and round(rank["rss_growth_second_half_mib"], 1) == 0.2
    assert "verdict: ok" in format_table(result)


def test_each_failed_check_is_named():
    args = build_parser().parse_args(ARGS + ["--max-growth-mib", "16"])
    grown, inexact = _samples(441.0), "gen.0.weight: max |difference| 0.1"
    result = _verdict(args, [(grown, None), (_samples(437.1, graphs=11, recompiles=1), inexact)])
    assert not result["ok"]
    assert result["ranks"][0]["failures"] == ["RSS grew +5.4% after warm-up (limit 5%)",
                                             "RSS grew +22.5 MiB after warm-up (limit 16 MiB)"]
    assert result["ranks"][1]["failures"] == ["RSS grew +18.6 MiB after warm-up (limit 16 MiB)",
                                             "11 graphs compiled where 10 were expected", "1 recompiles",
                                             f"final gradients differ: {inexact}"]
    verdict = format_table(result).splitlines()[-1]
    assert verdict.startswith("verdict: FAILED (rank 0: RSS grew +5.4%") and "rank 1: " in verdict
