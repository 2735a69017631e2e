"""Simulate a plan as the implementation that runs it (its placement's ``runtime``;
:mod:`torch_dcp.sim.runtimes`), forward and backward: torch_dcp's executor on the programs'
timeline (:mod:`torch_dcp.sim.timeline`) with its costs, or a baseline's own
(TransformerEngine's ring, an NCCL all-gather); a head-parallel plan as its all-to-alls around
its outer plan's run.
"""

from __future__ import annotations


import numpy as np

from ..cost import CostModel
from ..plan import Plan
from ..plan.heads import HeadParallelPlan
from ..planners.base import Runtime
from .runtimes import RUNTIMES, all_to_all_ops_seconds, head_exchange_seconds, te_ring_step_seconds
from .timeline import PRUNE_MARGIN, PassResult, SimResult, _pass_traffic, _shared_links

__all__ = ["simulate", "simulate_within", "model_of", "ring_step_seconds", "SimResult", "PassResult", "PRUNE_MARGIN"]


def simulate(plan: Plan | HeadParallelPlan, cost_model: CostModel | str | None = None,
             runtime: Runtime | None = None) -> SimResult:
    """Simulate ``plan`` on its topology with ``cost_model`` (default: the model the plan was
    made with, :func:`model_of`), as ``runtime`` runs it (default: the plan's own,
    :class:`~torch_dcp.planners.base.Runtime`).

    torch_dcp's executor (``Runtime.EXECUTOR``): every rank's forward and backward programs run
    as a timeline: each attention launch takes ``FLOPs / throughput + launch_overhead`` seconds
    (throughput interpolated from the cost model's table by the work per launch; with the
    model's executor costs where it has them), reductions and copies bytes / memory bandwidth,
    and every message latency + bytes / bandwidth on its link: the sending and receiving
    rank's NVLink port inside a node, the rank's own network rail between nodes
    (:class:`~torch_dcp.Topology`); a rank's compute in a division starts when its inputs have
    arrived (the executor's ``CommWait``). A baseline's own implementation (ring attention as
    TransformerEngine runs it, an NCCL all-gather of K/V) is charged its own costs
    (:mod:`torch_dcp.sim.runtimes`). A head-parallel plan runs its all-to-all in, the
    outer plan (simulated on the groups' topology,
    :meth:`~torch_dcp.plan.heads.HeadLayout.outer_topology`) and its all-to-all out, one after
    the other in each pass; every rank of a group has its group's timeline. Ring attention's
    own step formula, to check the simulated ``ring`` against, is :func:`ring_step_seconds`.

    Args:
        plan: a :class:`~torch_dcp.Plan` or :class:`~torch_dcp.plan.heads.HeadParallelPlan`
            (its batch gives the FLOPs and bytes: heads, head_dim, dtype).
        cost_model: a :class:`~torch_dcp.CostModel` or a name :meth:`CostModel.load` takes;
            ``None``: the model that timed the plan's candidates (``plan.cost_model``), else
            the A100 table (:func:`model_of`).
        runtime: the implementation whose costs to charge; ``None``: ``plan``'s own
            (``Runtime.EXECUTOR`` to time a baseline's plan as torch_dcp's executor runs it).

    Returns:
        :class:`SimResult`: ``forward`` and ``backward`` :class:`PassResult` (per-rank busy,
        exposed-communication, idle and finish times, seconds, and each rank's events),
        ``makespan_s`` (forward + backward makespans, seconds), ``ideal_s`` (the compute
        floor: all ranks' compute over the world size, seconds) and ``ratio_to_ideal``.

    Raises:
        RuntimeError: the programs deadlock (a plan that does not validate).
        ValueError: a cost model name :meth:`CostModel.load` does not know.
    """
    result = simulate_within(plan, cost_model, runtime=runtime)
    assert result is not None  # no bound: always simulated
    return result


