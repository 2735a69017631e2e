"""The entry point from a batch to a plan."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .batch import BatchSpec
from .plan import Plan
from .planners import Routing, get_planner
from .schedule import assign_divisions
from .topology import Topology
from .workload import check_block_size

__all__ = ["plan", "DEFAULT_DIVISIONS"]

#: divisions per rank when ``divisions=None`` (the DCP paper's T = 4), fewer for batches with fewer tiles
DEFAULT_DIVISIONS = 4


def plan(
    batch: BatchSpec,
    topology: Topology | int,
    planner: str = "greedy",
    block_size: int = 1024,
    divisions: int | None = None,
    **options: Any,
) -> Plan:
    """Plan one attention step of ``batch`` on ``topology``.

    Args:
        batch: documents, masks, heads, dtype of the global batch.
        topology: a :class:`Topology`, or a world size (all ranks on one node).
        planner: ``"greedy"``, ``"dcp"``, ``"ring"``, ``"megatron"`` (see :mod:`torch_dcp.planners`).
        block_size: tokens per block ``B``, an integer in ``1 ..`` :data:`~torch_dcp.batch.MAX_TOKENS`
            (checked for every planner; ``ring`` and ``megatron`` cut chunks of ``L / 2W``
            instead).
        divisions: ``T``, divisions per rank for compute/communication overlap (per
            scheduling round, for planners with rounds): an integer in ``1 .. n_tiles`` (the
            placement's number of tiles; 1 when it has none), or ``None`` (default) for
            ``min(4, n_tiles)`` (at least 1), so that tiny batches plan too.
        **options: planner-specific options (e.g. ``eps_compute`` for ``greedy``).

    Returns:
        The :class:`Plan`; ``plan.plan_seconds`` holds the planning time (placement and
        divisions).

    Raises:
        ValueError: unknown planner, a bad topology, a block size that is not an integer in
            ``1 .. MAX_TOKENS``, or divisions that are not ``None`` or an integer in
            ``1 .. max(1, n_tiles)`` (the message names the value, the bound and the tiles).
    """
    topology = Topology.coerce(topology)
    fn = get_planner(planner)
    check_block_size(block_size)
    if divisions is not None and (isinstance(divisions, bool) or not isinstance(divisions, (int, np.integer))):
        raise ValueError(f"divisions must be an integer (or None for automatic), got {divisions!r}")
    t0 = time.perf_counter()
    placement = fn(batch, topology, block_size, **options)
    n_tiles = placement.workload.n_tiles
    bound = max(1, n_tiles)  # a batch with no tiles still runs as one (empty) division
    if divisions is None:
        divisions = min(DEFAULT_DIVISIONS, bound)
    elif not 1 <= divisions <= bound:
        raise ValueError(f"divisions must lie in 1..{bound} (the number of tiles of the {planner} placement of this "
                         f"batch: {n_tiles}), got {divisions}")
    divisions = int(divisions)
    if placement.routing is Routing.RING:  # ring attention's own steps, whatever divisions asks
        tile_division, n_div = placement.ring_steps()
    else:
        tile_division = assign_divisions(placement, divisions, topology)
        rounds = placement.tile_round
        n_div = divisions * (1 if rounds is None or rounds.size == 0 else int(rounds.max()) + 1)
    seconds = time.perf_counter() - t0
    return Plan(placement, topology, tile_division, n_div, plan_seconds=seconds)
