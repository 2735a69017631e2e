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


def paper_sources(longalign: str | None = None, long_data_collections: str | None = None,
                  total: int = 131072, seed: int = 0) -> dict[str, list[int]]:
    """Document-length sources of the microbenchmark, ``{name: lengths}``: ``corpus`` (the
    embedded real corpus, shuffled), ``longtail`` (:func:`torch_dcp.data.long_tail_lengths`),
    and, when given, ``longalign`` / ``ldc``: lengths read from a local copy of LongAlign-10k /
    Long-Data-Collections (a dataset path, or a ``.json`` length list written by
    :func:`torch_dcp.data.save_lengths`)."""
    from .data import (byte_tokenize, load_documents, load_lengths, long_data_collections_lengths,
                       long_tail_lengths, longalign_lengths)

    rng = np.random.default_rng(seed)
    corpus = [len(byte_tokenize(t)) for t in load_documents()]
    out = {"corpus": [corpus[i] for i in rng.permutation(len(corpus))],
           "longtail": long_tail_lengths(total * 4, seed=seed)}
    for name, path, loader in (("longalign", longalign, longalign_lengths),
                               ("ldc", long_data_collections, long_data_collections_lengths)):
        if path:
            lens = load_lengths(path) if str(path).endswith(".json") else loader(path)
            out[name] = [lens[i] for i in rng.permutation(len(lens))]
    return out


def scaled_batch(lengths: list[int], scale: float, total: int = 131072) -> list[int]:
    """Document lengths multiplied by ``scale`` (DCP paper §7.1 scales 0.5, 1, 2, 4), taken in
    order until they fill ``total`` tokens (the last one cut).

    Raises:
        ValueError: non-positive scale, or lengths that cannot fill ``total`` tokens.
    """
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    batch, used = [], 0
    for n in lengths:
        n = max(1, min(total - used, int(round(n * scale))))
        batch.append(n)
        used += n
        if used == total:
            return batch
    raise ValueError(f"the length source holds only {used} tokens at scale {scale}, fewer than {total}")