def model_of(plan: Plan | HeadParallelPlan, cost_model: CostModel | str | None = None) -> CostModel:
    """The cost model to time ``plan`` with: ``cost_model`` where given (a model or a name
    :meth:`CostModel.load` takes), else the model :func:`torch_dcp.plan` timed the plan's
    candidates with (``plan.cost_model``, its ``source``: :meth:`CostModel.from_source`), else
    the A100 table (a plan made without a model).

    Raises:
        ValueError: a name or source that no model answers to.
    """
    if cost_model is not None:
        return CostModel.load(cost_model)
    made_with = getattr(plan, "cost_model_object", None)
    if made_with is not None:
        return made_with
    source = getattr(plan, "cost_model", "")
    return CostModel.from_source(source) if source else CostModel.a100()

def simulate_within(plan: Plan | HeadParallelPlan, cost_model: CostModel | str | None = None,
                    bound: float = float("inf"), runtime: Runtime | None = None) -> SimResult | None:
    """:func:`simulate`, or None where the run cannot take less than ``bound`` seconds: the
    forward pass runs first, and if it plus the backward's floor (the larger of
    :func:`kernel_floor_seconds` and :func:`link_floor_seconds` of the backward; a
    head-parallel plan's all-to-alls added) exceeds ``bound`` (by :data:`PRUNE_MARGIN`), the
    backward is not simulated. :func:`torch_dcp.plan` times its candidates so: a loser's
    backward costs nothing, and the fastest is the same as with every run complete.

    Raises:
        RuntimeError: the programs deadlock (a plan that does not validate).
    """
    cm = model_of(plan, cost_model)
    if isinstance(plan, HeadParallelPlan):
        inner = simulate_within(plan.outer, cm, bound - head_exchange_seconds(plan, cm), runtime)
        return None if inner is None else _simulate_heads(plan, inner, cm)
    return RUNTIMES[plan.placement.runtime if runtime is None else runtime](plan, cm, bound)

def _simulate_heads(plan: HeadParallelPlan, inner: SimResult, cm: CostModel) -> SimResult:
    """The head-parallel plan's run from its outer plan's (``inner``): the all-to-all in, the
    outer plan's pass, the all-to-all out, and the device operations its implementation issues
    around them (:func:`~torch_dcp.sim.runtimes.all_to_all_ops_seconds`, charged with the
    all-to-all in);
    on shared cores (as :func:`_on_shared_cores`) each pass takes at least every rank's busy time
    plus the host costs of the outer plan's transfers (in every head group) and of the
    all-to-alls, over the cores."""
    n = plan.head_parallel
    links = _shared_links(cm, plan.world_size)
    passes = []
    for res, backward in ((inner.forward, False), (inner.backward, True)):
        ops = all_to_all_ops_seconds(plan, cm, backward)
        a_in, a_out = plan.all_to_all_seconds(backward, "in") + ops, plan.all_to_all_seconds(backward, "out")
        span = a_in + res.makespan_s + a_out
        if links is not None:
            nbytes, transfers = _pass_traffic(plan.outer, backward)
            a2a = [plan.all_to_all_bytes(backward, way) for way in ("in", "out")]
            span = max(span, links.shared_seconds(float(res.busy_s.sum()) * n,
                                                  nbytes * n + sum(float(m.sum()) for m in a2a),
                                                  transfers * n + sum(int(np.count_nonzero(m)) for m in a2a)))
        head = [("all-to-all", 0.0, a_in - ops)] + ([("all-to-all ops", a_in - ops, a_in)] if ops else [])
        events = [head + [(k, s + a_in, e + a_in) for k, s, e in ev]
                  + [("all-to-all", a_in + res.makespan_s, span)] for ev in res.events for _ in range(n)]
        passes.append(PassResult(span, np.repeat(res.busy_s, n) + ops,
                                 np.repeat(res.exposed_comm_s, n) + a_in - ops + a_out,
                                 np.repeat(res.idle_s, n), np.full(plan.world_size, span), events))
    return SimResult(passes[0], passes[1], passes[0].makespan_s + passes[1].makespan_s, inner.ideal_s)

def ring_step_seconds(plan: Plan, cost_model: CostModel | str | None = None) -> float:
    """Ring attention's own step formula as TransformerEngine runs it, forward + backward
    (seconds): :func:`torch_dcp.sim.runtimes.te_ring_step_seconds` (its docstring has the formula
    and its source); ``cost_model`` as in :func:`simulate`.

    Raises:
        ValueError: ``plan`` does not use ring routes.
    """
    return te_ring_step_seconds(plan, model_of(plan, cost_model))
