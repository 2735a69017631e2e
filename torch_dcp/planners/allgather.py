"""All-gather context parallelism on the zig-zag layout (PyTorch's ``context_parallel`` with its
all-gather rotation; TransformerEngine's ``AttnFuncWithCPAndKVAllGather``).

The layout is ring attention's (:func:`~torch_dcp.planners.ring.zigzag_spans`: rank ``r`` holds
chunks ``r`` and ``2W - 1 - r`` of every document) and tiles follow their queries. It runs as
its authors' implementations run it (``Runtime.ALLGATHER``, :mod:`torch_dcp.sim.runtimes`): one NCCL
all-gather of K/V per pass before the attention, one call per local zig-zag half over the
gathered keys, and in the backward TransformerEngine's reduce-scatter of dK/dV in the K/V dtype,
the collectives costed as NCCL runs them on the topology (:mod:`torch_dcp.cost.collectives`) and
not overlapped with compute. As torch_dcp's executor runs the same placement (dcp's candidate
``"dcp:allgather"``, or :func:`torch_dcp.sim.runtimes.on_executor`), every rank fetches every chunk
it needs straight from its owner (:attr:`~torch_dcp.planners.base.Routing.DIRECT`: a chunk
needed by ``n`` ranks leaves its owner ``n`` times) in the scheduler's divisions.
"""

from __future__ import annotations

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from ..workload import Workload, check_block_size
from .base import Placement, Routing, Runtime
from .ring import zigzag_placement, zigzag_spans
from .static import split_documents

__all__ = ["plan_allgather"]


def plan_allgather(batch: BatchSpec, topology: Topology, block_size: int | None = None,
                   cp_size: int | None = None) -> Placement:
    """Zig-zag placement (:func:`~torch_dcp.planners.ring.zigzag_placement`), run by an NCCL
    all-gather (``Runtime.ALLGATHER``; on torch_dcp's executor every fetch from the owner).

    ``cp_size``: ranks per CP group (:mod:`torch_dcp.planners.static`): the documents are split
    over the ``W / cp_size`` groups of consecutive ranks (:func:`~torch_dcp.planners.static.split_documents`),
    each laid out zig-zag over its group's ranks, which gather among themselves; ``None`` (or
    ``W``): one group of all ranks.

    Raises:
        ValueError: ``block_size`` is not ``None`` or an integer in ``1 .. MAX_TOKENS``, or
            ``cp_size`` does not divide the world size.
    """
    w = topology.world_size
    if cp_size is None or cp_size == w:
        return zigzag_placement(batch, topology, block_size, "allgather", Routing.DIRECT, Runtime.ALLGATHER)
    if block_size is not None:
        check_block_size(block_size)
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1 or w % cp_size:
        raise ValueError(f"cp_size must be a positive integer dividing the world size {w}, got {cp_size!r}")
    group = split_documents(batch.doc_lens, w // int(cp_size))
    doc, start, end, member = zigzag_spans(batch.doc_lens, int(cp_size))
    workload = Workload.from_spans(batch, doc, start, end)
    rank = member + group[doc] * int(cp_size)
    return Placement(workload, w, rank, rank[workload.tile_q], planner=f"allgather/cp{int(cp_size)}",
                     routing=Routing.DIRECT, runtime=Runtime.ALLGATHER, cp_size=int(cp_size))
