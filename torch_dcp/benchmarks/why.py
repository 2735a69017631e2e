"""Where dcp's own plans lose time to all-gather CP: each plan's critical path split into balanced
compute, imbalance and exposed communication, beside the bytes each moves.

    python -m torch_dcp.benchmarks why [--clusters h100x4] [--cost kernels] [--masks causal]

On the paper's microbenchmark batches (as ``compare``), per cluster and batch, two plans are
simulated with one cost model (default ``kernels``: each cluster's kernel table without the
executor's fixed costs, so that what remains is placement and transfers):

* ``dcp``: dcp's own plan (``torch_dcp.plan(planner="dcp", head_parallel="auto")`` with the
  static runtimes left out of its candidates: :data:`~torch_dcp.planners.dcp.OWN_RIVALS`), its best of the block sizes;
* ``allgather``: all-gather CP at its best CP size (whole documents split over the CP groups,
  :func:`~torch_dcp.planners.allgather.plan_allgather`), as NCCL runs it: the collectives on
  NCCL's ring, compute not overlapped with them.

Each plan's time is its passes' makespans; a pass ends when its critical rank (the one that
finishes last) does, after its compute and its waits. So the time splits, per pass and summed,
into ``compute`` (the mean busy time over ranks: the work spread evenly), ``imbalance`` (the
critical rank's busy time over that mean) and ``exposed`` (the critical rank's time waiting for
transfers: dcp's fetches and returns not hidden behind compute, the all-to-alls of a
head-parallel plan, the all-gather's collectives); dcp's exposed term is split again by where
those waits fall on the critical rank (:func:`exposed_phases`): ``fill``, before its first
attention launch (inputs no local compute hides), ``drain``, after its last (partial results
on their way home), and ``between``. Beside them: bytes between nodes and the most
bytes one rank receives, forward + backward (:meth:`~torch_dcp.plan.Plan.stats`; the all-gather's
as NCCL's ring moves them; in brackets, the fewest bytes between nodes any routing of dcp's
placement could move, each block into each node once and each node's partial results summed
before they leave it: :func:`~torch_dcp.sim.floors.node_once_bytes`), and the busiest rail and the
busiest NVLink port of each plan: the milliseconds that link is busy over both passes at its bandwidth, and its GB
(:func:`~torch_dcp.sim.floors.link_busy_seconds`: sender's out and receiver's in, every
transfer of the plan; a head-parallel plan's all-to-alls with it). A plan whose busiest link
is busy for about its whole time is bound by that link; the all-gather's ring keeps every rail
and port of its group equally busy.

Each cluster ends with the batches where the all-gather is faster and, over them, the median of
each term's difference (dcp's minus the all-gather's): the term that carries the gap is where
dcp's plans lose.

``--links rail=8`` (and ``nvlink=F``) asks what bounds the plans: every network rail (NVLink
port) of each cluster ``F`` times faster, both plans made and simulated again on it. Where dcp's
time falls by about its exposed term, that link class carries its waits.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import numpy as np

from ..planners.dcp import OWN_RIVALS
from ..sim.floors import link_busy_seconds, node_once_bytes
from ..topology import Topology
from .common import cluster_cases, rounded

__all__ = ["OWN_RIVALS", "split_time", "exposed_phases", "why_batch", "summarize", "bench_why", "parse_links",
           "faster_links"]

_TERMS = ("compute", "imbalance", "exposed")
#: the exposed term split by where on the critical rank the waits fall (:func:`exposed_phases`)
_PHASES = ("fill", "between", "drain")
#: event kinds of a simulated rank (:class:`~torch_dcp.sim.timeline.PassResult` ``events``) that
#: are waits on transfers rather than work: dcp's ``CommWait``, a head-parallel plan's
#: all-to-alls, the all-gather runtime's collectives
_WAIT_KINDS = frozenset({"wait", "all-to-all", "all-gather", "reduce-scatter"})


#: link class -> the :class:`~torch_dcp.Topology` bandwidth ``--links`` scales
_LINKS = {"rail": "inter_bandwidth", "nvlink": "intra_bandwidth"}


def parse_links(text: str) -> dict[str, float]:
    """``"rail=8,nvlink=2"`` as ``{"rail": 8.0, "nvlink": 2.0}`` (classes of :data:`_LINKS`).

    Raises:
        ValueError: an unknown link class, a repeated one, or a factor that is not a positive number.
    """
    out: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in _LINKS or name in out:
            raise ValueError(f"--links: {item!r}: expected CLASS=FACTOR, each class once, CLASS in {sorted(_LINKS)}")
        try:
            factor = float(value)
        except ValueError:
            factor = 0.0
        if not 0.0 < factor < float("inf"):
            raise ValueError(f"--links: {item!r}: the factor must be a positive number")
        out[name] = factor
    return out


def faster_links(topology: Topology, links: dict[str, float]) -> Topology:
    """``topology`` with every link of each class in ``links`` that many times faster
    (:func:`parse_links`; latencies unchanged)."""
    return dataclasses.replace(topology, **{_LINKS[k]: getattr(topology, _LINKS[k]) * f for k, f in links.items()})


def split_time(sim: Any) -> dict[str, float]:
    """A simulated run (:class:`~torch_dcp.sim.timeline.SimResult`) as ``compute``,
    ``imbalance``, ``exposed`` and ``time`` (seconds, both passes; module docstring)."""
    out = dict.fromkeys((*_TERMS, "time"), 0.0)
    for res in (sim.forward, sim.backward):
        c = int(np.argmax(res.finish_s))
        mean = float(res.busy_s.mean())
        out["compute"] += mean
        out["imbalance"] += float(res.busy_s[c]) - mean
        out["exposed"] += float(res.finish_s[c] - res.busy_s[c])
        out["time"] += res.makespan_s
    return out


def exposed_phases(sim: Any) -> dict[str, float]:
    """The exposed term of :func:`split_time` (seconds, both passes) split by where the critical
    rank's time not spent working falls: ``fill`` before its first attention launch (the
    pipeline filling: inputs that no local compute hides), ``drain`` after its last one (partial
    results and gradients on their way home, a head-parallel plan's closing all-to-all, the
    all-gather's reduce-scatter) and ``between`` (the rest). A rank with no attention launch has
    all of it in ``between``."""
    out = dict.fromkeys(_PHASES, 0.0)
    for res in (sim.forward, sim.backward):
        c = int(np.argmax(res.finish_s))
        events = res.events[c]
        exposed = float(res.finish_s[c] - res.busy_s[c])
        attn = [(s, e) for kind, s, e in events if kind == "attention"]
        if not attn:
            out["between"] += exposed
            continue
        first, last = min(s for s, _ in attn), max(e for _, e in attn)
        work = [(float(s), float(e)) for kind, s, e in events if kind not in _WAIT_KINDS]
        fill = first - sum(min(e, first) - s for s, e in work if s < first)
        drain = float(res.finish_s[c]) - last - sum(e - max(s, last) for s, e in work if e > last)
        out["fill"] += fill
        out["drain"] += drain
        out["between"] += exposed - fill - drain
    return out


def _allgather(batch, topology: Topology, cm) -> tuple[int, Any, Any]:
    """All-gather CP at its fastest CP size: ``(c, plan, its simulated run)``."""
    from ..api import divide
    from ..planners import plan_allgather
    from ..planners.static import cp_sizes
    from ..sim.simulate import simulate

    best = None
    for c in cp_sizes("allgather", batch, topology):
        plan = divide(plan_allgather(batch, topology, cp_size=c), topology, 1)
        sim = simulate(plan, cm)
        if best is None or sim.makespan_s < best[2].makespan_s:
            best = (c, plan, sim)
    return best


def why_batch(batch, topology: Topology, cm, block_sizes: list[int]) -> dict[str, Any]:
    """One batch on one cluster: dcp's own plan against all-gather CP at its best CP size,
    each time split (:func:`split_time`, in ms) with its bytes (GB)."""
    import torch_dcp

    from ..sim.simulate import simulate

    best = None
    for bs in block_sizes:
        plan = torch_dcp.plan(batch, topology, planner="dcp", block_size=bs, cost_model=cm, head_parallel="auto",
                              rivals=OWN_RIVALS)
        sim = simulate(plan, cm)
        if best is None or sim.makespan_s < best[1].makespan_s:
            best = (plan, sim)
    c, ag_plan, ag_sim = _allgather(batch, topology, cm)
    row: dict[str, Any] = {"dcp_plan": best[0].planner, "allgather_cp": c}
    for name, (plan, sim) in (("dcp", best), ("allgather", (ag_plan, ag_sim))):
        stats = plan.stats()
        row.update({f"{name}_{k}_ms": v * 1e3 for k, v in split_time(sim).items()})
        row.update({f"{name}_{k}_ms": v * 1e3 for k, v in exposed_phases(sim).items()})
        row[f"{name}_inter_node_gb"] = stats["inter_node_bytes"] / 1e9
        row[f"{name}_max_recv_gb"] = stats["max_rank_recv_bytes"] / 1e9
        busy = link_busy_seconds(plan)
        for kind, bandwidth in (("rail", topology.rail_bandwidth), ("port", topology.intra_bandwidth)):
            sec = max(float(busy[(kind, way)].max(initial=0.0)) for way in ("out", "in"))
            row[f"{name}_{kind}_ms"], row[f"{name}_{kind}_gb"] = sec * 1e3, sec * bandwidth / 1e9
    row["dcp_node_once_gb"] = node_once_bytes(best[0]) / 1e9
    row["dcp_over_allgather"] = row["dcp_time_ms"] / row["allgather_time_ms"]
    return row


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Per cluster: the batches where the all-gather is faster and, over them, the median of
    each term's difference (ms, dcp's minus the all-gather's)."""
    lose = [r for r in rows if r["dcp_over_allgather"] > 1.0]
    out: dict[str, Any] = {"batches": len(rows), "allgather_faster": len(lose)}
    for t in (*_TERMS, "time"):
        out[f"median_gap_{t}_ms"] = float(np.median([r[f"dcp_{t}_ms"] - r[f"allgather_{t}_ms"] for r in lose])) \
            if lose else None
    return out


def bench_why(clusters: list[tuple[str, int]], masks: list[str], scales: list[float], block_sizes: list[int],
              cost: str = "kernels", heads: tuple[int, int] = (8, 2), as_json: bool = False, out=None,
              sources: dict[str, list[int]] | None = None, total: int = 131072,
              links: dict[str, float] | None = None) -> list[dict]:
    """Run the report (module docstring) and print it: JSON lines (``as_json``: one per batch,
    then one summary per cluster) or Markdown tables (``out``, default stdout); returns the batch
    rows. ``links``: link classes made faster (:func:`faster_links`), named in each row."""
    out = out or sys.stdout
    rows = []
    faster = ", ".join(f"{k} x{f:g}" for k, f in (links or {}).items())
    for cluster, topology, cm, cases in cluster_cases(clusters, masks, scales, cost, heads, "why", sources, total):
        if links:
            topology, cluster = faster_links(topology, links), f"{cluster} ({faster})"
        mine = []
        for scale, name, mask, batch in cases:
            row = {"cluster": cluster, "scale": scale, "batch": name, "mask": mask,
                   **why_batch(batch, topology, cm, block_sizes)}
            mine.append(row)
            if as_json:
                print(json.dumps(rounded(row)), file=out, flush=True)
        summary = summarize(mine)
        if as_json:
            print(json.dumps(rounded({"cluster": cluster, "cost_model": cm.source, "summary": summary})), file=out,
                  flush=True)
        else:
            _table(cluster, cm.source, mine, summary, out)
        rows += mine
    return rows


def _table(cluster: str, source: str, rows: list[dict], summary: dict, out) -> None:
    p = lambda s="": print(s, file=out)  # noqa: E731
    p(f"\n### {cluster}, simulated ({source})\n")
    p("| scale | batch | mask | dcp plan | dcp ms: compute + imbalance + exposed | allgather (c) ms: compute + "
      "imbalance + exposed | dcp exposed ms: fill / between / drain | dcp / allgather | GB between nodes dcp "
      "(node-once) / allgather | most GB into a rank dcp / allgather | busiest rail ms (GB) dcp / allgather | "
      "busiest NVLink port ms (GB) dcp / allgather |")
    p("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        split = {n: f"{r[f'{n}_time_ms']:.2f}: " + " + ".join(f"{r[f'{n}_{t}_ms']:.2f}" for t in _TERMS)
                 for n in ("dcp", "allgather")}
        p(f"| {r['scale']:g} | {r['batch']} | {r['mask']} | {r['dcp_plan']} | {split['dcp']} | "
          f"({r['allgather_cp']}) {split['allgather']} | "
          + " / ".join(f"{r[f'dcp_{k}_ms']:.2f}" for k in _PHASES) + f" | {r['dcp_over_allgather']:.3f} | "
          f"{r['dcp_inter_node_gb']:.2f} ({r['dcp_node_once_gb']:.2f}) / {r['allgather_inter_node_gb']:.2f} | "
          f"{r['dcp_max_recv_gb']:.3f} / {r['allgather_max_recv_gb']:.3f} | "
          + " | ".join(" / ".join(f"{r[f'{n}_{k}_ms']:.2f} ({r[f'{n}_{k}_gb']:.2f})" for n in ("dcp", "allgather"))
                       for k in ("rail", "port")) + " |")
    p(f"\nThe all-gather is faster on {summary['allgather_faster']}/{summary['batches']} batches"
      + ("." if not summary["allgather_faster"] else
         "; over them, the median gap (dcp's minus the all-gather's, ms): "
         + ", ".join(f"{t} {summary[f'median_gap_{t}_ms']:+.3f}" for t in (*_TERMS, "time"))))

