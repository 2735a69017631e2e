"""Planning at scale: dcp's default plan at 131K tokens / 32 ranks up to 4M tokens / 1,024 ranks.

    python -m torch_dcp.benchmarks scale [--cases 131k,1m,4m] [--mask causal] [--rivals ring,allgather,bytes]
    python -m torch_dcp.benchmarks scale --calibrate

For every case (tokens, nodes of 8 ranks, ``--preset`` links and cost model (H100 by default; its
kernel table with the executor's fixed costs, what ``"auto"`` plans with on that card), document
lengths of the embedded corpus (the Python standard library's sources as byte tokens) in shuffled
order, as the ``paper`` benchmark's ``corpus`` batch, GQA 8/2, head_dim 128, bf16, block size 1024),
in a fresh process of its own (bounded by ``--timeout`` seconds and ``--max-memory-gb``), it prints
one JSON line: the default plan's planning time (CPU seconds of that process: one core; with
``--batches N``, N batches of the case planned one after another in that process, as a planning
worker plans step after step, and the median of their times, each listed in ``plan_cpu_s_each``; the
first also pays the process's one-time costs), the process's peak memory, the serialized plan's
bytes (what every rank fetches), its compute and memory imbalance, its simulated forward + backward
time, its ratio to the ideal (busy time spread evenly) and to the compute floor
(:func:`torch_dcp.sim.floors.batch_floor_seconds`), and the simulated times of the rivals asked for
(``ring``, ``allgather``, ``bytes``: dcp's own fewest-bytes plan; all three timed as torch_dcp's
executor runs them, as dcp's own candidates: the baselines as their authors' implementations run
them are ``benchmarks compare``'s), each planned in its own process too (on the same batches;
``slower_than`` names a rival faster on any of them). A rival that cannot be planned within the
bounds is reported as such. The other figures are the first batch's.

``--calibrate`` measures how well :func:`torch_dcp.sim.estimate.estimate_seconds` picks what to
simulate: on the paper's batches (A100 and H100, 4 x 8 and 1 x 8, GQA 8/2 and 32/8, causal and
λ) it simulates every candidate of the default plan and prints, per batch, the best of the
``k`` best by estimate against the best of all (1.0: the shortlist holds the fastest).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import resource
import sys
import time
from typing import Any

import numpy as np

__all__ = ["CASES", "parse_case", "bench_scale", "calibrate"]

#: name -> (tokens, nodes of 8 ranks); any other case is written ``TOKENSxNODES`` (e.g. ``16384x2``)
CASES = {"131k": (131072, 4), "1m": (1 << 20, 32), "4m": (1 << 22, 128)}
RIVALS = ("ring", "allgather", "bytes")


def parse_case(case: str) -> tuple[int, int]:
    """``(tokens, nodes)`` of a case name (:data:`CASES`) or ``TOKENSxNODES``.

    Raises:
        ValueError: neither.
    """
    if case in CASES:
        return CASES[case]
    try:
        tokens, nodes = (int(x) for x in case.split("x"))
        if tokens >= 1 and nodes >= 1:
            return tokens, nodes
    except ValueError:
        pass
    raise ValueError(f"unknown case {case!r}: one of {', '.join(CASES)} or TOKENSxNODES (e.g. 16384x2)")


#: the first corpus shuffle of batch ``i`` of a case: seed ``i * BATCH_SEED_STRIDE``
BATCH_SEED_STRIDE = 1000


def _batch(tokens: int, mask: str, heads: tuple[int, int], index: int = 0):
    """Batch ``index`` of the case: document lengths of the embedded corpus in shuffled
    order (seed ``index * BATCH_SEED_STRIDE``, reshuffled with the next seed when one pass does
    not fill ``tokens``)."""
    from .common import MASKS, bench_batch, paper_sources, scaled_batch

    lengths, seed = [], index * BATCH_SEED_STRIDE
    while sum(lengths) < tokens:
        lengths += paper_sources(seed=seed)["corpus"]
        seed += 1
    return bench_batch(scaled_batch(lengths, 1.0, tokens), MASKS[mask], heads)


def _measure(case: str, mask: str, planner: str, heads: tuple[int, int], max_memory_gb: float,
             preset: str = "h100", batches: int = 1) -> dict[str, Any]:
    """The case's ``batches`` plans in this (child) process: planning CPU seconds (median and
    each), peak memory, the first batch's figures, every batch's simulated time."""
    import statistics

    import torch_dcp
    from ..cost import CostModel
    from ..sim.runtimes import on_executor
    from ..sim.floors import batch_floor_seconds
    from ..sim.simulate import simulate
    from ..topology import Topology

    limit = int(max_memory_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    tokens, nodes = parse_case(case)
    topo = Topology.preset(preset, n_nodes=nodes)
    cm = CostModel.load(f"{preset}-executor")  # what "auto" plans with on that card
    options: dict[str, Any] = {"planner": planner}
    if planner == "bytes":
        options = {"planner": "dcp", "objective": "bytes"}
    if options["planner"] == "dcp":
        options["cost_model"] = cm
    seconds, sims, first = [], [], None
    for i in range(batches):
        batch = _batch(tokens, mask, heads, i)
        t0 = time.process_time()
        plan = torch_dcp.plan(batch, topo, block_size=1024, **options)
        seconds.append(time.process_time() - t0)
        # dcp's plan on the runtime it names (its static runtimes among them); a rival as dcp's
        # candidate: on torch_dcp's executor
        sim = simulate(plan if planner == "dcp" else on_executor(plan), cm)
        sims.append(round(sim.makespan_s * 1e3, 4))
        if first is None:
            s = plan.stats()
            floor = batch_floor_seconds(batch, topo.world_size, cm)
            first = {"tokens": batch.total_tokens, "documents": batch.n_docs, "plan_bytes": len(plan.to_bytes()),
                     "chosen": plan.planner, "compute_imbalance": round(s["compute_imbalance"], 3),
                     "memory_imbalance": round(s["memory_imbalance"], 3), "sim_ms": sims[0],
                     "ratio_to_ideal": round(sim.ratio_to_ideal, 3),
                     "ratio_to_floor": round(sim.makespan_s / floor, 3) if floor > 0 else None}
    row = {"case": case, "planner": planner, "preset": preset, "ranks": topo.world_size, "mask": mask,
           "batches": batches, "plan_cpu_s": round(statistics.median(seconds), 3),
           "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3), **first}
    if batches > 1:
        row["plan_cpu_s_each"] = [round(x, 3) for x in seconds]
        row["sim_ms_each"] = sims
    return row


def _in_child(timeout: float, fn, *args) -> dict[str, Any]:
    """``fn(*args)`` in a fresh spawned process, at most ``timeout`` seconds; an error or a
    timeout comes back as ``{"error": ...}``."""
    pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
    try:
        return pool.submit(fn, *args).result(timeout=timeout)
    except cf.TimeoutError:
        return {"error": f"not done within {timeout:g} s"}
    except MemoryError:
        return {"error": "out of memory (over --max-memory-gb)"}
    except Exception as err:  # the child's error, or the child killed (BrokenProcessPool)
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    finally:
        for p in list(getattr(pool, "_processes", {}).values()):  # a timed-out child is killed, not waited for
            p.kill()
        pool.shutdown(wait=True, cancel_futures=True)


def bench_scale(cases: list[str], mask: str, rivals: list[str], heads: tuple[int, int] = (8, 2),
                timeout: float = 600.0, max_memory_gb: float = 16.0, out=sys.stdout, preset: str = "h100",
                batches: int = 1) -> list[dict]:
    """Run the scale benchmark (module docstring); returns the rows printed, one per case.
    ``timeout`` bounds each process (all its ``batches``)."""
    rows = []
    for case in cases:
        row = _in_child(timeout, _measure, case, mask, "dcp", heads, max_memory_gb, preset, batches)
        row.setdefault("case", case)
        sims: dict[str, list] = {"dcp": row.get("sim_ms_each", [row.get("sim_ms")])}
        for rival in rivals:
            r = _in_child(timeout, _measure, case, mask, rival, heads, max_memory_gb, preset, batches)
            row[f"{rival}_ms"] = r.get("sim_ms", r.get("error"))
            row[f"{rival}_plan_cpu_s"] = r.get("plan_cpu_s")
            sims[rival] = r.get("sim_ms_each", [r.get("sim_ms")])
            if batches > 1:
                row[f"{rival}_ms_each"] = sims[rival]
        if "sim_ms" in row:
            row["slower_than"] = [r for r in rivals if any(isinstance(x, float) and x < d
                                                           for x, d in zip(sims[r], sims["dcp"]))]
        print(json.dumps(row), file=out, flush=True)
        rows.append(row)
    return rows


def calibrate(out=sys.stdout, ks: tuple[int, ...] = (1, 2, 3, 5)) -> list[dict]:
    """Best of the ``k`` best candidates by estimate against the best of all, per paper batch
    (module docstring); returns the rows printed."""
    from ..api import _head_sizes, _plans_at
    from ..cost import CostModel
    from ..sim.estimate import estimate_seconds
    from ..sim.floors import floor_seconds
    from ..sim.simulate import simulate
    from ..topology import Topology
    from .common import MASKS, bench_batch, paper_batches

    rows = []
    for preset in ("a100", "h100"):
        cm = CostModel.load(preset)
        for nodes in (4, 1):
            topo = Topology.preset(preset, n_nodes=nodes)
            for bname in ("corpus", "longtail"):
                for heads in ((8, 2), (32, 8)):
                    for mask in ("causal", "lambda"):
                        batch = bench_batch(paper_batches(1.0)[bname], MASKS[mask], heads)
                        plans = [p for n in _head_sizes(batch, topo, "dcp", "auto", {})
                                 for p in _plans_at(batch, topo, "dcp", n, 1024, None, "dcp", {})]
                        est = np.array([max(estimate_seconds(p, cm), floor_seconds(p, cm)) for p in plans])
                        sim = np.array([simulate(p, cm).makespan_s for p in plans])
                        order = np.argsort(est, kind="stable")
                        row = {"preset": preset, "nodes": nodes, "batch": bname, "heads": f"{heads[0]}/{heads[1]}",
                               "mask": mask, "candidates": len(plans),
                               "estimate_over_sim": [round(float(x), 3) for x in np.quantile(est / sim, [0, 0.5, 1])],
                               **{f"top{k}_over_best": round(float(sim[order[:k]].min() / sim.min()), 4) for k in ks}}
                        print(json.dumps(row), file=out, flush=True)
                        rows.append(row)
    worst = {k: max(r[f"top{k}_over_best"] for r in rows) for k in ks}
    print(f"worst over {len(rows)} batches, best of the k best by estimate / best of all: "
          + ", ".join(f"k={k}: {v:.4f}" for k, v in worst.items()), file=out, flush=True)
    return rows


def add_arguments(p) -> None:
    """The ``scale`` command's options."""
    p.add_argument("--cases", default="131k,1m", help=f"comma-separated, of {', '.join(CASES)} or TOKENSxNODES "
                   "(default 131k,1m)")
    p.add_argument("--mask", default="causal", help="causal, lambda, blockwise or shared_question (default causal)")
    p.add_argument("--rivals", default=",".join(RIVALS), help=f"comma-separated, of {', '.join(RIVALS)}; '' for none")
    p.add_argument("--heads", default="8/2", help="query/key-value heads (default 8/2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per plan (default 600)")
    p.add_argument("--max-memory-gb", type=float, default=16.0, help="address space per plan's process (default 16)")
    p.add_argument("--preset", default="h100", help="links and cost model: h100 or a100 (default h100)")
    p.add_argument("--batches", type=int, default=1, help="batches per case, planned one after another in one "
                   "process; the median planning time is reported (default 1)")
    p.add_argument("--calibrate", action="store_true", help="the estimate's shortlist against simulating every "
                   "candidate, on the paper's batches")


