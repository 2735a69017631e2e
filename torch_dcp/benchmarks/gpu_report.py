"""The whole GPU report in one command::

    python -m torch_dcp.benchmarks gpu-report --out gpu_report          # every stage, under 8 minutes on an H100
    python -m torch_dcp.benchmarks gpu-report --out r --quick           # the short variants, under 3 minutes
    python -m torch_dcp.benchmarks gpu-report --dry-run                 # the stages and their commands (any machine)
    python -m torch_dcp.benchmarks gpu-report --out r --stages step-causal,launches

Every stage is one command run in a subprocess of its own (its own session, so a launcher's
children go with it) under its own time limit (seconds, ``Stage.timeout_s``, scaled by
``--timeout-scale``): a stage that fails or hangs is recorded as ``failed`` or ``timeout`` with
the last lines of its output, and the next stage runs. The whole report runs within a budget
(``--budget``, default 8 minutes, ``--quick`` 3): each stage's limit is cut to what is left of
it and a stage the budget does not reach is ``skipped``, so the report's own wall time is
bounded by construction. On an H200 with cold compile caches the stages took 324-410 s in all.
Figures are read from what each command prints (its JSON lines, pytest's summary, the main
job's per-step JSON, torchtitan's step lines), also from a stage that failed part way.

It writes ``OUT/gpu_report.json`` (the machine, then one record per stage: ``name``,
``command``, ``status`` in ``passed|failed|timeout|skipped``, ``returncode``, ``seconds``,
``timeout_s``, ``figures``, ``error_tail``; then every target with its measured value) and
``OUT/gpu_report.md`` (the table a person reads: figure, target, measured, met?), and each
stage's stdout and stderr under ``OUT/logs/``.

The stages are :func:`default_stages` (the suite's CUDA tests, ``benchmarks step``, ``kernels
division|reduce``, launches per division, the main job and torchtitan on CUDA, each against no
parallelism); the targets :data:`TARGETS`. Recipes and tests are read from the checkout the
package sits in (``--root``); a stage whose files or modules are missing is ``skipped``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .gpu_report_readers import READERS
from .gpu_report_targets import TARGETS, Target, evaluate_targets

__all__ = ["Stage", "StageResult", "Target", "default_stages", "select", "run_stage", "run_report",
           "evaluate_targets", "write_report", "machine", "TARGETS", "READERS", "add_arguments", "run", "main",
           "NoCudaError"]

#: the checkout the package sits in (recipes/ and tests/ beside torch_dcp/)
ROOT = Path(__file__).resolve().parents[2]
#: default budgets of the whole report (seconds): every stage runs within what is left of it
FULL_BUDGET_S, QUICK_BUDGET_S = 900.0, 180.0
_TAIL_LINES = 20


class NoCudaError(RuntimeError):
    """``gpu-report`` was asked to run on a machine where torch sees no CUDA device."""


@dataclass(frozen=True)
class Stage:
    """One command of the report.

    Attributes:
        name: identifier (``--stages`` picks by it), e.g. ``"step-causal"``.
        title: what it measures, one line.
        argv: the command, run with the checkout as working directory.
        timeout_s: seconds it may run before it and its children are killed (positive).
        reader: key of :data:`READERS`: how figures are read from its output (stdout, then
            stderr).
        needs_modules: modules that must be importable, else the stage is ``skipped``.
        needs_paths: files under the root that must exist, else ``skipped``.
        needs_imports: modules that must import without error here (imported by the report,
            e.g. a package whose release needs a newer torch), else ``skipped`` with the error.
    """

    name: str
    title: str
    argv: tuple[str, ...]
    timeout_s: float
    reader: str = "last_json"
    needs_modules: tuple[str, ...] = ()
    needs_paths: tuple[str, ...] = ()
    needs_imports: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.name or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"stage name must be letters, digits, '-', '_' or '.', got {self.name!r}")
        if not self.argv:
            raise ValueError(f"stage {self.name!r}: empty command")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"stage {self.name!r}: timeout_s must be a positive number of seconds, "
                             f"got {self.timeout_s!r}")
        if self.reader not in READERS:
            raise ValueError(f"stage {self.name!r}: unknown reader {self.reader!r}; choose from {sorted(READERS)}")


@dataclass
class StageResult:
    """What one stage gave: ``status`` is ``passed`` (exit 0), ``failed`` (another exit
    status), ``timeout`` (killed after ``timeout_s``) or ``skipped`` (``reason``)."""

    name: str
    title: str
    command: str
    status: str
    returncode: int | None
    seconds: float
    timeout_s: float
    figures: dict[str, Any] = field(default_factory=dict)
    error_tail: list[str] = field(default_factory=list)
    reason: str = ""


# ---------------------------------------------------------------------- the stage table
def default_stages(quick: bool = False, python: str = sys.executable) -> list[Stage]:
    """The report's stages (module docstring); ``quick``: the short variants (smaller batches,
    fewer steps; without the λ step, the division kernels and torchtitan). Each limit bounds one
    stage; the report's budget (:data:`FULL_BUDGET_S`, :data:`QUICK_BUDGET_S`) bounds them all."""
    bench = (python, "-m", "torch_dcp.benchmarks")
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda")
    tokens, ranks = ("32768", "8") if quick else ("131072", "32")
    step = (*bench, "step", "--device", "cuda", "--tokens", tokens, "--repeat", "3")
    layers = (*step, "--layers", "4")
    cal = "outputs/gpu_report_calibration.json"
    check = (*bench, "calibrate", "--check", "--device", "cuda", "--cost", cal, "--repeat", "2", "--cases",
             f"longtail:causal:{tokens}:{'1x8' if quick else '4x8'}:1024,longtail:lambda:{tokens}:"
             f"{'1x8' if quick else '4x8'}:1024")
    model = ("--tokens-per-step", "8192" if quick else "16384", "--max-doc-len", "4096", "--block-size", "1024",
             "--divisions", "4", "--dim", "512", "--layers", "4", "--heads", "8", "--kv-heads", "2",
             "--ffn-hidden", "1408", "--steps", "5" if quick else "20")
    train = "recipes/train_llama.py"
    titan = ("recipes/torchtitan_cpu.py", "--device", "cuda", "--nproc", "1", "--steps", "3" if quick else "10",
             "--assets", "outputs/gpu_report_torchtitan_assets")
    ops = (*bench, "ops", "--device", "cuda", "--batch", "longtail", "--block-size", "1024", "--divisions", "4",
           "--heads", "8", "--kv-heads", "2", "--head-dim", "128", "--dtype", "bfloat16")
    ops += ("--tokens", "16384", "--topology", "1x8") if quick else ("--tokens", "131072", "--topology", "4x8")
    # (stage, full limit, quick limit or None: not among the short variants). Full limits: about
    # 1.3-1.5x what each stage took on an H200 with cold compile caches (2026-11-26: sync 40 s,
    # tests-cuda 132 s, step 29 s each, kernels division 45 s, reduce 18 s, launches 17 s, main
    # job 46 s / 16 s); the report's budget (run_report) bounds their sum.
    table = [
        (Stage("sync", "no synchronisation inside a step's attention forward + backward (sync debug mode 'error')",
               (*pytest, "tests/test_executor.py", "-k", "synchronisation"), 60, "pytest", ("pytest", "hypothesis"), ("tests",)), 60, 50),
        (Stage("tests-cuda", "the suite's CUDA tests (pytest -m cuda)",
               (*pytest, "tests", "-k", "not synchronisation") if not quick else
               (*pytest, "tests/test_varlen.py", "tests/test_flash_attn.py", "tests/test_triton_merge.py"), 180,
               "pytest", ("pytest", "hypothesis"), ("tests",)), 180, 40),
        (Stage("replay-tests", "layer replay's and the Trainer's CUDA tests (CUDA graphs, fallback, DCPSFTTrainer)",
               (*pytest, "tests/test_replay.py", "tests/test_hf_trainer.py"), 150, "pytest", ("pytest", "hypothesis"),
               ("tests",)), 150, 90),
        (Stage("step-causal", f"step, causal, {tokens} tokens: W=1 vs dense flex and varlen flash; "
               f"{ranks}-rank busiest, 4 layers eager and replayed", (*layers, "--mask", "causal", "--ranks", ranks, "--profile"),
               90), 90, 45),
        (Stage("step-lambda", f"step, lambda, {tokens} tokens: W=1 vs dense flex; {ranks}-rank busiest, 4 layers "
               "eager and replayed", (*layers, "--mask", "lambda", "--ranks", ranks, "--profile"), 100), 100, None),
        (Stage("step-w1-causal", f"step, causal, {tokens} tokens, W=1: 4 layers eager and replayed (time, memory)",
               (*layers, "--mask", "causal", "--ranks", "1"), 60), 60, 30),
        (Stage("step-w1-lambda", f"step, lambda, {tokens} tokens, W=1: 4 layers eager and replayed (time, memory)",
               (*layers, "--mask", "lambda", "--ranks", "1"), 60), 60, None),
        (Stage("calibrate", "the card's cost model, fitted to the executor's own times",
               (*bench, "calibrate", "--device", "cuda", "--out", cal), 300), 300, None),
        (Stage("calibrate-check", f"the card's model against every rank, eager, {ranks} ranks", check, 120, "check",
               needs_paths=(cal,)), 120, None),
        (Stage("calibrate-check-replay", f"the card's model against every rank, replayed, {ranks} ranks",
               (*check, "--replay"), 150, "check", needs_paths=(cal,)), 150, None),
        (Stage("step-flash-attn", f"step, causal, {tokens} tokens, W=1, kernel flash_attn",
               (*step, "--mask", "causal", "--kernel", "flash_attn"), 45, needs_modules=("flash_attn",)), 45, 30),
        (Stage("step-varlen", f"step, causal, {tokens} tokens, W=1, kernel varlen (aten), beside flash_attn",
               (*step, "--mask", "causal", "--kernel", "varlen"), 30, needs_modules=("flash_attn",)), 30, 20),
        (Stage("kernels-division", "one division's kernel vs the dense call, TFLOP/s",
               (*bench, "kernels", "division", "--device", "cuda"), 60), 60, None),
        (Stage("kernels-division-flash-attn", "one division through flash_attn vs the dense call, TFLOP/s",
               (*bench, "kernels", "division", "--device", "cuda", "--kernel", "flash_attn"), 45,
               needs_modules=("flash_attn",)), 45, None),
        (Stage("kernels-reduce", "LSE merge: torch, Triton, per-block loop vs the memory-bound limit",
               (*bench, "kernels", "reduce", "--device", "cuda"), 30), 30, 20),
        (Stage("launches", "executor operations and CUDA kernel launches per division (profiler), paper batch",
               ops, 30, "ops"), 30, 20),
        (Stage("train-dcp", "main job on CUDA, one process, --cp-impl torch_dcp",
               (python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", train,
                "--cp-impl", "torch_dcp", *model), 70, "train", needs_paths=(train,)), 70, 40),
        (Stage("train-dcp-no-replay", "main job on CUDA, one process, --cp-impl torch_dcp --no-replay",
               (python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", train,
                "--cp-impl", "torch_dcp", "--no-replay", *model), 70, "train", needs_paths=(train,)), 70, 40),
        (Stage("train-none", "main job on CUDA, one process, --cp-impl none",
               (python, train, "--cp-impl", "none", *model), 30, "train", needs_paths=(train,)), 30, 20),
        (Stage("torchtitan-dcp", "torchtitan debug model on CUDA, one process, with DCP",
               (python, *titan, "--dump", "outputs/gpu_report_torchtitan_dcp"), 60, "torchtitan", ("torchtitan",),
               (titan[0],), ("torchtitan.trainer",)), 60, None),
        (Stage("torchtitan-none", "torchtitan debug model on CUDA, one process, without CP",
               (python, *titan, "--no-dcp", "--dump", "outputs/gpu_report_torchtitan_none"), 45, "torchtitan",
               ("torchtitan",), (titan[0],), ("torchtitan.trainer",)), 45, None),
    ]
    stages = [dataclasses.replace(st, timeout_s=float(short if quick else full)) for st, full, short in table
              if not (quick and short is None)]
    return stages


