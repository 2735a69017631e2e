"""Pictures of a plan (PNG, matplotlib): placement map, traffic matrix, per-rank timeline.

Needs matplotlib (``pip install 'torch-dcp[benchmarks]'``); uses the non-interactive Agg backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..plan import Plan
from ..sim.simulate import SimResult

__all__ = ["placement_map", "traffic_matrix", "timeline"]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - optional dependency
        raise ImportError("torch_dcp.benchmarks.viz needs matplotlib: pip install 'torch-dcp[benchmarks]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rank_colors(world: int) -> Any:
    plt = _pyplot()
    cmap = plt.get_cmap("tab20" if world <= 20 else "nipy_spectral")
    return [cmap(i / max(1, world - 1)) if world > 20 else cmap(i) for i in range(world)]


def placement_map(plan: Plan, path: str | Path, max_tiles: int = 60000) -> Path:
    """Two panels: every document's token blocks coloured by home rank (rows = documents,
    x = tokens), and the attention tiles on the (query block, key block) grid coloured by the
    rank computing them. Returns the PNG path."""
    plt = _pyplot()
    wl, pl = plan.workload, plan.placement
    colors = _rank_colors(plan.world_size)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6))
    docs = wl.block_doc
    order = np.argsort(-plan.batch.doc_lens, kind="stable")
    row_of_doc = np.empty(plan.batch.n_docs, np.int64)
    row_of_doc[order] = np.arange(plan.batch.n_docs)
    for b in range(wl.n_blocks):
        ax1.barh(row_of_doc[docs[b]], wl.block_len[b], left=wl.block_start[b], height=0.8,
                 color=colors[pl.block_rank[b]], edgecolor="none")
    ax1.set_xlabel("token position in document")
    ax1.set_ylabel("document (longest first)")
    ax1.set_title(f"token blocks by home rank ({plan.planner}, {plan.world_size} ranks)")
    ax1.invert_yaxis()
    n = min(wl.n_tiles, max_tiles)
    sel = np.linspace(0, wl.n_tiles - 1, n).astype(np.int64) if wl.n_tiles > max_tiles else np.arange(wl.n_tiles)
    ax2.scatter(wl.block_offset[wl.tile_kv[sel]], wl.block_offset[wl.tile_q[sel]], s=2, marker="s",
                c=[colors[r] for r in pl.tile_rank[sel]])
    ax2.set_xlabel("key token (global)")
    ax2.set_ylabel("query token (global)")
    ax2.set_title(f"{wl.n_tiles} tiles by computing rank")
    ax2.invert_yaxis()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def traffic_matrix(plan: Plan, path: str | Path) -> Path:
    """Bytes from rank to rank (forward + backward), with node boundaries. Returns the path."""
    plt = _pyplot()
    m = plan.traffic_matrix() / 1e6
    fig, ax = plt.subplots(figsize=(7, 6))
    im = ax.imshow(m, cmap="viridis")
    fig.colorbar(im, ax=ax, label="MB (forward + backward)")
    rpn = plan.topology.ranks_per_node
    for k in range(1, plan.topology.n_nodes):
        ax.axhline(k * rpn - 0.5, color="w", lw=0.8)
        ax.axvline(k * rpn - 0.5, color="w", lw=0.8)
    s = plan.stats()
    ax.set_xlabel("receiving rank")
    ax.set_ylabel("sending rank")
    ax.set_title(f"{plan.planner}: {s['comm_bytes'] / 1e9:.2f} GB moved, {s['inter_node_bytes'] / 1e9:.2f} GB between nodes")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline(result: SimResult, path: str | Path, title: str = "") -> Path:
    """Per-rank timeline of a simulation: attention, reductions/copies and exposed
    communication waits, forward then backward. Returns the path."""
    plt = _pyplot()
    colors = {"attention": "tab:blue", "reduction": "tab:green", "copy": "tab:gray", "wait": "tab:red"}
    w = len(result.forward.finish_s)
    fig, ax = plt.subplots(figsize=(12, max(3, 0.25 * w + 1)))
    offset = 0.0
    for p in (result.forward, result.backward):
        for r, evs in enumerate(p.events):
            for kind in colors:
                bars = [((s + offset) * 1e3, (e - s) * 1e3) for k, s, e in evs if k == kind and e > s]
                if bars:
                    ax.broken_barh(bars, (r - 0.4, 0.8), color=colors[kind])
        offset += p.makespan_s
        ax.axvline(offset * 1e3, color="k", lw=0.8)
    for kind, c in colors.items():
        ax.plot([], [], color=c, lw=6, label=kind)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("ms (forward | backward)")
    ax.set_ylabel("rank")
    ax.invert_yaxis()
    ax.set_title(title or f"makespan {result.makespan_s * 1e3:.2f} ms, ideal {result.ideal_s * 1e3:.2f} ms")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
