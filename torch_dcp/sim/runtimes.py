"""What a plan costs as each implementation runs it: torch_dcp's executor, and the static
baselines' own implementations (:class:`~torch_dcp.planners.base.Runtime`).

:func:`torch_dcp.sim.simulate.simulate` looks the plan's runtime up in :data:`RUNTIMES`.

**torch_dcp's executor** (``Runtime.EXECUTOR``): the plan's programs on the simulator's
timeline (:func:`torch_dcp.sim.timeline.simulate_programs`), every instruction charged the cost
model's executor costs where it has them (:mod:`torch_dcp.cost.executor`).

**TransformerEngine's ring** (``Runtime.TE_RING``; TransformerEngine,
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``,
``AttnFuncWithCPAndKVP2P``, THD inputs on the zig-zag layout of ``get_batch_on_this_cp_rank``):
``W`` steps per pass; in step ``s`` a rank runs one attention call over its queries and the K/V
chunks it holds while it sends them to ``r + 1`` and receives the next ones from ``r - 1``
(``batch_isend_irecv`` on its own stream: the transfer of step ``s + 1`` overlaps the compute of
step ``s``), then corrects its running output with the step's (one LSE merge per step). In the
backward each step runs one attention-backward call, and the dK/dV partials travel with the K/V
in the K/V dtype (``dkv`` buffers of ``k.dtype``), each rank adding its own before passing them
on. The timeline is the ring plan's programs on the simulator with the kernels alone (the cost
model without its executor costs: FLOPs over the kernel table's throughput plus one launch
overhead per call), transfers sized with dK/dV in the K/V dtype; where the cost model counts
them (a GPU preset: :attr:`~torch_dcp.cost.executor.ExecutorCosts.te_ring`) and the ring has
more than one rank, each step with tiles is charged the device operations TransformerEngine's
source issues per step (its half-reads, LSE and output corrections among them), at the same cost
per operation as torch_dcp's; otherwise the output merges one per step at the memory bandwidth.
Its closed form with the kernels alone, ``sum_s max(compute_s, transfer_{s+1})`` per pass, is
:func:`te_ring_step_seconds`.

**torch_dcp's ring** (``Runtime.DCP_RING``, :class:`~torch_dcp.executor.ring.RingExecutor`):
TransformerEngine's timeline (the same steps, transfers and dK/dV in the K/V dtype), each step
with tiles charged the runtime's own device operations per step (counted, on a GPU preset:
:attr:`~torch_dcp.cost.executor.ExecutorCosts.ring`; its LSE merge among them); a model without
that count (a CPU calibration) times the plan as torch_dcp's executor runs it.

**All-gather CP** (``Runtime.ALLGATHER``, and torch_dcp's own, ``Runtime.DCP_ALLGATHER``;
PyTorch's ``context_parallel`` with its all-gather rotation,
``torch/distributed/tensor/experimental/_attention.py``, and TransformerEngine's
``AttnFuncWithCPAndKVAllGather``): K/V are gathered from every rank of the CP group by one NCCL
all-gather before the attention, which then runs as one call over the gathered keys (torch_dcp's
:class:`~torch_dcp.executor.allgather.AllGatherExecutor`; TransformerEngine makes one call per
local zig-zag half, one launch more); the backward gathers K/V again, runs one
attention-backward call and returns dK/dV by an NCCL reduce-scatter in the K/V dtype
(TransformerEngine's backward: PyTorch's passes dK/dV around the ring in float32, the slower of
the two). With CP groups smaller than the world (``Placement.cp_size``) every group gathers on
its own ranks. Each implementation pays its own device operations where the cost model counts
them (a GPU preset): torch_dcp's runtime its counted ones, TransformerEngine's those its source
issues (8 forward, 18 backward on a rank that gathers: two halves, each with its own copies;
K and V gathered, dK and dV reduce-scattered, by one collective each). The collectives are
costed as NCCL runs them on the topology (:mod:`torch_dcp.cost.collectives`); compute does not
overlap them.

**torch_dcp's all-gather crossing each node once** (``Runtime.DCP_NODE_ALLGATHER``,
:class:`~torch_dcp.executor.allgather_node.NodeAllGatherExecutor`): the same closed form with its
own collectives, each NCCL's ring on its group (the node's ranks over NVLink; the rail's, one
rank per node, each with its share of the node's rails), the attention of the node's own keys
overlapping the rail's gather, and its counted operations per pass.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from ..cost import CostModel
from ..cost.collectives import allgather_seconds, reduce_scatter_seconds
from ..plan import BlockwiseAttention, BlockwiseReduction, Plan, ReduceOp
from ..plan.heads import HeadParallelPlan
from ..planners.base import Routing, Runtime
from .timeline import PassResult, SimResult, _on_shared_cores, _Pass, pass_local_bytes, simulate_programs
from ..workload import Buf

__all__ = ["RUNTIMES", "te_ring_step_seconds", "all_to_all_ops_seconds", "head_exchange_seconds",
           "ring_estimate_seconds",
           "ring_priced_as_executor", "simulate_allgather", "allgather_pass_seconds", "on_executor"]


def on_executor(plan: "Plan | HeadParallelPlan") -> "Plan | HeadParallelPlan":
    """``plan`` as torch_dcp's executor runs it (``Runtime.EXECUTOR``: its stats, transfers and
    simulated time are the executor's): a baseline's plan that ``context_parallel`` runs; ``plan``
    itself where the executor already runs it."""
    if isinstance(plan, HeadParallelPlan):
        outer = on_executor(plan.outer)
        return plan if outer is plan.outer else HeadParallelPlan(outer, plan.batch, plan.topology, plan.head_parallel,
                                                                 plan.label, plan.keep_sharded)
    if plan.placement.runtime is Runtime.EXECUTOR:
        return plan
    placement = dataclasses.replace(plan.placement, runtime=Runtime.EXECUTOR)
    return Plan(placement, plan.topology, plan.tile_division, plan.divisions, plan.plan_seconds)


class _TERingPass(_Pass):
    """A pass of TransformerEngine's ring: the plan's programs (one attention call per ring
    step), each LSE merge charged as one merge per step (read the running output and the
    step's, write the running one) at the memory bandwidth."""

    def on_reduction(self, ins: BlockwiseReduction, r: int, t: float) -> None:
        if ins.op is not ReduceOp.LSE_MERGE:
            return super().on_reduction(ins, r, t)
        merges = np.maximum(np.diff(ins.src_ptr) - 1, 0)
        nbytes = 3.0 * float((merges * self.blen[ins.dst_block]).sum()) * self.row_bytes[ins.src]
        steps = int(merges.max(initial=0))
        self._compute(r, t, "reduction", nbytes / self.cm.memory_bandwidth + steps * self.cm.launch_overhead)


class _CountedRingPass(_TERingPass):
    """A pass of a ring runtime whose device operations per step are counted (torch_dcp's
    :class:`~torch_dcp.executor.ring.RingExecutor`, or TransformerEngine's ring counted from its
    source): the ring's programs with the kernels alone, each step with tiles charged the
    runtime's own operations (``step_seconds``, forward or backward: its reads, partial writes
    and the step's LSE merge, so the merge costs nothing more here)."""

    def __init__(self, plan: Plan, cm: CostModel, backward: bool,
                 step_seconds: tuple[float, float] = (0.0, 0.0)):
        super().__init__(plan, cm, backward)
        self.step_seconds = float(step_seconds[int(backward)])

    def on_attention(self, ins: BlockwiseAttention, r: int, t: float) -> None:
        self._compute(r, t, "attention", self.attention_s[id(ins)] + self.step_seconds)

    def on_reduction(self, ins: BlockwiseReduction, r: int, t: float) -> None:
        if ins.op is not ReduceOp.LSE_MERGE:
            return super().on_reduction(ins, r, t)
        self._compute(r, t, "reduction", 0.0)  # in the step's counted operations


def _te_ring_steps(plan: Plan, cm: CostModel) -> tuple[float, float] | None:
    """TransformerEngine's counted operations per ring step (seconds, forward and backward) where
    ``cm`` has them and the ring has more than one rank (at CP size 1, as Ulysses' outer plan on
    one node, TransformerEngine runs no ring: one attention call, its kernels alone)."""
    return None if cm.executor is None or plan.world_size < 2 else cm.executor.te_ring


def all_to_all_ops_seconds(plan: HeadParallelPlan, cm: CostModel, backward: bool) -> float:
    """Seconds of one pass of the device operations a head-parallel plan's implementation issues
    around its all-to-alls, beside its outer plan's: where the outer plan runs on
    TransformerEngine's ring (the baselines' Ulysses and HCP), those of its all-to-all CP
    (``ExecutorCosts.te_a2a``, counted from its source: with its one attention call where the
    outer plan is one rank, as Ulysses runs without a ring, around the ring's steps otherwise);
    else torch_dcp's head parallelism's (``ExecutorCosts.heads``, counted on it; ``heads_executor``
    around torch_dcp's executor, which writes O and the LSE into the kept state); 0 with a model
    without the count."""
    ex = cm.executor
    if ex is None:
        return 0.0
    runtime = plan.outer.placement.runtime
    if runtime is Runtime.TE_RING:
        return 0.0 if ex.te_a2a is None else float(ex.te_a2a[int(backward) + (0 if plan.outer.world_size == 1 else 2)])
    own = ex.heads_executor if runtime is Runtime.EXECUTOR and ex.heads_executor is not None else ex.heads
    return 0.0 if own is None else float(own[int(backward)])


def head_exchange_seconds(plan: HeadParallelPlan, cm: CostModel) -> float:
    """Forward + backward seconds of a head-parallel plan's all-to-alls
    (:meth:`~torch_dcp.plan.heads.HeadParallelPlan.all_to_all_seconds`) and the operations its
    implementation issues around them (:func:`all_to_all_ops_seconds`), which no overlap hides:
    what the simulator adds to its outer plan's run."""
    return sum(plan.all_to_all_seconds(bw) + all_to_all_ops_seconds(plan, cm, bw) for bw in (False, True))


def _ring_timeline(plan: Plan, cm: CostModel, bound: float, steps: tuple[float, float] | None) -> SimResult | None:
    """A ring's programs with the kernels alone, each step with tiles charged ``steps`` (its
    counted operations, seconds forward and backward), or, where None, its merges' bytes."""
    pass_cls = _TERingPass if steps is None else functools.partial(_CountedRingPass, step_seconds=steps)
    return simulate_programs(plan, cm.with_executor(None), bound, pass_cls)


def _simulate_te_ring(plan: Plan, cm: CostModel, bound: float = float("inf")) -> SimResult | None:
    """TransformerEngine's ring (module docstring): the programs with the kernels alone, each
    step charged its counted operations where the model has them."""
    return _ring_timeline(plan, cm, bound, _te_ring_steps(plan, cm))


def ring_priced_as_executor(cm: CostModel) -> bool:
    """Whether ``cm`` prices torch_dcp's ring runtime as its executor runs the same layout: a
    model with executor costs but without the ring's counted operations (a CPU calibration)."""
    return cm.executor is not None and cm.executor.ring is None


def _simulate_dcp_ring(plan: Plan, cm: CostModel, bound: float = float("inf")) -> SimResult | None:
    """torch_dcp's ring runtime (``Runtime.DCP_RING``): TransformerEngine's timeline (its steps,
    its dK/dV in the K/V dtype) with the runtime's own counted operations per step; a model
    without that count charges the plan as torch_dcp's executor runs it
    (:func:`ring_priced_as_executor`)."""
    if ring_priced_as_executor(cm):
        return simulate_programs(plan, cm, bound)
    return _ring_timeline(plan, cm, bound, (0.0, 0.0) if cm.executor is None else cm.executor.ring)


def _simulate_executor(plan: Plan, cm: CostModel, bound: float = float("inf")) -> SimResult | None:
    return simulate_programs(plan, cm, bound)


def te_ring_step_seconds(plan: Plan, cost_model: CostModel | None = None) -> float:
    """TransformerEngine's ring step formula for a ring plan, forward + backward (seconds).

    Each pass takes ``sum_s max(compute_s, transfer_{s+1})`` over the ``W`` ring steps: step
    ``s`` computes while the K/V chunks of step ``s + 1`` travel one hop (Liu et al., *Ring
    Attention with Blockwise Transformers*, 2023, §3; TransformerEngine's
    ``AttnFuncWithCPAndKVP2P``). ``compute_s`` is the slowest rank's step: its attention call
    (the kernels alone: the cost model's table and launch overhead, no executor costs), from
    the second step on, where it has tiles, one memory-bound merge of its output rows (forward)
    or sum of its dK/dV rows (backward), two slots read and one written, and in the first step
    the staging copy of its own rows. ``transfer_s`` is the slowest hop's transfer into step ``s``; in the backward
    the dK/dV partials of step ``s`` (in the dtype the plan's runtime sends them: the K/V dtype
    for ``ring``) share the hop with the K/V chunks of step ``s + 2`` (they travel while step
    ``s + 1`` computes), and the last dK/dV hop home is exposed. Times come from
    ``cost_model`` (default: the A100 table) and the plan's topology.

    Raises:
        ValueError: ``plan`` does not use ring routes.
    """
    if plan.placement.routing is not Routing.RING:
        raise ValueError(f"ring_step_seconds needs a ring plan, got routing {plan.placement.routing.value!r}")
    cm = (cost_model or CostModel.a100()).with_executor(None)
    wl, pl, topo = plan.workload, plan.placement, plan.topology
    w, itb, t = plan.world_size, pl.token_bytes(), plan.tables
    inter = topo.node_of((np.arange(w) - 1) % w) != topo.node_of(np.arange(w))
    rows = pl.rank_tokens().astype(np.float64)
    total = 0.0
    for backward in (False, True):
        # the attention of every (rank, step): one call; from the second step on, the output's
        # merge (forward) or the dK/dV partials' sum (backward): read two slots, write one
        cell = pl.tile_rank.astype(np.int64) * w + np.asarray(plan.tile_division, np.int64)
        compute = cm.launch_seconds(wl, np.arange(wl.n_tiles), cell, w * w, backward).reshape(w, w)
        row = itb[(True, Buf.DKV)] if backward else itb[(False, Buf.OPART)]
        busy = compute[:, 1:] > 0  # a step without tiles (a sparse mask's) has nothing to merge
        compute[:, 1:] += np.where(busy, cm.memory_seconds_array(3.0 * rows * row)[:, None], 0.0)
        # staging the rank's own K/V (and Q side) rows for the first step: read + write
        compute[:, 0] += cm.memory_seconds_array(2.0 * rows * (itb[(backward, Buf.KV)] + itb[(backward, Buf.Q)]))
        # bytes into rank r over the hop that overlaps step s - 1 (s = w + 1: after the last step)
        nbytes = np.zeros((w, w + 2))
        np.add.at(nbytes, (t["fetch_rank"], t["fetch_div"]), wl.block_len[t["fetch_block"]] * itb[(backward, Buf.KV)])
        if backward:
            np.add.at(nbytes, (t["ret_kv_dst"], t["ret_kv_div"] + 2),
                      wl.block_len[t["ret_kv_block"]] * itb[(True, Buf.DKV)])
        hop = np.array([[cm.transfer_seconds(nbytes[r, s], topo, bool(inter[r])) if nbytes[r, s] else 0.0
                         for s in range(w + 2)] for r in range(w)])
        total += sum(max(compute[:, s].max(), hop[:, s + 1].max()) for s in range(w)) + hop[:, w + 1].max()
    return float(total)


def ring_estimate_seconds(plan: Plan, cm: CostModel) -> float:
    """Forward + backward of a ring on its own runtime in closed form (seconds):
    :func:`te_ring_step_seconds`, plus, with a model that counts them, the runtime's own
    operations (torch_dcp's on ``Runtime.DCP_RING``, TransformerEngine's on ``Runtime.TE_RING``)
    in each of the ``W`` steps of both passes."""
    seconds = te_ring_step_seconds(plan, cm)
    ex = cm.executor
    steps = None if ex is None else {Runtime.DCP_RING: ex.ring, Runtime.TE_RING: _te_ring_steps(plan, cm)}.get(
        plan.placement.runtime)
    if steps is not None:
        seconds += plan.world_size * sum(steps)
    return float(seconds)


def allgather_pass_seconds(plan: Plan, cm: CostModel, backward: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pass of all-gather CP (module docstring), per rank: ``(gather seconds, reduce-scatter
    seconds (0 forward), compute seconds)``, float64 ``[W]`` each. Every CP group
    (:meth:`~torch_dcp.planners.base.Placement.cp_group`) gathers on its own ranks (the
    topology of :func:`~torch_dcp.planners.static.group_topology`); its shards are its ranks'
    K/V rows (its largest rank's, as NCCL pads them). Each rank's compute is one attention call
    over its queries and the gathered keys: the kernels alone (``Runtime.ALLGATHER``; where the
    model counts them, :attr:`~torch_dcp.cost.executor.ExecutorCosts.te_allgather` on a GPU
    preset, plus TransformerEngine's own device operations per pass on a rank that gathers, at
    the same cost per operation as torch_dcp's, and its K and V, dK and dV, each moved by a
    collective of its own), or, as
    torch_dcp's :class:`~torch_dcp.executor.allgather.AllGatherExecutor` runs it
    (``Runtime.DCP_ALLGATHER``), plus that runtime's own device operations per pass
    (:attr:`~torch_dcp.cost.executor.ExecutorCosts.allgather`: counted, on a GPU preset), or,
    for a model without that count (a CPU calibration), charged as one division and one pass
    of the executor. Computed once per plan, cost model and pass (:meth:`~torch_dcp.plan.Plan.memo`:
    the planner times these closed forms more than once); the arrays are read-only."""
    return plan.memo(("allgather_pass_seconds", bool(backward)), cm,
                     lambda: _allgather_pass_seconds(plan, cm, backward))


def _allgather_pass_seconds(plan: Plan, cm: CostModel, backward: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from ..planners.static import group_topology

    if plan.placement.runtime is Runtime.DCP_NODE_ALLGATHER:
        return _node_allgather_pass_seconds(plan, cm, backward)
    kern = cm.with_executor(None)
    wl, pl, topo, w = plan.workload, plan.placement, plan.topology, plan.world_size
    itb = pl.token_bytes()
    tokens = pl.rank_tokens()
    c = pl.cp_size or w
    gtopo = topo if c == w else group_topology(topo, c)
    rows = tokens.reshape(w // c, c).max(axis=1).astype(np.float64)
    ours = pl.runtime is Runtime.DCP_ALLGATHER
    ex = cm.executor
    # TransformerEngine's own operations where the model counts them (its K and V, and its dK and
    # dV, each by a collective of their own); torch_dcp's runtime moves K and V side by side
    te = None if ours or ex is None or c == 1 else ex.te_allgather
    calls = 1 if te is None else 2
    gather = np.array([calls * allgather_seconds(r * itb[(backward, Buf.KV)] / calls, gtopo) if c > 1 and r else 0.0
                       for r in rows])
    scatter = np.array([calls * reduce_scatter_seconds(r * itb[(True, Buf.DKV)] / calls, gtopo)
                        if c > 1 and r and backward else 0.0 for r in rows])
    tiles, cell = np.arange(wl.n_tiles), pl.tile_rank.astype(np.int64)
    if ours and ex is not None and ex.allgather is None:  # as one division and one pass of the executor
        compute = cm.launch_seconds(wl, tiles, cell, w, backward)
        compute = compute + np.atleast_1d(ex.pass_seconds(pass_local_bytes(plan, backward), backward))
    else:  # the kernels alone, plus the implementation's own counted operations
        compute = kern.launch_seconds(wl, tiles, cell, w, backward)
        if ours and ex is not None:
            compute = compute + ex.allgather[2 * (c > 1) + int(backward)]
        elif te is not None:
            compute = compute + te[int(backward)]
    return np.repeat(gather, c), np.repeat(scatter, c), compute


def _node_allgather_pass_seconds(plan: Plan, cm: CostModel,
                                 backward: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`allgather_pass_seconds` of the node-once all-gather
    (:mod:`torch_dcp.executor.allgather_node`; CP groups of ``n`` whole nodes of ``r`` ranks,
    shards of ``R`` rows): the near all-gather (``r`` ranks over NVLink, ``t0``) and the rail's
    (``n`` ranks, one per node, each rank's share of its node's rails, ``tA``) at once; the near
    keys' attention (``near``) from ``t0``; the far all-gather (``n - 1`` shards per rank on the
    node, ``tB``) once the rail's is in and the near attention enqueued; then the far keys'
    attention (``far``). The gather's exposed time is ``max(t0, tA - near) + tB`` (so that it
    plus the compute is ``max(t0 + near, tA) + tB + far``); compute is both calls plus the
    runtime's counted operations (:attr:`~torch_dcp.cost.executor.ExecutorCosts.node_allgather`),
    or, on a model without that count, two divisions and one pass of the executor. Backward:
    the same, then the node's sums of the far keys' dK/dV (``n - 1`` shards per rank on the
    node) and the rail's (``n`` ranks), and what the near keys' sums, posted behind the far
    gather, take beyond the far attention."""
    from ..planners.static import group_topology

    wl, pl, w = plan.workload, plan.placement, plan.world_size
    c = pl.cp_size or w
    g = group_topology(plan.topology, c)
    r, n = g.ranks_per_node, g.n_nodes
    near_topo = dataclasses.replace(g, n_nodes=1)
    rail_topo = dataclasses.replace(g, ranks_per_node=1, nics_per_node=1, inter_bandwidth=g.inter_bandwidth / r)
    itb = pl.token_bytes()
    rows = pl.rank_tokens().reshape(w // c, c).max(axis=1).astype(np.float64)  # each group's shard

    def seconds(shards: float, per_row: float, topo) -> np.ndarray:  # per rank: its group's collective
        return np.repeat([allgather_seconds(x * shards * per_row, topo) if x else 0.0 for x in rows], c)

    kv = itb[(backward, Buf.KV)]
    t0, t_rail, t_far = seconds(1, kv, near_topo), seconds(1, kv, rail_topo), seconds(n - 1, kv, near_topo)
    node = plan.topology.node_of(pl.block_rank)
    far_tile = (node[wl.tile_kv] != node[wl.tile_q]).astype(np.int64)
    cell = pl.tile_rank.astype(np.int64) * 2 + far_tile
    ex = cm.executor
    if ex is not None and ex.node_allgather is None:  # as two divisions and one pass of the executor
        calls = cm.launch_seconds(wl, np.arange(wl.n_tiles), cell, 2 * w, backward).reshape(w, 2)
        own = np.atleast_1d(ex.pass_seconds(pass_local_bytes(plan, backward), backward))
    else:  # the kernels alone, plus the runtime's counted operations
        calls = cm.with_executor(None).launch_seconds(wl, np.arange(wl.n_tiles), cell, 2 * w, backward).reshape(w, 2)
        own = np.zeros(w) if ex is None else np.full(w, ex.node_allgather[int(backward)])
    near, far = calls[:, 0], calls[:, 1]
    gather = np.maximum(t0, t_rail - near) + t_far
    scatter = np.zeros(w)
    if backward:
        dkv = itb[(True, Buf.DKV)]
        scatter = np.maximum(seconds(1, dkv, near_topo) - far, 0.0) + seconds(n - 1, dkv, near_topo) \
            + seconds(1, dkv, rail_topo)
    return gather, scatter, near + far + own


def simulate_allgather(plan: Plan, cm: CostModel, bound: float = float("inf")) -> SimResult:
    """All-gather CP's forward and backward (module docstring): in each pass every CP group
    takes its all-gather, then its slowest rank's compute, then (backward) its reduce-scatter;
    the pass ends with the slowest group, and on ranks that share fewer cores than there are
    ranks (the model's measured links say so) it takes at least their work and the collectives'
    host costs over the cores, as the other runtimes' passes do. ``bound`` is not used (the
    passes are closed forms)."""
    passes = []
    w = plan.world_size
    c = plan.placement.cp_size or w
    for backward in (False, True):
        gather, scatter, compute = allgather_pass_seconds(plan, cm, backward)
        finish = gather + compute
        group_end = np.repeat(finish.reshape(w // c, c).max(axis=1), c) + scatter
        span = float(group_end.max(initial=0.0))
        events = [[("all-gather", 0.0, float(g)), ("attention", float(g), float(f))]
                  + ([("reduce-scatter", float(e - s), float(e))] if s else []) for g, f, s, e in
                  zip(gather, finish, scatter, group_end)]
        # a rank ends with its attention, or (backward) with its group's reduce-scatter, which
        # waits for the group's slowest rank: the wait is exposed communication
        done = group_end if backward else finish
        # on ranks sharing fewer cores (gloo on a CPU), at least their work and the collectives' host costs
        # over the cores, as every runtime's pass
        passes.append(_on_shared_cores(plan, cm, PassResult(span, compute.copy(), done - compute, span - done, done,
                                                            events), backward))
    ideal = float(sum(p.busy_s.sum() for p in passes)) / w
    return SimResult(passes[0], passes[1], passes[0].makespan_s + passes[1].makespan_s, ideal)


#: runtime -> ``fn(plan, cost model, bound) -> SimResult | None`` (None: not faster than ``bound``)
RUNTIMES: dict[Runtime, Callable[..., SimResult | None]] = {
    Runtime.EXECUTOR: _simulate_executor,
    Runtime.TE_RING: _simulate_te_ring,
    Runtime.ALLGATHER: simulate_allgather,
    Runtime.DCP_ALLGATHER: simulate_allgather,
    Runtime.DCP_NODE_ALLGATHER: simulate_allgather,
    Runtime.DCP_RING: _simulate_dcp_ring,
}