# ---------------------------------------------------------------------- running
def _tail(text: str, n: int = _TAIL_LINES) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]


def _missing(stage: Stage, root: Path) -> str:
    for mod in stage.needs_modules:
        if importlib.util.find_spec(mod) is None:
            return f"module {mod!r} is not installed"
    for rel in stage.needs_paths:
        if not (root / rel).exists():
            return f"{rel} not found under {root} (run from a checkout of torch_dcp, or pass --root)"
    for mod in stage.needs_imports:
        try:
            importlib.import_module(mod)
        except Exception as e:  # e.g. torchtitan 0.3.0 under torch 2.11: a name torch lacks
            return f"{mod} does not import here ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return ""


def run_stage(stage: Stage, root: Path, logs: Path, timeout_scale: float = 1.0,
              env: dict[str, str] | None = None, cap_s: float = math.inf) -> StageResult:
    """Run one stage in its own subprocess and session, killed (with its children) after
    ``min(stage.timeout_s * timeout_scale, cap_s)`` seconds; stdout and stderr go to
    ``logs/NAME.*``."""
    limit = min(stage.timeout_s * timeout_scale, cap_s)
    cmd = shlex.join(stage.argv)
    why = _missing(stage, root)
    if why:
        return StageResult(stage.name, stage.title, cmd, "skipped", None, 0.0, limit, reason=why)
    logs.mkdir(parents=True, exist_ok=True)
    out_path, err_path = logs / f"{stage.name}.stdout", logs / f"{stage.name}.stderr"
    t0 = time.perf_counter()
    with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
        try:
            proc = subprocess.Popen(stage.argv, cwd=root, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        except OSError as e:
            return StageResult(stage.name, stage.title, cmd, "failed", None, 0.0, limit, error_tail=[str(e)])
        status = "passed"
        try:
            rc: int | None = proc.wait(timeout=limit)
            if rc != 0:
                status = "failed"
        except subprocess.TimeoutExpired:
            status, rc = "timeout", None
            _kill_group(proc)
    seconds = time.perf_counter() - t0
    stdout = out_path.read_text(errors="replace")
    stderr = err_path.read_text(errors="replace")
    res = StageResult(stage.name, stage.title, cmd, status, rc, seconds, limit)
    try:
        res.figures = READERS[stage.reader](stdout + "\n" + stderr)  # torchtitan logs to stderr
    except Exception as e:  # a reader must not cost the report: record why
        res.figures = {"reader_error": f"{type(e).__name__}: {e}"}
    if status != "passed":
        res.error_tail = _tail(stderr) or _tail(stdout)
        if status == "timeout":
            res.error_tail.append(f"[gpu-report] killed after {limit:.0f} s (the stage's time limit)")
    return res


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group, SIGKILL 5 s later if it is still there."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def machine() -> dict[str, Any]:
    """Python, torch, CUDA device and flash-attn of this machine (no GPU needed)."""
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    import torch

    from ..executor.kernels.flash_attn import flash_attn_versions

    info.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda=torch.cuda.is_available())
    if info["cuda"]:
        info.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)))

    info["flash_attn"] = flash_attn_versions()
    return info


