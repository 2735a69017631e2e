"""dcp against the context parallelism a user would run: every baseline as its authors'
implementation runs it, each static family at its best CP size, per batch.

    python -m torch_dcp.benchmarks compare [--clusters a100x4,h100x4,h100x1,a100x1] [--cost executor]
                                           [--json | --jsonl FILE] [--masks ...] [--scales ...]
                                           [--block-sizes auto | 1024,2048,...]

On the DCP paper's microbenchmark batches (§7.1: 131,072-token global batches of the embedded
corpus's lengths, the Python standard library's source files as byte tokens, and of a long-tail
generator, at length scales 0.5-4; causal, λ, blockwise and shared-question masks; GQA 8/2,
head_dim 128, bf16), for every cluster (a topology preset and its number of nodes of 8 ranks),
every figure simulated (:func:`torch_dcp.sim.simulate.simulate`) with one cost model (``--cost``:
``executor`` (default) for each cluster's ``<preset>-executor`` model, what ``"auto"`` plans with
on that card; ``kernels`` for its ``<preset>`` model, the kernels alone, without the executor's
fixed costs; or any name or file :meth:`torch_dcp.CostModel.load` takes):

* ``dcp``: ``torch_dcp.plan(planner="dcp", head_parallel="auto")``, its best over
  ``--block-sizes`` (its own knob, tuned as the baselines' CP sizes are; by default those of
  ``block_size="auto"``, :func:`~torch_dcp.api.auto_block_sizes`: 1024, 2048 and 512, and 256 for
  a sparse mask, whose tiles then waste less of each block's edges), on the runtime its plan
  names (torch_dcp's executor, or its own all-gather runtime for the static configurations
  among dcp's candidates); with ``--own``, dcp's own
  plans only (those static runtimes left out of its candidates: what dcp's placements reach);
* ``ring`` (TransformerEngine's P2P ring), ``allgather`` (an NCCL all-gather of K/V, TE's
  reduce-scatter of dK/dV), ``ulysses`` and ``hcp``, each at its best CP size with data
  parallelism across the CP groups (:mod:`torch_dcp.benchmarks.static_cp`), as their own
  implementations run them (:mod:`torch_dcp.sim.runtimes`);
* ``megatron``: Megatron-Core's dynamic CP (its own CP size per document) on the whole group;
* the best of those baselines, and ``dcp / best`` (below 1: dcp is faster).

A batch where dcp takes more than :data:`TARGET` times the best baseline is an exception, listed
with its cause, the first that holds: ``memory`` where the baseline's CP groups hold more tokens
than dcp's memory bound lets any rank hold (dcp is then planned again with that memory,
``eps_memory`` raised to the baseline's token imbalance: ``dcp_same_memory_ms``, and the summary's
``within_target_same_memory`` counts the batches within the target either way); ``runtime costs``
where the baseline is all-gather CP and dcp ran that configuration (or a faster one) on
torch_dcp's own all-gather runtime (``Runtime.DCP_ALLGATHER``, among dcp's candidates): each
implementation pays its own device operations per pass (torch_dcp's counted on its runtime;
TransformerEngine's counted from its source, where the cost model has them; else its kernels
alone), and likewise where the baseline is ring attention or HCP and dcp ran that layout on its
own ring runtime (``Runtime.DCP_RING``: its counted operations per step, TransformerEngine's ring
those counted from its source, where the cost model has them; else its kernels and its merges'
bytes); ``executor`` where the baseline's own layout at its CP size, run by torch_dcp's executor,
is no faster than dcp (within 1 %; the gap is how the baseline's implementation runs it: one
attention call per step without the executor's costs per division, for which dcp has no runtime of
its own); ``executor costs`` where dcp's plan, timed with the kernels alone (the model without its
executor costs), is within the target; else ``placement``. Each cluster ends with the range
(min-median-max) of ``dcp / best`` and of the speedup over each family at its best CP size, and
over ring attention across the whole world (CP size ``W``, the configuration the paper benchmark's
``ring`` column runs).

Beside the times, every configuration's peak attention memory per rank (MiB: the tokens a rank
holds plus the keys and values of other ranks it holds at once, as its runtime runs it;
:func:`~torch_dcp.plan.memory.attention_memory`): ``dcp_peak_mib``, ``<family>_peak_mib`` at the
family's best CP size (``<family>_peak_by_cp_mib`` at each), ``best_baseline_peak_mib``. Each
cluster's summary gives the best baseline's peak over dcp's (min-median-max), the tuned
configuration's, and names the batches where the best baseline holds more than ``1 +
eps_memory`` times dcp's peak (dcp's own memory tolerance): its speed bought with memory dcp does
not spend. ``--same-memory`` gives dcp that memory against each mask's tuned configuration: dcp
planned again on every batch whose CP groups, in that configuration, hold more than ``1 +
eps_memory`` times the mean tokens, with the groups' imbalance as its bound.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from ..planners.dcp import EPS_MEMORY
from ..topology import Topology
from .common import cluster_cases, rounded
from .static_cp import STATIC_FAMILIES, split_documents, static_cp_runs, static_cp_seconds

__all__ = ["tuned_static", "tuned_same_memory", "dcp_with_memory", "group_imbalance", "TARGET", "parse_clusters",
           "compare_batch", "bench_compare", "summarize"]

#: dcp's time over the best baseline's above which a batch is listed as an exception
TARGET = 1.03
#: bytes per MiB (the memory columns)
MIB = float(1 << 20)


def parse_clusters(spec: str) -> list[tuple[str, int]]:
    """``"a100x4,h100x1"`` as ``[("a100", 4), ("h100", 1)]`` (a topology preset and its nodes).

    Raises:
        ValueError: a malformed entry or an unknown preset.
    """
    from ..topology import TOPOLOGY_PRESETS

    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, _, nodes = item.partition("x")
        if name not in TOPOLOGY_PRESETS or not nodes.isdigit() or int(nodes) < 1:
            raise ValueError(f"a cluster is PRESETxNODES with a preset of {sorted(TOPOLOGY_PRESETS)}, got {item!r}")
        out.append((name, int(nodes)))
    if not out:
        raise ValueError("no cluster given")
    return out


def compare_batch(batch, topology: Topology, cm, block_sizes: list[int] | None,
                  own: bool = False) -> dict[str, Any]:
    """One batch on one cluster (module docstring): a row of milliseconds, CP sizes, the best
    baseline, ``dcp_over_best`` and, past :data:`TARGET`, the ``exception`` and its cause.
    ``block_sizes``: dcp's (None: :func:`~torch_dcp.api.auto_block_sizes` of the batch);
    ``own``: dcp's own plans only (the static CP runtimes left out of its candidates,
    :data:`~torch_dcp.planners.dcp.OWN_RIVALS`)."""
    from ..planners.dcp import OWN_RIVALS

    import torch_dcp
    from torch_dcp.api import auto_block_sizes

    from ..plan.memory import attention_memory
    from ..sim.simulate import simulate

    row: dict[str, Any] = {}
    best_dcp = None
    for bs in auto_block_sizes(batch) if block_sizes is None else block_sizes:
        t0 = time.perf_counter()
        plan = torch_dcp.plan(batch, topology, planner="dcp", block_size=bs, cost_model=cm, head_parallel="auto",
                              **({"rivals": OWN_RIVALS} if own else {}))
        plan_s = time.perf_counter() - t0
        ms = simulate(plan, cm).makespan_s * 1e3
        if best_dcp is None or ms < best_dcp[0]:
            best_dcp = (ms, bs, plan, plan_s)
    ms, bs, plan, plan_s = best_dcp
    row.update(dcp_ms=ms, dcp_block_size=bs, dcp_plan=plan.planner, dcp_plan_seconds=plan_s,
               dcp_kernels_ms=simulate(plan, cm.with_executor(None)).makespan_s * 1e3,
               dcp_peak_mib=float(attention_memory(plan).max()) / MIB)
    baselines: dict[str, float] = {}
    for family in STATIC_FAMILIES:
        runs = static_cp_runs(family, batch, topology, cm)
        if not runs:
            row[f"{family}_ms"] = None
            continue
        c = min(runs, key=lambda k: (runs[k].seconds, k))
        row[f"{family}_ms"], row[f"{family}_cp"] = runs[c].seconds * 1e3, c
        row[f"{family}_peak_mib"] = runs[c].peak_bytes / MIB
        row[f"{family}_by_cp_ms"] = {str(k): v.seconds * 1e3 for k, v in runs.items()}
        row[f"{family}_peak_by_cp_mib"] = {str(k): v.peak_bytes / MIB for k, v in runs.items()}
        baselines[family] = runs[c].seconds * 1e3
    mega = torch_dcp.plan(batch, topology, planner="megatron", cost_model=cm)
    row["megatron_ms"] = baselines["megatron"] = simulate(mega, cm).makespan_s * 1e3
    row["megatron_peak_mib"] = float(attention_memory(mega).max()) / MIB
    best = min(baselines, key=baselines.__getitem__)
    row["best_baseline"] = best + (f"@{row[f'{best}_cp']}" if f"{best}_cp" in row else "")
    row["best_baseline_ms"] = baselines[best]
    row["best_baseline_peak_mib"] = row[f"{best}_peak_mib"]
    row["dcp_over_best"] = ms / baselines[best]
    if row["dcp_over_best"] > TARGET:
        row["exception"] = _cause(row, best, batch, topology, cm, own)
    return row


def dcp_with_memory(batch, topology: Topology, cm, block_size: int, imbalance: float, own: bool = False) -> float:
    """dcp's simulated time (ms) when every rank may hold ``imbalance`` times the mean tokens
    (``eps_memory = imbalance - 1``): what it does with the memory a static configuration whose
    CP groups hold whole documents spends."""
    from ..planners.dcp import OWN_RIVALS
    from ..sim.simulate import simulate

    import torch_dcp

    plan = torch_dcp.plan(batch, topology, planner="dcp", block_size=block_size, cost_model=cm, head_parallel="auto",
                          eps_memory=imbalance - 1.0, **({"rivals": OWN_RIVALS} if own else {}))
    return simulate(plan, cm).makespan_s * 1e3


def group_imbalance(batch, topology: Topology, cp: int) -> float:
    """The most tokens a CP group of ``cp`` ranks holds over the mean, documents split whole
    between the ``W / cp`` groups as the static families split them."""
    groups = topology.world_size // cp
    load = np.bincount(split_documents(batch.doc_lens, groups), weights=batch.doc_lens, minlength=groups)
    return float(load.max() / load.mean())


def _same_memory(row: dict, batch, topology: Topology, cm, own: bool, imbalance: float) -> str:
    """dcp given the memory the best baseline spends (:func:`dcp_with_memory`): its time in
    ``row["dcp_same_memory_ms"]`` and over the best baseline in ``row["dcp_same_memory_over_best"]``;
    the words for the exception's cause."""
    ms = dcp_with_memory(batch, topology, cm, row["dcp_block_size"], imbalance, own)
    row["dcp_same_memory_ms"], row["dcp_same_memory_over_best"] = ms, ms / row["best_baseline_ms"]
    return (f"; given that memory (eps_memory {imbalance - 1.0:.2f}), dcp takes {ms:.2f} ms "
            f"({ms / row['best_baseline_ms']:.3f}x)")


