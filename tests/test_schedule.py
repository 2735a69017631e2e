"""Division schedules: the node-first cut (intra-node tiles before inter-node ones)."""

from __future__ import annotations

import numpy as np
import pytest

import torch_dcp
from torch_dcp import BatchSpec, Causal, Lambda, SharedQuestion
from torch_dcp.api import divide
from torch_dcp.schedule import assign_divisions, mixes_nodes, node_tiers
from reference import assert_emulation_exact

TOPO = torch_dcp.Topology(n_nodes=2, ranks_per_node=2)


def _placement(mask, lengths=(300, 97, 211, 40, 160), topo=TOPO, planner="ring"):
    batch = BatchSpec(list(lengths), mask, n_heads=4, n_kv_heads=2, head_dim=16, dtype="float64")
    plan = torch_dcp.plan(batch, topo, planner=planner, block_size=32, divisions=4, head_parallel=1)
    return batch, plan.placement


def _tiers_by_hand(pl, topo):
    wl = pl.workload
    rank = pl.tile_rank
    homes = (pl.block_rank[wl.tile_q], pl.block_rank[wl.tile_kv])
    inter = np.array([any(topo.node_of(int(h[i])) != topo.node_of(int(rank[i])) for h in homes)
                      for i in range(wl.n_tiles)], bool)
    remote = np.array([any(int(h[i]) != int(rank[i]) for h in homes) for i in range(wl.n_tiles)], bool)
    return remote & ~inter, inter


@pytest.mark.parametrize("divisions", [3, 4, 6])
def test_node_first_runs_intra_node_tiles_before_inter_node_ones(divisions):
    # greedy keeps documents whole where it can; a long causal document spread over both
    # nodes leaves ranks with local, intra-node and inter-node tiles
    _, pl = _placement(Causal(), lengths=(1500, 97, 211, 40, 160), planner="greedy")
    in_node, inter = node_tiers(pl, TOPO)
    want_in, want_inter = _tiers_by_hand(pl, TOPO)
    assert np.array_equal(in_node, want_in) and np.array_equal(inter, want_inter)
    assert mixes_nodes(pl, TOPO)
    div = assign_divisions(pl, divisions, TOPO, node_first=True)
    plain = assign_divisions(pl, divisions, TOPO)
    local = ~in_node & ~inter
    assert (div[local] == 0).all()
    split = 0
    for r in range(TOPO.world_size):
        mine = pl.tile_rank == r
        if (mine & in_node).any() and (mine & inter).any():
            split += 1
            assert (div[mine & in_node] == 1).all()
            assert set(np.unique(div[mine & inter]).tolist()) <= set(range(2, divisions))
            # the inter-node tiles use every division from 2 on where they need that many
            assert 2 in div[mine & inter]
        else:  # nothing to put first: the plain cut
            assert np.array_equal(div[mine], plain[mine])
    assert split > 0
    plan = divide(pl, TOPO, divisions, node_first=True)
    assert np.array_equal(plan.tile_division, div)
    plan.validate()


def test_node_first_is_the_plain_cut_where_it_cannot_differ():
    _, pl = _placement(Causal(), lengths=(1500, 97, 211, 40, 160), planner="greedy")
    for t in (1, 2):  # too few divisions
        assert np.array_equal(assign_divisions(pl, t, TOPO, node_first=True), assign_divisions(pl, t, TOPO))
    # with a local tail the tail's cut stands
    assert np.array_equal(assign_divisions(pl, 4, TOPO, local_tail=0.25, node_first=True),
                          assign_divisions(pl, 4, TOPO, local_tail=0.25))
    one_node = torch_dcp.Topology(n_nodes=1, ranks_per_node=4)
    _, pl1 = _placement(Causal(), lengths=(1500, 97, 211, 40, 160), topo=one_node, planner="greedy")
    assert not mixes_nodes(pl1, one_node)
    assert np.array_equal(assign_divisions(pl1, 4, one_node, node_first=True), assign_divisions(pl1, 4, one_node))
    with pytest.raises(ValueError, match="node_first needs the topology"):
        assign_divisions(pl, 4, node_first=True)


@pytest.mark.parametrize("mask", [Causal(), Lambda(sink=16, window=48), SharedQuestion()],
                         ids=["causal", "lambda", "sq"])
@pytest.mark.parametrize("planner", ["greedy", "dcp"])
def test_node_first_plans_stay_exact(mask, planner):
    # forward and backward against the float64 dense reference, GQA, odd lengths
    batch, pl = _placement(mask, lengths=(900, 97, 211, 41, 163), planner=planner)
    plan = divide(pl, TOPO, 5, node_first=True)
    plan.validate()
    assert_emulation_exact(plan, batch)


def test_timed_plans_also_time_a_node_first_schedule():
    # a long causal document over two nodes of four ranks: dcp's chosen placement is also timed
    # with its intra-node tiles first at T + 2 (the fastest here), and the plan returned is the
    # fastest of all it timed
    topo = torch_dcp.Topology(n_nodes=2, ranks_per_node=4)
    batch = BatchSpec([24000, 3000, 2000, 1500, 1000, 500], Causal(), n_heads=8, n_kv_heads=2, head_dim=64)
    own = ("ring", "megatron", "allgather", "documents")  # dcp's own placements win: no static runtime
    plan = torch_dcp.plan(batch, topo, planner="dcp", block_size=512, head_parallel=1, cost_model="a100", rivals=own)
    labels = [name for name, _ in plan.candidates]
    assert any(label.endswith("(node first, T=6)") for label in labels), labels
    assert any(label.endswith("(local tail)") for label in labels)
    base = [label for label in labels if "(" in label and "runner-up" not in label]
    assert base[-1].endswith("(local tail, node)")  # each schedule on the other node-once routes too, last
    best = np.nanmin([t for _, t in plan.candidates])
    assert torch_dcp.sim.simulate(plan, torch_dcp.CostModel.a100()).makespan_s == pytest.approx(best, rel=1e-12)
    assert plan.divisions == 6 and np.array_equal(plan.tile_division,
                                                  assign_divisions(plan.placement, 6, topo, node_first=True))
    # divisions given: node first at that T, not more
    fixed = torch_dcp.plan(batch, topo, planner="dcp", block_size=512, head_parallel=1, divisions=4, rivals=own)
    assert any(label.endswith("(node first, T=4)") for label, _ in fixed.candidates)
    assert fixed.divisions == 4
