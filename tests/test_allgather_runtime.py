"""All-gather CP run as its authors run it (``torch_dcp.executor.allgather``): exact against the
dense float64 reference in one process and on gloo, priced as it runs, among dcp's candidates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torch_dcp
from torch_dcp import BatchSpec, Causal, Lambda, Topology
from torch_dcp.plan import load_plan
from torch_dcp.plan.heads import HeadLayout, HeadParallelPlan
from torch_dcp.api import divide
from torch_dcp.benchmarks.static_cp import static_cp_seconds
from torch_dcp.executor import InProcessTransport, Mailbox, make_executor
from torch_dcp.executor.allgather import AllGatherExecutor, collective_groups
from torch_dcp.planners import Runtime, plan_allgather
from torch_dcp.planners.documents import plan_documents
from torch_dcp.planners.static import cp_sizes
from torch_dcp.sim.runtimes import on_executor
from torch_dcp.sim.simulate import simulate
from reference import (assert_bf16_close, assert_replay_matches_eager, assert_stalled_peer_times_out,
                       context_step_errors, random_qkv, reference_attention, reference_with_grads)
from spawn import run_ranks
from test_exact import HEADS, MASKS, _batch, _check

#: (world size, CP size): the whole group at 2, 3 and 8 ranks, CP groups of 2 and 4, and of 1
#: (every rank its own documents: no collective)
GROUPS = [(2, None), (3, None), (4, 2), (8, 4), (8, None), (4, 1)]


def _plan(batch, world, cp, divisions=2):
    topo = Topology.single_node(world)
    return divide(plan_allgather(batch, topo, cp_size=cp), topo, divisions)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("world,cp", GROUPS)
def test_exact_every_mask_and_group(mask, world, cp):
    heads = list(HEADS)[GROUPS.index((world, cp)) % len(HEADS)]  # GQA and MHA over the groups
    batch = _batch(mask, heads)
    plan = _plan(batch, world, cp)
    assert plan.placement.runtime is Runtime.ALLGATHER and plan.placement.cp_size == cp
    _check(plan, batch)


@pytest.mark.parametrize("mask", ["causal", "lambda"])
def test_exact_with_the_varlen_kernel(mask):
    # the varlen kernel reads some key rows several times (its segments): their dK/dV add up
    from torch_dcp.executor import AutoKernel, ReferenceKernel, VarlenKernel

    batch = _batch(mask, "gqa8/2-d32")
    for world, cp in ((4, None), (4, 1), (8, 4)):
        _check(_plan(batch, world, cp), batch, kernel=AutoKernel(ReferenceKernel(), VarlenKernel(), min_rows=1))


def test_a_cp_group_without_documents_and_a_rank_without_tokens():
    # one document over 4 ranks in CP groups of 2: the second group holds nothing; and a
    # 3-token document zig-zag over 4 ranks: a rank of the first group holds nothing either
    for lens, world, cp in (([40], 4, 2), ([3], 4, 4), ([40, 1], 8, 2)):
        batch = BatchSpec(lens, Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float64")
        plan = _plan(batch, world, cp, divisions=1)
        assert min(plan.local_tokens(r) for r in range(world)) == 0
        _check(plan, batch)


@pytest.mark.parametrize("mask", ["causal", "lambda", "ranges"])
@pytest.mark.parametrize("nodes,rpn,n,cp", [(2, 4, 4, 1), (2, 4, 4, 2), (1, 4, 2, 1), (2, 2, 2, 2)])
def test_exact_as_the_outer_plan_of_head_parallelism(mask, nodes, rpn, n, cp):
    # Ulysses' shape (head groups trading heads, each rank one attention call over its group's
    # documents: CP groups of one outer rank) and all-gather across the head groups
    batch = _batch(mask, "gqa8/2-d32")
    topo = Topology(n_nodes=nodes, ranks_per_node=rpn)
    lay = HeadLayout.of(batch, n)
    ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
    plan = HeadParallelPlan(divide(plan_allgather(ob, ot, cp_size=cp), ot, 1), batch, topo, n, f"allgather/hp{n}")
    ex = make_executor(plan, 0, InProcessTransport(Mailbox(), 0))
    assert isinstance(ex.outer, AllGatherExecutor)
    _check(plan, batch)


def test_runs_on_its_own_executor_with_collectives_only():
    batch = _batch("causal", "gqa8/2-d32")
    plan = _plan(batch, 4, 2)
    mailbox = Mailbox()
    ex = make_executor(plan, 1, InProcessTransport(mailbox, 1))
    assert isinstance(ex, AllGatherExecutor) and ex.members == (0, 1)
    with pytest.raises(ValueError, match="device_plan must be None"):
        make_executor(plan, 1, InProcessTransport(mailbox, 1), device_plan=object())
    other = divide(plan_allgather(batch, Topology.single_node(4)), Topology.single_node(4), 2)
    with pytest.raises(ValueError, match="runs plans of runtime"):
        AllGatherExecutor(on_executor(other), 0, InProcessTransport(mailbox, 0))
    # the plan carries its CP size through serialisation and into its digest
    back = load_plan(plan.to_bytes())
    assert back.placement.cp_size == 2 and back.placement.runtime is Runtime.ALLGATHER
    assert back.digest() == plan.digest() != _plan(batch, 4, 4).digest()
    with pytest.raises(ValueError, match="dividing the world size"):
        plan_allgather(batch, Topology.single_node(4), cp_size=3)


def test_bf16_dk_dv_reduced_in_the_kv_dtype_stay_close():
    batch = _batch("causal", "gqa8/2-d32", dtype="bfloat16")
    plan = _plan(batch, 4, None)
    assert_bf16_close(plan, batch)


def test_priced_per_cp_group_as_the_static_configuration():
    batch = BatchSpec([30000, 9000, 7000, 5000, 3000, 2000, 1000, 500], Causal(), n_heads=8, n_kv_heads=2,
                      head_dim=128, dtype="bfloat16")
    topo = Topology.preset("h100", n_nodes=2)
    cm = torch_dcp.CostModel.load("h100-executor")
    static = static_cp_seconds("allgather", batch, topo, cm)
    assert sorted(static) == cp_sizes("allgather", batch, topo) == [8, 16]
    for c, want in static.items():
        got = simulate(divide(plan_allgather(batch, topo, cp_size=c), topo, 4), cm).makespan_s
        assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_placement_that_moves_nothing_runs_alone_exactly(mask, world):
    """Every document whole on one rank with its tiles: the placement runs alone (one attention
    call per rank and pass on the all-gather runtime, CP groups of one rank), exact; a placement
    that moves a block, or runs on another runtime, does not."""
    heads = list(HEADS)[world % len(HEADS)]
    batch = _batch(mask, heads)
    topo = Topology.single_node(world)
    docs = plan_documents(batch, topo, 64)
    alone = docs.alone()
    assert alone is not None and alone.runtime is Runtime.DCP_ALLGATHER and alone.cp_size == 1
    assert (alone.block_rank == docs.block_rank).all() and (alone.tile_rank == docs.tile_rank).all()
    plan = divide(alone, topo, 1)
    assert isinstance(make_executor(plan, 0, InProcessTransport(Mailbox(), 0)), AllGatherExecutor)
    _check(plan, batch)
    moved = docs.tile_rank.copy()
    moved[-1] = (moved[-1] + 1) % world
    assert dataclasses.replace(docs, tile_rank=moved).alone() is None
    assert plan_allgather(batch, topo, cp_size=1).alone() is None  # already its own runtime


def test_dcp_candidates_that_move_nothing_run_alone():
    # a long-tail causal batch on 2 x 8 H100s: every candidate that moves nothing runs alone (at
    # N = 8, one head group per node, some of dcp's own placements keep every document whole on
    # one; at N = 1 and 2 they all move blocks)
    from torch_dcp.api import _plans_at

    batch = BatchSpec([9000, 3000] + [400] * 30, Causal(), n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
    topo = Topology.preset("h100", n_nodes=2)
    for n in (1, 2, 8):
        plans = _plans_at(batch, topo, "dcp", n, 1024, None, "dcp", {})
        outer = [p.outer if n > 1 else p for p in plans]
        assert all(o.placement.alone() is None for o in outer)  # none left on the executor
        assert any(o.placement.runtime is Runtime.DCP_ALLGATHER and o.placement.cp_size == 1
                   and not o.planner.startswith("dcp:allgather") for o in outer) == (n == 8)


def test_among_dcp_candidates_and_chosen_where_fastest():
    # a corpus-like causal batch on 2 x 8 H100s: all-gather CP on its runtime at some CP size is
    # among the candidates, always simulated, and the plan returned is never slower than it
    batch = BatchSpec([6000, 5000, 4000] + [700] * 20, Causal(), n_heads=8, n_kv_heads=2, head_dim=128,
                      dtype="bfloat16")
    topo = Topology.preset("h100", n_nodes=2)
    plan = torch_dcp.plan(batch, topo, cost_model="h100-executor")
    static = [label for label, _ in plan.candidates if label.startswith("dcp:allgather/cp")]
    assert static[:2] == ["dcp:allgather/cp8", "dcp:allgather/cp16"]
    assert "dcp:allgather/cp1/hp8" in static  # Ulysses' shape, one node per head group
    best = simulate(plan).makespan_s
    for c in (8, 16):  # simulated, or skipped because its floor lies above a faster candidate
        ours = dataclasses.replace(plan_allgather(batch, topo, cp_size=c), runtime=Runtime.DCP_ALLGATHER)
        assert best <= simulate(divide(ours, topo, 1), plan.cost_model_object).makespan_s * (1 + 1e-9)
    # the CP groups created at context entry for rank 0: CP size 8 at N = 1 (and, for the whole
    # group's node-once all-gather, the rail {0, 8}: its node group is the CP group of 8); at each
    # N > 1 its head group (head parallelism's all-to-alls; at N = 8 the node, listed already), then
    # outer CP groups of 4 and 8 head groups at N = 2, 2 and 4 at N = 4, 2 at N = 8 (ranks of
    # inner index 0), each listed once
    assert collective_groups(plan, 0) == [tuple(range(8)), (0, 8), (0, 1), (0, 2, 4, 6), tuple(range(0, 16, 2)),
                                          (0, 1, 2, 3), (0, 4), (0, 4, 8, 12)]
    assert collective_groups(plan, 5)[:4] == [tuple(range(8)), (5, 13), (4, 5), (1, 3, 5, 7)]


# ---------------------------------------------------------------------- gloo
def _gloo_worker(rank: int, world: int, mesh) -> None:
    for mask, cp in ((None, 2), (Lambda(sink=3, window=9), None)):
        batch = BatchSpec([1, 19, 50, 6, 33, 2], mask, n_heads=8, n_kv_heads=2, head_dim=16, dtype="float32")
        plan = _plan(batch, world, cp)
        q, k, v, go = random_qkv(batch, torch.float32, seed=2)
        ref = reference_with_grads(batch, q.double(), k.double(), v.double(), go.double())
        errs = context_step_errors(mesh, batch, rank, q, k, v, go, ref, plan=plan)
        assert max(errs.values()) <= 1e-5, f"rank {rank} cp {cp}: {errs}"


    # all-gather across head groups: 2-way head parallelism, the two head groups one CP group
    # (the collectives on the ranks of one inner index: {0, 2} and {1, 3}, created at entry)
    batch = BatchSpec([1, 19, 50, 6, 33, 2], None, n_heads=8, n_kv_heads=2, head_dim=16, dtype="float32")
    lay = HeadLayout.of(batch, 2)
    topo = Topology.single_node(world)
    ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
    plan = HeadParallelPlan(divide(plan_allgather(ob, ot, cp_size=2), ot, 1), batch, topo, 2, "allgather/cp2/hp2")
    q, k, v, go = random_qkv(batch, torch.float32, seed=3)
    ref = reference_with_grads(batch, q.double(), k.double(), v.double(), go.double())
    errs = context_step_errors(mesh, batch, rank, q, k, v, go, ref, plan=plan)
    assert max(errs.values()) <= 1e-5, f"rank {rank} hp2/cp2: {errs}"

    # B > 1: the rank's tokens in two rows of one SDPA call ([B, H, S_local / B, D])
    batch = BatchSpec([8, 12, 4, 8], Causal(), n_heads=2, n_kv_heads=2, head_dim=4, dtype="float64")
    plan = _plan(batch, world, 2)
    q, k, v = (torch.randn(1, 2, 32, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
               for s in range(3))
    with torch_dcp.context_parallel(mesh, plan=plan) as ctx:
        idx = torch.from_numpy(ctx.plan.token_indices(rank))
        n = len(idx)
        ql, kl, vl = (t[:, :, idx].clone().requires_grad_(True) for t in (q, k, v))
        b = 2 if n % 2 == 0 and n else 1
        out = torch.nn.functional.scaled_dot_product_attention(
            *(t[0].unflatten(1, (b, n // b)).transpose(0, 1) for t in (ql, kl, vl)), is_causal=True)
        out.square().sum().backward()
    qg, kg, vg = (t[0].transpose(0, 1).clone().requires_grad_(True) for t in (q, k, v))
    ref = reference_attention(batch, qg, kg, vg)
    ref.square().sum().backward()
    got = out.detach().transpose(0, 1).flatten(1, 2).transpose(0, 1)
    assert torch.allclose(got, ref.detach()[idx], atol=1e-10)
    for grad, want in ((ql.grad, qg.grad), (kl.grad, kg.grad), (vl.grad, vg.grad)):
        assert torch.allclose(grad[0].transpose(0, 1), want[idx], atol=1e-10)


    # layer replay records the runtime like any plan
    batch = BatchSpec([70, 13, 41, 90], Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype="float32")
    plan = _plan(batch, world, 2)
    assert_replay_matches_eager(mesh, rank, plan, batch)


def test_gloo_context_parallel_exact(tmp_path):
    run_ranks(_gloo_worker, 4, tmp_path)


def _stalled_worker(rank: int, world: int, mesh) -> None:
    batch = BatchSpec([40, 24], Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float32")
    plan = _plan(batch, world, None)
    assert_stalled_peer_times_out(AllGatherExecutor, plan, rank, "all-gather")


def test_a_stalled_peer_times_out_on_every_waiting_rank(tmp_path):
    run_ranks(_stalled_worker, 3, tmp_path, barrier=False)


def test_on_shared_cores_a_pass_takes_the_ranks_work_over_the_cores():
    """Ranks that share fewer cores than there are ranks (gloo on a CPU, the model's measured
    links say so): an all-gather pass takes at least the ranks' work plus the collectives' host
    costs over the cores, as the executor's passes do, so that the planner does not prefer the
    all-gather for missing that floor."""
    from torch_dcp.cost import CostModel, Links
    from torch_dcp.cost.auto import PRESET_DIR

    topo = Topology(n_nodes=1, ranks_per_node=4)
    batch = BatchSpec([3000, 1000, 700, 300], Causal(), n_heads=4, n_kv_heads=2, head_dim=32, dtype="float32")
    plan = divide(dataclasses.replace(plan_allgather(batch, topo), runtime=Runtime.DCP_ALLGATHER), topo, 1)
    base = CostModel.load(str(PRESET_DIR / "cpu.json"))
    links = Links(latency=1.7e-4, bandwidth=1.1e9, world_size=4, backend="gloo", cores=2,
                  host_byte_seconds=1.1e-9, host_message_seconds=7.7e-5)
    alone, shared = simulate(plan, base), simulate(plan, dataclasses.replace(base, links=links))
    for backward in (False, True):
        a, s = (alone.backward, shared.backward) if backward else (alone.forward, shared.forward)
        _, _, nb, fwd = plan.transfers()
        mine = fwd != backward
        floor = links.shared_seconds(float(a.busy_s.sum()), float(nb[mine].sum()), int(mine.sum()))
        assert s.makespan_s == pytest.approx(max(a.makespan_s, floor))
        assert floor > a.makespan_s  # 4 ranks' work on 2 cores: the floor binds here
