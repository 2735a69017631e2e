"""``recipes/train_llama.py --compare-precomputed ROUNDS``: the main job's steps with plans from
the planning loader, made before training, or made in line, side by side.

    torchrun --standalone --nproc-per-node 4 recipes/train_llama.py --compare-precomputed 4

The same ``--steps`` steps from the same initial weights in every mode of ``--compare-modes``
(``loader``: planned ``--plan-ahead`` steps ahead by the workers; ``precomputed``: every plan and
device plan made before the round; ``inline``: planned in ``next()`` on every rank), the modes
alternating round by round; rank 0 prints one JSON line (each mode's mean step time, with and
without each round's first step, its loader waits and store time, its ratio to
``precomputed``) and a summary line.
"""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

__all__ = ["compare_precomputed"]


def compare_precomputed(job, emit) -> None:
    """The benchmark (module docstring) on ``job`` (``train_llama.Job``); ``emit`` writes rank 0's
    JSON line.

    Raises:
        SystemExit: an unknown mode in ``--compare-modes``.
    """
    a = job.args
    modes = [m.strip() for m in a.compare_modes.split(",") if m.strip()]
    unknown = set(modes) - {"loader", "precomputed", "inline"}
    if unknown:
        raise SystemExit(f"--compare-modes: unknown modes {sorted(unknown)}")
    t0 = time.perf_counter()
    with job.loader(0) as inline:  # every plan and device plan made before training
        pre = list(inline)
    pre_s = time.perf_counter() - t0
    times: dict[str, list[list[float]]] = {m: [] for m in modes}
    extra: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(a.compare_precomputed):
        for mode in modes:
            job.build_model()
            dist.barrier()
            if mode == "precomputed":  # fresh tensors (a step shards its buffers in place), made before the round
                fresh = [dataclasses.replace(pb, data=(*(t.clone() for t in pb.data[:3]), pb.data[3]), wait_seconds=0.0)
                         for pb in pre]
                rows = job.run_dcp(fresh, lambda r: None)
            else:
                with job.loader(a.plan_ahead if mode == "loader" else 0) as loader:
                    rows = job.run_dcp(loader, lambda r: None)
            times[mode].append([r["step_s"] for r in rows])
            extra[mode] += rows
    if job.rank != 0:
        return
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    base_all = mean([t for ts in times.get("precomputed", []) for t in ts])
    base_steady = mean([t for ts in times.get("precomputed", []) for t in ts[1:]])
    out = {"ranks": job.world, "steps": a.steps, "rounds": a.compare_precomputed, "planner": a.planner,
           "plan_ahead": a.plan_ahead, "plan_workers": a.plan_workers,
           "inline_plan_ms_per_step": round(1000 * mean([pb.plan_seconds for pb in pre]), 2),
           "precompute_s": round(pre_s, 2)}
    for mode in modes:
        all_ = [t for ts in times[mode] for t in ts]
        steady = [t for ts in times[mode] for t in ts[1:]]
        rows = extra[mode]
        res = {"mean_step_s": round(mean(all_), 4), "mean_step_s_after_first": round(mean(steady), 4),
               "plan_wait_ms": round(mean([r["plan_wait_ms"] for r in rows]), 3),
               "store_ms": round(mean([r["store_ms"] for r in rows]), 3),
               "poll_ms": round(mean([r["poll_ms"] for r in rows]), 3)}
        if base_all:
            res["ratio_to_precomputed"] = round(mean(all_) / base_all, 4)
            res["ratio_to_precomputed_after_first"] = round(mean(steady) / base_steady, 4)
        res["store_fraction_of_step"] = round(res["store_ms"] / 1000 / mean(all_), 6)
        out[mode] = res
    emit(out)
    print("compare: " + ", ".join(f"{m} {out[m]['mean_step_s']:.4f} s/step"
                                  + (f" ({out[m]['ratio_to_precomputed']:.4f}x precomputed)" if base_all else "")
                                  for m in modes)
          + f"; in-line planning {out['inline_plan_ms_per_step']} ms/step", flush=True)
