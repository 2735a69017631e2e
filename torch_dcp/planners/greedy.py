"""A fast dynamic planner: short documents stay whole on one rank, long ones are split.

Documents are taken in descending attention FLOPs (longest-processing-time order). A
document that fits on a rank -- within the token capacity ``(1 + eps_memory) * T / W`` and
the compute capacity ``(1 + eps_compute) * F / W`` -- goes whole to the least-loaded such
rank: pure data parallelism for it, no communication. A document that fits nowhere is cut
into blocks of ``block_size`` and spread over the fewest least-loaded ranks that can hold its
tokens and FLOPs; its blocks go, heaviest query row first, to the least-loaded of those
ranks with token room, and its tiles, largest first, to the least-loaded rank that holds most
of their data (the query side: Q, and O partials avoided; else the key/value side; else the
least-loaded rank overall) while the compute capacity holds.
"""

from __future__ import annotations

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from ..workload import Workload
from .base import Placement

__all__ = ["plan_greedy"]


def plan_greedy(
    batch: BatchSpec,
    topology: Topology,
    block_size: int = 1024,
    eps_compute: float = 0.1,
    eps_memory: float = 0.1,
) -> Placement:
    """Greedy locality-first placement (see module docstring).

    Raises:
        ValueError: bad ``block_size`` or negative tolerances.
    """
    if eps_compute < 0 or eps_memory < 0:
        raise ValueError(f"eps_compute and eps_memory must be >= 0, got {eps_compute}, {eps_memory}")
    w = topology.world_size
    wl = Workload.uniform(batch, block_size)
    flops = wl.tile_flops_fwd
    doc_flops = np.bincount(wl.block_doc[wl.tile_q], weights=flops, minlength=batch.n_docs)
    mean_tokens = batch.total_tokens / w
    mean_flops = flops.sum() / w
    cap_tokens = (1.0 + eps_memory) * mean_tokens
    cap_flops = (1.0 + eps_compute) * mean_flops
    load = np.zeros(w)
    tokens = np.zeros(w)
    block_rank = np.full(wl.n_blocks, -1, np.int64)
    tile_rank = np.full(wl.n_tiles, -1, np.int64)

    doc_nb = np.bincount(wl.block_doc, minlength=batch.n_docs)
    doc_first = np.concatenate(([0], np.cumsum(doc_nb)[:-1]))
    tile_doc = wl.block_doc[wl.tile_q]
    tile_order = np.argsort(tile_doc, kind="stable")
    doc_tile_first = np.concatenate(([0], np.cumsum(np.bincount(tile_doc, minlength=batch.n_docs))))
    row_flops = np.bincount(wl.tile_q, weights=flops, minlength=wl.n_blocks)
    # bytes a tile avoids moving when it runs with its query block (Q + O partial + LSE)
    # vs with its key/value block (K + V)
    q_side = batch.n_heads * batch.head_dim * (batch.elem_size + batch.acc_size) + batch.n_heads * batch.acc_size
    kv_side = 2 * batch.n_kv_heads * batch.head_dim * batch.elem_size
    q_first = q_side >= kv_side

    order = np.lexsort((-batch.doc_lens, -doc_flops))
    for d in order:
        length = batch.doc_lens[d]
        blocks = np.arange(doc_first[d], doc_first[d] + doc_nb[d])
        tiles = tile_order[doc_tile_first[d]:doc_tile_first[d + 1]]
        fits = (tokens + length <= cap_tokens) & (load + doc_flops[d] <= cap_flops)
        if fits.any():
            r = int(np.argmin(np.where(fits, load + tokens * 1e-30, np.inf)))
            block_rank[blocks] = r
            tile_rank[tiles] = r
            load[r] += doc_flops[d]
            tokens[r] += length
            continue
        # split over the fewest ranks that can hold it (the least-loaded ones): traffic grows
        # with the number of ranks a document spans
        k = max(-(-length // mean_tokens), -(-doc_flops[d] // mean_flops) if mean_flops > 0 else 1)
        group = np.zeros(w, bool)
        group[np.argsort(load + tokens * 1e-30, kind="stable")[: int(min(max(k, 2), w))]] = True
        # blocks by descending row FLOPs to the least (projected) loaded group rank with room
        projected = load.copy()
        for b in blocks[np.argsort(-row_flops[blocks], kind="stable")]:
            room = tokens + wl.block_len[b] <= cap_tokens
            pick = room & group if (room & group).any() else room
            r = int(np.argmin(np.where(pick, projected, np.inf))) if pick.any() else int(np.argmin(tokens))
            block_rank[b] = r
            tokens[r] += wl.block_len[b]
            projected[r] += row_flops[b]
        # tiles, largest first, to the data-holding rank with compute room
        for t in tiles[np.argsort(-flops[tiles], kind="stable")]:
            rq, rkv = block_rank[wl.tile_q[t]], block_rank[wl.tile_kv[t]]
            f = flops[t]
            for r in ((rq, rkv) if q_first else (rkv, rq)):
                if load[r] + f <= cap_flops:
                    break
            else:
                r = int(np.argmin(load))
                if load[r] + f > cap_flops:  # nothing has room: least-loaded data holder
                    r = rq if load[rq] <= load[rkv] else rkv
            tile_rank[t] = r
            load[r] += f
    return Placement(wl, w, block_rank, tile_rank, planner="greedy")
