"""What dcp's division schedule costs: each plan simulated as it runs (``T`` divisions) and as
dataflow (tiles started when their inputs are there, :mod:`torch_dcp.sim.dataflow`)::

    python -m torch_dcp.benchmarks readiness --topology a100 --cost a100

For every paper batch (4 nodes x 8 ranks, 131,072 tokens) dcp's plan at the faster of the block
sizes, with:

* ``divisions``: :func:`torch_dcp.sim.simulate.simulate`, the time dcp chooses and reports;
* ``static kernels``: the same placement and routes with ``K`` launches per rank in a fixed
  order, one wait per received block and relays sent on arrival (best of ``K`` = 4, 8, 16);
* ``per tile``: every tile as soon as its inputs are there, at its division's throughput (a
  bound for finer execution of this plan: it ignores the cost of small launches);
* the pass floor (the larger of the busiest rank's kernel time in the division run and the
  busiest link, per pass; the static kernels launch differently and may go below it) and
  ``ideal`` (balanced compute, nothing exposed). The JSON lines add ``floor_ms``
  (:func:`torch_dcp.sim.floors.floor_seconds`, at the kernels' best throughput), which no model
  goes below.

The gap between ``divisions`` and ``per tile`` is what the division schedule loses; the gap
between ``per tile`` and ``ideal`` is the plan's own imbalance and links.

With ``--all-candidates`` every placement dcp's time objective considers for the batch (its
partitions and fallback layouts at every compute bound, ring attention's and Megatron's plans:
:func:`torch_dcp.planners.dcp_candidates`, each divided as :func:`torch_dcp.plan` divides it)
runs the three ways too, and a second table gives the best ratio to ideal (each candidate against
its own ideal) any of them reaches in each model: whether a placement dcp passes over would meet a
target under finer execution (slow: 1-6 min per batch and block size on the paper
batches)::

    python -m torch_dcp.benchmarks readiness --topology a100 --cost a100 --masks causal \\
        --block-sizes 1024 --all-candidates
"""

from __future__ import annotations

import json
import sys

from ..api import divide
from ..api import plan as make_plan
from ..cost import CostModel
from ..sim.dataflow import simulate_dataflow
from ..planners import dcp_candidates
from ..sim.floors import floor_seconds, link_floor_seconds
from ..sim.simulate import simulate
from ..topology import Topology
from .common import MASKS, bench_batch, paper_batches, paper_sources, progress

__all__ = ["bench_readiness"]

KERNELS = (4, 8, 16)


def bench_readiness(topology: Topology, cost: CostModel | str = "a100", masks: tuple[str, ...] = tuple(MASKS),
                    scales: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0), block_sizes: tuple[int, ...] = (1024, 2048),
                    divisions: int = 4, out=sys.stdout, total: int = 131072,
                    sources: dict[str, list[int]] | None = None, all_candidates: bool = False) -> list[dict]:
    """dcp's plan of every paper batch under the three execution models; prints JSON lines and
    a Markdown table; returns the rows (times in ms). ``all_candidates``: each row also gets
    ``candidates`` (how many were run) and ``best_divisions``, ``best_static``, ``best_per_tile``
    (the lowest ratio to its own ideal of any candidate, over the block sizes, in each model),
    printed as a second table."""
    cm = cost if isinstance(cost, CostModel) else CostModel.load(cost)
    sources = sources or paper_sources(total=total)
    rows = []
    bar = progress(len(scales) * len(sources) * len(masks) * len(block_sizes), "readiness")
    for scale in scales:
        for bname, lens in paper_batches(scale, total, sources=sources).items():
            for mname in masks:
                batch = bench_batch(lens, MASKS[mname])
                best = None
                reach = {"candidates": 0, "best_divisions": float("inf"), "best_static": float("inf"),
                         "best_per_tile": float("inf")}
                for bs in block_sizes:
                    if all_candidates:
                        _reach(reach, batch, topology, cm, bs, divisions)
                    plan = make_plan(batch, topology, planner="dcp", block_size=bs, divisions=divisions, cost_model=cm)
                    sim = simulate(plan, cm)
                    if best is None or sim.makespan_s < best[1].makespan_s:
                        best = (plan, sim, bs)
                    bar.update()
                plan, sim, bs = best
                static = {k: simulate_dataflow(plan, cm, kernels_per_rank=k).makespan_s for k in KERNELS}
                k_best = min(static, key=static.get)
                pass_floor = sum(max(float(ps.busy_s.max()), link_floor_seconds(plan, backward))
                                 for backward, ps in ((False, sim.forward), (True, sim.backward)))
                row = {"scale": scale, "batch": bname, "mask": mname, "block_size": bs,
                       "divisions_ms": sim.makespan_s * 1e3, "static_ms": static[k_best] * 1e3, "kernels": k_best,
                       "per_tile_ms": simulate_dataflow(plan, cm).makespan_s * 1e3,
                       "pass_floor_ms": pass_floor * 1e3, "floor_ms": floor_seconds(plan, cm) * 1e3,
                       "ideal_ms": sim.ideal_s * 1e3}
                if all_candidates:  # the chosen plan (maybe its local-tail variant) is one dcp considers too
                    for key, ms in (("best_divisions", "divisions_ms"), ("best_static", "static_ms"),
                                    ("best_per_tile", "per_tile_ms")):
                        reach[key] = min(reach[key], row[ms] / row["ideal_ms"])
                    row.update(reach)
                rows.append(row)
                print(json.dumps(row, default=lambda v: round(v, 4)), file=out, flush=True)
    bar.close()
    _table(rows, out)
    if all_candidates:
        _reach_table(rows, out)
    return rows


