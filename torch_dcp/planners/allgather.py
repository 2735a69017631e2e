"""All-gather context parallelism on the zig-zag layout (PyTorch's ``context_parallel`` with its
all-gather rotation).

The layout is ring attention's (:func:`~torch_dcp.planners.ring.zigzag_spans`: rank ``r`` holds
chunks ``r`` and ``2W - 1 - r`` of every document) and tiles follow their queries, but every
rank fetches every key/value chunk it needs straight from its owner, and dK/dV partials go
straight home (:attr:`~torch_dcp.planners.base.Routing.DIRECT`): a chunk needed by ``n`` ranks
leaves its owner ``n`` times. The divisions come from the scheduler like any planner's.
"""

from __future__ import annotations

from ..batch import BatchSpec
from ..topology import Topology
from .base import Placement, Routing
from .ring import zigzag_placement

__all__ = ["plan_allgather"]


def plan_allgather(batch: BatchSpec, topology: Topology, block_size: int | None = None) -> Placement:
    """Zig-zag placement (:func:`~torch_dcp.planners.ring.zigzag_placement`), every fetch from
    the owner.

    Raises:
        ValueError: ``block_size`` is not ``None`` or an integer in ``1 .. MAX_TOKENS``.
    """
    return zigzag_placement(batch, topology, block_size, "allgather", Routing.DIRECT)
