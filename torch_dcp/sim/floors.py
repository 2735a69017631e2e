"""Floors of a plan's time: what no run of it can beat (seconds), from its placement and the cost
model alone, without simulating it. :func:`torch_dcp.plan` skips simulating a candidate whose
floor lies above a faster candidate's simulated time; the benchmarks report plans against
:func:`batch_floor_seconds`, the batch's attention spread evenly over the ranks.
"""

from __future__ import annotations

import numpy as np

from ..batch import BatchSpec
from ..cost import CostModel
from ..plan import Plan
from ..plan.heads import HeadParallelPlan
from ..planners.base import Runtime
from ..workload import Buf, Workload

__all__ = ["link_floor_seconds", "link_busy_seconds", "node_once_bytes", "compute_floor_seconds",
           "division_launch_seconds", "kernel_floor_seconds", "floor_seconds", "batch_floor_seconds",
           "search_floor_seconds"]


def link_floor_seconds(plan: Plan, backward: bool | None = None) -> float:
    """The busiest link's busy time of ``plan`` (seconds): every transfer occupies the
    sender's outgoing and the receiver's incoming NVLink port (inside a node) or rail (between
    nodes) for ``bytes / bandwidth``; the floor is the largest total over ports and rails. No
    schedule of the plan is shorter (the simulator runs one transfer at a time per port and
    rail). 0 for a plan on the all-gather runtime (its collectives move no route's transfers).

    Args:
        backward: ``None`` (default): both passes' transfers together; ``False`` / ``True``:
            the forward's or the backward's only.
    """
    if plan.placement.runtime.gathers:  # collectives, priced in closed form: no route's transfers
        return 0.0
    src, dst, nbytes, forward = plan.transfers()
    if backward is not None:
        keep = forward != backward
        src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
    return max([0.0] + [float(v.max(initial=0.0)) for v in plan.topology.link_seconds(src, dst, nbytes).values()])


def link_busy_seconds(plan: Plan | HeadParallelPlan) -> dict[tuple[str, str], np.ndarray]:
    """Seconds every NVLink port and rail is busy over both passes of ``plan``
    (:meth:`~torch_dcp.topology.Topology.link_seconds` of its transfers; on the all-gather runtime
    its collectives as NCCL's ring moves them, each ring hop between nodes over all the nodes'
    rails, as :mod:`torch_dcp.cost.collectives` prices it; a head-parallel plan's outer transfers
    on every inner index plus its all-to-alls). Keys ``("port" | "rail", "out" | "in")``."""
    if isinstance(plan, HeadParallelPlan):
        n = plan.head_parallel
        osrc, odst, onb, _ = plan.outer.transfers()
        parts = [(osrc * n + i, odst * n + i, onb) for i in range(n)]
        for bw in (False, True):
            m = plan.all_to_all_bytes(bw)
            s, d = np.nonzero(m)
            parts.append((s, d, m[s, d]))
        src, dst, nbytes = (np.concatenate([p[k] for p in parts]) for k in range(3))
    else:
        src, dst, nbytes, _ = plan.transfers()
        # NCCL's rings across nodes: a channel per NIC, every rail (the node-once all-gather's rail
        # collectives: each rank on its own)
        if plan.placement.runtime.gathers and plan.placement.runtime is not Runtime.DCP_NODE_ALLGATHER:
            src, dst, nbytes = _over_every_rail(plan.topology, src, dst, nbytes)
    return plan.topology.link_seconds(src, dst, nbytes)


