"""The benchmark CLI's functions on a small cluster and batch (the paper's setup is the same
code with 131,072 tokens on 4 x 8 ranks)."""

from __future__ import annotations

import io

import pytest

from torch_dcp import Topology
from torch_dcp.benchmarks.cli import main
from torch_dcp.benchmarks.common import scaled_batch
from torch_dcp.benchmarks.planners import bench_paper
from torch_dcp.benchmarks.sweeps import bench_sweep
from torch_dcp.data import long_tail_lengths, save_lengths

TOTAL = 16384
TOPO = Topology(n_nodes=2, ranks_per_node=2)
SOURCES = {"tail": long_tail_lengths(4 * TOTAL, max_len=8192, seed=2)}


def test_paper_table_side_by_side():
    out = io.StringIO()
    rows = bench_paper(["ring", "megatron", "greedy", "dcp"], ["causal", "lambda"], [0.5, 2.0], [512, 1024], 4, TOPO,
                       out=out, sources=SOURCES, total=TOTAL)
    text = out.getvalue()
    assert len(rows) == 2 * 2 * 4  # scales x masks x planners (best block size each)
    for r in rows:
        assert r["total_ms"] == pytest.approx(r["fwd_ms"] + r["bwd_ms"])
        assert r["total_ms"] >= r["ideal_ms"] * (1 - 1e-9)
        if r["planner"] == "ring":
            assert r["speedup_vs_ring"] == pytest.approx(1.0)
        if r["planner"] == "dcp":
            base = min(x["total_ms"] for x in rows if x["planner"] != "dcp" and
                       (x["scale"], x["mask"]) == (r["scale"], r["mask"]))
            assert r["speedup_vs_best_baseline"] == pytest.approx(base / r["total_ms"])
            # ring attention's plan is among dcp's candidates, timed on the same cost model
            assert r["speedup_vs_ring"] >= 1 - 1e-9
    assert text.count("| 0.5 | tail |") == 2 and "dcp at least as fast as every baseline here" in text
    assert sum(1 for line in text.splitlines() if line.startswith("{")) == len(rows)


@pytest.mark.parametrize("sweep", ["block-size", "sparsity", "eps"])
def test_sweeps_print_tables(sweep):
    out = io.StringIO()
    rows = bench_sweep(sweep, TOPO, ["causal"], [512, 1024], batch_name="tail", out=out, sources=SOURCES, total=TOTAL)
    text = out.getvalue()
    assert f"Traffic sweep '{sweep}'" in text
    assert all(r["comm_bytes"] >= r["inter_node_bytes"] >= 0 for r in rows)
    if sweep == "sparsity":
        fractions = [r["flops_fraction"] for r in rows if r["planner"] == "dcp"]
        assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
        assert "R^2" in text
    if sweep == "eps":
        assert len(rows) == 6 and all(r["planner"] == "dcp" for r in rows)


def test_balance_floors_bound_the_simulated_time():
    """The balance benchmark: both dcp objectives per batch, each plan's simulated time at or
    above its compute and link floors, and ideal at or below the compute floor."""
    from torch_dcp.benchmarks.balance import bench_balance

    out = io.StringIO()
    rows = bench_balance(TOPO, "h100", masks=("causal",), scales=(1.0,), block_sizes=(512,), out=out,
                         sources=SOURCES, total=TOTAL)
    assert len(rows) == 1
    for obj in ("time", "bytes"):
        r = rows[0][obj]
        assert r["ms"] >= max(r["compute_floor_ms"], r["link_floor_ms"]) * (1 - 1e-9)
        assert r["ideal_ms"] <= r["compute_floor_ms"] * (1 + 1e-9)
        # the per-pass floor: at least the whole-step floors, at most the simulated time
        assert max(r["compute_floor_ms"], r["link_floor_ms"]) * (1 - 1e-9) <= r["pass_floor_ms"] <= r["ms"] * (1 + 1e-9)
    assert rows[0]["bytes"]["link_floor_ms"] > 0  # 2 nodes, compute within 1.1: the long documents cross
    assert rows[0]["bytes"]["compute_imbalance"] <= 1.1 + 1e-9
    # the balanced plan is one of the time objective's candidates, timed on the same model
    assert rows[0]["time"]["ms"] <= rows[0]["bytes"]["ms"] * (1 + 1e-12)
    assert "time objective at least as fast as the balanced plan on" in out.getvalue()
    # where the time goes: the last rank's waits, split around its kernels, fit in the pass times
    for obj in ("time", "bytes"):
        t = rows[0][obj]
        waits = [t[f"exposed_{k}_ms"] for k in ("start", "middle", "end")]
        assert min(waits) >= 0 and sum(waits) < t["ms"]
        if t["link_floor_ms"] > 0:
            assert sum(waits) > 0
    assert "waits before first kernel / between / after last kernel" in out.getvalue()
    assert "time objective: pass floor / ideal" in out.getvalue()


