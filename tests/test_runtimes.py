"""The baselines as their own implementations run them (torch_dcp.sim.runtimes): TransformerEngine's
ring against its step formula, all-gather CP against NCCL's collectives, and simulate() timing a
plan with the model it was made with."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import torch_dcp
from torch_dcp import BatchSpec, Causal, CostModel, Full, Lambda, Topology
from torch_dcp.benchmarks.common import bench_batch, paper_batches
from torch_dcp.cost.collectives import Algorithm, algorithm_of, allgather_seconds, reduce_scatter_seconds
from torch_dcp.planners import Runtime
from torch_dcp.plan import load_plan
from torch_dcp.sim.runtimes import allgather_pass_seconds, on_executor
from torch_dcp.sim.simulate import ring_step_seconds, simulate
from torch_dcp.workload import Buf, item_token_bytes


@pytest.fixture(scope="module")
def longtail():
    return paper_batches(0.5, 65536)["longtail"]


@pytest.mark.parametrize("preset,nodes,cost", [("a100", 4, "a100-executor"), ("h100", 1, "h100-executor")],
                         ids=["a100-4x8", "h100-1x8"])
@pytest.mark.parametrize("mask", [Causal(), Lambda(sink=64, window=4096)], ids=["causal", "lambda"])
def test_ring_is_transformer_engines_step_formula(preset, nodes, cost, mask, longtail):
    """Simulated ring attention with the kernels alone within 0.9-1.1x of TransformerEngine's
    step formula (per step one attention call and one merge, the transfer overlapped with the
    previous step's compute, dK/dV in the K/V dtype); under the executor presets TE's ring pays
    its own operations per step, not torch_dcp's executor's per division."""
    batch = bench_batch(longtail, mask)
    kernels = cost.split("-")[0]
    plan = torch_dcp.plan(batch, Topology.preset(preset, n_nodes=nodes), planner="ring", cost_model=kernels)
    assert plan.placement.runtime is Runtime.TE_RING
    sim, formula = simulate(plan).makespan_s, ring_step_seconds(plan)
    assert 0.9 <= sim / formula <= 1.1, (sim, formula)
    # its counted operations per step in place of the merges' bytes and launches
    counted = simulate(plan, cost).makespan_s
    assert counted != pytest.approx(sim, rel=1e-3)
    assert counted < sim + plan.world_size * sum(CostModel.load(cost).executor.te_ring)
    # torch_dcp's executor running the same plan pays its own per-division costs (the ranks' busy
    # time; both move the same bytes, dK/dV in the K/V dtype, so a ring bound by its rails, A100
    # 4 x 8, takes about the same time on either)
    busy = lambda r: float(r.forward.busy_s.sum() + r.backward.busy_s.sum())  # noqa: E731
    assert busy(simulate(on_executor(plan), cost)) != pytest.approx(busy(simulate(plan, cost)), rel=1e-3)


def test_ring_runtimes_pay_their_own_counted_operations_per_step(longtail):
    """On a GPU preset TransformerEngine's ring and torch_dcp's ring runtime share one timeline
    (the same steps and transfers, dK/dV in the K/V dtype) and differ only in the device
    operations each issues per step: TransformerEngine's counted from its source, torch_dcp's
    under fake CUDA, both at the preset's cost per operation."""
    import json

    from torch_dcp.cost.model import GPU_EXECUTOR_PRESET
    from torch_dcp.sim.runtimes import ring_estimate_seconds, te_ring_step_seconds

    preset = json.loads(GPU_EXECUTOR_PRESET.read_text())
    per_op, te, ours = preset["seconds_per_op"], preset["baselines"]["te_ring"], preset["counted"]["ring"]
    cm = CostModel.load("h100-executor")
    assert cm.executor.te_ring == pytest.approx((te["forward"] * per_op, te["backward"] * per_op))
    assert cm.executor.ring == pytest.approx((ours["forward"] * per_op, ours["backward"] * per_op))
    topo = Topology.preset("h100", n_nodes=1)
    baseline = torch_dcp.plan(bench_batch(longtail, Causal()), topo, planner="ring", cost_model="h100")
    mine = torch_dcp.Plan(dataclasses.replace(baseline.placement, runtime=Runtime.DCP_RING), topo,
                          baseline.tile_division, baseline.divisions)
    same = cm.with_executor(dataclasses.replace(cm.executor, te_ring=cm.executor.ring))
    assert simulate(baseline, same).makespan_s == pytest.approx(simulate(mine, same).makespan_s, rel=1e-12)
    assert simulate(baseline, cm).makespan_s != pytest.approx(simulate(mine, cm).makespan_s, rel=1e-3)
    for plan, steps in ((baseline, cm.executor.te_ring), (mine, cm.executor.ring)):
        extra = ring_estimate_seconds(plan, cm) - te_ring_step_seconds(plan, cm)
        assert extra == pytest.approx(topo.world_size * sum(steps), rel=1e-9)
    # Ulysses on one node: an outer ring of one rank, which TransformerEngine does not run as a ring
    ulysses = torch_dcp.plan(bench_batch(longtail, Causal()), topo, planner="ulysses", cost_model="h100")
    assert ulysses.outer.world_size == 1 and ulysses.outer.placement.runtime is Runtime.TE_RING
    # (its a2a's own operations per pass, with its one attention call, are its only fixed costs)
    a2a_ops = sum(cm.executor.te_a2a[:2])
    assert simulate(ulysses, cm).makespan_s == pytest.approx(simulate(ulysses, "h100").makespan_s + a2a_ops, rel=1e-12)


def test_ring_sends_dkv_in_the_kv_dtype():
    """TransformerEngine's ring and torch_dcp's executor running the same ring move the same
    bytes: K/V, and dK/dV partials in the K/V dtype (the executor casts its float32 partials)."""
    batch = BatchSpec([3000, 900, 5000], Causal(), n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
    plan = torch_dcp.plan(batch, Topology(n_nodes=2, ranks_per_node=2), planner="ring")
    te, ours = plan.stats(), on_executor(plan).stats()
    assert (te["fwd_comm_bytes"], te["bwd_comm_bytes"]) == (ours["fwd_comm_bytes"], ours["bwd_comm_bytes"])
    itb = item_token_bytes(batch)
    assert itb[(True, Buf.DKV)] == itb[(True, Buf.KV)] and itb[(True, Buf.DQ)] == 8 * 128 * 4  # dQ stays float32
    assert load_plan(plan.to_bytes()).placement.runtime is Runtime.TE_RING  # serialised with the plan


def test_nccl_collectives_by_hand():
    topo = Topology(n_nodes=4, ranks_per_node=8, intra_bandwidth=300e9, intra_latency=3e-6, inter_bandwidth=50e9,
                    inter_latency=15e-6, nics_per_node=4)
    shard = 4 * 2**20
    # NCCL's ring (the default): every ring into a node carries the W - 1 = 31 other shards over the
    # node's 4 rails, each rank 31 shards over NVLink; 28 hops inside nodes, 3 across
    inter, intra = 31 * shard / 50e9, 31 * shard / 300e9
    assert allgather_seconds(shard, topo) == pytest.approx(28 * 3e-6 + 3 * 15e-6 + max(inter, intra))
    assert reduce_scatter_seconds(shard, topo) == allgather_seconds(shard, topo)
    # with in-network reduction every remote shard enters each node once: 24 shards, 1.29x fewer
    sharp = dataclasses.replace(topo, in_network_reduction=True)
    inter, intra = 3 * 8 * shard / 50e9, 7 * 4 * shard / 300e9
    assert allgather_seconds(shard, sharp) == pytest.approx(7 * 3e-6 + 3 * 15e-6 + max(inter, intra))
    assert allgather_seconds(shard, topo, Algorithm.NODE_ONCE) == allgather_seconds(shard, sharp)
    assert algorithm_of(topo) is Algorithm.RING and algorithm_of(sharp) is Algorithm.NODE_ONCE
    two = Topology(n_nodes=2, ranks_per_node=8)  # the ring carries 15 / 8 = 1.875x the node-once bytes
    big = 2**30
    assert allgather_seconds(big, two) / allgather_seconds(big, two, Algorithm.NODE_ONCE) == pytest.approx(
        1.875, rel=1e-3)
    with pytest.raises(ValueError, match="in_network_reduction must be a bool"):
        Topology(in_network_reduction="yes")
    assert Topology.from_dict(sharp.to_dict()) == sharp
    one = Topology(n_nodes=1, ranks_per_node=8)
    assert allgather_seconds(shard, one) == pytest.approx(7 * one.intra_latency + 7 * shard / one.intra_bandwidth)
    assert allgather_seconds(0, topo) == 0 and allgather_seconds(shard, Topology(n_nodes=1, ranks_per_node=1)) == 0
    with pytest.raises(ValueError, match="shard_bytes"):
        allgather_seconds(-1, topo)


@pytest.mark.parametrize("preset,nodes", [("a100", 4), ("h100", 1)])
def test_allgather_is_nccl_collectives_plus_compute(preset, nodes, longtail):
    """All-gather CP: one NCCL all-gather of K/V per pass, TE's reduce-scatter of dK/dV in the K/V
    dtype, the compute after them: at most 1.25x a hierarchical all-gather / reduce-scatter (the
    inter-node and NVLink stages one after the other) plus the slowest rank's compute."""
    topo = Topology.preset(preset, n_nodes=nodes)
    batch = bench_batch(longtail, Causal())
    plan = torch_dcp.plan(batch, topo, planner="allgather", cost_model=f"{preset}-executor")
    assert plan.placement.runtime is Runtime.ALLGATHER
    sim = simulate(plan).makespan_s
    itb = item_token_bytes(batch)
    shard = float(plan.placement.rank_tokens().max())
    n, r = topo.n_nodes, topo.ranks_per_node

    def hierarchical(nbytes):
        return ((r - 1) * topo.intra_latency + (n - 1) * topo.inter_latency
                + (n - 1) * r * nbytes / topo.inter_bandwidth + (r - 1) * n * nbytes / topo.intra_bandwidth)

    model = CostModel.load(f"{preset}-executor")
    compute = sum(allgather_pass_seconds(plan, model, bw)[2].max() for bw in (False, True))
    # TransformerEngine's: K and V (dK and dV) each by a collective of its own
    reference = 2 * (2 * hierarchical(shard * itb[(False, Buf.KV)] / 2)
                     + hierarchical(shard * itb[(True, Buf.KV)] / 2)) + compute
    assert sim <= 1.25 * reference
    assert sim >= compute  # never faster than its own compute
    # the point-to-point all-gather the executor would run moves each block once per fetching rank
    assert simulate(on_executor(plan)).makespan_s > sim


def test_allgather_baseline_pays_its_own_counted_operations(longtail):
    """On a GPU preset the baseline's all-gather CP is charged TransformerEngine's device
    operations per pass (counted from its source: more than torch_dcp's runtime issues), each at
    the preset's cost per operation; with the kernel table alone, none."""
    import json

    from torch_dcp.cost.model import GPU_EXECUTOR_PRESET

    topo = Topology.preset("h100", n_nodes=1)
    plan = torch_dcp.plan(bench_batch(longtail, Causal()), topo, planner="allgather", cost_model="h100-executor")
    preset = json.loads(GPU_EXECUTOR_PRESET.read_text())
    te, per_op = preset["baselines"]["te_allgather"], preset["seconds_per_op"]
    assert te["forward"] > preset["counted"]["gathered"]["forward"]
    assert te["backward"] > preset["counted"]["gathered"]["backward"]
    model, kern = CostModel.load("h100-executor"), CostModel.load("h100")
    for bw, name in ((False, "forward"), (True, "backward")):
        extra = allgather_pass_seconds(plan, model, bw)[2] - allgather_pass_seconds(plan, kern, bw)[2]
        assert extra == pytest.approx(np.full(topo.world_size, te[name] * per_op), rel=1e-9)
    # torch_dcp's runtime on the same layout pays its own count, not TransformerEngine's
    ours = dataclasses.replace(plan.placement, runtime=Runtime.DCP_ALLGATHER)
    ours_plan = torch_dcp.Plan(ours, topo, plan.tile_division, plan.divisions)
    extra = allgather_pass_seconds(ours_plan, model, True)[2] - allgather_pass_seconds(ours_plan, kern, True)[2]
    assert extra == pytest.approx(np.full(topo.world_size, preset["counted"]["gathered"]["backward"] * per_op))


def test_simulate_uses_the_model_the_plan_was_made_with():
    batch = BatchSpec([4000, 900, 3000, 200], Causal(), n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
    topo = Topology(n_nodes=1, ranks_per_node=4)
    plan = torch_dcp.plan(batch, topo, planner="dcp", block_size=512, cost_model="h100-executor")
    h100 = simulate(plan, "h100-executor").makespan_s
    assert simulate(plan).makespan_s == h100
    assert simulate(plan, CostModel.a100()).makespan_s != h100  # another model when given
    loaded = load_plan(plan.to_bytes())  # the source's name alone
    assert loaded.cost_model == plan.cost_model and simulate(loaded).makespan_s == pytest.approx(h100, rel=1e-12)
    assert CostModel.from_source("h100").source == CostModel.load("h100").source
    with pytest.raises(ValueError, match="no cost model with source"):
        CostModel.from_source("a model of nowhere")
    ring = torch_dcp.plan(batch, topo, planner="ring", cost_model="h100")  # a named model is recorded too
    assert simulate(ring).makespan_s == simulate(ring, "h100").makespan_s != simulate(ring, "a100").makespan_s


def test_full_mask_allgather_computes_its_queries_in_one_call():
    batch = BatchSpec([4096], Full(), n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
    plan = torch_dcp.plan(batch, Topology(n_nodes=1, ranks_per_node=2), planner="allgather")
    cm = CostModel.a100()
    _, scatter, compute = allgather_pass_seconds(plan, cm, False)
    assert not scatter.any()
    # each rank: its two query halves (2048 rows) against all 4096 keys, one call
    pairs = 2048.0 * 4096
    one = cm.attention_seconds(pairs * 8, pairs * 4 * 8 * 128, False, False, 128, "bfloat16")
    assert np.allclose(compute, one)