def node_once_bytes(plan: Plan | HeadParallelPlan) -> float:
    """The fewest bytes between nodes any routing of ``plan``'s placement moves, both passes: every
    block (queries or keys/values, per pass) that ranks of another node need crosses into that
    node once, and every block's partial results from one node (output parts, dQ, dK/dV) are
    summed there and leave it once (the node-once exchange of MagiAttention's hierarchical
    group-cast / group-reduce). :meth:`Plan.stats` ``inter_node_bytes`` equals it when the plan's
    routes cross each node once (``Routing.NODE``); above it, the bytes that routing pays again. A
    head-parallel plan: its outer plan's, on every inner index, plus its all-to-alls between
    nodes; a plan on the all-gather runtime: its collectives' (no route to change)."""
    if isinstance(plan, HeadParallelPlan):
        cross = plan.topology.node_of(np.arange(plan.world_size))
        a2a = sum(float(m[cross[:, None] != cross[None, :]].sum()) for m in (plan.all_to_all_bytes(bw)
                                                                              for bw in (False, True)))
        return node_once_bytes(plan.outer) * plan.head_parallel + a2a
    if plan.placement.runtime.gathers:
        return float(plan.stats()["inter_node_bytes"])
    node, wl, t = plan.topology.node_of, plan.workload, plan.tables
    itb = plan.placement.token_bytes()
    total = 0.0
    fb, fk = t["fetch_block"], t["fetch_kind"]
    into = node(t["fetch_rank"])
    cross = node(t["fetch_src"]) != into
    once = np.unique(np.stack([fb[cross], fk[cross], into[cross]]), axis=1, return_index=True)[1]
    for backward in (False, True):  # each (block, kind) into each node once, per pass
        per = np.where(fk == 0, itb[(backward, Buf.Q)], itb[(backward, Buf.KV)]) * wl.block_len[fb]
        total += float(per[cross][once].sum())
    for backward, side, kind in ((False, "q", Buf.OPART), (True, "q", Buf.DQ), (True, "kv", Buf.DKV)):
        b, out = t[f"ret_{side}_block"], node(t[f"ret_{side}_rank"])
        cross = out != node(t[f"ret_{side}_dst"])
        once = np.unique(np.stack([b[cross], out[cross]]), axis=1, return_index=True)[1]
        total += float((itb[(backward, kind)] * wl.block_len[b[cross][once]]).sum())  # each block out of a node once
    return total


