"""The Megatron dynamic-CP planner: the seed's worked example, rounds as sequential phases."""

from __future__ import annotations

import numpy as np

import torch_dcp
from torch_dcp import BatchSpec, Topology
from torch_dcp.planners.megatron import megatron_schedule

K = 1024


def test_worked_example_of_the_seed():
    lens = [32 * K, 16 * K, 8 * K, 4 * K, 4 * K, 4 * K, 4 * K, 2 * K]
    rounds = megatron_schedule(lens, 8, 4 * K)
    assert rounds[0] == [(0, 0, 8)]  # the 32K document alone, on all 8 ranks
    second = {d: (first, cp) for d, first, cp in rounds[1]}
    assert len(rounds) == 2
    assert second == {1: (0, 4), 2: (4, 2), 3: (6, 1), 4: (6, 1), 5: (7, 1), 6: (7, 1), 7: (6, 1)}


def test_rounds_become_sequential_ring_steps():
    lens = [32 * K, 16 * K, 8 * K, 4 * K, 4 * K, 4 * K, 4 * K, 2 * K]
    batch = BatchSpec(lens, n_heads=8, n_kv_heads=2, head_dim=128)
    plan = torch_dcp.plan(batch, Topology(n_nodes=1, ranks_per_node=8), planner="megatron", divisions=2,
                          max_seqlen_per_rank=4 * K)
    plan.validate()
    assert plan.divisions == 8 + 4  # round 0: a ring of 8 ranks; round 1: its largest group has 4
    wl = plan.workload
    doc_of_tile = wl.block_doc[wl.tile_q]
    assert np.all(plan.tile_division[doc_of_tile == 0] < 8)
    assert np.all(plan.tile_division[doc_of_tile != 0] >= 8)
    # ring attention inside each group: K/V only ever move to the next rank of the group
    t, home = plan.tables, plan.placement.block_rank
    groups = plan.placement.ring_groups
    g = groups[wl.block_doc[t["fetch_block"]]]
    assert np.array_equal(t["fetch_src"], g[:, 0] + (t["fetch_rank"] - g[:, 0] - 1) % g[:, 1])
    assert np.all((home[t["fetch_block"]] >= g[:, 0]) & (home[t["fetch_block"]] < g[:, 0] + g[:, 1]))
    assert not np.any(wl.block_doc[t["fetch_block"]] >= 3)  # one-rank groups move nothing
    # the 16K document lives on ranks 0..3 only, the 4K documents on one rank each
    assert set(plan.placement.block_rank[wl.block_doc == 1].tolist()) == {0, 1, 2, 3}
    for d, r in ((3, 6), (4, 6), (5, 7), (6, 7), (7, 6)):
        assert set(plan.placement.block_rank[wl.block_doc == d].tolist()) == {r}
