"""Ring attention on the zig-zag layout (static context parallelism as TransformerEngine runs it).

Every document is cut into ``2 W`` chunks (``W`` = world size); rank ``r`` holds chunks ``r`` and
``2W - 1 - r`` of every document, so causal work is balanced per document. Chunk sizes are as
even as possible, earlier chunks one token longer; with TransformerEngine's requirement that
lengths be multiples of ``2W`` this is its exact layout (TransformerEngine
``get_batch_on_this_cp_rank`` for THD inputs).

Tiles follow their queries; key/value chunks travel around the ring (Liu et al., *Ring Attention
with Blockwise Transformers*, 2023, §3): in step ``s`` rank ``r`` attends to the key/value chunks
of rank ``r - s`` while it passes them on to ``r + 1`` and receives those of ``r - s - 1`` from
``r - 1``, ``W - 1`` steps in all, each transfer overlapped with the previous step's compute; in
the backward the dK/dV partials travel the same way, each rank adding its own
(:attr:`~torch_dcp.planners.base.Routing.RING`).

The plan is run as TransformerEngine runs it (``Runtime.TE_RING``; TransformerEngine's
``AttnFuncWithCPAndKVP2P``): one attention call and one output merge per step, dK/dV partials in
the K/V dtype, no torch_dcp executor costs; :mod:`torch_dcp.sim.runtimes` has the model and
:func:`torch_dcp.sim.simulate.ring_step_seconds` its step formula. dcp keeps the same placement
among its candidates as run by torch_dcp's executor (``"dcp:ring"``). All-gather CP on the same
layout is :func:`~torch_dcp.planners.allgather.plan_allgather`.
"""

from __future__ import annotations

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from ..workload import Workload, check_block_size
from .base import Placement, Routing, Runtime

__all__ = ["plan_ring", "zigzag_placement", "zigzag_spans"]


def zigzag_spans(doc_lens: np.ndarray, group_size: np.ndarray) -> tuple[np.ndarray, ...]:
    """Zig-zag chunks of every document over its group of ranks.

    Document ``d`` is cut into ``2 k`` chunks (``k = group_size[d]``) as evenly as possible,
    earlier chunks one token longer; chunk ``c`` goes to group member ``c`` for ``c < k`` and
    ``2k - 1 - c`` otherwise. Empty chunks are dropped.

    Returns ``(doc, start, end, member)``, int64 arrays in (document, start) order.
    """
    doc_lens = np.asarray(doc_lens, np.int64)
    k = np.broadcast_to(np.asarray(group_size, np.int64), doc_lens.shape)
    n_chunks = 2 * k
    doc = np.repeat(np.arange(len(doc_lens)), n_chunks)
    first = np.concatenate(([0], np.cumsum(n_chunks)[:-1]))
    c = np.arange(n_chunks.sum()) - np.repeat(first, n_chunks)
    lens, nc, kk = doc_lens[doc], n_chunks[doc], k[doc]
    size = lens // nc + (c < lens % nc)
    start = np.concatenate(([0], np.cumsum(size)[:-1])) - np.repeat(np.concatenate(([0], np.cumsum(doc_lens)[:-1])), n_chunks)
    member = np.where(c < kk, c, nc - 1 - c)
    keep = size > 0
    return doc[keep], start[keep], (start + size)[keep], member[keep]


def zigzag_placement(batch: BatchSpec, topology: Topology, block_size: int | None, planner: str,
                     routing: Routing, runtime: Runtime = Runtime.EXECUTOR) -> Placement:
    """The zig-zag layout over all ranks (:func:`zigzag_spans`), tiles on their query's rank,
    with ``routing``, run by ``runtime``. ``block_size`` is not used (chunks are ``L / 2W``), but it must be
    ``None`` or a valid block size, as for every planner.

    Raises:
        ValueError: ``block_size`` is not ``None`` or an integer in ``1 .. MAX_TOKENS``.
    """
    if block_size is not None:
        check_block_size(block_size)
    w = topology.world_size
    doc, start, end, member = zigzag_spans(batch.doc_lens, w)
    workload = Workload.from_spans(batch, doc, start, end)
    # blocks are sorted by (doc, start): the order of the spans
    return Placement(workload, w, member, member[workload.tile_q], planner=planner, routing=routing, runtime=runtime)


def plan_ring(batch: BatchSpec, topology: Topology, block_size: int | None = None) -> Placement:
    """Ring attention on the zig-zag layout (:func:`zigzag_placement`): tiles in ring step
    ``(rank - key/value home) mod W``; the plan has ``W`` divisions (the ring steps) whatever
    ``divisions`` asks; run as TransformerEngine runs it (``Runtime.TE_RING``, module docstring).

    Raises:
        ValueError: ``block_size`` is not ``None`` or an integer in ``1 .. MAX_TOKENS``.
    """
    return zigzag_placement(batch, topology, block_size, "ring", Routing.RING, Runtime.TE_RING)
