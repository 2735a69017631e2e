"""Benchmarks.

    python -m torch_dcp.bench planners [--block-size 1024] [--planners ring,greedy,dcp] ...

``planners`` runs every planner on the same 131,072-token global batches -- (a) ``corpus``:
real document lengths of the embedded corpus (the Python standard library's sources,
byte tokens), (b) ``longtail``: :func:`torch_dcp.data.long_tail_lengths` with its documented
defaults, (c) ``one``: a single 131,072-token document -- under the causal, λ,
causal-blockwise and shared-question masks (DCP paper §7.1 defaults), on 4 nodes × 8 ranks,
GQA 8/2, head_dim 128, bf16. It prints one JSON line per (batch, mask, planner) and a summary
line per planner.
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

__all__ = ["planner_batches", "bench_planners", "main"]

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
    args = p.parse_args(argv)
    if args.cmd == "planners":
        masks = args.masks.split(",")
        for m in masks:
            if m not in MASKS:
                p.error(f"unknown mask {m!r}; choose from {sorted(MASKS)}")
        bench_planners(args.planners.split(","), masks, args.batches.split(","), args.block_size, args.divisions,
                       Topology(n_nodes=args.nodes, ranks_per_node=args.ranks_per_node))


if __name__ == "__main__":
    main()
