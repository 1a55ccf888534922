"""ZeRO-3: an engine called twice in one step reduce-scatters each parameter's summed gradient once,
and parameters are gathered again in backward only where DeepSpeed would gather them again.

The GAN's discriminator (ZeRO-3) is called twice in the loss, so each of its parameters is gathered
twice and its gradient arrives from two gathers' backwards. graphzero sums the two full gradients
and reduce-scatters once (sum_shard_grads); with a graph break between the two calls, the first
graph's backward holds them for the last one (hold_shard_grads; graphzero/runtime/partial.py). Counted from the traced graph (the dump summary's
``comm_bytes_per_step``, the input bytes of the graph's reduce-scatters), the bytes per step equal
what DeepSpeed eager ZeRO-3 reduces for the same engines in one step (its collectives counted with
torch.profiler, as graphzero-compare counts them): each parameter's gradient once, padded to a
multiple of the world size. Gradients against the single-process reference are checked for this
shape by test_zero3.py (test_gan_both_zero3), which runs the same graph.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_zero3 import gan_loss, z3_config

from graphzero_tools.bench_metrics import summarize_collectives
from scenario_utils import check_gan_step, data, engine, gan_engines, mlp, rank_world


@pytest.fixture(scope="module", autouse=True)
def fresh_ranks_after(ranks):
    # ZeRO-3 initialisation patches torch.nn.functional.linear process-wide.
    yield
    ranks.close()


def _engines():
    torch.manual_seed(0)
    return {"gen": engine(mlp(8, 16, 8), z3_config(3)), "disc": engine(mlp(8, 16, 1), z3_config(3))}


def _padded_bytes(module: torch.nn.Module, world: int) -> int:
    return sum(-(-p.ds_numel // world) * world * 4 for p in module.parameters())


def once_per_step_scenario(path: str) -> dict:
    rank, world = rank_world()
    # DeepSpeed eager: one step, its collectives counted from the profiler's gloo events
    eager = _engines()
    z, real = data(0, rank, (4, 8), (4, 8))
    eager["disc"].backward(gan_loss(eager, z, real))   # warm-up step (first-step allocations)
    for e in eager.values():
        e.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        eager["disc"].backward(gan_loss(eager, z, real))
    deepspeed_reduced = summarize_collectives(prof.events(), world)["bytes_reduced"]

    gz = _engines()
    step = torch.compile(gan_loss, backend="graphzero", options={"engines": gz, "dump_dir": path})
    for t in range(2):
        z, real = data(t, rank, (4, 8), (4, 8))
        step(gz, z, real).backward()
        for e in gz.values():
            e.step()
    out = {"deepspeed_reduced": deepspeed_reduced,
           "padded": {name: _padded_bytes(e.module, world) for name, e in gz.items()}}
    if rank == 0:
        summary = json.loads((Path(path) / "summary.json").read_text())
        out["graphs"] = [{name: (e["reduce_scatter"], e["comm_bytes_per_step"]) for name, e in g["engines"].items()}
                         for g in summary["graphs"]]
    dist.barrier()
    return out


def test_engine_called_twice_reduces_once_per_step(ranks, tmp_path):
    res = ranks.run(once_per_step_scenario, str(tmp_path))[0]
    graphs, padded = res["graphs"], res["padded"]
    assert graphs, res
    for g in graphs:
        for name, (collectives, nbytes) in g.items():
            # every parameter's gradient reduced exactly once: the padded bytes, not twice the disc's
            assert nbytes == padded[name], (name, nbytes, padded)
            assert collectives >= 1, g
    # DeepSpeed eager reduces the same bytes (plus its 4-byte-scale norm/overflow reductions)
    ours = sum(padded.values())
    assert ours <= res["deepspeed_reduced"] <= ours + 64, (ours, res["deepspeed_reduced"])


def broken_gan_loss(models, z, real):
    """gan_loss with a graph break between the discriminator's two calls: two graphs reach it."""
    fake_score = models["disc"](models["gen"](z)).mean()
    torch._dynamo.graph_break()
    return -fake_score + models["disc"](real).mean()


