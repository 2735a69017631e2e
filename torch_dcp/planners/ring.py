"""Static context parallelism with the zig-zag layout (ring attention, TransformerEngine THD).

Every document is cut into ``2 W`` chunks (``W`` = world size); rank ``r`` holds chunks ``r`` and
``2W - 1 - r`` of every document, so causal work is balanced per document. Tiles follow their
queries: the tile ``(q chunk, kv chunk)`` runs on the query chunk's rank, so key/value chunks
travel (as in ring attention). Chunk sizes are as even as possible, earlier chunks one token
longer; with TransformerEngine's requirement that lengths be multiples of ``2W`` this is its
exact layout (TransformerEngine ``get_batch_on_this_cp_rank`` for THD inputs).
"""

from __future__ import annotations

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from ..workload import Workload
from .base import Placement

__all__ = ["plan_ring"]


def plan_ring(batch: BatchSpec, topology: Topology, block_size: int | None = None) -> Placement:
    """Zig-zag static CP placement. ``block_size`` is ignored (chunks are ``L / 2W``)."""
    w = topology.world_size
    n_chunks = 2 * w
    lens = batch.doc_lens
    base, extra = lens // n_chunks, lens % n_chunks
    c = np.arange(n_chunks)
    chunk_len = base[:, None] + (c[None, :] < extra[:, None])  # [n_docs, 2W]
    chunk_start = np.cumsum(chunk_len, axis=1) - chunk_len
    chunk_rank = np.where(c < w, c, n_chunks - 1 - c)
    keep = chunk_len > 0
    doc = np.broadcast_to(np.arange(batch.n_docs)[:, None], keep.shape)[keep]
    start = chunk_start[keep]
    workload = Workload.from_spans(batch, doc, start, start + chunk_len[keep])
    # blocks are sorted by (doc, start) -- the same order as the kept chunks
    block_rank = np.broadcast_to(chunk_rank[None, :], keep.shape)[keep]
    tile_rank = block_rank[workload.tile_q]
    return Placement(workload, w, block_rank, tile_rank, planner="ring")