def test_readiness_models_bound_by_the_pass_floor():
    """The readiness benchmark: dcp's plan in divisions, static kernels and per tile, every
    model at or above the plan's floor, the division run at or above its pass floor; over every
    candidate placement (and the chosen plan), no ratio below 1 in divisions or per tile, and
    the best in divisions at most the chosen plan's."""
    from torch_dcp.benchmarks.readiness import KERNELS, bench_readiness

    out = io.StringIO()
    rows = bench_readiness(TOPO, "h100", masks=("causal", "lambda"), scales=(1.0,), block_sizes=(512,), out=out,
                           sources=SOURCES, total=TOTAL, all_candidates=True)
    assert [r["mask"] for r in rows] == ["causal", "lambda"]
    for r in rows:
        for key in ("divisions_ms", "static_ms", "per_tile_ms"):
            assert r[key] >= r["floor_ms"] * (1 - 1e-9)
        assert r["floor_ms"] * (1 - 1e-9) <= r["pass_floor_ms"] <= r["divisions_ms"] * (1 + 1e-9)
        assert r["pass_floor_ms"] >= r["ideal_ms"] * (1 - 1e-9)
        assert r["kernels"] in KERNELS
        assert r["candidates"] >= 3  # partitions, fallback layouts, ring attention's plan
        assert 1 - 1e-9 <= r["best_divisions"] <= r["divisions_ms"] / r["ideal_ms"] * (1 + 1e-9)
        assert r["best_per_tile"] >= 1 - 1e-9 and r["best_static"] > 0
    text = out.getvalue()
    assert "causal: ratio to ideal with divisions" in text and "sparse masks: ratio to ideal" in text
    assert "Best ratio to ideal over every placement dcp considers" in text


def test_scaled_batch_and_errors(tmp_path, capsys):
    assert scaled_batch([100, 300, 50], 2.0, 700) == [200, 500]
    assert sum(scaled_batch([7] * 100, 0.5, 200)) == 200
    with pytest.raises(ValueError, match="fewer than"):
        scaled_batch([10, 10], 1.0, 100)
    with pytest.raises(ValueError, match="unknown sweep"):
        bench_sweep("nope", TOPO, ["causal"], [512], sources=SOURCES, total=TOTAL)
    with pytest.raises(SystemExit):
        main(["paper", "--batches", "longalign"])
    assert "need --longalign" in capsys.readouterr().err
    # a saved length list is a length source
    save_lengths(SOURCES["tail"], tmp_path / "la.json")
    with pytest.raises(SystemExit):
        main(["paper", "--longalign", str(tmp_path / "la.json"), "--batches", "longalign,bogus"])
    assert "bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["readiness", "--masks", "causal,nope"])
    assert "unknown mask 'nope'" in capsys.readouterr().err


def test_cost_table_from_file(tmp_path):
    from torch_dcp.cost import CostModel

    (tmp_path / "t.json").write_text(CostModel.h100().to_json())
    assert CostModel.load(str(tmp_path / "t.json")) == CostModel.h100()
    with pytest.raises(ValueError, match="JSON cost model file"):
        CostModel.load("b200")


