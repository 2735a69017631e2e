"""The entry point from a batch to a plan."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .batch import BatchSpec
from .plan import Plan
from .planners import CANDIDATES, Placement, Routing, get_planner
from .schedule import assign_divisions
from .topology import Topology
from .workload import check_block_size

if TYPE_CHECKING:  # pragma: no cover
    from .cost import CostModel

__all__ = ["plan", "divide", "DEFAULT_DIVISIONS"]

#: divisions per rank when ``divisions=None`` (the DCP paper's T = 4), fewer for batches with fewer tiles
DEFAULT_DIVISIONS = 4
#: share of every rank's local compute the alternative schedule of a timed plan runs last
#: (:func:`torch_dcp.schedule.assign_divisions`); 0.25 beat 0.1 on most batches where it wins
LOCAL_TAIL = 0.25


def plan(
    batch: BatchSpec,
    topology: Topology | int,
    planner: str = "greedy",
    block_size: int = 1024,
    divisions: int | None = None,
    cost_model: "CostModel | str | None" = None,
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
        cost_model: for planners that offer several candidates (``"dcp"`` with its default
            time objective: its placements, ring attention's and Megatron's plans, see
            :func:`~torch_dcp.planners.dcp.dcp_candidates`), the :class:`~torch_dcp.cost.CostModel`
            (or ``"a100"``, ``"h100"``, JSON table paths) whose simulated forward + backward
            time picks the fastest (:func:`torch_dcp.simulate.simulate`); default ``"a100"``.
            The fastest placement is then also timed with its last division running a local
            tail (:data:`LOCAL_TAIL` of every rank's local compute, the remote tiles in the
            divisions before: :func:`~torch_dcp.schedule.assign_divisions`), kept if faster.
        **options: planner-specific options (e.g. ``eps_compute`` for ``greedy``).

    Returns:
        The :class:`Plan`; ``plan.plan_seconds`` holds the planning time (placement,
        divisions and, where candidates are timed, their simulation); ``plan.candidates``
        the ``(planner label, simulated seconds)`` of every candidate (NaN for one not
        simulated because its floor, :func:`torch_dcp.simulate.floor_seconds`, lies above a
        faster candidate's time; empty when the planner offers one).

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
    offer = CANDIDATES.get(planner)
    placements = offer(batch, topology, block_size, **options) if offer else [fn(batch, topology, block_size, **options)]
    n_tiles = placements[0].workload.n_tiles
    bound = max(1, n_tiles)  # a batch with no tiles still runs as one (empty) division
    if divisions is None:
        divisions = min(DEFAULT_DIVISIONS, bound)
    elif not 1 <= divisions <= bound:
        raise ValueError(f"divisions must lie in 1..{bound} (the number of tiles of the {planner} placement of this "
                         f"batch: {n_tiles}), got {divisions}")
    plans = [divide(p, topology, int(divisions)) for p in placements]
    timed: list[tuple[str, float]] = []
    if len(plans) > 1:
        from .cost import CostModel
        from .simulate import floor_seconds, simulate

        cm = cost_model if isinstance(cost_model, CostModel) else CostModel.load(cost_model or "a100")
        chosen, best = plans[0], float("inf")

        def consider(p: Plan, label: str) -> None:
            nonlocal chosen, best
            # a candidate whose floor is above the best simulated time cannot win
            t = simulate(p, cm).makespan_s if floor_seconds(p, cm) < best else float("nan")
            timed.append((label, t))
            if t < best:
                chosen, best = p, t

        for p in plans:
            consider(p, p.planner)
        if divisions >= 3 and chosen.placement.routing is not Routing.RING:
            consider(divide(chosen.placement, topology, int(divisions), local_tail=LOCAL_TAIL),
                     f"{chosen.planner} (local tail)")
    else:
        chosen = plans[0]
    chosen.plan_seconds = time.perf_counter() - t0
    chosen.candidates = timed
    return chosen


def divide(placement: Placement, topology: Topology, divisions: int, local_tail: float = 0.0) -> Plan:
    """The plan of ``placement`` with ``divisions`` per rank (ring attention: its own steps;
    ``local_tail``: see :func:`~torch_dcp.schedule.assign_divisions`), as :func:`plan` builds
    every candidate it times.

    Raises:
        ValueError: ``divisions`` is not a positive integer or ``local_tail`` lies outside ``[0, 1)``.
    """
    if placement.routing is Routing.RING:  # ring attention's own steps, whatever divisions asks
        tile_division, n_div = placement.ring_steps()
    else:
        tile_division = assign_divisions(placement, divisions, topology, local_tail)
        rounds = placement.tile_round
        n_div = divisions * (1 if rounds is None or rounds.size == 0 else int(rounds.max()) + 1)
    return Plan(placement, topology, tile_division, n_div)
