"""Fitting the executor's costs (:class:`~torch_dcp.cost.executor.ExecutorCosts`) to its measured
times (NumPy, SciPy).

The samples are what ``python -m torch_dcp.benchmarks calibrate`` measures by running the executor
itself: every instruction's time (``RankExecutor(..., timings=True)``) with its features, and every
rank's pass (its stretches of work between waits, network copies excluded). Each term is fitted
by non-negative least squares (Lawson and Hanson, *Solving Least Squares Problems*, 1974, ch. 23;
``scipy.optimize.nnls``); launches weighted by ``1 / sqrt(max(seconds, mean / 10))`` so that many
small launches count beside a few large ones, then scaled so that their predicted total is the
measured one (a rank's time is a sum); the other terms unweighted:

* a division's launch, per kernel and pass, on :data:`~torch_dcp.cost.executor.LAUNCH_FEATURES`;
* copies, LSE merges, sums and message gathers: ``fixed + byte x bytes``;
* a pass: what the rank's pass took beyond its instructions, ``fixed + byte x local bytes``.

:func:`fit_executor` returns the model and its residuals (:class:`FitReport`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from .executor import ExecutorCosts, KernelCosts, LaunchCosts, MemoryCosts

__all__ = ["LaunchSample", "MemorySample", "PassSample", "FitReport", "fit_executor", "nnls_fit"]

MEMORY_KINDS = ("copy", "merge", "sum", "pack")


@dataclasses.dataclass(frozen=True)
class LaunchSample:
    """One division's measured launch: ``features`` in :data:`LAUNCH_FEATURES` order."""

    kernel: str
    backward: bool
    features: tuple[float, ...]
    seconds: float


@dataclasses.dataclass(frozen=True)
class MemorySample:
    """One memory-bound instruction of ``kind`` (:data:`MEMORY_KINDS`: a copy, an LSE merge, a
    sum, a message gather) of ``nbytes`` bytes."""

    kind: str
    backward: bool
    nbytes: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class PassSample:
    """One rank's pass beyond its instructions: ``seconds`` for ``local_bytes`` of local rows."""

    backward: bool
    local_bytes: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class FitReport:
    """Residuals of a fit, per term: ``{term: (samples, median |relative error|, relative error
    of the term's total)}``; ``total`` over every sample together."""

    terms: dict[str, tuple[int, float, float]]

    def lines(self) -> list[str]:
        """A table of the residuals, one line per term."""
        out = ["| term | samples | median abs. rel. error | error of the sum |", "|---|---|---|---|"]
        for name, (n, med, tot) in self.terms.items():
            out.append(f"| {name} | {n} | {med:.3f} | {tot:+.3f} |")
        return out


def nnls_fit(x: np.ndarray, y: np.ndarray, weight: bool = True) -> np.ndarray:
    """Non-negative least squares ``min |W (x c - y)|, c >= 0`` with ``W = 1 / sqrt(max(y, mean(y) / 10))``
    (``weight``), columns scaled to unit norm for the solver: float64 ``[n_features]``.

    Raises:
        ValueError: shapes that do not match, or no sample.
    """
    from scipy.optimize import nnls

    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.ndim != 2 or y.shape != (x.shape[0],) or len(y) == 0:
        raise ValueError(f"nnls_fit: x [n, k] and y [n] with n >= 1, got {x.shape} and {y.shape}")
    w = 1.0 / np.sqrt(np.maximum(y, 0.1 * max(float(np.mean(y)), 1e-12))) if weight else np.ones_like(y)
    xs = x * w[:, None]
    scale = np.linalg.norm(xs, axis=0)
    scale[scale == 0] = 1.0
    c, _ = nnls(xs / scale, y * w, maxiter=50 * x.shape[1])
    return c / scale


def _residuals(pred: np.ndarray, y: np.ndarray) -> tuple[int, float, float]:
    rel = np.abs(pred / np.maximum(y, 1e-12) - 1.0)
    return len(y), float(np.median(rel)) if len(y) else 0.0, float(pred.sum() / max(y.sum(), 1e-12) - 1.0)


def fit_executor(launches: Iterable[LaunchSample], memory: Iterable[MemorySample], passes: Iterable[PassSample],
                 general: str, fast: str | None = None) -> tuple[ExecutorCosts, FitReport]:
    """Fit :class:`ExecutorCosts` to measured samples (module docstring).

    Args:
        general, fast: the kernel names of the model (:class:`ExecutorCosts`); every launch
            sample must be of one of them.

    Raises:
        ValueError: a kernel or pass without launch samples, or a sample of another kernel.
    """
    launches, memory, passes = list(launches), list(memory), list(passes)
    names = [general] + ([fast] if fast else [])
    stray = {s.kernel for s in launches} - set(names)
    if stray:
        raise ValueError(f"fit_executor: launch samples of kernels {sorted(stray)} outside the model's {names}")
    report: dict[str, tuple[int, float, float]] = {}
    kernels = {}
    for name in names:
        per_pass = []
        for backward in (False, True):
            sel = [s for s in launches if s.kernel == name and s.backward == backward]
            if not sel:
                raise ValueError(f"fit_executor: no {'backward' if backward else 'forward'} launch of {name!r} measured")
            x = np.array([s.features for s in sel], float)
            y = np.array([s.seconds for s in sel], float)
            c = nnls_fit(x, y)
            c = c * (y.sum() / max(float((x @ c).sum()), 1e-12))  # the weights bias the total: rescale to it
            per_pass.append(LaunchCosts.from_vector(c))
            report[f"{name} {'backward' if backward else 'forward'} launches"] = _residuals(x @ c, y)
        kernels[name] = KernelCosts(name, *per_pass)
    mem = {}
    for kind in MEMORY_KINDS:
        sel = [s for s in memory if s.kind == kind]
        if not sel:
            mem[kind] = MemoryCosts()
            continue
        x = np.array([[1.0, s.nbytes] for s in sel])
        y = np.array([s.seconds for s in sel])
        c = nnls_fit(x, y, weight=False)
        mem[kind] = MemoryCosts(float(c[0]), float(c[1]))
        report[kind] = _residuals(x @ c, y)
    fixed, pass_byte = [0.0, 0.0], 0.0
    if passes:  # one byte term, a fixed term per pass
        x = np.array([[not s.backward, s.backward, s.local_bytes] for s in passes], float)
        y = np.maximum(np.array([s.seconds for s in passes]), 1e-7)
        c = nnls_fit(x, y, weight=False)
        fixed, pass_byte = [float(c[0]), float(c[1])], float(c[2])
        for backward in (False, True):
            sel = x[:, 1] == backward
            if sel.any():
                report[f"{'backward' if backward else 'forward'} pass"] = _residuals(x[sel] @ c, y[sel])
    costs = ExecutorCosts(general=kernels[general], fast=kernels[fast] if fast else None, copy=mem["copy"],
                          merge=mem["merge"], sum=mem["sum"], pack=mem["pack"], pass_fixed=(fixed[0], fixed[1]),
                          pass_byte=pass_byte)
    return costs, FitReport(report)

