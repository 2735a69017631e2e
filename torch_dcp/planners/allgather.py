"""All-gather context parallelism on the zig-zag layout (PyTorch's ``context_parallel`` with its
all-gather rotation; TransformerEngine's ``AttnFuncWithCPAndKVAllGather``).

The layout is ring attention's (:func:`~torch_dcp.planners.ring.zigzag_spans`: rank ``r`` holds
chunks ``r`` and ``2W - 1 - r`` of every document) and tiles follow their queries. It runs as
its authors' implementations run it (``Runtime.ALLGATHER``, :mod:`torch_dcp.runtimes`): one NCCL
all-gather of K/V per pass before the attention, one call per local zig-zag half over the
gathered keys, and in the backward TransformerEngine's reduce-scatter of dK/dV in the K/V dtype,
the collectives costed as NCCL runs them on the topology (:mod:`torch_dcp.cost.collectives`) and
not overlapped with compute. As torch_dcp's executor runs the same placement (dcp's candidate
``"dcp:allgather"``, or :func:`torch_dcp.runtimes.on_executor`), every rank fetches every chunk
it needs straight from its owner (:attr:`~torch_dcp.planners.base.Routing.DIRECT`: a chunk
needed by ``n`` ranks leaves its owner ``n`` times) in the scheduler's divisions.
"""

from __future__ import annotations

from ..batch import BatchSpec
from ..topology import Topology
from .base import Placement, Routing, Runtime
from .ring import zigzag_placement

__all__ = ["plan_allgather"]


def plan_allgather(batch: BatchSpec, topology: Topology, block_size: int | None = None) -> Placement:
    """Zig-zag placement (:func:`~torch_dcp.planners.ring.zigzag_placement`), run by an NCCL
    all-gather (``Runtime.ALLGATHER``; on torch_dcp's executor every fetch from the owner).

    Raises:
        ValueError: ``block_size`` is not ``None`` or an integer in ``1 .. MAX_TOKENS``.
    """
    return zigzag_placement(batch, topology, block_size, "allgather", Routing.DIRECT, Runtime.ALLGATHER)
