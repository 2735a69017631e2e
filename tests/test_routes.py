"""Routes: relays in the plan IR (ring attention as it runs) and their checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import torch_dcp
from torch_dcp import BatchSpec, Causal, Full, Lambda, Topology
from torch_dcp.cost import CostModel
from torch_dcp.plan import CommLaunch, Plan, PlanError
from torch_dcp.plan.routes import check_routes, direct_routes
from torch_dcp.planners import Routing, Runtime
from torch_dcp.sim.simulate import ring_step_seconds, simulate
from torch_dcp.workload import BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR, Buf, item_token_bytes


def _batch(lens, mask=Causal(), dtype="float32"):
    return BatchSpec(lens, mask, n_heads=4, n_kv_heads=2, head_dim=8, dtype=dtype)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_ring_sends_only_to_the_next_rank_once_per_step(world):
    plan = torch_dcp.plan(_batch([37, 100, 5, 64]), world, planner="ring")
    plan.validate()
    assert plan.divisions == world
    t = plan.tables
    w = world
    # every rank receives every other rank's key/value blocks, from its left neighbour, in
    # step (rank - owner) mod W; dK/dV partials go to the right neighbour
    assert np.array_equal(t["fetch_src"], (t["fetch_rank"] - 1) % w)
    assert np.array_equal(t["ret_kv_dst"], (t["ret_kv_rank"] + 1) % w)
    home = plan.placement.block_rank
    assert np.array_equal(t["fetch_div"], (t["fetch_rank"] - home[t["fetch_block"]]) % w)
    for r in range(w):
        assert sorted(t["fetch_block"][t["fetch_rank"] == r].tolist()) == np.nonzero(home != r)[0].tolist()
    for backward in (False, True):
        for r in range(w):
            for ins in plan.program(r, backward).instructions:
                if isinstance(ins, CommLaunch):
                    assert {s.peer for s in ins.sends} <= {(r + 1) % w}
                    assert {s.peer for s in ins.recvs} <= {(r - 1) % w}
    # the plan's bytes are the ring's: W - 1 hops of each rank's K/V, forward and backward,
    # plus W - 1 hops of its dK/dV partials
    itb = item_token_bytes(plan.batch)
    kv_tokens = plan.batch.total_tokens * (w - 1)
    assert plan.stats()["comm_bytes"] == kv_tokens * (itb[(False, Buf.KV)] + itb[(True, Buf.KV)] + itb[(True, Buf.DKV)])


def test_ring_and_allgather_share_the_layout_not_the_routes():
    batch = _batch([37, 100, 5, 64], Lambda(sink=3, window=9))
    ring = torch_dcp.plan(batch, 4, planner="ring")
    ag = torch_dcp.plan(batch, 4, planner="allgather", divisions=2)
    assert np.array_equal(ring.placement.block_rank, ag.placement.block_rank)
    assert ring.placement.routing is Routing.RING and ag.placement.routing is Routing.DIRECT
    assert np.array_equal(ag.tables["fetch_src"], ag.placement.block_rank[ag.tables["fetch_block"]])
    assert ring.digest() != ag.digest()
    back = Plan.from_bytes(ring.to_bytes())
    assert back.placement.routing is Routing.RING and back.digest() == ring.digest()
    back.validate()


def _with_tables(plan, **changes):
    t = dict(plan.tables)
    t.update(changes)
    return t


def test_check_routes_rejects_relays_that_cannot_run():
    plan = torch_dcp.plan(_batch([37, 100, 5, 64]), 4, planner="ring")
    t = plan.tables
    check_routes(plan, t)
    # a relay in the same step as the relaying rank's own receive
    bad = t["fetch_div"].copy()
    i = int(np.nonzero(t["fetch_div"] == 2)[0][0])
    bad[i] = 1
    with pytest.raises(PlanError, match="not its home and does not hold it earlier"):
        check_routes(plan, _with_tables(plan, fetch_div=bad))
    # a partial sent to a rank that does not pass it on later
    dst = t["ret_kv_dst"].copy()
    j = int(np.nonzero(t["ret_kv_div"] == plan.world_size - 1)[0][0])  # the last hop, home
    dst[j] = (dst[j] + 1) % plan.world_size
    with pytest.raises(PlanError, match="does not pass it on later"):
        check_routes(plan, _with_tables(plan, ret_kv_dst=dst))
    # a rank fetching from itself
    with pytest.raises(PlanError, match="from itself"):
        check_routes(plan, _with_tables(plan, fetch_src=t["fetch_rank"]))
    # ring routes need tiles on their queries' ranks and divisions that are ring steps
    other = torch_dcp.plan(_batch([37, 100, 5, 64]), 4, planner="greedy", block_size=16)
    moved = dataclasses.replace(other.placement, routing=Routing.RING)
    with pytest.raises(PlanError, match="ring routes"):
        Plan(moved, other.topology, other.tile_division, other.divisions).tables


def test_direct_routes_are_unchanged_by_the_routing_table():
    plan = torch_dcp.plan(_batch([37, 100, 5, 64]), 4, planner="dcp", block_size=16, head_parallel=1)
    t = direct_routes(plan)
    home = plan.placement.block_rank
    assert np.array_equal(t["fetch_src"], home[t["fetch_block"]])
    assert np.array_equal(t["ret_q_dst"], home[t["ret_q_block"]])
    assert np.array_equal(t["ret_kv_dst"], home[t["ret_kv_block"]])


def test_node_once_routes_with_one_rank_per_node_are_direct():
    """With one rank per node (a head-parallel plan's outer plan across nodes) no node has a
    rank to choose as gateway, reducer or relay: both node-once routings are the direct routes,
    so the planner times each schedule on one of them only."""
    from torch_dcp.api import _reschedules, divide

    topo = Topology(n_nodes=4, ranks_per_node=1, nics_per_node=1)
    plan = torch_dcp.plan(_batch([300, 37, 100, 5, 64, 200]), topo, planner="dcp", block_size=16, head_parallel=1)
    direct = direct_routes(plan)
    for routing in (Routing.NODE, Routing.RAILS):
        routed = divide(dataclasses.replace(plan.placement, routing=routing, runtime=Runtime.EXECUTOR), topo, 4)
        assert routed.tables.keys() == direct.keys()
        assert all(np.array_equal(routed.tables[k], v) for k, v in direct_routes(routed).items())
        labels = [name for name, _ in _reschedules(routed, True)]
        assert labels and not any(_on_routing(name) for name in labels)
    # on nodes of two ranks each variant is timed on both
    topo2 = Topology(n_nodes=2, ranks_per_node=2, nics_per_node=2)
    plan2 = torch_dcp.plan(_batch([300, 37, 100, 5, 64, 200]), topo2, planner="dcp", block_size=16, head_parallel=1)
    routed = divide(dataclasses.replace(plan2.placement, routing=Routing.RAILS, runtime=Runtime.EXECUTOR), topo2, 4)
    labels = [name for name, _ in _reschedules(routed, True)]
    assert sum(map(_on_routing, labels)) == (len(labels) + 1) // 2 > 1  # the plan and every variant


def _on_routing(label: str) -> bool:
    """Whether a reschedule's label names another node-once routing (``"node"``, ``"T=3, rails"``)."""
    return any(label == r.value or label.endswith(f", {r.value}") for r in (Routing.NODE, Routing.RAILS))


def test_ring_step_formula_on_a_hand_computable_case():
    # one document of 4n tokens, full mask, 2 ranks on one node: rank 0 holds chunks 0 and 3,
    # rank 1 chunks 1 and 2; each step is 2 x 2 chunks of n x n pairs on each rank
    n, topo, cm = 4096, Topology(n_nodes=1, ranks_per_node=2), CostModel.a100()
    batch = BatchSpec([4 * n], Full(), n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
    plan = torch_dcp.plan(batch, topo, planner="ring")
    itb = item_token_bytes(batch)  # dK/dV partials in the K/V dtype, as TransformerEngine sends them
    assert itb[(True, Buf.DKV)] == itb[(True, Buf.KV)]
    pairs = 4.0 * n * n
    c_f = cm.attention_seconds(pairs * 8, pairs * FWD_FLOPS_PER_PAIR * 8 * 128, False, False, 128, "bfloat16")
    c_b = cm.attention_seconds(pairs * 8, pairs * BWD_FLOPS_PER_PAIR * 8 * 128, True, False, 128, "bfloat16")
    kv_f = cm.transfer_seconds(2 * n * itb[(False, Buf.KV)], topo, False)
    kv_b = cm.transfer_seconds(2 * n * itb[(True, Buf.KV)], topo, False)
    dkv = cm.transfer_seconds(2 * n * itb[(True, Buf.DKV)], topo, False)
    rows = 2 * n  # each rank's tokens: staged before the first step, merged (summed) after the second
    stage_f = cm.memory_seconds(2 * rows * (itb[(False, Buf.KV)] + itb[(False, Buf.Q)]))
    stage_b = cm.memory_seconds(2 * rows * (itb[(True, Buf.KV)] + itb[(True, Buf.Q)]))
    merge, dkv_sum = cm.memory_seconds(3 * rows * itb[(False, Buf.OPART)]), cm.memory_seconds(3 * rows * itb[(True, Buf.DKV)])
    forward = max(c_f + stage_f, kv_f) + c_f + merge
    backward = max(c_b + stage_b, kv_b) + c_b + dkv_sum + dkv  # the dK/dV sums of the last step go home after it
    assert ring_step_seconds(plan, cm) == pytest.approx(forward + backward, rel=1e-12)
    sim = simulate(plan, cm)
    assert sim.makespan_s == pytest.approx(forward + backward, rel=0.10)
    with pytest.raises(ValueError, match="ring plan"):
        ring_step_seconds(torch_dcp.plan(batch, topo, planner="allgather"), cm)


@pytest.mark.parametrize("mask", [Causal(), Lambda(sink=64, window=4096)], ids=["causal", "lambda"])
def test_simulated_ring_is_the_formula_on_two_nodes(mask):
    lens = [16384, 4000, 2800, 8000, 1200, 28000, 5152]  # 65,536 tokens: overheads the formula omits stay small
    batch = BatchSpec(lens, mask, n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
    plan = torch_dcp.plan(batch, Topology(n_nodes=2, ranks_per_node=4), planner="ring")
    plan.validate()
    formula = ring_step_seconds(plan)
    sim = simulate(plan).makespan_s
    assert formula <= sim <= 1.10 * formula, (sim, formula)


def test_node_routes_spread_gateways_and_reducers_over_rails():
    """Routing.NODE picks each block's gateway and reducer among the node's ranks that need it
    so that rails and NVLink ports carry even loads: with every rank of a node needing every
    block of the other node (one full-mask document, all-gather layout), each rail carries
    about the same bytes in and out (the first rank of every group would carry them all)."""
    from torch_dcp.api import divide

    batch = _batch([4096], Full())
    topo = Topology(n_nodes=2, ranks_per_node=4, nics_per_node=4)
    ag = torch_dcp.plan(batch, topo, planner="allgather", block_size=128, divisions=2)
    plan = divide(dataclasses.replace(ag.placement, routing=Routing.NODE, runtime=Runtime.EXECUTOR), topo, 2)
    plan.validate()
    t = plan.tables
    assert (t["fetch_src"] != plan.placement.block_rank[t["fetch_block"]]).any()  # relays
    assert (t["ret_kv_dst"] != plan.placement.block_rank[t["ret_kv_block"]]).any()  # pre-reductions
    src, dst, nbytes, _ = plan.transfers()
    inter = topo.node_of(src) != topo.node_of(dst)
    for way in ("out", "in"):  # one rail per rank, out of a node on the receiver's (PXN)
        rail = topo.link_seconds(src, dst, nbytes)[("rail", way)]
        assert rail.max() <= 1.2 * rail.mean()
    # the plan is exact
    assert plan.stats()["inter_node_bytes"] == pytest.approx(nbytes[inter].sum())


def test_node_routes_spread_a_split_window_over_the_rails():
    """A window-masked document split over two nodes needs the blocks at the split on the
    other node: direct routes put the crossings on the rails of the few ranks there. With
    NCCL's PXN (a crossing rides the receiver's rail at both ends), NODE routes land returns
    on relays of the home's node, RAILS routes also fetch through gateways that only pass a
    block on: their crossings spread over every rail of both nodes; both plans are exact."""
    from reference import assert_emulation_exact

    from torch_dcp.api import divide

    batch = BatchSpec([512], Lambda(sink=4, window=96), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float64")
    topo = Topology(n_nodes=2, ranks_per_node=4, nics_per_node=4)
    pl = torch_dcp.plan(batch, topo, planner="dcp", block_size=16, divisions=2, rivals=(), head_parallel=1).placement
    plans = {r: divide(dataclasses.replace(pl, routing=r), topo, 2)
             for r in (Routing.DIRECT, Routing.NODE, Routing.RAILS)}
    busiest, spread = {}, {}  # the busiest rail's seconds, and over the mean rail's
    for r, p in plans.items():
        loads = topo.link_seconds(*p.transfers()[:3])
        busiest[r] = max(loads[("rail", way)].max() for way in ("out", "in"))
        spread[r] = max(loads[("rail", way)].max() / loads[("rail", way)].mean() for way in ("out", "in"))
    assert spread[Routing.RAILS] <= 1.35 < spread[Routing.DIRECT], spread
    assert busiest[Routing.RAILS] < busiest[Routing.NODE] < busiest[Routing.DIRECT], busiest
    wl = pl.workload
    uses = {(r, k, b) for k, tb in enumerate((wl.tile_q, wl.tile_kv))
            for r, b in zip(pl.tile_rank.tolist(), tb.tolist())}
    for r in (Routing.NODE, Routing.RAILS):
        t = plans[r].tables
        fetches = zip(*(t[f"fetch_{c}"].tolist() for c in ("rank", "kind", "block")))
        passed = any((x, k, b) not in uses for x, k, b in fetches)
        assert passed is (r is Routing.RAILS)  # a gateway that needs no block of its own
        assert any((x, k, b) not in uses for k, side in enumerate(("q", "kv"))  # a relay with no partial
                   for x, b in zip(t[f"ret_{side}_rank"].tolist(), t[f"ret_{side}_block"].tolist()))
        assert_emulation_exact(plans[r], batch)