def run(a) -> int:
    """Run the ``scale`` command; returns the exit status (2 for a bad argument)."""
    from .common import MASKS

    if a.calibrate:
        calibrate()
        return 0
    cases = [c for c in a.cases.split(",") if c]
    rivals = [r for r in a.rivals.split(",") if r]
    bad = [r for r in rivals if r not in RIVALS]
    for c in cases:
        try:
            parse_case(c)
        except ValueError:
            bad.append(c)
    try:
        heads = tuple(int(x) for x in a.heads.split("/"))
        if len(heads) != 2 or min(heads) < 1 or heads[0] % heads[1]:
            raise ValueError
    except ValueError:
        bad.append(f"--heads {a.heads}")
    if a.mask not in MASKS:
        bad.append(f"--mask {a.mask}")
    if a.preset not in ("h100", "a100"):
        bad.append(f"--preset {a.preset}")
    if a.batches < 1:
        bad.append(f"--batches {a.batches}")
    if bad or not a.timeout > 0 or not a.max_memory_gb > 0:
        print(f"scale: bad arguments {bad or ['--timeout/--max-memory-gb must be positive']}; cases: {list(CASES)}, "
              f"rivals: {list(RIVALS)}", file=sys.stderr)
        return 2
    bench_scale(cases, a.mask, rivals, heads, a.timeout, a.max_memory_gb, preset=a.preset, batches=a.batches)
    return 0
