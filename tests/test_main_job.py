"""``python -m torch_dcp.benchmarks main-job``: the main job against PyTorch's context_parallel."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_dcp.benchmarks import main_job
from torch_dcp.benchmarks.cli import parser

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train_llama.py"
TINY = ["--steps", "2", "--tokens-per-step", "1024", "--max-doc-len", "512", "--block-size", "128", "--dim", "32",
        "--layers", "1", "--ffn-hidden", "64"]


def _run(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_dcp.benchmarks", "main-job", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_one_pair_side_by_side():
    """Both implementations run on the same batches; the figures are the recipe's rows."""
    res = _run("--pairs", "1", "--nproc", "2", "--json", "--", *TINY)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    (pair,) = out["pairs"]
    assert out["nproc"] == 2 and out["recipe_args"] == TINY
    assert pair["torch_dcp_tokens_per_s"] > 0 and pair["torch_tokens_per_s"] > 0
    assert pair["speedup"] == pytest.approx(pair["torch_dcp_tokens_per_s"] / pair["torch_tokens_per_s"], rel=1e-3)
    assert pair["torch_dcp_cpu_ms"] > 0 and pair["torch_cpu_ms"] > 0
    assert pair["planners"] and all(p.startswith("dcp") for p in pair["planners"])
    assert out["median_speedup"] == pair["speedup"]


def _fake(tokens: float, cpu: list[float]) -> dict:
    rows = [{"step": i, "tokens_per_s": tokens, "cpu_ms": c, "planner": "dcp"} for i, c in enumerate(cpu)]
    return {"tokens_per_s": tokens, "cpu_ms": sorted(cpu)[len(cpu) // 2], "rows": rows}


def test_summary_ratios_and_medians():
    pairs = [{"torch_dcp": _fake(150.0, [10, 11, 12]), "torch": _fake(100.0, [20, 22, 24])},
             {"torch_dcp": _fake(120.0, [10, 10, 10]), "torch": _fake(100.0, [15, 15, 15])},
             {"torch_dcp": _fake(200.0, [10, 10, 10]), "torch": _fake(100.0, [30, 30, 30])}]
    s = main_job.summarize(pairs)
    assert [p["speedup"] for p in s["pairs"]] == [1.5, 1.2, 2.0]
    assert [p["cpu_ratio"] for p in s["pairs"]] == [2.0, 1.5, 3.0]
    assert s["median_speedup"] == 1.5 and s["median_cpu_ratio"] == 2.0


@pytest.mark.parametrize("argv,needle", [
    (["--", "--cp-impl", "torch"], "set by the benchmark"),
    (["--", "--log-json=x.jsonl"], "set by the benchmark"),
    (["--pairs", "0"], "--pairs"),
    (["--recipe", "no/such/recipe.py"], "no recipe at no/such/recipe.py"),
])
def test_bad_arguments_name_what_was_wrong(argv, needle):
    args = parser().parse_args(["main-job", *argv])
    with pytest.raises(main_job.MainJobError, match=re.escape(needle)):
        main_job.run(args)


def test_a_failing_run_reports_its_cause():
    """The rank's own error comes ahead of the launcher's summary."""
    with pytest.raises(main_job.MainJobError, match=r"(?s)the torch_dcp run exited with status 1.*--no-such-option"):
        main_job.run_once(RECIPE, "torch_dcp", 1, [*TINY, "--no-such-option"], 120.0)


def test_excerpt_keeps_the_first_error_and_the_tail():
    lines = [f"line {i}" for i in range(40)]
    lines[5] = "ValueError: the cause"
    out = main_job._excerpt("\n".join(lines), before=2, last=3).splitlines()
    assert out == ["line 3", "line 4", "ValueError: the cause", "...", "line 37", "line 38", "line 39"]


def test_a_run_past_its_timeout_is_killed_with_its_ranks(tmp_path):
    """At the timeout the launcher is stopped and ends its ranks: none is left running."""
    t0 = time.monotonic()
    with pytest.raises(main_job.MainJobError, match="longer than --timeout 9 s"):  # the ranks are training by then
        main_job.run_once(RECIPE, "torch_dcp", 2, ["--steps", "100000", *TINY[2:]], 9.0)
    assert time.monotonic() - t0 < 9 + 35
    time.sleep(1.0)  # a rank's planning worker leaves within 0.5 s of its parent
    left = subprocess.run(["pgrep", "-f", "--", "--steps 100000"], capture_output=True, text=True, check=False).stdout.split()
    assert not left, f"processes left running: {left}"
