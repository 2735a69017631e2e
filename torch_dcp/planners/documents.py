"""Whole documents per rank: data parallelism over the group, no context parallelism.

Every document stays whole on one rank with all its tiles, so the plan moves no bytes: the
layout a data loader gives each data-parallel rank, longest document first to the rank holding
the fewest tokens so far (greedy longest-processing-time balancing by tokens, ties to the lower
rank). Inside a head-parallel plan (:mod:`torch_dcp.plan.heads`) the ranks are the head groups:
``N`` ranks of a node trading heads by all-to-all run every document of their group, which is
Ulysses at CP size ``N`` with data parallelism across the groups. dcp offers it among its rivals
(``"dcp:documents"``).
"""

from __future__ import annotations

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from ..workload import Workload, check_block_size
from .base import Placement

__all__ = ["plan_documents", "longest_first", "DOCUMENT_BLOCK"]

#: the largest block of a whole-document placement (tokens): a document up to this long is one
#: block, so one tile (a block-sparse kernel pays its mask boundary per tile, and the executor
#: per tile); longer ones are cut into blocks of this size, which bounds the dense masks of the
#: CPU kernel (query rows x keys per partial tile)
DOCUMENT_BLOCK = 16384


def longest_first(weights: np.ndarray, parts: int) -> np.ndarray:
    """Longest processing time first (Graham, *Bounds on multiprocessing timing anomalies*,
    1969): the part (rank or group) of every item, int64 ``[n]``, heaviest first to the part
    with the least weight so far (ties to the lower part). Documents by tokens here; a
    partition's vertices by weight where nothing connects them (:mod:`.partition`).

    Raises:
        ValueError: ``parts`` is not a positive integer.
    """
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise ValueError(f"parts must be a positive integer, got {parts!r}")
    w = np.asarray(weights)
    part = np.zeros(len(w), np.int64)
    load = np.zeros(parts, w.dtype if w.dtype.kind in "iu" else np.float64)
    for i in np.argsort(-w, kind="stable"):
        p = int(np.argmin(load))
        part[i] = p
        load[p] += w[i]
    return part


def plan_documents(batch: BatchSpec, topology: Topology, block_size: int = 1024) -> Placement:
    """Every document whole on one rank (:func:`longest_first`: longest first to the rank holding the fewest tokens) with all its tiles, in
    blocks of ``max(block_size, min(longest document, DOCUMENT_BLOCK))`` tokens (no block is
    ever fetched, so the block size only sets how many tiles the kernels see).

    Raises:
        ValueError: ``block_size`` is not an integer in ``1 .. MAX_TOKENS``.
    """
    block_size = check_block_size(block_size)
    longest = int(batch.doc_lens.max(initial=1))
    wl = Workload.uniform(batch, max(block_size, min(longest, DOCUMENT_BLOCK)))
    doc_rank = longest_first(batch.doc_lens, topology.world_size)
    block_rank = doc_rank[wl.block_doc]
    return Placement(wl, topology.world_size, block_rank, block_rank[wl.tile_q], planner="documents")
