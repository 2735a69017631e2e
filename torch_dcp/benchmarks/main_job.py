"""The main job against PyTorch's context parallelism, side by side: tokens/s and CPU per step.

    python -m torch_dcp.benchmarks main-job                      # 3 pairs, 4 gloo ranks, the recipe's defaults
    python -m torch_dcp.benchmarks main-job --pairs 5 -- --steps 40 --tokens-per-step 16384

Runs the README's main job (``recipes/train_llama.py``, from the working directory or
``--recipe``) under ``torchrun`` with ``--cp-impl torch_dcp`` and with ``--cp-impl torch``
(PyTorch's ``context_parallel``: ring attention over the whole packed sequence, causal, as its
authors run it on the same batches, model and FSDP2 mesh), ``--pairs`` times, one run at a
time, the order alternating from pair to pair so that a drift of the machine's speed falls on
both alike. Arguments after ``--`` go to both runs (not ``--cp-impl`` or ``--log-json``, which
this benchmark sets).

Each run's figures are the recipe's own rows: ``tokens_per_s``, the mean over its steps of the
documents' tokens over the step's wall time (the figure the recipe's summary prints), and
``cpu_ms``, the median over its steps of rank 0's CPU time per step (its threads; the planning
workers, processes of their own, are not counted). Printed: each pair's tokens/s and CPU
ms/step of both, their ratios (PyTorch's CPU over dcp's, dcp's tokens/s over PyTorch's), and the
median ratios over the pairs; ``--json`` prints it all as one JSON object. Tokens/s on a
machine whose cores the ranks share (4 ranks on 2 cores) swing by several percent from run to
run: the pairs and their median are the figure, not one run.

Raises (exit status 2 with the message): a recipe that is not there, a run that failed (its
output's tail), a run that outlived ``--timeout`` seconds (ended with its ranks), an argument
after ``--`` that this benchmark sets.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["MainJobError", "add_arguments", "run", "run_once", "summarize"]

#: the implementations compared, in the order of a pair's first run
IMPLS = ("torch_dcp", "torch")
#: recipe options the benchmark sets itself
_OWN = ("--cp-impl", "--log-json")


class MainJobError(RuntimeError):
    """A run of the main job that could not be measured (failed, timed out, or bad arguments)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", type=int, default=3, help="runs of each implementation, alternating (default 3)")
    p.add_argument("--nproc", type=int, default=4, help="ranks per run (torchrun --nproc-per-node; default 4)")
    p.add_argument("--recipe", default="recipes/train_llama.py", help="the main job's script")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: options of both runs")