def paper_batches(scale: float, total: int = 131072, seed: int = 0,
                  sources: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """The microbenchmark's global batches at one length scale, ``{name: lengths}``."""
    sources = sources or paper_sources(total=total, seed=seed)
    return {name: scaled_batch(lens, scale, total) for name, lens in sources.items()}


def _batch(lens: list[int], mask) -> BatchSpec:
    return BatchSpec(lens, mask, n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def bench_paper(planners: list[str], masks: list[str], scales: list[float], block_sizes: list[int], divisions: int,
                topology: Topology, cost="a100", out=sys.stdout, sources: dict[str, list[int]] | None = None,
                total: int = 131072) -> list[dict]:
    """Simulated attention time of every planner on the paper's microbenchmark batches (best
    block size per batch and planner); prints JSON lines and a Markdown table."""
    from .cost import CostModel
    from .simulate import simulate

    cm = cost if isinstance(cost, CostModel) else CostModel.load(cost)
    sources = sources or paper_sources(total=total)
    rows = []
    runs = sum(1 if p in ("ring", "megatron") else len(block_sizes) for p in planners)
    bar = _progress(len(scales) * len(sources) * len(masks) * runs, "paper")
    for scale in scales:
        for bname, lens in paper_batches(scale, total, sources=sources).items():
            for mname in masks:
                batch = _batch(lens, MASKS[mname])
                best: dict[str, dict] = {}
                for pname in planners:
                    for bs in ([block_sizes[0]] if pname in ("ring", "megatron") else block_sizes):
                        bar.set_postfix_str(f"{scale} {bname} {mname} {pname} B={bs}")
                        t0 = time.perf_counter()
                        plan = make_plan(batch, topology, planner=pname, block_size=bs, divisions=divisions)
                        plan_s = time.perf_counter() - t0
                        sim = simulate(plan, cm)
                        st = plan.stats()
                        row = {"scale": scale, "batch": bname, "mask": mname, "planner": pname, "block_size": bs,
                               "fwd_ms": sim.forward.makespan_s * 1e3, "bwd_ms": sim.backward.makespan_s * 1e3,
                               "total_ms": sim.makespan_s * 1e3, "ideal_ms": sim.ideal_s * 1e3,
                               "comm_bytes": st["comm_bytes"], "inter_node_bytes": st["inter_node_bytes"],
                               "compute_imbalance": st["compute_imbalance"],
                               "memory_imbalance": st["memory_imbalance"], "plan_seconds": plan_s}
                        if pname not in best or row["total_ms"] < best[pname]["total_ms"]:
                            best[pname] = row
                        bar.update()
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
    bar.close()
    _paper_table(rows, planners, masks, out)
    return rows


def _paper_table(rows: list[dict], planners: list[str], masks: list[str], out) -> None:
    print("\nSimulated attention time, forward + backward ms (speedup over ring, memory imbalance = max/mean "
          "resident tokens); best block size per planner\n", file=out)
    print("| scale | batch | mask | " + " | ".join(planners) + " | dcp vs best baseline | dcp / ideal | imbalance "
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
        extra = (f"{d.get('speedup_vs_best_baseline', float('nan')):.2f}x | {d['ratio_to_ideal']:.2f} | "
                 f"{d['compute_imbalance']:.2f}/{d['memory_imbalance']:.2f}") if d else "- | - | -"
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + f" | {extra} |", file=out)
    dcp = [r for r in rows if r["planner"] == "dcp" and "speedup_vs_best_baseline" in r]
    if dcp:
        wins = sum(r["speedup_vs_best_baseline"] >= 1.0 for r in dcp)
        print(f"\ndcp at least as fast as every baseline on {wins}/{len(dcp)} batches", file=out)
        for sparse in (False, True):
            sel = [r for r in dcp if (r["mask"] != "causal") == sparse]
            if sel:
                sp = [r["speedup_vs_ring"] for r in sel]
                ri = [r["ratio_to_ideal"] for r in sel]
                print(f"{'sparse masks' if sparse else 'causal'}: dcp speedup over ring {min(sp):.2f}-{max(sp):.2f}x, "
                      f"ratio to ideal {min(ri):.2f}-{max(ri):.2f}", file=out)


SWEEPS = ("block-size", "sparsity", "eps")


def bench_sweep(sweep: str, topology: Topology, masks: list[str], block_sizes: list[int], divisions: int = 4,
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
    bar = _progress(len(runs), sweep)
    for mask, opts, label in runs:
        m = MASKS[mask] if isinstance(mask, str) else mask
        batch = _batch(lens, m)
        opts = dict(opts)
        pname = opts.pop("planner")
        bar.set_postfix_str(f"{label} {pname}")
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
    pp2.add_argument("--cost", default="a100",
                     help="a100, h100, or JSON cost tables measured on your GPU (CostModel.to_json format), "
                          "comma-separated, e.g. one per head_dim")
    pp2.add_argument("--batches", default=None,
                     help="length sources to run (default: all): corpus, longtail, longalign, ldc")
    pp2.add_argument("--longalign", default=None, metavar="PATH",
                     help="LongAlign-10k's long.jsonl (or its folder, or a saved .json length list)")
    pp2.add_argument("--long-data-collections", default=None, metavar="PATH",
                     help="Long-Data-Collections folder (pretrain/, fine-tune/) or file, or a saved .json length list")
    pp2.add_argument("--sweep", choices=SWEEPS, default=None,
                     help="instead of the timing table: traffic vs block size (fig. 17), vs mask sparsity "
                          "(fig. 19) or vs imbalance tolerance (fig. 20) on one batch")
    pp2.add_argument("--sweep-batch", default="longtail", help="length source of the sweep's batch")
    pp2.add_argument("--sweep-scale", type=float, default=1.0, help="length scale of the sweep's batch")
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
        for m in args.masks.split(","):
            if m not in MASKS:
                p.error(f"unknown mask {m!r}; choose from {sorted(MASKS)}")
        sources = paper_sources(args.longalign, args.long_data_collections)
        if args.batches:
            unknown = set(args.batches.split(",")) - set(sources)
            if unknown:
                p.error(f"unknown or unavailable length sources {sorted(unknown)}; have {sorted(sources)} "
                        "(longalign/ldc need --longalign/--long-data-collections)")
            sources = {k: v for k, v in sources.items() if k in args.batches.split(",")}
        block_sizes = [int(x) for x in args.block_sizes.split(",")]
        if args.sweep:
            bench_sweep(args.sweep, Topology(), args.masks.split(","), block_sizes, args.divisions, args.sweep_batch,
                        args.sweep_scale, sources=sources)
            return
        bench_paper(args.planners.split(","), args.masks.split(","), [float(x) for x in args.scales.split(",")],
                    block_sizes, args.divisions, Topology(), args.cost, sources=sources)
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
