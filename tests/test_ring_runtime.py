"""Ring attention run as its authors run it (``torch_dcp.executor.ring``): exact against the
dense float64 reference in one process (every mask, GQA and MHA, 2-8 ranks, ranks without
tokens, as the outer plan of head parallelism: HCP) and on gloo."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torch_dcp
from torch_dcp import BatchSpec, Causal, Lambda, Topology
from torch_dcp.api import divide
from torch_dcp.executor import InProcessTransport, Mailbox, make_executor
from torch_dcp.executor.ring import RingExecutor
from torch_dcp.plan.heads import HeadLayout, HeadParallelPlan
from torch_dcp.planners import Runtime, plan_ring
from torch_dcp.sim.runtimes import on_executor
from reference import (assert_bf16_close, assert_replay_matches_eager, assert_stalled_peer_times_out, random_qkv,
                       reference_with_grads)
from spawn import run_ranks
from test_exact import HEADS, MASKS, _batch, _check


def _plan(batch, topo, runtime=Runtime.DCP_RING):
    return divide(dataclasses.replace(plan_ring(batch, topo), runtime=runtime), topo, topo.world_size)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_exact_every_mask_and_world(mask, world):
    heads = list(HEADS)[world % len(HEADS)]  # GQA and MHA over the world sizes
    batch = _batch(mask, heads)
    plan = _plan(batch, Topology.single_node(world))
    ex = make_executor(plan, 0, InProcessTransport(Mailbox(), 0))
    assert isinstance(ex, RingExecutor)
    _check(plan, batch)


def test_the_baseline_ring_plan_runs_on_it_and_the_executor_still_runs_its_layout():
    batch = _batch("causal", "gqa8/2-d32")
    topo = Topology.single_node(4)
    plan = torch_dcp.plan(batch, topo, planner="ring")
    assert plan.placement.runtime is Runtime.TE_RING
    assert isinstance(make_executor(plan, 1, InProcessTransport(Mailbox(), 1)), RingExecutor)
    _check(plan, batch)
    _check(on_executor(plan), batch)  # torch_dcp's general executor on the same layout
    with pytest.raises(ValueError, match="runs plans of runtime"):
        RingExecutor(on_executor(plan), 0, InProcessTransport(Mailbox(), 0))
    with pytest.raises(ValueError, match="device_plan must be None"):
        make_executor(plan, 0, InProcessTransport(Mailbox(), 0), device_plan=object())


@pytest.mark.parametrize("mask", ["causal", "lambda"])
def test_exact_with_the_varlen_kernel(mask):
    # the varlen kernel reads some key rows of a chunk several times: their dK/dV add up
    from torch_dcp.executor import AutoKernel, ReferenceKernel, VarlenKernel

    batch = _batch(mask, "gqa8/2-d32")
    _check(_plan(batch, Topology.single_node(4)), batch,
           kernel=AutoKernel(ReferenceKernel(), VarlenKernel(), min_rows=1))


def test_ranks_without_tokens_and_steps_without_tiles():
    # a 3-token document zig-zag over 4 ranks: one rank holds nothing, most steps have no tiles
    for lens, world in (([3], 4), ([40, 1], 8), ([5, 5], 3)):
        batch = BatchSpec(lens, Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float64")
        plan = _plan(batch, Topology.single_node(world))
        _check(plan, batch)


@pytest.mark.parametrize("mask", ["causal", "lambda", "ranges"])
@pytest.mark.parametrize("nodes,rpn,n", [(2, 4, 4), (4, 2, 2), (3, 2, 2)])
def test_exact_as_the_outer_plan_of_head_parallelism(mask, nodes, rpn, n):
    # HCP: head groups trading heads inside a node, the ring across the groups
    batch = _batch(mask, "gqa8/2-d32")
    topo = Topology(n_nodes=nodes, ranks_per_node=rpn)
    lay = HeadLayout.of(batch, n)
    ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
    plan = HeadParallelPlan(_plan(ob, ot), batch, topo, n, f"ring/hp{n}")
    assert isinstance(make_executor(plan, 0, InProcessTransport(Mailbox(), 0)).outer, RingExecutor)
    _check(plan, batch)


def test_bf16_dk_dv_passed_in_the_kv_dtype_stay_close():
    batch = _batch("causal", "gqa8/2-d32", dtype="bfloat16")
    plan = _plan(batch, Topology.single_node(4))
    assert_bf16_close(plan, batch)


# ---------------------------------------------------------------------- gloo
def _gloo_worker(rank: int, world: int, mesh) -> None:
    from reference import context_step_errors

    for mask, n in ((None, 1), (Lambda(sink=3, window=9), 1), (None, 2)):
        batch = BatchSpec([1, 19, 50, 6, 33, 2], mask, n_heads=8, n_kv_heads=2, head_dim=16, dtype="float32")
        topo = Topology.single_node(world)
        if n == 1:
            plan = _plan(batch, topo)
        else:  # HCP: 2-way head parallelism, the ring across the two head groups
            lay = HeadLayout.of(batch, n)
            ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
            plan = HeadParallelPlan(_plan(ob, ot), batch, topo, n, f"ring/hp{n}")
        q, k, v, go = random_qkv(batch, torch.float32, seed=2)
        ref = reference_with_grads(batch, q.double(), k.double(), v.double(), go.double())
        errs = context_step_errors(mesh, batch, rank, q, k, v, go, ref, plan=plan)
        assert max(errs.values()) <= 1e-5, f"rank {rank} mask {mask} hp{n}: {errs}"


    # layer replay records the runtime like any plan
    batch = BatchSpec([70, 13, 41, 90], Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype="float32")
    plan = _plan(batch, Topology.single_node(world))
    assert_replay_matches_eager(mesh, rank, plan, batch)


def test_gloo_context_parallel_exact(tmp_path):
    run_ranks(_gloo_worker, 4, tmp_path)


def _stalled_worker(rank: int, world: int, mesh) -> None:
    batch = BatchSpec([40, 24], Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float32")
    plan = _plan(batch, Topology.single_node(world))
    assert_stalled_peer_times_out(RingExecutor, plan, rank, "ring step")


def test_a_stalled_rank_times_out_every_other_within_the_timeout(tmp_path):
    run_ranks(_stalled_worker, 3, tmp_path, barrier=False)