def across_graphs_scenario(broken: bool, leftover: bool = False, inner: str = "inductor",
                           fail_first: bool = False) -> dict:
    """The GAN at ZeRO-3 over 3 steps, one graph or two: gradients and gradient norms against the
    single-process reference, and the bytes each backward reduced (torch.profiler, as
    graphzero-compare counts them; reduce_scatter, so that a byte is a byte on every backend).
    ``leftover``: before each step, a forward of the same step whose output is dropped (its
    backward never runs). ``fail_first``: first a backward that raises half way (its end never runs)."""
    from graphzero.errors import AutogradUsageError
    rank, world = rank_world()
    engines, ref = gan_engines(3)
    loss = broken_gan_loss if broken else gan_loss
    step = torch.compile(loss, backend="graphzero", options={"collective": "reduce_scatter", "inner": inner})
    if fail_first:
        with pytest.raises(AutogradUsageError):
            step(engines, *data(9, rank, (4, 8), (4, 8))).backward(create_graph=True)
    reduced = []
    for t in range(3):
        z, real = data(t, rank, (4, 8), (4, 8))
        if leftover:
            step(engines, z, real)
        out = step(engines, z, real)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            out.backward()
        counted = summarize_collectives(prof.events(), world)
        reduced.append((counted["bytes_reduced"], counted["reductions"]))
        check_gan_step(engines, ref, t)
    return {"reduced": reduced, "padded": sum(_padded_bytes(e.module, world) for e in engines.values())}


def test_engine_in_two_graphs_reduces_once_per_step(ranks):
    one = ranks.run(across_graphs_scenario, False)[0]
    two = ranks.run(across_graphs_scenario, True)[0]
    two_eager = ranks.run(across_graphs_scenario, True, False, "eager")[0]
    # the discriminator's gradient is reduced once per step, though two graphs' backwards reach it:
    # the same bytes as the one-graph step (whose bytes equal DeepSpeed's, above)
    assert one["padded"] <= one["reduced"][0][0] <= one["padded"] + 64, one
    assert [b for b, _ in two["reduced"]] == [b for b, _ in one["reduced"]], (one, two)
    assert two_eager["reduced"] == two["reduced"], (two, two_eager)


def test_a_backward_that_raised_leaves_nothing_behind(ranks):
    # its graphs counted and its end never ran: the next backward still reduces each gradient once
    # and right (at worst it keeps some until it ends), and the one after is back to the plain plan
    one = ranks.run(across_graphs_scenario, False)[0]
    res = ranks.run(across_graphs_scenario, True, False, "inductor", True)[0]
    assert all(res["padded"] <= nbytes <= res["padded"] + 64 for nbytes, _ in res["reduced"]), res
    assert res["reduced"][1:] == one["reduced"][1:], (one, res)


def test_forward_without_backward_keeps_gradients_right(ranks):
    # a dropped forward makes the counts say "another graph follows": the backward holds, and what
    # is still held when it ends is reduced then (one reduce-scatter per parameter), so the
    # gradients are right and each is still reduced once
    res = ranks.run(across_graphs_scenario, True, True)[0]
    # (reduced twice would be 1.37x here; a few bytes on top are the gradient norms' scalars)
    assert all(res["padded"] <= nbytes <= res["padded"] + 64 for nbytes, _ in res["reduced"]), res