def _cause(row: dict, best: str, batch, topology: Topology, cm, own: bool = False) -> str:
    """Why dcp is slower than the best baseline ``best`` on this batch (module docstring)."""
    from ..planners.base import Runtime

    ms, kern = row["dcp_ms"], row["dcp_kernels_ms"]
    if best in STATIC_FAMILIES:
        c = row[f"{best}_cp"]
        imbalance = group_imbalance(batch, topology, c)
        if imbalance > 1.0 + EPS_MEMORY:
            return (f"memory: the baseline's CP groups hold up to {imbalance:.2f}x the mean tokens (whole documents), "
                    f"beyond the {1.0 + EPS_MEMORY:.2f}x dcp holds every candidate to"
                    + _same_memory(row, batch, topology, cm, own, imbalance))
        if best == "allgather":
            ours = _own_allgather_ms(batch, topology, cm, c)
            row["allgather_on_dcp_runtime_ms"] = ours
            if ms <= ours * 1.01:
                return (f"runtime costs: torch_dcp's all-gather runtime at CP size {c} takes {ours:.2f} ms (dcp "
                        f"{ms:.2f} ms), the baseline's implementation {row['best_baseline_ms']:.2f} ms: each pays its "
                        "own device operations per pass and collectives")
        if best in ("ring", "hcp") and _ring_runtime_offered(best, topology, c):
            ours = static_cp_seconds(best, batch, topology, cm, [c], runtime=Runtime.DCP_RING)[c] * 1e3
            row[f"{best}_on_dcp_runtime_ms"] = ours
            if ms <= ours * 1.01:
                return (f"runtime costs: the same layout on torch_dcp's ring runtime takes {ours:.2f} ms (dcp {ms:.2f} "
                        f"ms), the baseline's implementation {row['best_baseline_ms']:.2f} ms: each pays its own "
                        "device operations per step")
        same = static_cp_seconds(best, batch, topology, cm, [c], runtime=Runtime.EXECUTOR)[c] * 1e3
        row[f"{best}_on_executor_ms"] = same
        if ms <= same * 1.01:  # dcp within 1 % of the same layout on the executor
            how = ("an NCCL all-gather (NCCL's ring: every K/V shard around the group, the rings into a node over "
                   "all its rails, pipelined with NVLink), where the executor fetches blocks point to point"
                   if best == "allgather" else
                   "its own implementation (one attention call per step over the visible pairs, no executor costs "
                   "per division, dK/dV in the K/V dtype)")
            return (f"executor: the same layout on torch_dcp's executor takes {same:.2f} ms (dcp {ms:.2f} ms); the "
                    f"baseline runs it as {how}")
    if kern <= TARGET * row["best_baseline_ms"]:
        return (f"executor costs: dcp's plan takes {kern:.2f} ms with the kernels alone, {ms:.2f} ms with the "
                f"executor's costs")
    return "placement: dcp's candidates are slower than this baseline's layout on torch_dcp's executor"


