"""The DCP hypergraph planner: objective = traffic, determinism, balance, comparison."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_dcp
from torch_dcp import BatchSpec, BlockwiseCausal, Causal, Lambda, SharedQuestion, Topology
from torch_dcp.planners import Routing
from torch_dcp.planners.dcp import DCPHypergraph, estimate_seconds


def _part(plan):
    pl = plan.placement
    return np.concatenate([pl.tile_rank, pl.block_rank])


@pytest.mark.parametrize("mask", [Causal(), Lambda(sink=8, window=200), SharedQuestion()])
def test_hypergraph_objective_is_the_plans_traffic(mask):
    batch = BatchSpec([900, 40, 2500, 7, 1300], mask, n_heads=8, n_kv_heads=2, head_dim=64)
    topo = Topology(n_nodes=2, ranks_per_node=3)
    for planner, options in (("dcp", {"node_routes": False}), ("greedy", {}), ("allgather", {})):
        plan = torch_dcp.plan(batch, topo, planner=planner, block_size=128, **options)
        hg = DCPHypergraph(plan.workload)
        s = plan.stats()
        assert hg.km1(_part(plan), topo.world_size) == pytest.approx(s["comm_bytes"], rel=1e-12)
        # node-level connectivity is a lower bound: two ranks of one node fetch a block twice
        node = _part(plan) // topo.ranks_per_node
        assert hg.km1(node, topo.n_nodes) <= s["inter_node_bytes"] + 1e-6


@pytest.mark.parametrize("mask", [Causal(), Lambda(sink=8, window=200)], ids=["causal", "lambda"])
def test_node_routes_cross_into_a_node_once(mask):
    """dcp on several nodes routes fetches through one gateway per node (Routing.NODE): every
    (node, kind, block) crosses the network at most once -- except blocks first needed in
    division 0 -- with the same placement and fewer inter-node bytes than direct routes."""
    batch = BatchSpec([3000, 700, 1200, 64, 2000, 5000], mask, n_heads=8, n_kv_heads=2, head_dim=64)
    topo = Topology(n_nodes=2, ranks_per_node=4)
    plan = torch_dcp.plan(batch, topo, planner="dcp", block_size=128)
    direct = torch_dcp.plan(batch, topo, planner="dcp", block_size=128, node_routes=False)
    assert plan.placement.routing is Routing.NODE and direct.placement.routing is Routing.DIRECT
    assert np.array_equal(plan.placement.block_rank, direct.placement.block_rank)
    plan.validate()
    t = plan.tables
    node = topo.node_of(t["fetch_rank"])
    crossing = node != topo.node_of(t["fetch_src"])
    keys = np.stack([node, t["fetch_kind"], t["fetch_block"]], axis=1)[crossing]
    uniq, count = np.unique(keys, axis=0, return_counts=True)
    for (n, k, b), c in zip(uniq, count):
        if c > 1:  # only groups first needed in division 0 stay direct
            rows = (node == n) & (t["fetch_kind"] == k) & (t["fetch_block"] == b)
            assert t["fetch_div"][rows].min() == 0, (n, k, b)
    relayed = ~crossing & (plan.placement.block_rank[t["fetch_block"]] != t["fetch_src"])
    # the direct plan's duplicates (several ranks of a node fetch one block) are what is relayed
    td = direct.tables
    dn = topo.node_of(td["fetch_rank"])
    dcross = dn != topo.node_of(td["fetch_src"])
    dk = np.stack([dn, td["fetch_kind"], td["fetch_block"]], axis=1)[dcross]
    _, inv, cnt = np.unique(dk, axis=0, return_inverse=True, return_counts=True)
    first_div = np.full(len(cnt), np.iinfo(np.int64).max)
    np.minimum.at(first_div, inv.reshape(-1), td["fetch_div"][dcross])
    duplicates = int((cnt - 1)[first_div > 0].sum())
    assert int(relayed.sum()) == duplicates
    assert duplicates > 0 or not isinstance(mask, Causal)  # the causal batch has some
    s, d = plan.stats(), direct.stats()
    assert (s["inter_node_bytes"] < d["inter_node_bytes"]) if duplicates else (s == {**d, "plan_seconds": s["plan_seconds"]})
    hg = DCPHypergraph(plan.workload)
    assert hg.km1(_part(plan) // topo.ranks_per_node, topo.n_nodes) <= s["inter_node_bytes"] + 1e-6
    assert torch_dcp.plan(batch, 4, planner="dcp", block_size=128).placement.routing is Routing.DIRECT  # one node


def test_deterministic_digest():
    batch = BatchSpec([5000, 300, 120, 9000, 640, 2048], Lambda(sink=16, window=1024), n_heads=8, n_kv_heads=2,
                      head_dim=128)
    topo = Topology(n_nodes=2, ranks_per_node=4)
    digests = {torch_dcp.plan(batch, topo, planner="dcp", block_size=256).digest() for _ in range(3)}
    assert len(digests) == 1
    other = torch_dcp.plan(batch, topo, planner="dcp", block_size=256, seed=7)
    other.validate()


def test_dcp_moves_fewer_bytes_than_ring_and_greedy(capsys):
    rng = np.random.default_rng(3)
    lens = [int(x) for x in np.minimum(16384, 64 + 600 * rng.pareto(1.1, 60))]
    topo = Topology(n_nodes=2, ranks_per_node=4)
    for mask in (Causal(), Lambda(sink=64, window=1024), BlockwiseCausal()):
        batch = BatchSpec(lens, mask, n_heads=8, n_kv_heads=2, head_dim=128)
        stats = {p: torch_dcp.plan(batch, topo, planner=p, block_size=512).stats() for p in ("ring", "greedy")}
        stats["dcp"] = torch_dcp.plan(batch, topo, planner="dcp", block_size=512, objective="bytes").stats()
        with capsys.disabled():
            print(f"\n{type(mask).__name__}: " + ", ".join(
                f"{p} comm={s['comm_bytes'] / 1e6:.1f}MB inter={s['inter_node_bytes'] / 1e6:.1f}MB "
                f"cimb={s['compute_imbalance']:.3f} mimb={s['memory_imbalance']:.3f}" for p, s in stats.items()))
        d = stats["dcp"]
        # against every plan that meets the same balance bounds
        for other in ("ring", "greedy"):
            o = stats[other]
            if o["compute_imbalance"] <= 1.1 + 1e-9 and o["memory_imbalance"] <= 1.1 + 1e-9:
                assert d["comm_bytes"] <= o["comm_bytes"], other
        assert d["inter_node_bytes"] <= 0.5 * stats["ring"]["inter_node_bytes"]
        assert d["compute_imbalance"] <= 1.1 + 1e-9 and d["memory_imbalance"] <= 1.1 + 1e-9


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 3000), min_size=4, max_size=20),
       mask=st.sampled_from([Causal(), Lambda(sink=4, window=300), BlockwiseCausal(block=64), SharedQuestion()]),
       nodes=st.integers(1, 2), rpn=st.integers(2, 4), block=st.sampled_from([32, 64]))
def test_balance_bounds(lens, mask, nodes, rpn, block):
    batch = BatchSpec(lens, mask, n_heads=4, n_kv_heads=2, head_dim=16)
    topo = Topology(n_nodes=nodes, ranks_per_node=rpn)
    objective = "bytes" if len(lens) % 2 else "time"
    plan = torch_dcp.plan(batch, topo, planner="dcp", block_size=block, objective=objective)
    plan.validate()
    s = plan.stats()
    wl = plan.workload
    w = topo.world_size
    # where blocks and tiles are fine-grained enough for the bounds to be reachable, they hold
    flops = wl.tile_flops_fwd + wl.tile_flops_bwd
    fine = flops.max() <= 0.02 * flops.sum() / w and wl.block_len.max() <= 0.02 * batch.total_tokens / w
    if fine:
        # the time objective may trade compute balance (up to max_compute_imbalance = 2) for traffic
        assert s["compute_imbalance"] <= (1.1 if objective == "bytes" else 2.0) + 1e-9
        assert s["memory_imbalance"] <= 1.1 + 1e-9


def test_bad_tolerances():
    batch = BatchSpec([100], n_heads=2, n_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="eps_inter"):
        torch_dcp.plan(batch, 2, planner="dcp", eps_inter=-1)
    with pytest.raises(ValueError, match="objective"):
        torch_dcp.plan(batch, 2, planner="dcp", objective="speed")
    with pytest.raises(ValueError, match="max_compute_imbalance"):
        torch_dcp.plan(batch, 2, planner="dcp", max_compute_imbalance=1.05)


def test_time_objective_never_estimates_slower_than_bytes():
    rng = np.random.default_rng(5)
    lens = [int(x) for x in np.minimum(16384, 64 + 600 * rng.pareto(1.1, 60))]
    topo = Topology(n_nodes=2, ranks_per_node=4)
    for mask in (Causal(), Lambda(sink=64, window=1024)):
        batch = BatchSpec(lens, mask, n_heads=8, n_kv_heads=2, head_dim=128)
        est = {}
        for objective in ("bytes", "time"):
            pl = torch_dcp.planners.plan_dcp(batch, topo, 512, objective=objective)
            hg = DCPHypergraph(pl.workload)
            part = np.concatenate([pl.tile_rank, pl.block_rank])
            est[objective] = estimate_seconds(hg, part, topo, 1.6e14)
            assert pl.rank_tokens().max() <= 1.1 * pl.rank_tokens().mean() + 512
        assert est["time"] <= est["bytes"] * (1 + 1e-12)


def test_estimate_counts_link_and_compute_bottlenecks():
    # two documents of one block each on a 2-node x 1-rank topology
    batch = BatchSpec([64, 64], Causal(), n_heads=2, n_kv_heads=1, head_dim=16)
    wl = torch_dcp.Workload.uniform(batch, 64)
    hg = DCPHypergraph(wl)
    topo = Topology(n_nodes=2, ranks_per_node=1, inter_bandwidth=1e6)
    flops = wl.tile_flops_fwd + wl.tile_flops_bwd
    local = np.array([0, 1, 0, 1])  # tiles then blocks: everything at home
    assert estimate_seconds(hg, local, topo, 1e9) == pytest.approx(flops.max() / 1e9)
    # both tiles on rank 0: block 1's query and key/value nets span both nodes
    remote = np.array([0, 0, 0, 1])
    # each node sends and receives those bytes (fetches one way, returns the other): both directions
    link = (hg.net_weight[1] + hg.net_weight[3]) / (2 * 1e6)
    assert estimate_seconds(hg, remote, topo, 1e9) == pytest.approx(max(flops.sum() / 1e9, link))
