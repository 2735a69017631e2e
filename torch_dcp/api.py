"""The entry point from a batch to a plan."""

from __future__ import annotations

import time
from typing import Any

from .batch import BatchSpec
from .plan import Plan
from .planners import Routing, get_planner
from .schedule import assign_divisions
from .topology import Topology

__all__ = ["plan"]


def plan(
    batch: BatchSpec,
    topology: Topology | int,
    planner: str = "greedy",
    block_size: int = 1024,
    divisions: int = 4,
    **options: Any,
) -> Plan:
    """Plan one attention step of ``batch`` on ``topology``.

    Args:
        batch: documents, masks, heads, dtype of the global batch.
        topology: a :class:`Topology`, or a world size (all ranks on one node).
        planner: ``"greedy"``, ``"dcp"``, ``"ring"``, ``"megatron"`` (see :mod:`torch_dcp.planners`).
        block_size: tokens per block ``B`` (ignored by ``ring``, whose chunks are
            ``L / 2W``).
        divisions: ``T``, divisions per rank for compute/communication overlap (per
            scheduling round, for planners with rounds).
        **options: planner-specific options (e.g. ``eps_compute`` for ``greedy``).

    Returns:
        The :class:`Plan`; ``plan.plan_seconds`` holds the planning time (placement and
        divisions).

    Raises:
        ValueError: unknown planner, bad block size, divisions, or topology.
    """
    topology = Topology.coerce(topology)
    fn = get_planner(planner)
    if isinstance(divisions, bool) or not isinstance(divisions, int) or divisions < 1:
        raise ValueError(f"divisions must be a positive integer, got {divisions!r}")
    t0 = time.perf_counter()
    placement = fn(batch, topology, block_size, **options)
    if placement.routing is Routing.RING:  # ring attention's own steps
        tile_division, n_div = placement.ring_steps()
    else:
        tile_division = assign_divisions(placement, divisions, topology)
        rounds = placement.tile_round
        n_div = divisions * (1 if rounds is None or rounds.size == 0 else int(rounds.max()) + 1)
    seconds = time.perf_counter() - t0
    return Plan(placement, topology, tile_division, n_div, plan_seconds=seconds)