class BreakInside(torch.nn.Module):
    """A discriminator whose forward has a graph break between its layers: no parameter of it is
    in both graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(8 * 2, 1)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(h)


def _generate(models, z):
    return models["gen"](z)


def _critic(models, x):
    # the discriminator called once: its two graphs reach different parameters
    return models["disc"](x).mean()


def _generator_loss(models, z):
    fake = models["gen"](z)
    torch._dynamo.graph_break()
    return -models["disc"](fake).mean()


def plain_path_scenario(stage: int, path: str) -> dict:
    """Graphs that share no parameter keep the plain backward: (1) a model split by a graph break
    (each graph reaches other parameters of the engine; only the discriminator has gradients), with
    gradients against the reference;
    (2) a generator forward whose backward never runs (a critic step on its detached output) does
    not make the next generator backward hold (every count restarts when a backward ends)."""
    import graphzero
    from scenario_utils import GRAD_TOL, Reference, assert_grads_close, full_grads
    rank, world = rank_world()
    torch.manual_seed(3)
    models = {"gen": mlp(8, 16, 8), "disc": BreakInside()}
    ref = Reference(models)
    engines = {name: engine(m, z3_config(stage)) for name, m in models.items()}
    graphzero.attach(**engines)
    options = {"dump_dir": path}
    split = torch.compile(_critic, backend="graphzero", options=options)
    for t in range(2):
        split(engines, *data(t, rank, (4, 8))).backward()
        ref.accumulate(_critic, [data(t, r, (4, 8)) for r in range(world)])
        assert_grads_close(full_grads(engines["disc"]), ref.grads("disc"), **GRAD_TOL, what=f"step {t} disc")
        engines["disc"].step()
        ref.step()
    generate, critic, generator_loss = (torch.compile(f, backend="graphzero", options=options)
                                        for f in (_generate, _critic, _generator_loss))
    for t in range(2):
        z, = data(t, rank, (4, 8))
        critic(engines, generate(engines, z).detach()).backward()
        engines["disc"].step()
        generator_loss(engines, z).backward()
        engines["gen"].step()
        engines["disc"].zero_grad()
    out = {}
    if rank == 0:
        out["graphs"] = [(g["id"], g.get("variant")) for g in json.loads((Path(path) / "summary.json").read_text())["graphs"]]
    dist.barrier()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_graphs_sharing_no_parameter_keep_the_plain_backward(ranks, tmp_path, stage):
    graphs = ranks.run(plain_path_scenario, stage, str(tmp_path))[0]["graphs"]
    assert len(graphs) >= 4, graphs
    assert all(variant is None for _, variant in graphs), graphs


def _chain_loss(models, x):
    return models["net"](x).square().mean()


def gathered_bytes_scenario(path: str, zero_options: dict) -> dict:
    """Bytes gathered per step by one ZeRO-3 engine (a 4-layer MLP called once): DeepSpeed eager
    (profiled, as graphzero-compare counts them) and graphzero's graph (dump summary, forward and
    backward), under the same zero_optimization options."""
    rank, world = rank_world()

    def net():
        torch.manual_seed(0)
        cfg = z3_config(3)
        cfg["zero_optimization"].update(zero_options)
        return {"net": engine(mlp(8, 32, 8, depth=4), cfg)}

    eager = net()
    x, = data(0, rank, (4, 8))
    for _ in range(2):   # the first step records DeepSpeed's module trace; the second is measured
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            eager["net"].backward(_chain_loss(eager, x))
        eager["net"].step()
    deepspeed_gathered = summarize_collectives(prof.events(), world)["bytes_gathered"]
    gz = net()
    step = torch.compile(_chain_loss, backend="graphzero", options={"engines": gz, "dump_dir": path})
    step(gz, x).backward()
    out = {"deepspeed_gathered": deepspeed_gathered, "padded": _padded_bytes(gz["net"].module, world)}
    if rank == 0:
        engines = json.loads((Path(path) / "summary.json").read_text())["graphs"][-1]["engines"]
        out["fwd"] = engines["net"]["all_gather_bytes_fwd"]
        out["bwd"] = engines["net"]["all_gather_bytes_bwd"]
    dist.barrier()
    return out


def test_parameters_stay_gathered_within_deepspeeds_reuse_distance(ranks, tmp_path):
    # DeepSpeed's defaults (stage3_max_reuse_distance 1e9 elements, stage3_prefetch_bucket_size 5e7)
    # keep the parameters gathered from the forward to the backward: graphzero gathers each once per
    # step, the bytes DeepSpeed gathers.
    kept = ranks.run(gathered_bytes_scenario, str(tmp_path / "default"), {})[0]
    assert kept["bwd"] == 0, kept
    assert kept["fwd"] == kept["padded"] == kept["deepspeed_gathered"], kept
    # With neither reaching past the next parameter DeepSpeed releases the parameters after their
    # forward use and gathers them again for backward, and so does graphzero (the parameters the
    # backward reads, but the last one used: not the first layer's weight, whose input needs no
    # gradient).
    tight = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1}
    regathered = ranks.run(gathered_bytes_scenario, str(tmp_path / "tight"), tight)[0]
    assert regathered["fwd"] == kept["fwd"], (regathered, kept)
    assert 0 < regathered["bwd"] < regathered["padded"], regathered
    assert regathered["deepspeed_gathered"] > kept["deepspeed_gathered"], (regathered, kept)