def run_report(stages: Sequence[Stage], out: str | os.PathLike, root: str | os.PathLike = ROOT,
               timeout_scale: float = 1.0, log: Callable[[str], None] | None = print,
               budget_s: float = math.inf) -> dict[str, Any]:
    """Run ``stages`` one after another (:func:`run_stage`) and write the report
    (:func:`write_report`) to ``out``; returns the report's dict. Any stage table works (tests
    pass small stand-in commands); figures go through :data:`TARGETS`. ``budget_s`` bounds the
    whole run (seconds): each stage's limit is cut to what is left of it, and a stage reached
    with under a second left is ``skipped`` (the budget is spent).

    Raises:
        ValueError: ``timeout_scale`` or ``budget_s`` not positive, or two stages with one name.
    """
    if not timeout_scale > 0:
        raise ValueError(f"timeout_scale must be positive, got {timeout_scale!r}")
    if not budget_s > 0:
        raise ValueError(f"budget_s must be positive seconds, got {budget_s!r}")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be unique, got {names}")
    root, out = Path(root), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    results, t0 = [], time.perf_counter()
    for i, stage in enumerate(stages):
        if log:
            log(f"[{i + 1}/{len(stages)}] {stage.name} (limit {stage.timeout_s * timeout_scale:.0f} s): "
                f"{shlex.join(stage.argv)}")
        left = budget_s - (time.perf_counter() - t0)
        if left < 1.0:
            res = StageResult(stage.name, stage.title, shlex.join(stage.argv), "skipped", None, 0.0, 0.0,
                              reason=f"the report's budget ({budget_s:.0f} s) is spent")
        else:
            res = run_stage(stage, root, out / "logs", timeout_scale, env, cap_s=left)
        results.append(res)
        if log:
            log(f"    {res.status} in {res.seconds:.1f} s" + (f": {res.reason}" if res.reason else "")
                + (f"; {res.error_tail[-1]}" if res.error_tail else ""))
    report = {"machine": machine(), "root": str(root), "seconds": time.perf_counter() - t0,
              "stages": [asdict(r) for r in results]}
    report["targets"] = evaluate_targets(results)
    write_report(report, out)
    return report


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def write_report(report: dict[str, Any], out: str | os.PathLike) -> tuple[Path, Path]:
    """``out/gpu_report.json`` and ``out/gpu_report.md`` from a report dict (:func:`run_report`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / "gpu_report.json", out / "gpu_report.md"
    jpath.write_text(json.dumps(report, indent=1, default=str, allow_nan=False) + "\n")
    m = report["machine"]
    lines = ["# torch_dcp GPU report", "",
             f"{m.get('device', 'no CUDA device')} (capability {m.get('capability')}), torch {m.get('torch')} "
             f"(CUDA {m.get('cuda_build')}), Python {m.get('python')}, flash-attn {m.get('flash_attn') or 'absent'}; "
             f"{m.get('date')}; {report['seconds']:.0f} s in all.", "",
             "## Targets", "", "| figure | target | measured | met? | source |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        met = {True: "yes", False: "**no**", None: "—"}[t["met"]]
        measured = _fmt(t["measured"]) if t["measured"] is not None else f"n/a ({t['why_none']})"
        lines.append(f"| {t['figure']} | {t['target']} | {measured} | {met} | {t['source']} |")
    lines += ["", "## Stages", "", "| stage | status | seconds (limit) | command |", "|---|---|---|---|"]
    for s in report["stages"]:
        status = s["status"] + (f" ({s['reason']})" if s["reason"] else "") + \
            (f", exit {s['returncode']}" if s["status"] == "failed" and s["returncode"] is not None else "")
        lines.append(f"| {s['name']} | {status} | {s['seconds']:.1f} ({s['timeout_s']:.0f}) | `{s['command']}` |")
    bad = [s for s in report["stages"] if s["status"] in ("failed", "timeout")]
    if bad:
        lines += ["", "## Failures", ""]
        for s in bad:
            lines += [f"### {s['name']}: {s['status']}", "", "```text", *s["error_tail"], "```", ""]
    lines += ["", f"Logs: `{out / 'logs'}`; figures of every stage: `{jpath.name}`.", ""]
    mpath.write_text("\n".join(lines))
    return jpath, mpath


# ---------------------------------------------------------------------- the command
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m torch_dcp.benchmarks gpu-report``."""
    p.add_argument("--out", default="gpu_report", help="folder for gpu_report.json, gpu_report.md and logs/")
    p.add_argument("--quick", action="store_true", help=f"the short variants (under {QUICK_BUDGET_S:.0f} s)")
    p.add_argument("--stages", default=None, help="comma-separated stage names to run (default: all; see --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="list the stages and their commands; run nothing")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every stage's time limit")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole report; each stage runs within what is left (default "
                        f"{FULL_BUDGET_S:.0f}, with --quick {QUICK_BUDGET_S:.0f})")
    p.add_argument("--root", default=str(ROOT), help="the checkout with recipes/ and tests/ (default: the package's)")


