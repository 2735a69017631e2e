"""The training recipe: DCP on 4 gloo ranks (FSDP2) against one process without parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train_llama.py"


def _runs(*runs: tuple[list[str], Path, int | None], recipe: Path = RECIPE) -> list[list[dict]]:
    """Run ``recipe`` once per ``(args, log, nproc)`` (under torchrun with ``nproc`` ranks, else
    one plain process), all at once (their start-ups overlap one another's waits); every run's
    rows (the JSON lines it wrote to ``--log-json``), in order."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = []
    for args, log, nproc in runs:
        cmd = [sys.executable]
        if nproc:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += [str(recipe), *args, "--log-json", str(log)]
        out = open(log.with_suffix(".out"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True), out, log))
    deadline = time.monotonic() + 600
    rows = []
    try:
        for proc, out, log in procs:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            out.close()
            assert code == 0, log.with_suffix(".out").read_text()[-6000:]
            rows.append([json.loads(line) for line in log.read_text().splitlines()])
    finally:
        for proc, out, _ in procs:
            proc.kill()
            proc.wait()
            out.close()
    return rows


# lambda-inline (32 s) is slow: the main job's path is causal-loader's, plans made in line equal
# the loader's (tests/test_planning.py), lambda exactness is tests/test_exact.py's
@pytest.mark.parametrize("mask,planning", [("causal", []),
                                           pytest.param("lambda", ["--plan-ahead", "0", "--ring-stats"],
                                                        marks=pytest.mark.slow),
                                           pytest.param("causal", ["--head-parallel", "2"], marks=pytest.mark.slow)],
                         ids=["causal-loader", "lambda-inline", "causal-head-parallel"])
def test_dcp_fsdp_matches_single_process(mask, planning, tmp_path):
    """The main job on 4 gloo ranks matches one process with a dense mask: causal with plans
    made ahead by the planning loader (the default), lambda with plans made in line; with head
    parallelism 2 under -m slow (the 4-rank torchtitan HSDP test and the gloo context test
    cover the head-parallel path in the default suite)."""
    common = ["--steps", "3", "--tokens-per-step", "3000", "--max-doc-len", "1500", "--mask", mask,
              "--block-size", "128"]
    dcp, ref = _runs((common + ["--cp-impl", "torch_dcp"] + planning, tmp_path / "dcp.jsonl", 4),
                     (common + ["--cp-impl", "none"], tmp_path / "ref.jsonl", None))
    assert len(dcp) == len(ref) == 3
    for a, b in zip(dcp, ref):
        assert a["docs"] == b["docs"] and a["longest"] == b["longest"]
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(b[key]), (key, a, b)
        assert a["comm_bytes"] > 0 and a["ring_comm_bytes"] > 0 and a["compute_imbalance"] >= 1.0
        assert a["head_parallel"] == (2 if "--head-parallel" in planning else a["head_parallel"])
    assert dcp[-1]["loss"] < dcp[0]["loss"]


def test_tensor_parallel_dcp_matches_tensor_parallel_alone(tmp_path):
    """The main job on 4 gloo ranks as 2 DCP x 2 TP (attention and MLP sharded by heads, each TP
    rank running the step's one plan of its 2 query / 1 KV heads over its DCP sub-group) matches
    the same --tp 2 without DCP (2 ranks, a dense mask over the whole batch)."""
    common = ["--steps", "3", "--tokens-per-step", "3000", "--max-doc-len", "1500", "--block-size", "128",
              "--tp", "2"]
    dcp, ref = _runs((common + ["--cp-impl", "torch_dcp"], tmp_path / "dcp.jsonl", 4),
                     (common + ["--cp-impl", "none"], tmp_path / "ref.jsonl", 2))
    assert len(dcp) == len(ref) == 3
    for a, b in zip(dcp, ref):
        assert a["plan_heads"] == [2, 1]  # the plan is made for the TP-local heads
        assert a["docs"] == b["docs"]
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)


def test_compare_precomputed_times_every_mode(tmp_path):
    """``--compare-precomputed`` (recipes/loader_modes.py): the same steps with plans from the
    loader, made before the round and made in line, each mode timed; rank 0 writes one row."""
    args = ["--steps", "2", "--tokens-per-step", "1024", "--max-doc-len", "512", "--block-size", "128", "--dim", "32",
            "--layers", "1", "--ffn-hidden", "64", "--compare-precomputed", "1",
            "--compare-modes", "loader,precomputed,inline"]
    ((out,),) = _runs((args, tmp_path / "modes.jsonl", 2))
    assert out["ranks"] == 2 and out["rounds"] == 1 and out["inline_plan_ms_per_step"] > 0
    for mode in ("loader", "precomputed", "inline"):
        assert out[mode]["mean_step_s"] > 0 and out[mode]["plan_wait_ms"] >= 0
    assert out["precomputed"]["ratio_to_precomputed"] == 1.0
    assert out["precomputed"]["store_ms"] == 0.0 and out["inline"]["store_ms"] == 0.0
