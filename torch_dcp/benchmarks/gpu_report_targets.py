"""The GPU report's targets (:data:`TARGETS`): each a figure read from a stage's output, its bound
and where the bound comes from; :func:`evaluate_targets` measures them on a report's stages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Target", "TARGETS", "evaluate_targets"]


@dataclass(frozen=True)
class Target:
    """One row of the report's table: the figures ``reads`` (``(stage, key)`` pairs) combined by
    ``how`` (``"value"``: the one figure; ``"ratio"``: first / second; ``"rel_diff"``:
    |first - second| / |second|), compared with ``bound`` by ``op`` (``"<="``, ``">="``,
    ``"=="``); ``bound=None``: reported, no target."""

    figure: str
    reads: tuple[tuple[str, str], ...]
    how: str = "value"
    op: str = "<="
    bound: float | None = None
    source: str = ""

    def __post_init__(self):
        n = {"value": 1, "ratio": 2, "rel_diff": 2}.get(self.how)
        if n is None or len(self.reads) != n:
            raise ValueError(f"target {self.figure!r}: how must be 'value' (one figure), 'ratio' or 'rel_diff' "
                             f"(two), got {self.how!r} with {len(self.reads)}")
        if self.op not in ("<=", ">=", "=="):
            raise ValueError(f"target {self.figure!r}: op must be '<=', '>=' or '==', got {self.op!r}")

    def measure(self, figures: dict[str, dict[str, Any]]) -> float | None:
        """The measured value from ``figures`` (by stage name), None where a figure is missing."""
        vals = [figures.get(stage, {}).get(key) for stage, key in self.reads]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v == v for v in vals):
            return None
        if self.how == "value":
            return float(vals[0])
        a, b = vals
        if self.how == "ratio":
            return a / b if b else None
        return abs(a - b) / max(abs(b), 1e-12)

    def check(self, value: float | None) -> bool | None:
        """Whether ``value`` meets the bound (None: no bound or no value)."""
        if self.bound is None or value is None:
            return None
        return {"<=": value <= self.bound, ">=": value >= self.bound, "==": value == self.bound}[self.op]


_I12 = "H100 executor target"
_FA = "flash-attn target"
_RP = "layer replay target"
#: the GPU targets (README, docs, the benchmarks' own TARGETS) and figures reported beside them
TARGETS: list[Target] = [
    Target("CUDA tests failing or erroring", (("tests-cuda", "not_passed"),), op="==", bound=0,
           source="the suite, pytest -m cuda"),
    Target("CUDA tests passed (run on the GPU, not skipped)", (("tests-cuda", "passed"),), op=">=", bound=1,
           source="the suite, pytest -m cuda"),
    Target("synchronisation tests failing (sync debug mode 'error' in a step)", (("sync", "not_passed"),), op="==",
           bound=0, source="docs/gpu.md: no synchronisation in the step"),
    Target("synchronisation tests passed (kernels flex, reference, auto, varlen[, flash_attn])", (("sync", "passed"),),
           op=">=", bound=4, source="tests/test_executor.py"),
    Target("causal W=1: executor / compiled dense flex", (("step-causal", "exec_over_dense"),), bound=1.15, source=_I12),
    Target("lambda W=1: executor / compiled dense flex", (("step-lambda", "exec_over_dense"),), bound=1.15, source=_I12),
    Target("causal W=1: executor / varlen flash (aten)", (("step-causal", "exec_over_varlen"),), bound=1.3, source=_I12),
    Target("causal 4x8: busiest rank / (dense / W x imbalance)", (("step-causal", "busiest_over_ideal"),), bound=1.3,
           source=_I12),
    Target("lambda 4x8: busiest rank / (dense / W x imbalance)", (("step-lambda", "busiest_over_ideal"),), bound=1.3,
           source=_I12),
    Target("causal 4x8, replay: busiest rank per layer / (dense / W x imbalance), PyTorch's kernels",
           (("step-causal", "replay_busiest_over_ideal"),), bound=1.6, source=_RP),
    Target("lambda 4x8, replay: busiest rank per layer / (dense / W x imbalance), PyTorch's kernels",
           (("step-lambda", "replay_busiest_over_ideal"),), bound=1.6, source=_RP),
    Target("causal 4x8: busiest rank per layer, replay / eager", (("step-causal", "replay_over_eager"),),
           source=_RP + ": side by side"),
    Target("lambda 4x8: busiest rank per layer, replay / eager", (("step-lambda", "replay_over_eager"),),
           source=_RP + ": side by side"),
    Target("causal 4x8: capture per step, worst rank (s)", (("step-causal", "capture_s_max"),), source=_RP),
    Target("lambda 4x8: capture per step, worst rank (s)", (("step-lambda", "capture_s_max"),), source=_RP),
    Target("lambda W=1, replay: executor / compiled dense flex", (("step-w1-lambda", "replay_busiest_over_ideal"),),
           bound=1.15, source=_RP),
    Target("causal W=1, replay: executor / compiled dense flex", (("step-w1-causal", "replay_busiest_over_ideal"),),
           bound=1.15, source=_RP),
    Target("causal W=1, replay: executor / varlen flash (aten; the target's FlashAttention-4 call: <= 1.1)",
           (("step-w1-causal", "replay_busiest_over_varlen_ideal"),), source=_RP),
    Target("causal W=1: peak memory, replay / eager (4 layers)", (("step-w1-causal", "replay_peak_over_eager"),),
           bound=1.1, source=_RP),
    Target("lambda W=1: peak memory, replay / eager (4 layers)", (("step-w1-lambda", "replay_peak_over_eager"),),
           bound=1.1, source=_RP),
    Target("causal 4x8: a replayed layer under sync debug 'error', failures", (("step-causal", "replay_sync_failures"),),
           op="==", bound=0, source=_RP),
    Target("lambda 4x8: a replayed layer under sync debug 'error', failures", (("step-lambda", "replay_sync_failures"),),
           op="==", bound=0, source=_RP),
    Target("causal 4x8: ranks whose recording fell back to eager", (("step-causal", "replay_fallbacks"),), op="==",
           bound=0, source=_RP),
    Target("causal 4x8: replayed forward vs eager, max abs difference", (("step-causal", "replay_err_forward"),),
           op="==", bound=0, source="replay runs the same kernels"),
    Target("lambda 4x8: replayed forward vs eager, max abs difference", (("step-lambda", "replay_err_forward"),),
           op="==", bound=0, source="replay runs the same kernels"),
    Target("causal 4x8: replayed backward vs eager / the eager backward's own spread",
           (("step-causal", "replay_backward_over_spread"),), source="flash's backward adds dQ with atomics"),
    Target("layer replay and Trainer CUDA tests failing", (("replay-tests", "not_passed"),), op="==", bound=0,
           source="tests/test_replay.py, tests/test_hf_trainer.py"),
    Target("calibrate --check, eager: cases with busiest and median rank in 0.8-1.25",
           (("calibrate-check", "inside"),), op=">=", bound=2, source="the card's calibration"),
    Target("calibrate --check, replay: cases with busiest and median rank in 0.8-1.25",
           (("calibrate-check-replay", "inside"),), op=">=", bound=2, source="the card's calibration"),
    Target("main job: tokens/s, replay / no replay",
           (("train-dcp", "tokens_per_s"), ("train-dcp-no-replay", "tokens_per_s")), "ratio",
           source="recipes/train_llama.py, one process"),
    Target("main job: last loss, |replay - no replay| / no replay",
           (("train-dcp", "last_loss"), ("train-dcp-no-replay", "last_loss")), "rel_diff", bound=1e-5,
           source="replay is bit-identical"),
    Target("causal W=1: executor vs dense, max abs error of out (bf16)", (("step-causal", "err_out"),), bound=5e-2,
           source="bf16 rounding"),
    Target("causal W=1, kernel flash_attn: executor / varlen flash (aten)", (("step-flash-attn", "exec_over_varlen"),),
           bound=1.3, source=_FA + " (as varlen)"),
    Target("causal W=1: executor time, kernel flash_attn / kernel varlen (aten)",
           (("step-flash-attn", "exec_s"), ("step-varlen", "exec_s")), "ratio", source=_FA + ": side by side"),
    Target("causal W=1, kernel flash_attn: max abs error of out vs dense", (("step-flash-attn", "err_out"),),
           bound=5e-2, source=_FA + ": exact (bf16 rounding)"),
    Target("division kernel / dense, forward TFLOP/s", (("kernels-division", "fwd_ratio"),), source="kernels division"),
    Target("division kernel / dense, backward TFLOP/s", (("kernels-division", "bwd_ratio"),), source="kernels division"),
    Target("division flash_attn / dense, forward TFLOP/s", (("kernels-division-flash-attn", "fwd_ratio"),),
           source="kernels division --kernel flash_attn"),
    Target("division flash_attn / dense, backward TFLOP/s", (("kernels-division-flash-attn", "bwd_ratio"),),
           source="kernels division --kernel flash_attn"),
    Target("LSE merge (Triton): fraction of the memory-bound limit", (("kernels-reduce", "triton_of_limit"),),
           source="kernels reduce"),
    Target("executor operations per division, forward (worst rank)",
           (("launches", "forward_ops_per_division_worst"),), bound=10, source="tests/test_executor.py bound"),
    Target("executor operations per division, backward (worst rank)",
           (("launches", "backward_ops_per_division_worst"),), bound=16, source="tests/test_executor.py bound"),
    Target("CUDA kernels per division, forward (profiler)", (("launches", "cuda_kernels_forward_per_division"),),
           source="benchmarks ops"),
    Target("CUDA kernels per division, backward (profiler)", (("launches", "cuda_kernels_backward_per_division"),),
           source="benchmarks ops"),
    Target("main job: tokens/s, torch_dcp / none", (("train-dcp", "tokens_per_s"), ("train-none", "tokens_per_s")),
           "ratio", source="recipes/train_llama.py, one process"),
    Target("main job: first loss, |torch_dcp - none| / none", (("train-dcp", "first_loss"), ("train-none", "first_loss")),
           "rel_diff", bound=1e-3, source="same weights and batch"),
    Target("main job: last loss, |torch_dcp - none| / none", (("train-dcp", "last_loss"), ("train-none", "last_loss")),
           "rel_diff", bound=2e-2, source="the loss curve without CP"),
    Target("torchtitan: last loss, |DCP - none| / none",
           (("torchtitan-dcp", "last_loss"), ("torchtitan-none", "last_loss")), "rel_diff", bound=1e-3,
           source="docs/torchtitan.md: the loss curve without CP"),
    Target("torchtitan: tokens/s, DCP / none", (("torchtitan-dcp", "tokens_per_s"), ("torchtitan-none", "tokens_per_s")),
           "ratio", source="torchtitan debug model"),
]


def evaluate_targets(results: Sequence[Any], targets: Sequence[Target] = TARGETS) -> list[dict[str, Any]]:
    """Every target with its measured value (None where its stages gave none, with their
    statuses) and ``met`` (True, False, or None: no bound or no value)."""
    figs = {r.name: r.figures for r in results}
    status = {r.name: r.status for r in results}
    rows = []
    for t in targets:
        value = t.measure(figs)
        stages = sorted({s for s, _ in t.reads})
        why = None if value is not None else "; ".join(
            f"{s}: no value" if status.get(s) == "passed" else f"{s}: {status.get(s, 'not run')}" for s in stages)
        rows.append({"figure": t.figure, "target": f"{t.op} {t.bound:g}" if t.bound is not None else "reported",
                     "measured": value, "met": t.check(value), "source": t.source, "stages": stages, "why_none": why})
    return rows
