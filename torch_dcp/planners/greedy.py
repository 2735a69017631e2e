"""A fast dynamic planner: short documents stay whole on one rank, long ones are split.

Documents are taken in descending attention FLOPs (longest-processing-time order). A
document whose FLOPs fit in the compute capacity ``(1 + eps_compute) * F / W`` goes whole to
the least-loaded rank with room for its tokens (token capacity ``(1 + eps_memory) * T / W``):
pure data parallelism for it, no communication. Any other document is cut into blocks of
``block_size`` and spread zig-zag (as ring attention, but only over the fewest least-loaded
ranks that can hold its tokens and FLOPs), and its tiles go, largest first, to the
least-loaded rank that holds most of their data (the query side: Q, and O partials avoided; else the key/value side; else the
least-loaded rank overall) while the compute capacity holds.
"""

from __future__ import annotations

import math

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from ..workload import Buf, Workload, item_token_bytes
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
    cap_tokens = (1.0 + eps_memory) * batch.total_tokens / w
    cap_flops = (1.0 + eps_compute) * flops.sum() / w
    load = np.zeros(w)
    tokens = np.zeros(w)
    block_rank = np.full(wl.n_blocks, -1, np.int64)
    tile_rank = np.full(wl.n_tiles, -1, np.int64)

    doc_nb = np.bincount(wl.block_doc, minlength=batch.n_docs)
    doc_first = np.concatenate(([0], np.cumsum(doc_nb)[:-1]))
    tile_doc = wl.block_doc[wl.tile_q]
    tile_order = np.argsort(tile_doc, kind="stable")
    doc_tile_first = np.concatenate(([0], np.cumsum(np.bincount(tile_doc, minlength=batch.n_docs))))
    # bytes a tile avoids moving when it runs with its query block (Q + O partial + LSE)
    # vs with its key/value block (K + V)
    itb = item_token_bytes(batch)
    q_first = itb[(False, Buf.Q)] + itb[(False, Buf.OPART)] >= itb[(False, Buf.KV)]

    order = np.lexsort((-batch.doc_lens, -doc_flops))
    for d in order:
        length = batch.doc_lens[d]
        blocks = np.arange(doc_first[d], doc_first[d] + doc_nb[d])
        tiles = tile_order[doc_tile_first[d]:doc_tile_first[d + 1]]
        fits = tokens + length <= cap_tokens
        if fits.any() and doc_flops[d] <= cap_flops:
            r = int(np.argmin(np.where(fits, load + tokens * 1e-30, np.inf)))
            block_rank[blocks] = r
            tile_rank[tiles] = r
            load[r] += doc_flops[d]
            tokens[r] += length
            continue
        # split over the fewest ranks that can hold it (the least-loaded ones): traffic grows
        # with the number of ranks a document spans
        k = max(math.ceil(length / cap_tokens), math.ceil(doc_flops[d] / cap_flops) if cap_flops > 0 else 1)
        k = int(min(max(k, 2), w))
        # widen the group until its ranks have room for their share of the tokens
        while k < w and np.count_nonzero(tokens + length / k <= cap_tokens) < k:
            k += 1
        if 4 * k > 3 * w:  # nearly every rank: use all, or the idle few break memory balance
            k = w
        room = tokens + length / k <= cap_tokens
        group = np.argsort(np.where(room, load, load + 1e300) + tokens * 1e-30, kind="stable")[:k]
        # zig-zag over the group (2k chunks, rank i holds chunks i and 2k-1-i): balanced
        # causal work per rank, like ring attention but over k ranks instead of all
        n2 = 2 * len(group)
        chunk = np.arange(len(blocks)) * n2 // len(blocks)
        member = np.where(chunk < len(group), chunk, n2 - 1 - chunk)
        block_rank[blocks] = group[member]
        np.add.at(tokens, group[member], wl.block_len[blocks])
        # tiles, largest first, to the data-holding rank with compute room (plain Python:
        # thousands of tiles, a few operations each)
        tiles = tiles[np.argsort(-flops[tiles], kind="stable")]
        loads, cap, ranks = load.tolist(), float(cap_flops), []
        for rq, rkv, f in zip(block_rank[wl.tile_q[tiles]].tolist(), block_rank[wl.tile_kv[tiles]].tolist(),
                              flops[tiles].tolist()):
            for r in ((rq, rkv) if q_first else (rkv, rq)):
                if loads[r] + f <= cap:
                    break
            else:
                r = min(range(w), key=loads.__getitem__)  # the least loaded (the first of equals)
                if loads[r] + f > cap:  # nothing has room: least-loaded data holder
                    r = rq if loads[rq] <= loads[rkv] else rkv
            ranks.append(r)
            loads[r] += f
        tile_rank[tiles] = ranks
        load = np.asarray(loads)
    return Placement(wl, w, block_rank, tile_rank, planner="greedy")