def test_step_benchmark_small_cpu(capsys):
    """``step`` on the CPU with tiny sizes: W=1 against the dense SDPA call, the busiest of 4
    emulated ranks (the flat plan: dcp alone would choose head parallelism for these heads), the
    varlen baseline skipped with its reason; the executor's output and gradients match the dense
    ones."""
    import json

    from torch_dcp.benchmarks.step import TARGETS

    rc = main(["step", "--device", "cpu", "--tokens", "1536", "--mask", "lambda", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "16", "--block-size", "128", "--divisions", "2", "--ranks", "4", "--repeat", "1"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    for key in ("device", "torch", "tokens", "docs", "mask", "kernel", "exec_s", "dense_s", "dense", "exec_over_dense",
                "varlen_s", "varlen", "exec_over_varlen", "err_out", "err_dq", "err_dk", "err_dv", "ranks",
                "topology", "rank_s", "busiest_rank", "busiest_s", "compute_imbalance", "ideal_s",
                "busiest_over_ideal", "ranks_err_out", "network_copies", "targets"):
        assert key in res, key
    assert res["device"] == "cpu" and res["tokens"] == 1536 and res["mask"] == "lambda" and res["topology"] == "1x4"
    assert res["exec_s"] > 0 and res["dense_s"] > 0 and res["exec_over_dense"] == res["exec_s"] / res["dense_s"]
    assert res["dense"].startswith("sdpa") and "CPU" in res["dense"]
    assert res["varlen_s"] is None and res["exec_over_varlen"] is None and "CUDA" in res["varlen"]
    assert max(res["err_out"], res["err_dq"], res["err_dk"], res["err_dv"], res["ranks_err_out"]) < 1e-4
    assert len(res["rank_s"]) == 4 and min(res["rank_s"]) > 0 and res["busiest_s"] == max(res["rank_s"])
    assert res["compute_imbalance"] >= 1.0
    assert res["ideal_s"] == pytest.approx(res["dense_s"] / 4 * res["compute_imbalance"])
    assert res["targets"] == TARGETS
    text = "\n".join(lines)
    assert "n/a: flash varlen needs CUDA" in text and "busiest rank" in text and "max abs error" in text


def test_step_benchmark_layers_eager_and_replayed_cpu(capsys):
    """``step --layers``: every rank of the plan timed per layer, eagerly and through layer replay
    (the eager recorder on the CPU), the replayed results bit-identical to the eager ones."""
    import json

    args = ["step", "--device", "cpu", "--tokens", "1024", "--mask", "causal", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--block-size", "128", "--ranks", "3", "--repeat", "1", "--layers", "3"]
    assert main(args + ["--profile"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("replay", "eager"):  # one layer of the busiest rank under the profiler
        assert res[f"profile_{name}_wall_s"] > 0 and res[f"profile_{name}_top"]
        assert any("scaled_dot_product" in row[0] for row in res[f"profile_{name}_top"])
    assert res["layers"] == 3 and res["layers_ranks"] == 3 and res["recorder"] == "EagerRecorder"
    assert len(res["eager_layer_busiest_s"]) == 3 and len(res["replay_rank_layer_s"]) == 3
    assert len(res["replay_rank_layer_s"][0]) == 3 and res["replay_fallbacks"] == 0
    assert res["replay_err_forward"] == 0.0 and res["replay_err_backward"] == 0.0 == res["eager_backward_spread"]
    assert res["replay_busiest_over_ideal"] == pytest.approx(res["replay_busiest_s"] / res["layers_ideal_s"])
    assert res["replay_peak_bytes"] is None and res["replay_sync_failures"] is None  # nothing to measure on a CPU
    assert main(args[:-2] + ["--layers", "2", "--no-replay"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not res["replay"] and "replay_busiest_s" not in res and len(res["eager_rank_layer_s"]) == 2
    with pytest.raises(ValueError, match="--layers must be at least 2 with replay"):
        main(args[:-2] + ["--layers", "1"])


def test_routes_cut_inter_node_bytes_on_the_same_placement(capsys):
    """Node routes against direct routes on one dcp placement: the same compute balance, fewer
    (never more) bytes between nodes, and the CLI rejects what it cannot run."""
    from torch_dcp.benchmarks.routes import bench_routes

    out = io.StringIO()
    rows = bench_routes(TOPO, "h100", batch="tail", mask="causal", scales=(1.0,), block_sizes=(512, 1024), out=out,
                        sources=SOURCES, total=TOTAL)
    assert [r["block_size"] for r in rows] == [512, 1024]
    for r in rows:
        assert r["node_compute_imbalance"] == pytest.approx(r["direct_compute_imbalance"])
        assert 0 < r["node_inter_node_bytes"] <= r["direct_inter_node_bytes"]
        assert r["saving"] == pytest.approx(1 - r["node_inter_node_bytes"] / r["direct_inter_node_bytes"])
        assert r["node_ms"] > 0 and r["direct_ms"] > 0
    assert any(r["saving"] > 0 for r in rows)  # some block crosses into a node for two ranks of it
    assert "fewer bytes between nodes than direct routes" in out.getvalue()
    with pytest.raises(ValueError, match="unknown batch 'nope'"):
        bench_routes(TOPO, batch="nope", sources=SOURCES, total=TOTAL)
    with pytest.raises(ValueError, match="several nodes"):
        bench_routes(Topology(n_nodes=1, ranks_per_node=4), sources=SOURCES, total=TOTAL)
    with pytest.raises(SystemExit):
        main(["routes", "--batch", "nope"])
    assert "unknown batch 'nope'" in capsys.readouterr().err


def test_ops_counts_a_compiled_flex_kernel(monkeypatch):
    """``ops`` counts a compiled FlexAttention kernel whose first compilation happens while it
    counts: what is compiled is flex itself, not the counter's wrapper (Dynamo cannot trace the
    counter's mode switch; on a GPU the first ``ops --device cuda`` call failed so)."""
    import torch_dcp
    from torch_dcp.benchmarks import ops
    from torch_dcp.executor.kernels import flex
    from torch_dcp.executor.kernels.flex import FlexKernel

    batch = torch_dcp.BatchSpec([300, 90, 200], torch_dcp.Lambda(sink=8, window=64), n_heads=4, n_kv_heads=2,
                                head_dim=16, dtype="float32")
    plan = torch_dcp.plan(batch, 2, planner="greedy", block_size=64)
    monkeypatch.setattr(flex, "_COMPILED", {})  # compiled for the first time inside the count
    monkeypatch.setattr(ops, "get_kernel", lambda *a, **k: FlexKernel(block_size=32, compile="aot_eager",
                                                                      recompute=False))
    rows = ops._count_ops(plan, "cpu", None, 0)
    assert {r["pass"] for r in rows} == {"forward", "backward"} and all(r["kernel_calls"] >= 1 for r in rows)
    assert set(flex._COMPILED) == {"flex:aot_eager", "backward:aot_eager"}


def test_operations_per_pass_and_per_division_come_apart():
    """The GPU executor preset's split (``ops --write-preset``): ranks whose operations are ``a + b
    x d`` over their ``d`` divisions give back ``a`` per pass and ``b`` per division from a count at
    several divisions and one at one (ranks without tiles counted as one division); two counts
    with the same divisions are refused."""
    from torch_dcp.benchmarks.ops import per_pass_and_division

    def rows(divisions, fwd, bwd):
        return [r for d in divisions for r in ({"pass": "forward", "divisions": d, "device_ops": fwd(max(1, d))},
                                                {"pass": "backward", "divisions": d, "device_ops": bwd(max(1, d))})]

    fwd, bwd = (lambda d: 5 + 2 * d), (lambda d: 13 + 3.5 * d)
    got = per_pass_and_division(rows([4, 3, 0, 2], fwd, bwd), rows([1, 1, 0, 1], fwd, bwd))
    assert got == pytest.approx({"forward": 2, "forward_pass": 5, "backward": 3.5, "backward_pass": 13})
    with pytest.raises(ValueError, match="forward: the plan has 1.0 divisions per rank"):
        per_pass_and_division(rows([1, 0], fwd, bwd), rows([1, 1], fwd, bwd))


def test_ops_counts_the_executors_operations_alone():
    """``ops`` counts what each rank's executor issues, nothing of its own harness: four ranks of
    all-gather CP in groups of one (each rank its own documents, one attention call per pass)
    issue the same operations each, forward and backward (each rank's dO was once taken inside
    the count, one indexing per rank charged to one of them)."""
    import dataclasses

    import torch_dcp
    from torch_dcp.api import divide
    from torch_dcp.benchmarks.ops import count_ops
    from torch_dcp.planners import Runtime, plan_allgather

    batch = torch_dcp.BatchSpec([256, 256, 256, 256], torch_dcp.Causal(), n_heads=4, n_kv_heads=2, head_dim=16,
                                dtype="float32")
    topo = Topology(n_nodes=1, ranks_per_node=4)
    plan = divide(dataclasses.replace(plan_allgather(batch, topo, cp_size=1), runtime=Runtime.DCP_ALLGATHER), topo, 1)
    rows = count_ops(plan)
    for name in ("forward", "backward"):
        counts = [(r["ops"], r["kernel_calls"]) for r in rows if r["pass"] == name]
        assert len(counts) == 4 and len(set(counts)) == 1, (name, counts)