def _ring_runtime_offered(family: str, topology: Topology, c: int) -> bool:
    """Whether dcp's candidates include ``family`` (ring or HCP) at CP size ``c`` on torch_dcp's
    ring runtime: the whole group (``c = W``), its ring (across the head groups for HCP) one dcp
    offers (:func:`~torch_dcp.planners.dcp.offers_ring_runtime`)."""
    from ..planners.dcp import offers_ring_runtime

    n = topology.ranks_per_node if family == "hcp" else 1  # HCP: one head group per node
    return c == topology.world_size and offers_ring_runtime(topology.world_size // n)


def _own_allgather_ms(batch, topology: Topology, cm, c: int) -> float:
    """All-gather CP at CP size ``c`` on torch_dcp's own runtime (dcp's candidate), simulated (ms)."""
    import dataclasses

    from ..api import divide
    from ..planners import Runtime, plan_allgather
    from ..sim.simulate import simulate

    placement = dataclasses.replace(plan_allgather(batch, topology, cp_size=c), runtime=Runtime.DCP_ALLGATHER)
    return simulate(divide(placement, topology, 1), cm).makespan_s * 1e3


def bench_compare(clusters: list[tuple[str, int]], masks: list[str], scales: list[float], block_sizes: list[int] | None,
                  cost: str = "executor", heads: tuple[int, int] = (8, 2), as_json: bool = False, out=sys.stdout,
                  sources: dict[str, list[int]] | None = None, total: int = 131072, jsonl=None,
                  own: bool = False, same_memory: bool = False) -> list[dict]:
    """Run the comparison (module docstring) and print it: JSON lines (``as_json``: one per batch,
    then one summary per cluster) or Markdown tables; ``own``: dcp's own plans only (the static
    runtimes left out of its candidates); ``same_memory``: dcp also against each mask's tuned
    configuration given that configuration's memory (:func:`tuned_same_memory`); ``jsonl``: a
    file that gets the JSON lines too; returns the batch rows."""
    rows = []
    for cluster, topology, cm, cases in cluster_cases(clusters, masks, scales, cost, heads, "compare", sources, total,
                                                      ", dcp's own plans" if own else ""):
        mine, batches = [], []
        for scale, name, mask, batch in cases:
            row = {"cluster": cluster, "cost_model": cm.source, "scale": scale, "batch": name, "mask": mask,
                   **compare_batch(batch, topology, cm, block_sizes, own)}
            mine.append(row)
            batches.append(batch)
            for f in ([out] if as_json else []) + ([jsonl] if jsonl is not None else []):
                print(json.dumps(rounded(row)), file=f, flush=True)
        summary = summarize(mine)
        if same_memory:
            for mask, tuned in summary["tuned_by_mask"].items():
                picked = [(r, b) for r, b in zip(mine, batches) if r["mask"] == mask]
                tuned.update(tuned_same_memory(picked, tuned, topology, cm, own) if tuned else {})
        for f in ([out] if as_json else []) + ([jsonl] if jsonl is not None else []):
            print(json.dumps(rounded({"cluster": cluster, "cost_model": cm.source, "summary": summary})), file=f,
                  flush=True)
        if not as_json:
            _table(cluster, cm.source, mine, summary, out)
        rows += mine
    return rows


def _span(values: list[float]) -> list[float] | None:
    return [float(np.min(values)), float(np.median(values)), float(np.max(values))] if values else None


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Per cluster: min-median-max of ``dcp / best`` and of the speedup over the best baseline and
    over each family (at its best CP size; ``ring_world``: ring attention over all ranks), the
    batches within :data:`TARGET`, and the exceptions."""
    out: dict[str, Any] = {"batches": len(rows), "dcp_over_best": _span([r["dcp_over_best"] for r in rows]),
                           "within_target": sum(r["dcp_over_best"] <= TARGET for r in rows),
                           "within_target_same_memory": sum(min(r["dcp_over_best"], r.get("dcp_same_memory_over_best",
                                                                                             np.inf)) <= TARGET
                                                            for r in rows),
                           "speedup_vs_best": _span([r["best_baseline_ms"] / r["dcp_ms"] for r in rows])}
    for family in (*STATIC_FAMILIES, "megatron"):
        vals = [r[f"{family}_ms"] / r["dcp_ms"] for r in rows if r.get(f"{family}_ms")]
        out[f"speedup_vs_{family}"] = _span(vals)
    world = [r["ring_by_cp_ms"][max(r["ring_by_cp_ms"], key=int)] / r["dcp_ms"] for r in rows if r.get("ring_by_cp_ms")]
    out["speedup_vs_ring_world"] = _span(world)
    out["exceptions"] = [{k: r[k] for k in ("scale", "batch", "mask", "dcp_over_best", "best_baseline", "exception")}
                         for r in rows if "exception" in r]
    peaks = [r for r in rows if "best_baseline_peak_mib" in r]  # rows of runs that measured memory
    out["best_peak_over_dcp"] = _span([r["best_baseline_peak_mib"] / r["dcp_peak_mib"] for r in peaks])
    out["more_memory"] = [{"scale": r["scale"], "batch": r["batch"], "mask": r["mask"],
                           "best_baseline": r["best_baseline"],
                           "peak_over_dcp": r["best_baseline_peak_mib"] / r["dcp_peak_mib"]}
                          for r in peaks if r["best_baseline_peak_mib"] > r["dcp_peak_mib"] * (1.0 + EPS_MEMORY)]
    out["total_speedup_vs_best"] = sum(r["best_baseline_ms"] for r in rows) / sum(r["dcp_ms"] for r in rows)
    out["tuned"] = tuned_static(rows)
    out["tuned_by_mask"] = {m: tuned_static([r for r in rows if r["mask"] == m])
                            for m in dict.fromkeys(r["mask"] for r in rows)}
    return out


def tuned_static(rows: list[dict]) -> dict[str, Any] | None:
    """The one static configuration a user would tune for these batches: the family and CP size
    with the least total time over all of them (every batch run at that CP size, data parallel
    across the groups), and dcp against it: ``total_speedup`` (its total time / dcp's) and the
    per-batch speedups (min-median-max). None when no configuration ran every batch."""
    best = None
    for family in STATIC_FAMILIES:
        sizes = set.intersection(*(set(r.get(f"{family}_by_cp_ms") or {}) for r in rows)) if rows else set()
        for cp in sizes:
            total = sum(r[f"{family}_by_cp_ms"][cp] for r in rows)
            if best is None or total < best[2]:
                best = (family, cp, total)
    if best is None:
        return None
    family, cp, total = best
    return {"family": family, "cp": int(cp), "total_ms": total,
            "total_speedup": total / sum(r["dcp_ms"] for r in rows),
            "speedup": _span([r[f"{family}_by_cp_ms"][cp] / r["dcp_ms"] for r in rows]),
            "peak_over_dcp": _span([r[f"{family}_peak_by_cp_mib"][cp] / r["dcp_peak_mib"] for r in rows
                                    if f"{family}_peak_by_cp_mib" in r])}


def tuned_same_memory(rows: list[tuple[dict, Any]], tuned: dict, topology: Topology, cm,
                      own: bool = False) -> dict[str, Any]:
    """dcp against the tuned configuration ``tuned`` (:func:`tuned_static` of these rows) given that
    configuration's memory: per ``(row, batch)``, where its CP groups hold more than ``1 +``
    :data:`~torch_dcp.planners.dcp.EPS_MEMORY` times the mean tokens (whole documents per group),
    dcp planned again with that imbalance as its memory bound (:func:`dcp_with_memory`, at the row's
    block size), else its time as it is. Returns ``same_memory_total_speedup`` and
    ``same_memory_speedup`` (min-median-max per batch) and ``same_memory_replanned`` (how many
    batches were planned again)."""
    family, cp = tuned["family"], str(tuned["cp"])
    ms, replanned = [], 0
    for row, batch in rows:
        imbalance = group_imbalance(batch, topology, int(cp))
        if imbalance > 1.0 + EPS_MEMORY:
            replanned += 1
            done = row.get("dcp_same_memory_ms") if row["best_baseline"] == f"{family}@{cp}" else None
            ms.append(done if done is not None else  # the exception's plan at this memory: not made twice
                      dcp_with_memory(batch, topology, cm, row["dcp_block_size"], imbalance, own))
        else:
            ms.append(row["dcp_ms"])
    theirs = [row[f"{family}_by_cp_ms"][cp] for row, _ in rows]
    return {"same_memory_total_speedup": sum(theirs) / sum(ms),
            "same_memory_speedup": _span([t / m for t, m in zip(theirs, ms)]), "same_memory_replanned": replanned}


def _fmt(span: list[float] | None) -> str:
    return "-" if span is None else f"{span[0]:.2f}-{span[1]:.2f}-{span[2]:.2f}"


def _table(cluster: str, source: str, rows: list[dict], summary: dict, out) -> None:
    p = lambda s="": print(s, file=out)  # noqa: E731
    p(f"\n### {cluster}, simulated ({source})\n")
    p("| scale | batch | mask | dcp ms | ring ms (c) | allgather ms (c) | ulysses ms (c) | hcp ms (c) | megatron ms "
      "| best baseline | dcp / best | peak MiB dcp / best |")
    p("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[f'{f}_ms']:.2f} ({r[f'{f}_cp']})" if r.get(f"{f}_ms") else "-" for f in STATIC_FAMILIES]
        p(f"| {r['scale']:g} | {r['batch']} | {r['mask']} | {r['dcp_ms']:.2f} | " + " | ".join(cells)
          + f" | {r['megatron_ms']:.2f} | {r['best_baseline']} | {r['dcp_over_best']:.3f} | "
          f"{r['dcp_peak_mib']:.0f} / {r['best_baseline_peak_mib']:.0f} |")
    p(f"\ndcp / best baseline (min-median-max): {_fmt(summary['dcp_over_best'])}; within {TARGET} on "
      f"{summary['within_target']}/{summary['batches']} batches ({summary['within_target_same_memory']} given the "
      "memory of a baseline that holds more); speedup (baseline / dcp) over the best "
      f"{_fmt(summary['speedup_vs_best'])}, " + ", ".join(
          f"{f} {_fmt(summary[f'speedup_vs_{f}'])}" for f in (*STATIC_FAMILIES, "megatron", "ring_world")))
    p(f"\nTotal time over the batches: the best baseline per batch / dcp {summary['total_speedup_vs_best']:.2f}. "
      "Against the one static configuration tuned for the run (least total time; per mask, then all masks):")
    for name, t in (*summary["tuned_by_mask"].items(), ("all masks", summary["tuned"])):
        if t:
            p(f"- {name}: {t['family']}@{t['cp']}, its total / dcp's {t['total_speedup']:.2f}, per batch "
              f"{_fmt(t['speedup'])}; its peak attention memory per rank / dcp's {_fmt(t['peak_over_dcp'])}"
              + (f"; given its memory (dcp planned again on {t['same_memory_replanned']} batches), its total / "
                 f"dcp's {t['same_memory_total_speedup']:.2f}, per batch {_fmt(t['same_memory_speedup'])}"
                 if "same_memory_speedup" in t else ""))
    p(f"\nPeak attention memory per rank, the best baseline / dcp: {_fmt(summary['best_peak_over_dcp'])}; "
      f"{len(summary['more_memory'])} batches where the best baseline holds more than {1.0 + EPS_MEMORY:.2f}x dcp's"
      + "".join(f"\n- more memory: scale {m['scale']:g} {m['batch']} {m['mask']}: {m['best_baseline']} holds "
                f"{m['peak_over_dcp']:.2f}x dcp's peak" for m in summary["more_memory"]))
    for e in summary["exceptions"]:
        p(f"- exception: scale {e['scale']:g} {e['batch']} {e['mask']}: dcp / {e['best_baseline']} = "
          f"{e['dcp_over_best']:.3f} ({e['exception']})")
