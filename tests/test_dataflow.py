"""The dataflow simulation against hand-computed timelines, and its bounds on planner plans."""

from __future__ import annotations

import numpy as np
import pytest

import torch_dcp
from torch_dcp import BatchSpec, Causal, Full, Lambda, Ranges, Topology
from torch_dcp.cost import CostModel
from torch_dcp.sim.dataflow import simulate_dataflow
from torch_dcp.sim.floors import compute_floor_seconds, link_floor_seconds
from torch_dcp.sim.simulate import simulate
from torch_dcp.workload import Buf, item_token_bytes

from test_simulate import B, FLAT, _plan, _tile_seconds, _xfer


def test_one_transfer_overlapped_with_one_tile():
    batch = BatchSpec([2 * B], Full(), n_heads=4, n_kv_heads=2, head_dim=32)
    plan = _plan(batch, [0, 1], lambda q, kv, br: br[q], 2)  # tiles follow queries
    a = _tile_seconds(batch, B * B)
    x = _xfer(B * item_token_bytes(batch)[(False, Buf.KV)])
    res = simulate_dataflow(plan, FLAT)
    # rank 1 runs its local tile while the key/value block travels, then the remote one
    assert res.forward.makespan_s == pytest.approx(max(a, x) + a, rel=1e-9)
    assert np.allclose(res.forward.busy_s, 2 * a)
    # one launch per rank waits for every input of the rank
    one = simulate_dataflow(plan, FLAT, kernels_per_rank=1)
    assert one.forward.makespan_s == pytest.approx(x + 2 * a, rel=1e-9)
    assert one.forward.tile_start_s.max() == pytest.approx(x, rel=1e-9)


def test_blocks_arrive_one_by_one():
    # rank 2 sees blocks 0 and 1 (from ranks 0 and 1) and itself, in one division: the division
    # waits for both blocks, the dataflow run starts each tile when its block is there
    n = 3 * B
    rows = [[(0, i + 1)] for i in range(B)] + [[(B, i + 1)] for i in range(B, 2 * B)] + \
        [[(0, i + 1)] for i in range(2 * B, n)]
    batch = BatchSpec([n], Ranges(rows), n_heads=4, n_kv_heads=2, head_dim=32)
    plan = _plan(batch, [0, 1, 2], lambda q, kv, br: br[q], 3, divisions=2)
    a_full, a_diag = _tile_seconds(batch, B * B), _tile_seconds(batch, B * (B + 1) // 2)
    x = _xfer(B * item_token_bytes(batch)[(False, Buf.KV)])
    assert x > a_diag
    res = simulate_dataflow(plan, FLAT)
    # both blocks travel at once (different senders, different ports... but one receiving port)
    assert res.forward.makespan_s == pytest.approx(max(x + a_full, 2 * x) + a_full, rel=1e-9)
    div = simulate(plan, FLAT)
    assert div.forward.makespan_s == pytest.approx(2 * x + 2 * a_full, rel=1e-9)


def test_returns_leave_when_their_block_is_done():
    # queries of block 0 see block 1 only; the tile runs on rank 1 and its partial goes home
    rows = [[(B, 2 * B)] for _ in range(B)] + [[(B, i + 1)] for i in range(B, 2 * B)]
    batch = BatchSpec([2 * B], Ranges(rows), n_heads=4, n_kv_heads=2, head_dim=32)
    plan = _plan(batch, [0, 1], lambda q, kv, br: 1, 2)
    itb = item_token_bytes(batch)
    a_full, a_diag = _tile_seconds(batch, B * B), _tile_seconds(batch, B * (B + 1) // 2)
    xq, xo = _xfer(B * itb[(False, Buf.Q)]), _xfer(B * itb[(False, Buf.OPART)])
    res = simulate_dataflow(plan, FLAT)
    # rank 1: local tile, then the remote one once Q of block 0 is there; its partial goes home
    assert res.forward.makespan_s == pytest.approx(max(a_diag, xq) + a_full + xo, rel=1e-9)


@pytest.mark.parametrize("planner", ["dcp", "ring", "allgather", "greedy"])
@pytest.mark.parametrize("mask", [Causal(), Lambda(64, 256)])
def test_no_pass_beats_its_floors(planner, mask):
    batch = BatchSpec([3000, 1200, 700, 193], mask, n_heads=4, n_kv_heads=2, head_dim=64)
    topo = Topology(n_nodes=2, ranks_per_node=4, intra_bandwidth=50e9, inter_bandwidth=10e9, nics_per_node=2)
    cm = CostModel.h100()
    plan = torch_dcp.plan(batch, topo, planner=planner, block_size=256, divisions=4, head_parallel=1)
    for k in (None, 1, 3):
        res = simulate_dataflow(plan, cm, kernels_per_rank=k)
        for backward, ps in ((False, res.forward), (True, res.backward)):
            floor = max(compute_floor_seconds(plan, cm, backward), link_floor_seconds(plan, backward))
            assert ps.makespan_s >= floor * (1 - 1e-9)
            assert ps.makespan_s >= ps.busy_s.max() * (1 - 1e-9)
            assert np.all(ps.tile_start_s >= 0) and np.all(ps.tile_start_s <= ps.makespan_s)
        assert res.makespan_s == pytest.approx(res.forward.makespan_s + res.backward.makespan_s)
    again = simulate_dataflow(plan, cm, kernels_per_rank=3)
    assert again.makespan_s == simulate_dataflow(plan, cm, kernels_per_rank=3).makespan_s  # deterministic


def test_bad_kernel_count():
    batch = BatchSpec([512], Causal(), n_heads=4, n_kv_heads=2, head_dim=64)
    plan = torch_dcp.plan(batch, Topology(n_nodes=1, ranks_per_node=2), planner="dcp", block_size=128, divisions=2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="kernels_per_rank"):
            simulate_dataflow(plan, kernels_per_rank=bad)
