"""``benchmarks gpu-report`` on a CPU machine: the stage runner (each stage a subprocess with its
own time limit), the JSON and markdown report, a stage that fails or hangs leaving every other
figure, ``--dry-run`` and the no-CUDA message. The stand-in stages are small real commands given
through ``run_report``'s stage table; the real table needs a GPU."""

from __future__ import annotations

import io
import json
import os
import sys
import time

import pytest
import torch

from torch_dcp.benchmarks import gpu_report as gr
from torch_dcp.benchmarks.cli import main as cli_main

PY = sys.executable


def _py(code: str) -> tuple[str, ...]:
    return (PY, "-c", code)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_failing_or_hanging_stage_leaves_every_other_figure(tmp_path):
    pidfile = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            "print('started', flush=True); time.sleep(120)")
    stages = [
        gr.Stage("step-causal", "stand-in: meets its targets",
                 _py("import json; print('table'); print(json.dumps({'exec_over_dense': 1.1, 'exec_over_varlen': 1.2,"
                     " 'busiest_over_ideal': 1.25, 'err_out': 0.01, 'rank_s': [1, 2],"
                     " 'bwd_ratio': float('nan')}))"), 20),
        gr.Stage("train-dcp", "stand-in: fails after two steps",
                 _py("import json, sys\nfor i, l in enumerate((5.0, 4.0)):\n"
                     "    print(json.dumps({'step': i, 'loss': l, 'tokens_per_s': 900.0 + i}))\n"
                     "print('Traceback: boom', file=sys.stderr); sys.exit(3)"), 20, "train"),
        gr.Stage("step-lambda", "stand-in: hangs, with a child", _py(hang), 2.5),
        gr.Stage("train-none", "stand-in: after the hang",
                 _py("import json\nfor i, l in enumerate((5.0, 3.0, 2.0)):\n"
                     "    print(json.dumps({'step': i, 'loss': l, 'tokens_per_s': 1000.0}))"), 20, "train"),
        gr.Stage("torchtitan-dcp", "stand-in: a missing module", _py("pass"), 20, "torchtitan",
                 needs_modules=("no_such_module_for_gpu_report",)),
    ]
    t0 = time.perf_counter()
    report = gr.run_report(stages, tmp_path / "out", log=None)
    assert time.perf_counter() - t0 < 25  # the hang cost its limit (+ the kill), not 120 s
    by = {s["name"]: s for s in report["stages"]}
    assert [s["status"] for s in report["stages"]] == ["passed", "failed", "timeout", "passed", "skipped"]
    assert by["step-causal"]["figures"]["exec_over_dense"] == 1.1 and "rank_s" not in by["step-causal"]["figures"]
    assert by["train-dcp"]["returncode"] == 3 and by["train-dcp"]["error_tail"] == ["Traceback: boom"]
    assert by["train-dcp"]["figures"] == {"steps": 2, "first_loss": 5.0, "last_loss": 4.0, "tokens_per_s": 901.0}
    assert by["step-lambda"]["returncode"] is None and "killed after 2 s" in by["step-lambda"]["error_tail"][-1]
    assert by["step-lambda"]["error_tail"][0] == "started" and 2.5 <= by["step-lambda"]["seconds"] < 15
    child = int(pidfile.read_text())
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the hanging stage's child outlived it"
    assert "no_such_module_for_gpu_report" in by["torchtitan-dcp"]["reason"]
    assert by["train-none"]["figures"]["last_loss"] == 2.0

    assert by["step-causal"]["figures"]["bwd_ratio"] is None  # NaN: no value (the file is strict JSON)
    on_disk = json.loads((tmp_path / "out" / "gpu_report.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"{c} in the report"))
    assert on_disk["stages"] == json.loads(json.dumps(report["stages"]))
    assert (tmp_path / "out" / "logs" / "train-dcp.stderr").read_text().strip() == "Traceback: boom"
    targets = {t["figure"]: t for t in on_disk["targets"]}
    t = targets["causal W=1: executor / compiled dense flex"]
    assert (t["measured"], t["met"], t["target"]) == (1.1, True, "<= 1.15")
    assert targets["causal 4x8: busiest rank / (dense / W x imbalance)"]["met"] is True
    lam = targets["lambda W=1: executor / compiled dense flex"]
    assert lam["measured"] is None and lam["met"] is None and lam["why_none"] == "step-lambda: timeout"
    first = targets["main job: first loss, |torch_dcp - none| / none"]
    assert first["measured"] == 0.0 and first["met"] is True  # the failed stage's figures still count
    last = targets["main job: last loss, |torch_dcp - none| / none"]
    assert last["measured"] == pytest.approx(1.0) and last["met"] is False
    assert targets["main job: tokens/s, torch_dcp / none"]["measured"] == pytest.approx(0.901)
    assert targets["main job: tokens/s, torch_dcp / none"]["target"] == "reported"

    md = (tmp_path / "out" / "gpu_report.md").read_text()
    assert "| figure | target | measured | met? | source |" in md
    assert "| causal W=1: executor / compiled dense flex | <= 1.15 | 1.1 | yes | H100 executor target |" in md
    assert "| main job: last loss, |torch_dcp - none| / none | <= 0.02 | 1 | **no** |" in md
    assert "n/a (step-lambda: timeout)" in md and "n/a (torchtitan-dcp: skipped; torchtitan-none: not run)" in md
    assert "### train-dcp: failed" in md and "### step-lambda: timeout" in md and "Traceback: boom" in md
    assert "| torchtitan-dcp | skipped (module 'no_such_module_for_gpu_report' is not installed) |" in md


def test_readers():
    pytest_out = "....s\n=== 5 passed, 2 skipped, 1 failed, 1 error in 3.21s ===\n"
    assert gr.READERS["pytest"](pytest_out) == {"passed": 5, "skipped": 2, "failed": 1, "errors": 1, "not_passed": 2}
    assert gr.READERS["pytest"]("1 passed, 3 deselected in 0.5s")["not_passed"] == 0
    titan = ("[rank0]:\x1b[32mstep:  1  \x1b[31mloss:  8.1234  grad_norm: 1.0  memory: 1GiB(1%)  tps: 1,000  tflops: 1\n"
             "[rank0]:step:  2  loss:  7.5  grad_norm:  0.5  memory: 1GiB  tps: 3,000  tflops: 1\n"
             "[rank0]:step:  3  loss:  7.0  grad_norm:  0.5  memory: 1GiB  tps: 5,000  tflops: 1\n")
    assert gr.READERS["torchtitan"](titan) == {"steps": 3, "first_loss": 8.1234, "last_loss": 7.0,
                                               "tokens_per_s": 4000.0}
    ops = "\n".join(json.dumps(r) for r in (
        {"rank": 0, "pass": "forward", "divisions": 4, "ops": 20, "per_div": 5.0, "kernel_calls": 4},
        {"rank": 1, "pass": "forward", "divisions": 2, "ops": 14, "per_div": 7.0, "kernel_calls": 2},
        {"rank": 0, "pass": "backward", "divisions": 4, "ops": 40, "per_div": 10.0, "kernel_calls": 4},
        {"cuda_kernels_forward_per_division": 6.5, "cuda_kernels_backward_per_division": 12.0, "note": "x"}))
    got = gr.READERS["ops"]("forward: executor ops per division ...\n" + ops)
    assert got["forward_ops_per_division_worst"] == 7.0 and got["backward_ops_per_division_worst"] == 10.0
    assert got["forward_kernel_calls"] == 6 and got["cuda_kernels_backward_per_division"] == 12.0
    assert gr.READERS["last_json"]("no json here\n{broken\n") == {}


def test_stage_table_and_options():
    full, quick = gr.default_stages(), gr.default_stages(quick=True)
    assert {s.name for s in quick} < {s.name for s in full}
    assert all(s.timeout_s < gr.FULL_BUDGET_S for s in full) and all(s.timeout_s < gr.QUICK_BUDGET_S for s in quick)
    names = {s.name for s in full}
    for t in gr.TARGETS:  # every target reads figures of stages in the table
        assert {s for s, _ in t.reads} <= names, t.figure
    assert [s.name for s in gr.select(full, "launches, sync")] == ["sync", "launches"]
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['nope'\]; choose from \['sync'"):
        gr.select(full, "sync,nope")
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got 0"):
        gr.Stage("x", "t", ("true",), 0)
    with pytest.raises(ValueError, match="unknown reader 'xml'"):
        gr.Stage("x", "t", ("true",), 1, reader="xml")
    with pytest.raises(ValueError, match="stage name must be"):
        gr.Stage("a b", "t", ("true",), 1)
    with pytest.raises(ValueError, match="how must be 'value' .* got 'ratio' with 1"):
        gr.Target("x", (("a", "b"),), "ratio")
    with pytest.raises(ValueError, match="op must be"):
        gr.Target("x", (("a", "b"),), op="<")
    with pytest.raises(ValueError, match="stage names must be unique"):
        gr.run_report([gr.Stage("a", "t", ("true",), 1)] * 2, "unused", log=None)
    with pytest.raises(ValueError, match="timeout_scale must be positive"):
        gr.run_report([], "unused", timeout_scale=0, log=None)


def test_dry_run_lists_stages_and_commands(capsys):
    assert cli_main(["gpu-report", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"gpu-report: {len(gr.default_stages())} stages, run from ")
    for s in gr.default_stages():
        assert f"  {s.name} " in out
    assert "-m torch_dcp.benchmarks step --device cuda --tokens 131072 --repeat 3 --layers 4 --mask lambda --ranks 32" in out
    assert "calibrate --check --device cuda --cost outputs/gpu_report_calibration.json" in out and "4x8:1024 --replay" in out
    assert "recipes/train_llama.py --cp-impl torch_dcp --no-replay" in out
    assert "-m pytest -q -p no:cacheprovider -m cuda tests/test_executor.py -k synchronisation" in out
    assert "-m pytest -q -p no:cacheprovider -m cuda tests -k 'not synchronisation'" in out
    assert "recipes/train_llama.py --cp-impl none" in out and "--nproc-per-node 1 recipes/train_llama.py" in out
    buf = io.StringIO()
    assert gr.main(["--dry-run", "--quick", "--stages", "step-causal,train-dcp", "--timeout-scale", "2"], out=buf) == 0
    text = buf.getvalue()
    assert "gpu-report --quick: 2 stages" in text and "limits adding up to 170 s within a budget of 180 s" in text
    assert "--tokens 32768 --repeat 3 --layers 4 --mask causal --ranks 8" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_no_cuda_exits_with_a_clear_message(tmp_path, capsys):
    assert gr.main(["--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "gpu-report needs a CUDA device" in err and "--dry-run lists the stages" in err
    assert not (tmp_path / "r").exists()
    assert cli_main(["gpu-report", "--out", str(tmp_path / "r")]) == 2
    with pytest.raises(SystemExit):  # a bad option is a usage error
        cli_main(["gpu-report", "--stages", "nope", "--dry-run"])


def test_the_budget_bounds_the_whole_report(tmp_path):
    # each stage alone fits its own limit; the budget cuts the second and skips the third
    sleep = _py("import time; print('up', flush=True); time.sleep(3)")
    stages = [gr.Stage("step-causal", "stand-in: 1 s", _py("import time; time.sleep(1)"), 20),
              gr.Stage("step-lambda", "stand-in: sleeps past the budget", sleep, 20),
              gr.Stage("launches", "stand-in: never reached", _py("pass"), 20),
              gr.Stage("torchtitan-dcp", "stand-in: a module that fails to import", _py("pass"), 20,
                       needs_imports=("json.no_such_submodule_for_gpu_report",))]
    t0 = time.perf_counter()
    report = gr.run_report(stages, tmp_path / "out", log=None, budget_s=3.0)
    assert time.perf_counter() - t0 < 3.0 + 8  # the budget, the kill of the cut stage and the report
    by = {s["name"]: s for s in report["stages"]}
    assert [s["status"] for s in report["stages"]] == ["passed", "timeout", "skipped", "skipped"]
    assert by["step-lambda"]["timeout_s"] < 2.5 and "killed after" in by["step-lambda"]["error_tail"][-1]
    assert by["launches"]["reason"] == "the report's budget (3 s) is spent"
    with pytest.raises(ValueError, match="budget_s must be positive"):
        gr.run_report(stages, tmp_path / "o2", log=None, budget_s=0)


def test_a_stage_whose_module_does_not_import_is_skipped_with_the_error(tmp_path):
    st = gr.Stage("torchtitan-dcp", "stand-in", _py("pass"), 20, needs_imports=("json.no_such_submodule_for_gpu_report",))
    res = gr.run_stage(st, tmp_path, tmp_path / "logs")
    assert res.status == "skipped" and "json.no_such_submodule_for_gpu_report does not import here" in res.reason
    assert "ModuleNotFoundError" in res.reason