def _over_every_rail(topo, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Transfers between nodes spread evenly over the sending and receiving nodes' ranks (so over
    all their rails): each becomes ``r`` transfers of ``1 / r`` the bytes between the ranks of the
    same local index; transfers inside a node as they are."""
    r = topo.ranks_per_node
    inter = topo.node_of(src) != topo.node_of(dst)
    local = np.arange(r)
    s = (topo.node_of(src[inter])[:, None] * r + local).ravel()
    d = (topo.node_of(dst[inter])[:, None] * r + local).ravel()
    b = np.repeat(nbytes[inter] / r, r)
    return (np.concatenate([src[~inter], s]), np.concatenate([dst[~inter], d]), np.concatenate([nbytes[~inter], b]))


def compute_floor_seconds(plan: Plan, cost_model: CostModel | None = None, backward: bool | None = None) -> float:
    """The busiest rank's attention FLOPs at the cost model's best throughput (seconds): a
    lower bound of its kernel time.

    Args:
        backward: ``None`` (default): forward + backward; ``False`` / ``True``: one pass.
    """
    cm = cost_model or CostModel.a100()
    b = plan.batch
    table = cm.table_for(b.head_dim, b.dtype)
    pl = plan.placement
    seconds = np.zeros(plan.world_size)
    if backward is not True:
        seconds += pl.rank_flops() / (max(max(table.fwd_full), max(table.fwd_causal)) * 1e12)
    if backward is not False:
        seconds += pl.rank_flops(backward=True) / (max(max(table.bwd_full), max(table.bwd_causal)) * 1e12)
    return float(seconds.max())


def division_launch_seconds(plan: Plan, cost_model: CostModel | None = None, backward: bool = False) -> np.ndarray:
    """Seconds of every rank's attention launch in every division of one pass, as
    :func:`torch_dcp.sim.simulate.simulate` times them (a division's tiles' FLOPs at the throughput of its work per
    launch, plus the launch overhead; 0 for a division without tiles): float64
    ``[world_size, divisions]`` (``[world_size, 1]`` on the all-gather runtime: one launch per rank),
    read-only (computed once per plan and cost model: :meth:`~torch_dcp.plan.Plan.memo`)."""
    cm = cost_model or CostModel.a100()
    return plan.memo(("division_launch_seconds", id(cm), bool(backward)), cm,
                     lambda: _division_launch_seconds(plan, cm, bool(backward)))


def _division_launch_seconds(plan: Plan, cm: CostModel, backward: bool) -> np.ndarray:
    wl, w, t = plan.workload, plan.world_size, plan.divisions
    if plan.placement.runtime.gathers:  # one launch per rank, the kernels alone: [W, 1]
        tile_rank = plan.placement.tile_rank.astype(np.int64)
        return cm.with_executor(None).launch_seconds(wl, np.arange(wl.n_tiles), tile_rank, w, backward).reshape(w, 1)
    cell = plan.placement.tile_rank.astype(np.int64) * t + np.asarray(plan.tile_division, np.int64)
    if plan.placement.runtime is not Runtime.EXECUTOR:  # a ring's own runtime: its kernels (a lower bound)
        cm = cm.with_executor(None)
    return cm.launch_seconds(wl, np.arange(wl.n_tiles), cell, w * t, backward).reshape(w, t)


def kernel_floor_seconds(plan: Plan, cost_model: CostModel | None = None, backward: bool | None = None) -> float:
    """The busiest rank's attention launches, each timed by the cost model as :func:`torch_dcp.sim.simulate.simulate`
    times it (:func:`division_launch_seconds`), copies and reductions left out (seconds). A
    lower bound of the rank's busy time, so of the pass's makespan; at least
    :func:`compute_floor_seconds`.

    Args:
        backward: ``None`` (default): forward + backward; ``False`` / ``True``: one pass.
    """
    passes = (False, True) if backward is None else (backward,)
    seconds = sum(division_launch_seconds(plan, cost_model, bw).sum(axis=1) for bw in passes)
    return float(np.max(seconds, initial=0.0))


def floor_seconds(plan: Plan | HeadParallelPlan, cost_model: CostModel | None = None) -> float:
    """``max(compute floor, link floor)`` of each pass, forward + backward: no simulated run
    of ``plan`` is shorter (the simulator runs the passes one after the other), so a candidate
    whose floor is above another's simulated time need not be simulated
    (:func:`torch_dcp.plan`). Each pass: the larger of :func:`kernel_floor_seconds` and
    :func:`link_floor_seconds`, so at least ``max(compute_floor_seconds, link_floor_seconds)``:
    a pass bound by its links and another by its compute add up. A head-parallel plan: its
    outer plan's floor plus its all-to-alls and the operations its implementation issues around
    them (:func:`~torch_dcp.sim.runtimes.all_to_all_ops_seconds`)."""
    if isinstance(plan, HeadParallelPlan):
        from .runtimes import head_exchange_seconds

        cm = cost_model or CostModel.a100()
        return floor_seconds(plan.outer, cm) + head_exchange_seconds(plan, cm)
    return sum(max(kernel_floor_seconds(plan, cost_model, backward), link_floor_seconds(plan, backward))
               for backward in (False, True))


def batch_floor_seconds(batch: BatchSpec, world_size: int, cost_model: CostModel | None = None) -> float:
    """The batch's compute floor on ``world_size`` ranks (seconds): its attention forward +
    backward spread evenly over the ranks, one launch per pass on each (a ``1/W`` share of
    every visible pair and FLOP, timed by the cost model), no communication. No plan of any
    planner beats it by more than the kernel table's gain from larger launches; the
    benchmarks report plans against it.

    Raises:
        ValueError: ``world_size`` is not a positive integer.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    cm = cost_model or CostModel.a100()
    wl = Workload.uniform(batch, min(1024, max(1, batch.total_tokens)))
    masked = not bool(np.all(wl.tile_full))
    pairs = float(wl.tile_pairs.sum()) * batch.n_heads / world_size
    return sum(cm.attention_seconds(pairs, float(flops.sum()) / world_size, bw, masked, batch.head_dim, batch.dtype)
               for bw, flops in ((False, wl.tile_flops_fwd), (True, wl.tile_flops_bwd)))


def search_floor_seconds(workload: Workload, world_size: int, cost_model: CostModel | None = None) -> float:
    """What no placement of ``workload``'s tiles over ``world_size`` ranks can beat on torch_dcp's
    executor (seconds, forward + backward): each pass's least total launch cost
    (:meth:`~torch_dcp.cost.CostModel.least_launch_seconds`) spread evenly over the ranks. Every
    simulated run of such a placement, at any number of divisions, takes at least this long (its
    busiest rank's launches take at least the mean), so :func:`torch_dcp.plan` skips the search
    over placements of ``workload`` where a static runtime's plan is already faster.

    Raises:
        ValueError: ``world_size`` is not a positive integer.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    cm = cost_model or CostModel.a100()
    return sum(cm.least_launch_seconds(workload, bw) for bw in (False, True)) / world_size
