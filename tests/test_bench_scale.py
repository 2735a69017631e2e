"""The scale benchmark (python -m torch_dcp.benchmarks scale): its rows, its bounds."""

from __future__ import annotations

import io
import json
import time

import pytest

from torch_dcp.benchmarks import cli
from torch_dcp.benchmarks.scale import bench_scale, parse_case


def test_scale_rows_name_every_figure_and_rival():
    out = io.StringIO()
    (row,) = bench_scale(["3000x1"], "causal", ["ring"], timeout=120, out=out)
    assert json.loads(out.getvalue()) == row
    assert row["ranks"] == 8 and row["tokens"] == 3000 and row["planner"] == "dcp"
    for key in ("plan_cpu_s", "peak_rss_gb", "plan_bytes", "compute_imbalance", "memory_imbalance", "sim_ms",
                "ratio_to_ideal", "ratio_to_floor", "ring_ms"):
        assert isinstance(row[key], float | int) and row[key] > 0, key
    # dcp's default plan is never slower than the rivals it offers itself
    assert row["slower_than"] == []
    assert row["sim_ms"] <= row["ring_ms"] * (1 + 1e-9)


def test_scale_batches_plan_several_batches_in_one_process_on_either_preset():
    (row,) = bench_scale(["3000x1"], "causal", ["ring"], timeout=120, out=io.StringIO(), preset="a100", batches=3)
    assert row["preset"] == "a100" and row["batches"] == 3
    assert len(row["plan_cpu_s_each"]) == len(row["sim_ms_each"]) == len(row["ring_ms_each"]) == 3
    assert row["plan_cpu_s"] == sorted(row["plan_cpu_s_each"])[1]  # the median
    assert row["sim_ms"] == row["sim_ms_each"][0]  # the other figures: the first batch's
    assert len(set(row["sim_ms_each"])) > 1  # different batches (corpus shuffles)
    assert row["slower_than"] == [] and all(d <= r * (1 + 1e-9) for d, r in zip(row["sim_ms_each"], row["ring_ms_each"]))


def test_scale_bounds_every_plan():
    t0 = time.monotonic()
    (row,) = bench_scale(["6000x2"], "causal", [], timeout=0.5, out=io.StringIO())
    assert "not done within 0.5 s" in row["error"]
    assert time.monotonic() - t0 < 30  # the children are killed, not waited for
    (row,) = bench_scale(["6000x2"], "causal", [], timeout=120, max_memory_gb=0.05, out=io.StringIO())
    assert "error" in row  # a plan over its memory bound is reported, not fatal


def test_scale_rejects_bad_arguments(capsys):
    with pytest.raises(ValueError, match="unknown case '2m'"):
        parse_case("2m")
    assert parse_case("1m") == (1 << 20, 32) and parse_case("100x3") == (100, 3)
    assert cli.main(["scale", "--cases", "2m"]) == 2
    assert cli.main(["scale", "--rivals", "ulysses"]) == 2
    assert cli.main(["scale", "--preset", "b200"]) == 2
    assert cli.main(["scale", "--batches", "0"]) == 2
    assert "bad arguments" in capsys.readouterr().err
