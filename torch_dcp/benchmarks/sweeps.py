"""The DCP paper's traffic sweeps (§7.3, figures 17, 19, 20) on one batch.

    python -m torch_dcp.benchmarks paper --sweep block-size|sparsity|eps [--sweep-batch longtail] [--sweep-scale 1]
"""

from __future__ import annotations

import json
import sys

import numpy as np

from ..api import plan as make_plan
from ..masks import Causal, Lambda
from ..topology import Topology
from .common import MASKS, bench_batch, paper_sources, progress, scaled_batch

__all__ = ["SWEEPS", "bench_sweep"]

SWEEPS = ("block-size", "sparsity", "eps")


def bench_sweep(sweep: str, topology: Topology, masks: list[str], block_sizes: list[int], divisions: int | None = 4,
                batch_name: str = "longtail", scale: float = 1.0, baseline: str = "ring", out=sys.stdout,
                sources: dict[str, list[int]] | None = None, total: int = 131072) -> list[dict]:
    """The paper's traffic sweeps on one batch (DCP paper §7.3), printed as JSON lines and a
    table of ``comm_bytes`` and inter-node bytes:

    * ``block-size`` (figure 17): dcp and ``baseline`` for each mask and block size;
      dcp runs with its fewest-bytes objective in all three sweeps (as the paper's planner);
    * ``sparsity`` (figure 19): λ masks of growing window, against the fraction of the
      causal mask's FLOPs they keep (``block_sizes[0]``); a least-squares line through the
      dcp points and its R² say how linear traffic is in the kept FLOPs;
    * ``eps`` (figure 20): dcp with every imbalance tolerance (``eps_inter``, ``eps_intra``,
      ``eps_compute``, ``eps_memory``) set to ε, fewest bytes objective, for each mask.

    Raises:
        ValueError: unknown sweep or batch name.
    """
    if sweep not in SWEEPS:
        raise ValueError(f"unknown sweep {sweep!r}; choose from {SWEEPS}")
    sources = sources or paper_sources(total=total)
    if batch_name not in sources:
        raise ValueError(f"unknown batch {batch_name!r}; have {sorted(sources)}")
    lens = scaled_batch(sources[batch_name], scale, total)
    def opts(p: str, b: int) -> dict:
        return {"planner": p, "block_size": b, **({"objective": "bytes"} if p == "dcp" else {})}

    if sweep == "block-size":
        runs = [(m, opts(p, b), f"B={b}") for m in masks for b in block_sizes for p in (baseline, "dcp")]
    elif sweep == "sparsity":
        windows = [w for w in (512, 1024, 2048, 4096, 8192, 16384, 32768) if w < max(lens)]
        mks = [(f"lambda w={w}", Lambda(sink=64, window=w)) for w in windows] + [("causal", Causal())]
        runs = [(m, opts(p, block_sizes[0]), name) for name, m in mks for p in (baseline, "dcp")]
    else:
        runs = [(m, {"planner": "dcp", "block_size": block_sizes[0], "objective": "bytes", "eps_inter": e,
                     "eps_intra": e, "eps_compute": e, "eps_memory": e}, f"eps={e}")
                for m in masks for e in (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)]
    causal_pairs = float(sum(n * (n + 1) // 2 for n in lens))
    rows = []
    bar = progress(len(runs), sweep)
    for mask, opts, label in runs:
        m = MASKS[mask] if isinstance(mask, str) else mask
        batch = bench_batch(lens, m)
        opts = dict(opts)
        pname = opts.pop("planner")
        bar.set_postfix_str(f"{label} {pname}")
        opts.setdefault("cost_model", "a100")  # the paper's cluster, as the sweeps' simulations
        plan = make_plan(batch, topology, planner=pname, divisions=divisions, **opts)
        st = plan.stats()
        row = {"sweep": sweep, "batch": batch_name, "scale": scale, "mask": mask if isinstance(mask, str) else label,
               "setting": label, "planner": pname,
               "flops_fraction": float(plan.workload.tile_pairs.sum()) / causal_pairs,
               "comm_bytes": st["comm_bytes"], "inter_node_bytes": st["inter_node_bytes"],
               "compute_imbalance": st["compute_imbalance"], "memory_imbalance": st["memory_imbalance"]}
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), file=out,
              flush=True)
        bar.update()
    bar.close()
    _sweep_table(rows, sweep, baseline, out)
    return rows


def _sweep_table(rows: list[dict], sweep: str, baseline: str, out) -> None:
    gb = 1e9
    print(f"\nTraffic sweep '{sweep}' (GB: all bytes / inter-node bytes, forward + backward)\n", file=out)
    if sweep == "eps":
        print("| mask | ε | dcp GB | dcp inter-node GB | compute imbalance | memory imbalance |", file=out)
        print("|---|---|---|---|---|---|", file=out)
        for r in rows:
            print(f"| {r['mask']} | {r['setting'][4:]} | {r['comm_bytes'] / gb:.3f} | {r['inter_node_bytes'] / gb:.3f} | "
                  f"{r['compute_imbalance']:.2f} | {r['memory_imbalance']:.2f} |", file=out)
        return
    first = "FLOPs kept (of causal)" if sweep == "sparsity" else "block size"
    print(f"| mask | {first} | {baseline} GB | {baseline} inter GB | dcp GB | dcp inter GB | dcp / {baseline} |", file=out)
    print("|---|---|---|---|---|---|---|", file=out)
    pairs = []
    for r in rows:
        if r["planner"] != "dcp":
            continue
        b = next(x for x in rows if x["planner"] == baseline and x["mask"] == r["mask"] and x["setting"] == r["setting"])
        col = f"{r['flops_fraction']:.3f}" if sweep == "sparsity" else r["setting"][2:]
        print(f"| {r['mask']} | {col} | {b['comm_bytes'] / gb:.3f} | {b['inter_node_bytes'] / gb:.3f} | "
              f"{r['comm_bytes'] / gb:.3f} | {r['inter_node_bytes'] / gb:.3f} | "
              f"{r['comm_bytes'] / max(b['comm_bytes'], 1):.2f} |", file=out)
        pairs.append((r["flops_fraction"], r["comm_bytes"]))
    if sweep == "sparsity" and len(pairs) > 2:
        x, y = np.array(pairs).T
        slope, icpt = np.polyfit(x, y, 1)
        r2 = 1 - ((y - (slope * x + icpt)) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-300)
        print(f"\ndcp traffic ~ {slope / gb:.3f} GB x FLOPs fraction + {icpt / gb:.3f} GB, R^2 = {r2:.3f}", file=out)
