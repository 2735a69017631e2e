"""Does dcp's time objective trade compute balance for bytes where it should?

    python -m torch_dcp.benchmarks balance --topology a100 --cost a100

On the paper's microbenchmark batches (4 nodes x 8 ranks, 131,072 tokens), dcp plans every
batch twice: with its default ``objective="time"`` (compute balance may loosen up to 2x where
links are the bottleneck; candidates timed on the simulator) and with ``objective="bytes"``
(compute held within 1.1 of the mean, fewest bytes). For both plans it prints the simulated
forward + backward time and three floors no schedule of that plan can beat:

* ``compute floor``: the busiest rank's kernel time (the plan's own compute balance);
* ``link floor``: the busiest link's bytes over its bandwidth (a rank's NVLink port in or out,
  a network rail in or out), forward and backward together;
* ``pass floor``: the larger of the two in each pass, forward + backward (the passes run one
  after the other, so a forward bound by its links and a backward bound by its compute add up;
  :func:`torch_dcp.sim.floors.floor_seconds` with the simulated kernel times);

and ``ideal``, the balanced compute (total kernel time / ranks) with nothing exposed. When the
balanced plan's link floor lies above the time objective's whole simulated time, holding compute
balance cannot pay on these links: that is the trade the time objective makes.

A second table says where the time objective's plan loses against ``ideal``: the busiest
rank's compute (its imbalance), its pass floor (what imbalance and links leave; the rest, up to
the simulated time, is lost by the schedule), and the waits of the rank that finishes each pass
last, split into those before its first kernel (the first fetch), between kernels, and after
its last kernel (partial results still travelling), forward + backward. Two closing lines give
the range of ``pass floor / ideal`` and ``simulated / pass floor`` over the batches.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from ..api import plan as make_plan
from ..cost import CostModel
from ..sim.floors import link_floor_seconds
from ..sim.simulate import simulate
from ..topology import Topology
from .common import MASKS, bench_batch, paper_batches, paper_sources, progress

__all__ = ["bench_balance"]


def bench_balance(topology: Topology, cost: CostModel | str = "a100", masks: tuple[str, ...] = ("causal", "lambda"),
                  scales: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0), block_sizes: tuple[int, ...] = (1024, 2048),
                  divisions: int = 4, out=sys.stdout, total: int = 131072,
                  sources: dict[str, list[int]] | None = None) -> list[dict]:
    """Both objectives on every paper batch (best block size each); prints JSON lines and a
    Markdown table; returns the rows (``time`` and ``bytes`` entries per batch)."""
    cm = cost if isinstance(cost, CostModel) else CostModel.load(cost)
    sources = sources or paper_sources(total=total)
    rows = []
    bar = progress(len(scales) * len(sources) * len(masks) * 2 * len(block_sizes), "balance")
    for scale in scales:
        for bname, lens in paper_batches(scale, total, sources=sources).items():
            for mname in masks:
                batch = bench_batch(lens, MASKS[mname])
                row = {"scale": scale, "batch": bname, "mask": mname}
                for objective in ("time", "bytes"):
                    best = None
                    for bs in block_sizes:
                        plan = make_plan(batch, topology, planner="dcp", block_size=bs, divisions=divisions,
                                         objective=objective, cost_model=cm)
                        sim = simulate(plan, cm)
                        busy = sim.forward.busy_s + sim.backward.busy_s
                        st = plan.stats()
                        pass_floor = sum(max(float(ps.busy_s.max()), link_floor_seconds(plan, backward))
                                         for backward, ps in ((False, sim.forward), (True, sim.backward)))
                        r = {"ms": sim.makespan_s * 1e3, "compute_floor_ms": float(busy.max()) * 1e3,
                             **{f"exposed_{k}_ms": v * 1e3 for k, v in _exposed(sim).items()},
                             "link_floor_ms": link_floor_seconds(plan) * 1e3, "pass_floor_ms": pass_floor * 1e3,
                             "ideal_ms": sim.ideal_s * 1e3,
                             "compute_imbalance": st["compute_imbalance"], "inter_node_gb": st["inter_node_bytes"] / 1e9,
                             "block_size": bs, "chosen": plan.planner}
                        if best is None or r["ms"] < best["ms"]:
                            best = r
                        bar.update()
                    row[objective] = best
                rows.append(row)
                print(json.dumps(row, default=lambda v: round(v, 4)), file=out, flush=True)
    bar.close()
    _table(rows, out)
    return rows


def _exposed(sim) -> dict[str, float]:
    """Waits (seconds, forward + backward) of the rank finishing each pass last: before its
    first kernel, between kernels, after its last kernel."""
    total = {"start": 0.0, "middle": 0.0, "end": 0.0}
    for ps in (sim.forward, sim.backward):
        events = ps.events[int(np.argmax(ps.finish_s))]
        kernels = [i for i, e in enumerate(events) if e[0] == "attention"] or [len(events)]
        for i, (kind, a, b) in enumerate(events):
            if kind == "wait":
                total["start" if i < kernels[0] else "end" if i > kernels[-1] else "middle"] += b - a
    return total


def _table(rows: list[dict], out) -> None:
    print("\n| scale | batch | mask | time objective ms (compute imb., inter GB) | floors compute / link / pass ms "
          "| bytes objective ms (compute imb., inter GB) | floors compute / link / pass ms | ideal ms | bytes / time |",
          file=out)
    print("|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        t, b = r["time"], r["bytes"]
        print(f"| {r['scale']} | {r['batch']} | {r['mask']} | {t['ms']:.2f} ({t['compute_imbalance']:.2f}, "
              f"{t['inter_node_gb']:.2f}) | {_floors(t)} | {b['ms']:.2f} ({b['compute_imbalance']:.2f}, "
              f"{b['inter_node_gb']:.2f}) | {_floors(b)} | {t['ideal_ms']:.2f} | {b['ms'] / t['ms']:.2f} |", file=out)
    print("\n| scale | batch | mask | time objective ms | ideal ms | busiest rank's compute ms | pass floor ms | "
          "waits before first kernel / between / after last kernel ms (last rank to finish, fwd + bwd) |", file=out)
    print("|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        t = r["time"]
        print(f"| {r['scale']} | {r['batch']} | {r['mask']} | {t['ms']:.2f} | {t['ideal_ms']:.2f} | "
              f"{t['compute_floor_ms']:.2f} | {t['pass_floor_ms']:.2f} | {t['exposed_start_ms']:.2f} / "
              f"{t['exposed_middle_ms']:.2f} / {t['exposed_end_ms']:.2f} |", file=out)
    wins = sum(r["bytes"]["ms"] >= r["time"]["ms"] for r in rows)
    print(f"\ntime objective at least as fast as the balanced plan on {wins}/{len(rows)} batches; "
          f"the balanced plan's link floor above the time objective's simulated time on "
          f"{sum(r['bytes']['link_floor_ms'] > r['time']['ms'] for r in rows)}/{len(rows)}", file=out)
    if rows:
        def span(values) -> str:
            return f"{min(values):.2f}-{max(values):.2f}"

        for name in ("time", "bytes"):
            obj = [r[name] for r in rows]
            print(f"{name} objective: pass floor / ideal {span([o['pass_floor_ms'] / o['ideal_ms'] for o in obj])}, "
                  f"simulated / pass floor {span([o['ms'] / o['pass_floor_ms'] for o in obj])}", file=out)


def _floors(r: dict) -> str:
    return f"{r['compute_floor_ms']:.2f} / {r['link_floor_ms']:.2f} / {r['pass_floor_ms']:.2f}"