def select(stages: Sequence[Stage], names: str | None) -> list[Stage]:
    """The stages named in ``names`` (comma-separated), in table order; all for None.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not names:
        return list(stages)
    want = [n.strip() for n in names.split(",") if n.strip()]
    known = [s.name for s in stages]
    unknown = [n for n in want if n not in known]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; choose from {known}")
    return [s for s in stages if s.name in want]


def run(args: argparse.Namespace, out: Any = None) -> int:
    """Run (or with ``--dry-run`` list) the report; returns the exit status: 0 when every stage
    ran to completion (passed or skipped), 1 when some failed or timed out.

    Raises:
        ValueError: an unknown stage name or a non-positive ``--timeout-scale``.
        NoCudaError: no CUDA device (not with ``--dry-run``).
    """
    out = out or sys.stdout
    if not args.timeout_scale > 0:
        raise ValueError(f"--timeout-scale must be positive, got {args.timeout_scale}")
    budget = getattr(args, "budget", None)
    budget = (QUICK_BUDGET_S if args.quick else FULL_BUDGET_S) if budget is None else budget
    if not budget > 0:
        raise ValueError(f"--budget must be positive seconds, got {budget}")
    stages = select(default_stages(args.quick), args.stages)
    if args.dry_run:
        root = Path(args.root)
        total = sum(s.timeout_s for s in stages) * args.timeout_scale
        print(f"gpu-report{' --quick' if args.quick else ''}: {len(stages)} stages, run from {root}, "
              f"limits adding up to {total:.0f} s within a budget of {budget:.0f} s; would write "
              f"{Path(args.out) / 'gpu_report.json'} and .md", file=out)
        for s in stages:
            why = _missing(s, root)
            print(f"  {s.name:<28} {s.timeout_s * args.timeout_scale:5.0f} s  {s.title}"
                  + (f"  [would skip: {why}]" if why else ""), file=out)
            print(f"      {shlex.join(s.argv)}", file=out)
        return 0
    import torch

    if not torch.cuda.is_available():
        raise NoCudaError(f"gpu-report needs a CUDA device: torch {torch.__version__} (CUDA build "
                          f"{torch.version.cuda}) sees none on this machine. --dry-run lists the stages and commands "
                          "it would run.")
    report = run_report(stages, args.out, args.root, args.timeout_scale, log=lambda s: print(s, file=out, flush=True),
                        budget_s=budget)
    print(f"wrote {Path(args.out) / 'gpu_report.md'} and gpu_report.json", file=out)
    return 1 if any(s["status"] in ("failed", "timeout") for s in report["stages"]) else 0


def main(argv: list[str] | None = None, out: Any = None) -> int:
    """``run`` with its own parser; a missing GPU or a bad option exits 2 with the message."""
    p = argparse.ArgumentParser(prog="python -m torch_dcp.benchmarks gpu-report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args, out)
    except (NoCudaError, ValueError) as e:
        print(f"gpu-report: {e}", file=sys.stderr)
        return 2