def run_once(recipe: Path, impl: str, nproc: int, extra: list[str], timeout: float) -> dict:
    """One run of ``recipe`` with ``--cp-impl impl`` on ``nproc`` ranks: ``{"impl", "tokens_per_s",
    "cpu_ms", "steps", "rows"}`` (the rows as the recipe logged them).

    Raises:
        MainJobError: the run exited non-zero (with its output's tail), outlived ``timeout``
            seconds (then ended with its ranks first: :func:`_stop`) or logged no step.
    """
    with tempfile.TemporaryDirectory(prefix="torch_dcp-main-job-") as tmp:
        log, out = Path(tmp) / "rows.jsonl", Path(tmp) / "out.txt"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(recipe), "--cp-impl", impl, "--log-json", str(log), *extra]
        with open(out, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                if proc.poll() is None:
                    _stop(proc)
        tail = _excerpt(out.read_text(errors="replace"))
        if code is None:
            raise MainJobError(f"main-job: the {impl} run took longer than --timeout {timeout:g} s (ended):\n{tail}")
        if code != 0:
            raise MainJobError(f"main-job: the {impl} run exited with status {code}:\n{tail}")
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    rows = [r for r in rows if "tokens_per_s" in r]
    if not rows:
        raise MainJobError(f"main-job: the {impl} run logged no step:\n{tail}")
    return {"impl": impl, "tokens_per_s": sum(r["tokens_per_s"] for r in rows) / len(rows),
            "cpu_ms": statistics.median(r["cpu_ms"] for r in rows), "steps": len(rows), "rows": rows}


def _excerpt(text: str, before: int = 8, last: int = 12) -> str:
    """What a failed run's output says: the lines up to its first error (a rank's, ahead of the
    launcher's summary) and its last lines."""
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if "error" in line.lower()), None)
    head = [] if first is None or first >= len(lines) - last else lines[max(0, first - before):first + 1] + ["..."]
    return "\n".join(head + lines[-last:])


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """End a ``torchrun`` and its ranks: SIGTERM first (the launcher ends each rank's process
    group, the rank's planning workers with it), after ``grace`` seconds SIGKILL to the
    launcher's own session."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def summarize(pairs: list[dict[str, dict]]) -> dict:
    """Ratios per pair (``{impl: run_once(...)}``) and their medians: ``speedup`` is dcp's tokens/s
    over PyTorch's, ``cpu_ratio`` PyTorch's CPU ms/step over dcp's."""
    out = []
    for p in pairs:
        d, t = p["torch_dcp"], p["torch"]
        out.append({"torch_dcp_tokens_per_s": round(d["tokens_per_s"], 1),
                    "torch_tokens_per_s": round(t["tokens_per_s"], 1),
                    "speedup": round(d["tokens_per_s"] / t["tokens_per_s"], 4),
                    "torch_dcp_cpu_ms": d["cpu_ms"], "torch_cpu_ms": t["cpu_ms"],
                    "cpu_ratio": round(t["cpu_ms"] / d["cpu_ms"], 4) if d["cpu_ms"] > 0 else None,
                    "planners": sorted({r.get("planner") for r in d["rows"] if r.get("planner")})})
    ratios = [p["cpu_ratio"] for p in out if p["cpu_ratio"] is not None]
    return {"pairs": out, "median_speedup": round(statistics.median(p["speedup"] for p in out), 4),
            "median_cpu_ratio": round(statistics.median(ratios), 4) if ratios else None}


def run(args: argparse.Namespace) -> dict:
    """The benchmark (module docstring); returns :func:`summarize`'s result with the settings."""
    extra = list(args.recipe_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    bad = [a for a in extra if a.split("=", 1)[0] in _OWN]
    if bad:
        raise MainJobError(f"main-job: {', '.join(_OWN)} are set by the benchmark; got {bad} after --")
    if args.pairs < 1 or args.nproc < 1 or not args.timeout > 0:
        raise MainJobError(f"main-job: --pairs and --nproc must be >= 1 and --timeout positive, got {args.pairs}, "
                           f"{args.nproc}, {args.timeout}")
    recipe = Path(args.recipe)
    if not recipe.is_file():
        raise MainJobError(f"main-job: no recipe at {recipe} (run from the repository's root, or give --recipe)")
    pairs = []
    for i in range(args.pairs):
        pair = {}
        for impl in IMPLS if i % 2 == 0 else IMPLS[::-1]:
            pair[impl] = run_once(recipe, impl, args.nproc, extra, args.timeout)
            if not args.json:
                print(f"pair {i + 1}/{args.pairs}: {impl}: {pair[impl]['tokens_per_s']:.0f} tokens/s, rank 0 "
                      f"{pair[impl]['cpu_ms']:.0f} ms CPU/step", flush=True)
        pairs.append(pair)
    res = {"nproc": args.nproc, "recipe_args": extra, **summarize(pairs)}
    if args.json:
        print(json.dumps(res))
    else:
        for i, p in enumerate(res["pairs"]):
            print(f"pair {i + 1}: torch_dcp {p['torch_dcp_tokens_per_s']:.0f} / torch {p['torch_tokens_per_s']:.0f} "
                  f"tokens/s = {p['speedup']:.3f}x; CPU ms/step (rank 0) torch {p['torch_cpu_ms']:.0f} / torch_dcp "
                  f"{p['torch_dcp_cpu_ms']:.0f} = {p['cpu_ratio']}x; dcp's plans {', '.join(p['planners'])}")
        print(f"median over {len(pairs)} pair(s): torch_dcp makes {res['median_speedup']:.3f}x PyTorch's "
              f"context_parallel tokens/s; PyTorch's step takes {res['median_cpu_ratio']}x its CPU (rank 0)")
    return res
