"""What node routes save: dcp's placement with node routes against the same placement with
direct routes.

    python -m torch_dcp.benchmarks routes --topology a100 --cost a100 --batch corpus --mask causal

On the paper's microbenchmark batches (4 nodes x 8 ranks, 131,072 tokens, T = 4), dcp's best
placement of each batch and block size (:func:`torch_dcp.planners.dcp_candidates` with
``shortlist=1`` and no rivals) is divided twice (:func:`torch_dcp.api.divide`):

* ``Routing.RAILS`` (dcp's default on several nodes): a block crosses into a node once, at a
  gateway rank, and is passed on over NVLink; partial results are summed inside the node before
  they leave it once;
* ``Routing.DIRECT``: every consumer fetches every block from its home rank and returns every
  partial result straight to it.

The placement, hence its compute and memory balance, is the same; the table gives the bytes
that cross between nodes and the simulated forward + backward time of both, and a closing line
the range of the saving in inter-node bytes.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from ..api import divide
from ..cost import CostModel
from ..planners import Routing, dcp_candidates
from ..sim.simulate import simulate
from ..topology import Topology
from .common import MASKS, bench_batch, paper_batches, paper_sources, progress

__all__ = ["bench_routes"]


def bench_routes(topology: Topology, cost: CostModel | str = "a100", batch: str = "corpus", mask: str = "causal",
                 scales: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0), block_sizes: tuple[int, ...] = (1024, 2048),
                 divisions: int = 4, out=sys.stdout, total: int = 131072,
                 sources: dict[str, list[int]] | None = None) -> list[dict]:
    """Node routes against direct routes on dcp's placement of one paper batch at every scale
    and block size; prints JSON lines and a Markdown table; returns the rows (bytes in bytes,
    times in ms).

    Raises:
        ValueError: an unknown ``mask`` or ``batch`` (the message lists the known ones), or a
            topology of one node (both routings are then the same).
    """
    if mask not in MASKS:
        raise ValueError(f"unknown mask {mask!r}; choose from {sorted(MASKS)}")
    if topology.n_nodes < 2:
        raise ValueError(f"node routes differ from direct ones only on several nodes; the topology has "
                         f"{topology.n_nodes}")
    cm = cost if isinstance(cost, CostModel) else CostModel.load(cost)
    sources = sources or paper_sources(total=total)
    if batch not in sources:
        raise ValueError(f"unknown batch {batch!r}; choose from {sorted(sources)}")
    rows = []
    bar = progress(len(scales) * len(block_sizes), "routes")
    for scale in scales:
        spec = bench_batch(paper_batches(scale, total, sources=sources)[batch], MASKS[mask])
        for bs in block_sizes:
            node = dcp_candidates(spec, topology, bs, node_routes=True, shortlist=1, rivals=())[0]
            row = {"scale": scale, "batch": batch, "mask": mask, "block_size": bs}
            for label, placement in (("node", node), ("direct", dataclasses.replace(node, routing=Routing.DIRECT))):
                plan = divide(placement, topology, divisions)
                st = plan.stats()
                row[f"{label}_inter_node_bytes"] = st["inter_node_bytes"]
                row[f"{label}_compute_imbalance"] = st["compute_imbalance"]
                row[f"{label}_ms"] = simulate(plan, cm).makespan_s * 1e3
            row["saving"] = 1 - row["node_inter_node_bytes"] / max(row["direct_inter_node_bytes"], 1)
            rows.append(row)
            print(json.dumps(row, default=lambda v: round(v, 4)), file=out, flush=True)
            bar.update()
    bar.close()
    _table(rows, out)
    return rows


def _table(rows: list[dict], out) -> None:
    print("\n| scale | B | compute imbalance | inter-node GB: direct / node | saving | simulated ms: direct / node |",
          file=out)
    print("|---|---|---|---|---|---|", file=out)
    for r in rows:
        print(f"| {r['scale']} | {r['block_size']} | {r['node_compute_imbalance']:.3f} | "
              f"{r['direct_inter_node_bytes'] / 1e9:.3f} / {r['node_inter_node_bytes'] / 1e9:.3f} | "
              f"{r['saving']:.0%} | {r['direct_ms']:.2f} / {r['node_ms']:.2f} |", file=out)
    if rows:
        s = [r["saving"] for r in rows]
        print(f"node routes move {min(s):.0%}-{max(s):.0%} fewer bytes between nodes than direct routes, "
              f"same placement", file=out)
