"""Planner benchmarks.

    python -m torch_dcp.benchmarks planners [--block-size 1024] [--planners ring,greedy,dcp] ...

``planners`` runs every planner on the same 131,072-token global batches -- (a) ``corpus``:
real document lengths of the embedded corpus (the Python standard library's sources,
byte tokens), (b) ``longtail``: :func:`torch_dcp.data.long_tail_lengths` with its documented
defaults, (c) ``one``: a single 131,072-token document -- under the causal, λ,
causal-blockwise and shared-question masks (DCP paper §7.1 defaults), on 4 nodes × 8 ranks,
GQA 8/2, head_dim 128, bf16. It prints one JSON line per (batch, mask, planner) and a summary
line per planner.

    python -m torch_dcp.benchmarks paper [--scales 0.5,1,2,4] [--block-sizes 512,1024,2048,4096]

``paper`` reproduces the DCP paper's microbenchmark setup (§7.1: 4 × 8 A100, GQA 8/2,
head_dim 128, 131,072-token batches, T = 4, document lengths scaled by 0.5/1/2/4; dcp's default
plan may keep a node-first schedule at T = 6 where it is faster, see ``--divisions``) in the
simulator: every planner on the same batches, the best block size per batch, forward and
backward attention time (every baseline over the whole group, as its authors' implementation
runs it: :mod:`torch_dcp.sim.runtimes`; at the CP size a user would choose: ``benchmarks compare``),
speedups over ring and over the best of these baselines, ratio to the ideal
(every rank's simulated busy time spread evenly) and to the compute floor
(:func:`torch_dcp.sim.floors.batch_floor_seconds`).
Its traffic sweeps (``paper --sweep ...``) are in :mod:`torch_dcp.benchmarks.sweeps`.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from ..api import plan as make_plan
from ..topology import Topology
from .common import MASKS, bench_batch, paper_batches, paper_sources, planner_batches, progress

__all__ = ["bench_planners", "bench_paper"]


def bench_planners(planners: list[str], masks: list[str], batches: list[str], block_size: int, divisions: int | None,
                   topology: Topology, out=sys.stdout, heads: tuple[int, int] = (8, 2)) -> list[dict]:
    """Run the planner benchmark; returns the rows it printed (a planner that cannot run the
    batch, e.g. ``ulysses`` with more ranks than heads, prints a ``refused`` line instead)."""
    rows = []
    all_batches = planner_batches()
    for bname in batches:
        lens = all_batches[bname]
        for mname in masks:
            batch = bench_batch(lens, MASKS[mname], heads)
            for pname in planners:
                t0 = time.perf_counter()
                try:
                    plan = make_plan(batch, topology, planner=pname, block_size=block_size, divisions=divisions,
                                     cost_model="a100")  # the A100 cluster this table simulates
                except ValueError as err:
                    print(json.dumps({"batch": bname, "mask": mname, "planner": pname, "refused": str(err)}),
                          file=out, flush=True)
                    continue
                seconds = time.perf_counter() - t0
                s = plan.stats()
                row = {
                    "batch": bname, "mask": mname, "planner": pname, "block_size": block_size,
                    "n_docs": len(lens), "longest": int(max(lens)),
                    "plan_seconds": round(seconds, 4),
                    "comm_bytes": s["comm_bytes"], "inter_node_bytes": s["inter_node_bytes"],
                    "compute_imbalance": round(s["compute_imbalance"], 4),
                    "memory_imbalance": round(s["memory_imbalance"], 4),
                    "plan_bytes": len(plan.to_bytes()),
                    "n_tiles": s["n_tiles"], "head_parallel": s.get("head_parallel", 1),
                }
                rows.append(row)
                print(json.dumps(row), file=out, flush=True)
    for pname in planners:
        mine = [r for r in rows if r["planner"] == pname]
        if not mine:
            continue
        times = [r["plan_seconds"] for r in mine]
        summary = {
            "summary": pname, "plan_seconds_median": round(float(np.median(times)), 4),
            "plan_seconds_max": round(max(times), 4),
            "compute_imbalance_max": max(r["compute_imbalance"] for r in mine),
            "memory_imbalance_max": max(r["memory_imbalance"] for r in mine),
            "plan_bytes_max": max(r["plan_bytes"] for r in mine),
        }
        for other in planners:
            if other == pname:
                continue
            pairs = [(a, b) for a in mine for b in rows if b["planner"] == other and b["batch"] == a["batch"]
                     and b["mask"] == a["mask"]]
            summary[f"comm_le_{other}"] = f"{sum(a['comm_bytes'] <= b['comm_bytes'] for a, b in pairs)}/{len(pairs)}"
        print(json.dumps(summary), file=out, flush=True)
    return rows


def bench_paper(planners: list[str], masks: list[str], scales: list[float], block_sizes: list[int], divisions: int | None,
                topology: Topology, cost="a100", out=sys.stdout, sources: dict[str, list[int]] | None = None,
                total: int = 131072, heads: tuple[int, int] = (8, 2)) -> list[dict]:
    """Simulated attention time of every planner on the paper's microbenchmark batches (best
    block size per batch and planner); prints JSON lines and a Markdown table. A planner that
    cannot run a batch (``ulysses`` with more ranks than heads) prints a ``refused`` line and
    an empty cell. ``dcp`` runs with ``head_parallel="auto"`` (every valid head parallelism
    among its candidates)."""
    from ..cost import CostModel
    from ..sim.floors import batch_floor_seconds
    from ..sim.simulate import ring_step_seconds, simulate

    cm = cost if isinstance(cost, CostModel) else CostModel.load(cost)
    sources = sources or paper_sources(total=total)
    rows = []
    fixed = ("ring", "allgather", "megatron", "ulysses", "hcp")  # chunk sizes of their own: block size ignored
    runs = sum(1 if p in fixed else len(block_sizes) for p in planners)
    bar = progress(len(scales) * len(sources) * len(masks) * runs, "paper")
    for scale in scales:
        for bname, lens in paper_batches(scale, total, sources=sources).items():
            for mname in masks:
                batch = bench_batch(lens, MASKS[mname], heads)
                floor_ms = batch_floor_seconds(batch, topology.world_size, cm) * 1e3
                best: dict[str, dict] = {}
                for pname in planners:
                    for bs in ([block_sizes[0]] if pname in fixed else block_sizes):
                        bar.set_postfix_str(f"{scale} {bname} {mname} {pname} B={bs}")
                        t0 = time.perf_counter()
                        bar.update()
                        try:
                            plan = make_plan(batch, topology, planner=pname, block_size=bs, divisions=divisions,
                                             cost_model=cm, **({"head_parallel": "auto"} if pname == "dcp" else {}))
                        except ValueError as err:
                            print(json.dumps({"scale": scale, "batch": bname, "mask": mname, "planner": pname,
                                              "refused": str(err)}), file=out, flush=True)
                            break
                        plan_s = time.perf_counter() - t0
                        sim = simulate(plan, cm)
                        st = plan.stats()
                        row = {"scale": scale, "batch": bname, "mask": mname, "planner": pname, "block_size": bs,
                               "fwd_ms": sim.forward.makespan_s * 1e3, "bwd_ms": sim.backward.makespan_s * 1e3,
                               "total_ms": sim.makespan_s * 1e3, "ideal_ms": sim.ideal_s * 1e3, "floor_ms": floor_ms,
                               "comm_bytes": st["comm_bytes"], "inter_node_bytes": st["inter_node_bytes"],
                               "compute_imbalance": st["compute_imbalance"],
                               "memory_imbalance": st["memory_imbalance"], "plan_seconds": plan_s,
                               "head_parallel": st.get("head_parallel", 1)}
                        if pname == "ring":  # TransformerEngine's ring step formula (its own per-step kernels)
                            row["formula_ms"] = ring_step_seconds(plan, cm) * 1e3
                        if pname not in best or row["total_ms"] < best[pname]["total_ms"]:
                            best[pname] = row
                ring = best.get("ring", {}).get("total_ms")
                baselines = [r["total_ms"] for p, r in best.items() if p != "dcp"]
                for pname, row in best.items():
                    row["speedup_vs_ring"] = ring / row["total_ms"] if ring else None
                    if pname == "dcp" and baselines:
                        row["speedup_vs_best_baseline"] = min(baselines) / row["total_ms"]
                    row["ratio_to_ideal"] = row["total_ms"] / row["ideal_ms"] if row["ideal_ms"] else None
                    row["ratio_to_floor"] = row["total_ms"] / floor_ms if floor_ms else None
                    rows.append(row)
                    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                          file=out, flush=True)
    bar.close()
    _paper_table(rows, planners, masks, out)
    return rows


def _paper_table(rows: list[dict], planners: list[str], masks: list[str], out) -> None:
    print("\nSimulated attention time, forward + backward ms (speedup over ring, memory imbalance = max/mean "
          "resident tokens); best block size per planner\n", file=out)
    print("| scale | batch | mask | " + " | ".join(planners) + " | dcp vs best baseline | dcp / floor | imbalance "
          "dcp (compute/memory) |", file=out)
    print("|---|---|---|" + "---|" * (len(planners) + 3), file=out)
    keys = sorted({(r["scale"], r["batch"], r["mask"]) for r in rows},
                  key=lambda k: (k[0], k[1], masks.index(k[2]) if k[2] in masks else 0))
    for key in keys:
        cells = []
        for p in planners:
            r = next((r for r in rows if (r["scale"], r["batch"], r["mask"], r["planner"]) == (*key, p)), None)
            cells.append(f"{r['fwd_ms']:.2f}+{r['bwd_ms']:.2f} ({r['speedup_vs_ring']:.2f}x, mem {r['memory_imbalance']:.2f})"
                         if r else "-")
        d = next((r for r in rows if (r["scale"], r["batch"], r["mask"], r["planner"]) == (*key, "dcp")), None)
        extra = (f"{d.get('speedup_vs_best_baseline', float('nan')):.2f}x | {d['ratio_to_floor']:.2f} | "
                 f"{d['compute_imbalance']:.2f}/{d['memory_imbalance']:.2f}") if d else "- | - | -"
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + f" | {extra} |", file=out)
    ring = [r for r in rows if "formula_ms" in r]
    if ring:
        ratio = [r["total_ms"] / r["formula_ms"] for r in ring]
        print(f"\nring simulated / TransformerEngine's ring step formula: {min(ratio):.3f}-{max(ratio):.3f}", file=out)
    dcp = [r for r in rows if r["planner"] == "dcp" and "speedup_vs_best_baseline" in r]
    if dcp:
        wins = sum(r["speedup_vs_best_baseline"] >= 1.0 for r in dcp)
        print(f"\ndcp at least as fast as every baseline here (each over the whole group; at its best CP size: "
              f"benchmarks compare) on {wins}/{len(dcp)} batches", file=out)
        for sparse in (False, True):
            sel = [r for r in dcp if (r["mask"] != "causal") == sparse]
            if sel:
                sp = [r["speedup_vs_ring"] for r in sel]
                ri = [r["ratio_to_ideal"] for r in sel]
                print(f"{'sparse masks' if sparse else 'causal'}: dcp speedup over ring (one ring over every rank) "
                      f"{min(sp):.2f}-{max(sp):.2f}x, "
                      f"ratio to ideal {min(ri):.2f}-{max(ri):.2f}", file=out)
        heavy = [r for r in dcp if r["mask"] == "causal" and r["floor_ms"] >= 5.0]
        if heavy:
            rf = [r["ratio_to_floor"] for r in heavy]
            print(f"causal batches with a compute floor >= 5 ms: dcp / floor {min(rf):.2f}-{max(rf):.2f} "
                  f"({sum(x <= 1.25 for x in rf)}/{len(rf)} within 1.25x)", file=out)
