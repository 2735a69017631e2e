"""Benchmarks.

    python -m torch_dcp.bench planners [--block-size 1024] [--planners ring,greedy,dcp] ...

``planners`` runs every planner on the same 131,072-token global batches -- (a) ``corpus``:
real document lengths of the embedded corpus (the Python standard library's sources,
byte tokens), (b) ``longtail``: :func:`torch_dcp.data.long_tail_lengths` with its documented
defaults, (c) ``one``: a single 131,072-token document -- under the causal, λ,
causal-blockwise and shared-question masks (DCP paper §7.1 defaults), on 4 nodes × 8 ranks,
GQA 8/2, head_dim 128, bf16. It prints one JSON line per (batch, mask, planner) and a summary
line per planner.

    python -m torch_dcp.bench paper [--scales 0.5,1,2,4] [--block-sizes 512,1024,2048,4096]

``paper`` reproduces the DCP paper's microbenchmark setup (§7.1: 4 × 8 A100, GQA 8/2,
head_dim 128, 131,072-token batches, T = 4, document lengths scaled by 0.5/1/2/4) in the
simulator: every planner on the same batches, the best block size per batch, forward and
backward attention time, speedups over ring and over the best baseline, ratio to the ideal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .api import plan as make_plan
from .batch import BatchSpec
from .masks import BlockwiseCausal, Causal, Lambda, SharedQuestion
from .topology import Topology

__all__ = ["planner_batches", "bench_planners", "paper_batches", "bench_paper", "main"]

MASKS = {
    "causal": Causal(),
    "lambda": Lambda(),
    "blockwise": BlockwiseCausal(),
    "shared_question": SharedQuestion(),
}


def planner_batches(total: int = 131072, seed: int = 0) -> dict[str, list[int]]:
    """Document lengths of the benchmark batches, ``{name: lengths}``."""
    from .data import byte_tokenize, load_documents, long_tail_lengths, pack_batches

    docs = [byte_tokenize(t) for t in load_documents()]
    corpus = [len(d) for d in next(pack_batches(docs, total, total, seed=seed))]
    return {"corpus": corpus, "longtail": long_tail_lengths(total, seed=seed), "one": [total]}


def bench_planners(planners: list[str], masks: list[str], batches: list[str], block_size: int, divisions: int,
                   topology: Topology, out=sys.stdout) -> list[dict]:
    """Run the planner benchmark; returns the rows it printed."""
    rows = []
    all_batches = planner_batches()
    for bname in batches:
        lens = all_batches[bname]
        for mname in masks:
            batch = BatchSpec(lens, MASKS[mname], n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
            for pname in planners:
                t0 = time.perf_counter()
                plan = make_plan(batch, topology, planner=pname, block_size=block_size, divisions=divisions)
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
                    "n_tiles": s["n_tiles"],
                }
                rows.append(row)
                print(json.dumps(row), file=out, flush=True)
    for pname in planners:
        mine = [r for r in rows if r["planner"] == pname]
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


def paper_batches(scale: float, total: int = 131072, seed: int = 0) -> dict[str, list[int]]:
    """The microbenchmark's length sources with every document length multiplied by
    ``scale`` (DCP paper §7.1 scales 0.5, 1, 2, 4), re-packed to ``total`` tokens."""
    from .data import byte_tokenize, load_documents, long_tail_lengths

    rng = np.random.default_rng(seed)
    corpus = [len(byte_tokenize(t)) for t in load_documents()]
    tail = long_tail_lengths(total * 4, seed=seed)
    out = {}
    for name, lens in (("corpus", [corpus[i] for i in rng.permutation(len(corpus))]), ("longtail", tail)):
        batch, used = [], 0
        for n in lens:
            n = max(1, min(total - used, int(round(n * scale))))
            batch.append(n)
            used += n
            if used == total:
                break
        out[name] = batch
    return out


def bench_paper(planners: list[str], masks: list[str], scales: list[float], block_sizes: list[int], divisions: int,
                topology: Topology, cost: str = "a100", out=sys.stdout) -> list[dict]:
    """Simulated attention time of every planner on the paper's microbenchmark batches (best
    block size per batch and planner); prints JSON lines and a Markdown table."""
    from .cost import CostModel
    from .simulate import simulate

    cm = CostModel.h100() if cost == "h100" else CostModel.a100()
    rows = []
    for scale in scales:
        for bname, lens in paper_batches(scale).items():
            for mname in masks:
                batch = BatchSpec(lens, MASKS[mname], n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
                best: dict[str, dict] = {}
                for pname in planners:
                    for bs in ([block_sizes[0]] if pname in ("ring", "megatron") else block_sizes):
                        t0 = time.perf_counter()
                        plan = make_plan(batch, topology, planner=pname, block_size=bs, divisions=divisions)
                        plan_s = time.perf_counter() - t0
                        sim = simulate(plan, cm)
                        st = plan.stats()
                        row = {"scale": scale, "batch": bname, "mask": mname, "planner": pname, "block_size": bs,
                               "fwd_ms": sim.forward.makespan_s * 1e3, "bwd_ms": sim.backward.makespan_s * 1e3,
                               "total_ms": sim.makespan_s * 1e3, "ideal_ms": sim.ideal_s * 1e3,
                               "comm_bytes": st["comm_bytes"], "compute_imbalance": st["compute_imbalance"],
                               "memory_imbalance": st["memory_imbalance"], "plan_seconds": plan_s}
                        if pname not in best or row["total_ms"] < best[pname]["total_ms"]:
                            best[pname] = row
                ring = best.get("ring", {}).get("total_ms")
                baselines = [r["total_ms"] for p, r in best.items() if p != "dcp"]
                for pname, row in best.items():
                    row["speedup_vs_ring"] = ring / row["total_ms"] if ring else None
                    if pname == "dcp" and baselines:
                        row["speedup_vs_best_baseline"] = min(baselines) / row["total_ms"]
                    row["ratio_to_ideal"] = row["total_ms"] / row["ideal_ms"] if row["ideal_ms"] else None
                    rows.append(row)
                    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                          file=out, flush=True)
    print("\n| scale | batch | mask | " + " | ".join(f"{p} fwd+bwd ms (x ring)" for p in planners) + " | dcp / ideal |",
          file=out)
    print("|---|---|---|" + "---|" * (len(planners) + 1), file=out)
    keys = sorted({(r["scale"], r["batch"], r["mask"]) for r in rows}, key=lambda k: (k[0], k[1], masks.index(k[2])))
    for key in keys:
        cells = []
        for p in planners:
            r = next((r for r in rows if (r["scale"], r["batch"], r["mask"], r["planner"]) == (*key, p)), None)
            cells.append(f"{r['fwd_ms']:.2f}+{r['bwd_ms']:.2f} ({r['speedup_vs_ring']:.2f}x)" if r else "-")
        d = next((r for r in rows if (r["scale"], r["batch"], r["mask"], r["planner"]) == (*key, "dcp")), None)
        ratio = f"{d['ratio_to_ideal']:.2f}" if d else "-"
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + f" | {ratio} |", file=out)
    return rows


def write_pictures(out: str, batch_name: str, mask: str, planner: str, block_size: int,
                   topology: Topology | None = None) -> list[str]:
    """Write ``placement.png``, ``traffic.png`` and ``timeline.png`` of one benchmark plan
    into ``out``; returns the paths."""
    from pathlib import Path

    from . import viz
    from .simulate import simulate

    Path(out).mkdir(parents=True, exist_ok=True)
    batch = BatchSpec(planner_batches()[batch_name], MASKS[mask], n_heads=8, n_kv_heads=2, head_dim=128)
    plan = make_plan(batch, topology or Topology(), planner=planner, block_size=block_size)
    paths = [viz.placement_map(plan, Path(out) / "placement.png"), viz.traffic_matrix(plan, Path(out) / "traffic.png"),
             viz.timeline(simulate(plan), Path(out) / "timeline.png",
                          title=f"{planner}, {batch_name} batch, {mask} mask: simulated attention (A100 table)")]
    for pth in paths:
        print(pth)
    return [str(pth) for pth in paths]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m torch_dcp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("planners", help="compare planners on the same batches")
    pp.add_argument("--planners", default="ring,greedy,dcp")
    pp.add_argument("--masks", default=",".join(MASKS))
    pp.add_argument("--batches", default="corpus,longtail,one")
    pp.add_argument("--block-size", type=int, default=1024)
    pp.add_argument("--divisions", type=int, default=4)
    pp.add_argument("--nodes", type=int, default=4)
    pp.add_argument("--ranks-per-node", type=int, default=8)
    pp2 = sub.add_parser("paper", help="the DCP paper's microbenchmark, simulated, all planners side by side")
    pp2.add_argument("--planners", default="ring,greedy,megatron,fcp,dcp")
    pp2.add_argument("--masks", default=",".join(MASKS))
    pp2.add_argument("--scales", default="0.5,1,2,4")
    pp2.add_argument("--block-sizes", default="512,1024,2048,4096")
    pp2.add_argument("--divisions", type=int, default=4)
    pp2.add_argument("--cost", choices=["a100", "h100"], default="a100")
    pp3 = sub.add_parser("pictures", help="placement map, traffic matrix and simulated timeline of one plan (PNG)")
    pp3.add_argument("--out", default=".")
    pp3.add_argument("--batch", choices=["corpus", "longtail", "one"], default="longtail")
    pp3.add_argument("--mask", choices=sorted(MASKS), default="lambda")
    pp3.add_argument("--planner", default="dcp")
    pp3.add_argument("--block-size", type=int, default=1024)
    args = p.parse_args(argv)
    if args.cmd == "pictures":
        write_pictures(args.out, args.batch, args.mask, args.planner, args.block_size)
        return
    if args.cmd == "paper":
        bench_paper(args.planners.split(","), args.masks.split(","), [float(x) for x in args.scales.split(",")],
                    [int(x) for x in args.block_sizes.split(",")], args.divisions, Topology(), args.cost)
        return
    if args.cmd == "planners":
        masks = args.masks.split(",")
        for m in masks:
            if m not in MASKS:
                p.error(f"unknown mask {m!r}; choose from {sorted(MASKS)}")
        bench_planners(args.planners.split(","), masks, args.batches.split(","), args.block_size, args.divisions,
                       Topology(n_nodes=args.nodes, ranks_per_node=args.ranks_per_node))


if __name__ == "__main__":
    main()