def _reach(acc: dict, batch, topology: Topology, cm: CostModel, block_size: int, divisions: int) -> None:
    """Fold every dcp candidate placement of ``batch`` at ``block_size`` into ``acc``: the
    count, and the lowest ratio to ideal in each execution model (each placement divided
    plainly; the node-first or local-tail schedule :func:`~torch_dcp.api.plan` may pick is
    folded in by the caller, as the chosen plan)."""
    for placement in dcp_candidates(batch, topology, block_size):
        plan = divide(placement, topology, divisions)
        sim = simulate(plan, cm)
        static = min(simulate_dataflow(plan, cm, kernels_per_rank=k).makespan_s for k in KERNELS)
        for key, seconds in (("best_divisions", sim.makespan_s), ("best_static", static),
                             ("best_per_tile", simulate_dataflow(plan, cm).makespan_s)):
            acc[key] = min(acc[key], seconds / sim.ideal_s)
        acc["candidates"] += 1


def _reach_table(rows: list[dict], out) -> None:
    print("\nBest ratio to ideal over every placement dcp considers (each against its own ideal)\n", file=out)
    print("| scale | batch | mask | candidates | divisions | static kernels | per tile |", file=out)
    print("|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        print(f"| {r['scale']} | {r['batch']} | {r['mask']} | {r['candidates']} | {r['best_divisions']:.2f} "
              f"| {r['best_static']:.2f} | {r['best_per_tile']:.2f} |", file=out)


def _table(rows: list[dict], out) -> None:
    print("\n| scale | batch | mask | divisions ms | static kernels ms (K) | per tile ms | pass floor ms | ideal ms "
          "| ratio to ideal: divisions / static / per tile |", file=out)
    print("|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        i = r["ideal_ms"]
        print(f"| {r['scale']} | {r['batch']} | {r['mask']} | {r['divisions_ms']:.2f} | {r['static_ms']:.2f} "
              f"({r['kernels']}) | {r['per_tile_ms']:.2f} | {r['pass_floor_ms']:.2f} | {i:.2f} | "
              f"{r['divisions_ms'] / i:.2f} / {r['static_ms'] / i:.2f} / {r['per_tile_ms'] / i:.2f} |", file=out)
    for label, keep in (("causal", lambda m: m == "causal"), ("sparse masks", lambda m: m != "causal")):
        sel = [r for r in rows if keep(r["mask"])]
        if not sel:
            continue

        def span(key: str) -> str:
            v = [r[key] / r["ideal_ms"] for r in sel]
            return f"{min(v):.2f}-{max(v):.2f}"

        gain = [1 - r["static_ms"] / r["divisions_ms"] for r in sel]
        print(f"{label}: ratio to ideal with divisions {span('divisions_ms')}, static kernels {span('static_ms')}, "
              f"per tile {span('per_tile_ms')}; static kernels {min(gain):+.0%}..{max(gain):+.0%} "
              f"time saved against divisions", file=out)
