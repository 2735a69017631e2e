"""How ``gpu-report`` reads a stage's figures from its output (:data:`READERS`, by
:attr:`torch_dcp.benchmarks.gpu_report.Stage.reader`): JSON lines, pytest's closing counts, the
``ops`` benchmark's operations and kernels per division, the main job's and torchtitan's losses
and tokens/s."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

__all__ = ["READERS", "json_lines", "scalars"]


def json_lines(text: str) -> list[dict]:
    """Every line of ``text`` that is a JSON object, parsed."""
    rows = []
    for line in (x.strip() for x in text.splitlines()):
        try:
            rows.append(json.loads(line) if line.startswith("{") and line.endswith("}") else None)
        except ValueError:
            continue
    return [r for r in rows if isinstance(r, dict)]


def scalars(row: dict) -> dict[str, Any]:
    """The row's numbers, strings, booleans and nulls; NaN and infinities as None (strict JSON)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()
            if isinstance(v, (int, float, str, bool)) or v is None}


def _read_last_json(text: str) -> dict[str, Any]:
    """The scalar fields of the last JSON object line."""
    rows = json_lines(text)
    return scalars(rows[-1]) if rows else {}


def _read_pytest(text: str) -> dict[str, Any]:
    """pytest's closing counts: ``passed``, ``failed``, ``skipped``, ``errors``, ..."""
    out: dict[str, Any] = {}
    for line in reversed(text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", line)
        if found and re.search(r"\bin [\d.]+s", line):
            for n, what in found:
                out["errors" if what.startswith("error") else what] = int(n)
            break
    if out:
        out = {"passed": 0, "failed": 0, "errors": 0, **out}
        out["not_passed"] = out["failed"] + out["errors"]
    return out


def _read_ops(text: str) -> dict[str, Any]:
    """``benchmarks ops``: the worst rank's executor operations per division (each pass) and
    the profiler's CUDA kernels per division."""
    out: dict[str, Any] = {}
    rows = json_lines(text)
    for name in ("forward", "backward"):
        sel = [r for r in rows if r.get("pass") == name and "per_div" in r]
        if sel:
            out[f"{name}_ops_per_division_worst"] = max(r["per_div"] for r in sel)
            out[f"{name}_kernel_calls"] = sum(r.get("kernel_calls", 0) for r in sel)
            out[f"{name}_divisions"] = sum(r.get("divisions", 0) for r in sel)
    for r in rows:
        if "cuda_kernels_forward_per_division" in r:
            out.update(scalars(r))
    return out


def _loss_series(losses: list[float], tps: list[float]) -> dict[str, Any]:
    if not losses:
        return {}
    steady = tps[1:] if len(tps) > 1 else tps  # the first step compiles and warms up
    return {"steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1],
            "tokens_per_s": sum(steady) / len(steady) if steady else None}


def _read_train(text: str) -> dict[str, Any]:
    """``recipes/train_llama.py``: first and last loss, mean tokens/s after the first step."""
    rows = [r for r in json_lines(text) if "loss" in r and "tokens_per_s" in r]
    return _loss_series([float(r["loss"]) for r in rows], [float(r["tokens_per_s"]) for r in rows])


def _read_torchtitan(text: str) -> dict[str, Any]:
    """torchtitan's step lines (``step: N loss: X ... tps: Y``)."""
    losses, tps = [], []
    for line in text.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # torchtitan colours its log
        m = re.search(r"step:\s*(\d+)\s+loss:\s*([-+\d.eE]+).*?tps:\s*([\d,]+)", line)
        if m:
            losses.append(float(m.group(2)))
            tps.append(float(m.group(3).replace(",", "")))
    return _loss_series(losses, tps)


def _read_check(text: str) -> dict[str, Any]:
    """``calibrate --check``: cases inside the range, and per case (``BATCH_MASK``) the busiest
    and the median rank's measured / predicted."""
    rows = [r for r in json_lines(text) if "cases" in r]
    if not rows:
        return {}
    out = {"inside": rows[-1].get("inside"), "cases": len(rows[-1]["cases"])}
    for c in rows[-1]["cases"]:
        for key in ("busiest", "median"):
            out[f"{c['batch']}_{c['mask']}_{key}"] = c.get(key)
    return out


#: how figures are read from a stage's stdout, by :attr:`Stage.reader`
READERS: dict[str, Callable[[str], dict[str, Any]]] = {
    "last_json": _read_last_json, "pytest": _read_pytest, "ops": _read_ops, "train": _read_train,
    "torchtitan": _read_torchtitan, "check": _read_check, "none": lambda text: {},
}
