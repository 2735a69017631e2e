"""The simulator against hand-computed timelines of small plans."""

from __future__ import annotations

import json

import numpy as np
import pytest

import torch_dcp
from torch_dcp import BatchSpec, Causal, Full, Plan, Ranges, Topology, Workload
from torch_dcp.cost import A100, H100, CostModel, KernelTable
from torch_dcp.planners import Placement
from torch_dcp.schedule import assign_divisions
from torch_dcp.sim.floors import compute_floor_seconds, floor_seconds, kernel_floor_seconds, link_floor_seconds
from torch_dcp.sim.simulate import simulate
from torch_dcp.workload import Buf, item_token_bytes

B = 64
TFLOPS = 100.0
# constant throughput, free memory traffic and launches: hand-computable times
FLAT = CostModel(KernelTable((1.0,), (TFLOPS,), (TFLOPS,), (TFLOPS,), (TFLOPS,)), memory_bandwidth=1e30,
                 launch_overhead=0.0)
TOPO = dict(intra_bandwidth=1e9, intra_latency=1e-6)


def _plan(batch, spans_rank, tile_rank_of, world, divisions=2):
    wl = Workload.uniform(batch, B)
    block_rank = np.array(spans_rank)
    tile_rank = np.array([tile_rank_of(int(q), int(kv), block_rank) for q, kv in zip(wl.tile_q, wl.tile_kv)])
    pl = Placement(wl, world, block_rank, tile_rank)
    topo = Topology(n_nodes=1, ranks_per_node=world, **TOPO)
    plan = Plan(pl, topo, assign_divisions(pl, divisions), divisions)
    plan.validate()
    return plan


def _tile_seconds(batch, pairs, backward=False):
    per_pair = (10 if backward else 4) * batch.n_heads * batch.head_dim
    return pairs * per_pair / (TFLOPS * 1e12)


def _xfer(nbytes):
    return 1e-6 + nbytes / 1e9


def test_one_transfer_overlapped_with_one_tile():
    batch = BatchSpec([2 * B], Full(), n_heads=4, n_kv_heads=2, head_dim=32)
    plan = _plan(batch, [0, 1], lambda q, kv, br: br[q], 2)  # tiles follow queries
    res = simulate(plan, FLAT)
    a = _tile_seconds(batch, B * B)
    x = _xfer(B * item_token_bytes(batch)[(False, Buf.KV)])
    assert res.forward.makespan_s == pytest.approx(max(a, x) + a, rel=1e-9)
    assert np.allclose(res.forward.busy_s, 2 * a)
    assert np.allclose(res.forward.exposed_comm_s, max(0.0, x - a))


def test_congested_link_serialises_transfers():
    # blocks 1 and 2 see block 0 and themselves: rank 0 sends block 0 to ranks 1 and 2
    n = 3 * B
    rows = [[(0, i + 1)] for i in range(B)] + [[(0, B), (B * (i // B), i + 1)] for i in range(B, n)]
    batch = BatchSpec([n], Ranges(rows), n_heads=4, n_kv_heads=2, head_dim=32)
    plan = _plan(batch, [0, 1, 2], lambda q, kv, br: br[q], 3)
    res = simulate(plan, FLAT)
    a_diag = _tile_seconds(batch, B * (B + 1) // 2)
    a_full = _tile_seconds(batch, B * B)
    x = _xfer(B * item_token_bytes(batch)[(False, Buf.KV)])
    assert x > a_diag  # the second transfer waits for the first on rank 0's link
    ends = sorted(res.forward.finish_s[1:])
    assert ends[0] == pytest.approx(x + a_full, rel=1e-9)
    assert ends[1] == pytest.approx(2 * x + a_full, rel=1e-9)
    assert res.forward.makespan_s == pytest.approx(2 * x + a_full, rel=1e-9)


def test_exposed_final_reduction():
    # queries of block 0 see block 1 only; its tile runs on rank 1 (query fetched, partial returned)
    rows = [[(B, 2 * B)] for _ in range(B)] + [[(B, i + 1)] for i in range(B, 2 * B)]
    batch = BatchSpec([2 * B], Ranges(rows), n_heads=4, n_kv_heads=2, head_dim=32)
    mem_bw = 1e10
    cm = CostModel(FLAT.kernel, memory_bandwidth=mem_bw, launch_overhead=0.0)
    plan = _plan(batch, [0, 1], lambda q, kv, br: 1, 2)
    res = simulate(plan, cm)
    itb = item_token_bytes(batch)
    a_full, a_diag = _tile_seconds(batch, B * B), _tile_seconds(batch, B * (B + 1) // 2)
    b = batch
    copy1 = 2 * B * (b.n_heads * b.head_dim * b.elem_size) / mem_bw + 2 * B * (2 * b.n_kv_heads * b.head_dim * b.elem_size) / mem_bw
    row = itb[(False, Buf.OPART)]  # a partial's row: O in the inputs' dtype, its LSE in float32
    assert row == b.n_heads * b.head_dim * b.elem_size + b.n_heads * b.acc_size
    xq = _xfer(B * itb[(False, Buf.Q)])
    xo = _xfer(B * itb[(False, Buf.OPART)])
    # rank 1: copies, local tile, waits for Q of block 0 (sent once rank 0 has copied too),
    # remote tile, returns the partial
    r1_ret = copy1 + max(a_diag, xq) + a_full
    # rank 0: copies, then waits for the partial, then merges it (2 slots of B rows read+write)
    copy0 = copy1
    r0_end = max(copy0, r1_ret + xo) + 2 * B * row / mem_bw
    assert res.forward.finish_s[0] == pytest.approx(r0_end, rel=1e-9)
    assert res.forward.exposed_comm_s[0] == pytest.approx(r1_ret + xo - copy0, rel=1e-9)


def test_cost_tables_and_json_round_trip():
    for table in (A100, H100):
        assert table.tflops(1024, False, True) < table.tflops(8192, False, True)
        assert table.tflops(100, True, False) == table.bwd_full[0]  # clamped
    cm = CostModel.h100()
    assert CostModel.from_json(cm.to_json()) == cm
    with pytest.raises(ValueError, match="malformed"):
        CostModel.from_json("{}")
    with pytest.raises(ValueError, match="increasing"):
        KernelTable((2.0, 1.0), (1, 1), (1, 1), (1, 1), (1, 1))


@pytest.mark.parametrize("planner", ["ring", "greedy", "dcp", "megatron", "fcp"])
def test_simulation_bounds(planner):
    rng = np.random.default_rng(1)
    lens = [int(x) for x in np.minimum(8192, 64 + 500 * rng.pareto(1.1, 40))]
    batch = BatchSpec(lens, Causal(), n_heads=8, n_kv_heads=2, head_dim=128)
    plan = torch_dcp.plan(batch, Topology(n_nodes=2, ranks_per_node=4), planner=planner, block_size=512,
                          **({"head_parallel": 1} if planner == "dcp" else {}))
    res = simulate(plan)
    assert res.makespan_s >= res.ideal_s * (1 - 1e-12)
    for p in (res.forward, res.backward):
        assert np.all(p.idle_s >= -1e-15) and np.all(p.busy_s > 0)
        assert np.allclose(p.finish_s, p.busy_s + p.exposed_comm_s)
    # the floors torch_dcp.plan uses to skip candidates are below every simulated run
    for cm in (CostModel.a100(), CostModel.h100()):
        sim = simulate(plan, cm)
        busy = sim.forward.busy_s + sim.backward.busy_s
        assert compute_floor_seconds(plan, cm) <= busy.max() * (1 + 1e-12)
        assert link_floor_seconds(plan) <= sim.makespan_s * (1 + 1e-12)
        assert 0 < floor_seconds(plan, cm) <= sim.makespan_s * (1 + 1e-12)
        # per pass: each pass is bound by its own busiest rank and link
        for backward, ps in ((False, sim.forward), (True, sim.backward)):
            assert compute_floor_seconds(plan, cm, backward) <= ps.busy_s.max() * (1 + 1e-12)
            # the kernel floor is the simulator's own attention time of the busiest rank
            attention = [sum(e - s for kind, s, e in ev if kind == "attention") for ev in ps.events]
            assert kernel_floor_seconds(plan, cm, backward) == pytest.approx(max(attention), rel=1e-9)
            assert kernel_floor_seconds(plan, cm, backward) >= compute_floor_seconds(plan, cm, backward) * (1 - 1e-12)
            assert link_floor_seconds(plan, backward) <= ps.makespan_s * (1 + 1e-12)
        assert link_floor_seconds(plan, False) + link_floor_seconds(plan, True) >= link_floor_seconds(plan) * (1 - 1e-12)
        assert floor_seconds(plan, cm) >= max(compute_floor_seconds(plan, cm), link_floor_seconds(plan)) * (1 - 1e-12)


@pytest.mark.parametrize("nics", [1, 2])
def test_ranks_of_a_node_share_a_rail_or_send_on_their_own(nics):
    # 2 nodes x 2 ranks; queries of blocks 2 and 3 (node 1) see block 0 resp. 1 (node 0) and
    # themselves: ranks 0 and 1 each send one block to node 1 at the same time
    n = 4 * B
    rows = [[(B * (i // B), i + 1)] for i in range(2 * B)]
    rows += [[(0, B), (2 * B, i + 1)] for i in range(2 * B, 3 * B)] + [[(B, 2 * B), (3 * B, i + 1)] for i in range(3 * B, n)]
    batch = BatchSpec([n], Ranges(rows), n_heads=4, n_kv_heads=2, head_dim=32)
    wl = Workload.uniform(batch, B)
    block_rank = np.arange(4)
    pl = Placement(wl, 4, block_rank, block_rank[wl.tile_q])
    inter_bw, inter_lat = 1e8, 2e-6
    topo = Topology(n_nodes=2, ranks_per_node=2, inter_bandwidth=inter_bw, inter_latency=inter_lat,
                    nics_per_node=nics, **TOPO)
    assert topo.rail_bandwidth == inter_bw / nics
    assert list(topo.rail_of(np.arange(4))) == ([0, 0, 0, 0] if nics == 1 else [0, 1, 0, 1])
    plan = Plan(pl, topo, assign_divisions(pl, 2), 2)
    plan.validate()
    res = simulate(plan, FLAT)
    x = inter_lat + B * item_token_bytes(batch)[(False, Buf.KV)] * nics / inter_bw
    a_diag = _tile_seconds(batch, B * (B + 1) // 2)
    a_full = _tile_seconds(batch, B * B)
    assert x > a_diag
    ends = sorted(res.forward.finish_s[2:])
    senders = sorted(res.forward.finish_s[:2])  # a sender's wait covers its send
    if nics == 1:  # one rail with the node's whole bandwidth: one transfer, then the other
        assert ends == pytest.approx([x + a_full, 2 * x + a_full], rel=1e-9)
        assert senders == pytest.approx([x, 2 * x], rel=1e-9)
    else:  # a rail each, at half the node's bandwidth: both at once
        assert ends == pytest.approx([x + a_full, x + a_full], rel=1e-9)
        assert senders == pytest.approx([x, x], rel=1e-9)


def test_topology_presets_and_rails():
    a100, h100 = Topology.preset("a100"), Topology.preset("h100", n_nodes=2)
    assert a100 == Topology() and a100.rail_bandwidth == 12.5e9 and a100.rail_of(3) == 1
    assert h100.world_size == 16 and h100.rail_bandwidth == 50e9 and h100.rail_of(9) == 1
    assert Topology(n_nodes=1, ranks_per_node=2, nics_per_node=8).rail_bandwidth == 50e9 / 2
    with pytest.raises(ValueError, match="preset"):
        Topology.preset("tpu")
    with pytest.raises(ValueError, match="nics_per_node"):
        Topology(nics_per_node=0)
    assert Topology.from_dict(h100.to_dict()) == h100


def test_links_back_fill_gaps():
    from torch_dcp.sim.timeline import _earliest_common_gap, _Link

    a, b = _Link(), _Link()
    a.reserve(0.0, 5.0)  # a later transfer already holds link a over [0, 5)
    b.reserve(6.0, 8.0)  # and link b over [6, 8)
    # a transfer needing only b, ready at 1, takes b's idle gap [1, 3) instead of queueing after 8
    assert _earliest_common_gap([b], 1.0, 2.0) == 1.0
    # one needing a and b for 2 s: a is free from 5, b is busy from 6 -> first common gap at 8
    assert _earliest_common_gap([a, b], 0.0, 2.0) == 8.0
    # for 1 s it fits in [5, 6)
    assert _earliest_common_gap([a, b], 0.0, 1.0) == 5.0
    b.reserve(1.0, 3.0)
    assert b.starts == [1.0, 6.0] and _earliest_common_gap([b], 0.5, 1.0) == 3.0
    # reservations after every interval append, earlier ones insert: the intervals stay sorted
    b.reserve(9.0, 10.0)
    b.reserve(3.0, 4.0)
    assert b.starts == [1.0, 3.0, 6.0, 9.0] and b.ends == [3.0, 4.0, 8.0, 10.0]
    assert _earliest_common_gap([b], 0.0, 1.0) == 0.0  # before every interval
    assert _earliest_common_gap([b], 3.5, 2.0) == 4.0  # [4, 6) fits 2 s
    assert _earliest_common_gap([b], 3.5, 2.5) == 10.0  # nothing before the last end does
    assert _earliest_common_gap([b], 11.0, 5.0) == 11.0  # after every interval


def test_tables_per_head_dim_and_dtype(tmp_path):
    slow = KernelTable((1.0,), (TFLOPS / 4,) * 1, (TFLOPS / 4,), (TFLOPS / 4,), (TFLOPS / 4,))
    cm = CostModel.merge(FLAT, CostModel(FLAT.kernel, tables=((32, "float32", slow),)))
    assert cm.table_for(32, "float32") is slow and cm.table_for(32) is slow
    assert cm.table_for(64, "float32") is FLAT.kernel and cm.table_for(32, "bfloat16") is FLAT.kernel
    assert CostModel.from_json(cm.to_json()) == cm
    # a head_dim-32 float32 batch runs on the slow table: 4x the attention time of FLAT
    batch = BatchSpec([2 * B], Full(), n_heads=4, n_kv_heads=2, head_dim=32, dtype="float32")
    plan = _plan(batch, [0, 0], lambda q, kv, br: 0, 2)
    a = simulate(plan, FLAT).forward.busy_s.sum()
    assert simulate(plan, cm).forward.busy_s.sum() == pytest.approx(4 * a, rel=1e-9)
    # a measured file (meta with head_dim and dtype) is filed under its shape; load() merges files
    meta = json.loads(CostModel(slow).to_json()) | {"meta": {"head_dim": 32, "dtype": "float32"}}
    (tmp_path / "hd32.json").write_text(json.dumps(meta))
    (tmp_path / "base.json").write_text(FLAT.to_json())
    loaded = CostModel.load(f"{tmp_path / 'base.json'},{tmp_path / 'hd32.json'}")
    assert loaded.kernel == FLAT.kernel and loaded.table_for(32, "float32") == slow
    assert CostModel.load("h100") == CostModel.h100()
    with pytest.raises(ValueError, match="JSON cost model files"):
        CostModel.load("b200")


def test_link_seconds_charge_ports_inside_a_node_and_rails_between_nodes():
    topo = Topology(n_nodes=2, ranks_per_node=4, nics_per_node=2, intra_bandwidth=100.0, inter_bandwidth=20.0)
    # ranks 0 -> 1 inside node 0; 1 -> 5 and 3 -> 7 between nodes (rails: ranks 0-1 rail 0, 2-3 rail 1)
    s = topo.link_seconds(np.array([0, 1, 3]), np.array([1, 5, 7]), np.array([50.0, 10.0, 30.0]))
    assert s[("port", "out")].tolist() == [0.5] + [0.0] * 7 and s[("port", "in")][1] == 0.5
    assert topo.rail_bandwidth == 10.0 and topo.rail_index(7) == 3
    assert s[("rail", "out")].tolist() == [1.0, 3.0, 0.0, 0.0]
    assert s[("rail", "in")].tolist() == [0.0, 0.0, 1.0, 3.0]


@pytest.mark.parametrize("head_parallel", [1, 2])
def test_simulate_within_gives_up_only_on_runs_that_cannot_finish_under_the_bound(head_parallel):
    # the forward runs first; the backward only where the forward plus the backward's floor
    # (and a head-parallel plan's all-to-alls) can still finish under the bound
    from torch_dcp.sim.simulate import simulate_within

    batch = BatchSpec([3000, 900, 700, 300], Causal(), n_heads=8, n_kv_heads=2, head_dim=64)
    topo = Topology(n_nodes=2, ranks_per_node=2)
    plan = torch_dcp.plan(batch, topo, planner="greedy", block_size=256, head_parallel=head_parallel)
    cm = CostModel.a100()
    full = simulate(plan, cm)
    unbounded = simulate_within(plan, cm)
    assert unbounded.makespan_s == full.makespan_s and unbounded.ideal_s == full.ideal_s
    assert np.array_equal(unbounded.backward.finish_s, full.backward.finish_s)
    # a bound the run meets, or only ties: the whole run, the same
    for bound in (full.makespan_s, full.makespan_s * 1.5):
        assert simulate_within(plan, cm, bound).makespan_s == full.makespan_s
    # a bound under the forward alone: given up
    assert simulate_within(plan, cm, full.forward.makespan_s * 0.5) is None
    # between: given up exactly where the forward plus the backward's lower bound exceeds it
    outer = plan.outer if head_parallel > 1 else plan
    a2a = sum(plan.all_to_all_seconds(bw) for bw in (False, True)) if head_parallel > 1 else 0.0
    inner_fwd = simulate(outer, cm).forward.makespan_s
    lower = inner_fwd + max(kernel_floor_seconds(outer, cm, True), link_floor_seconds(outer, True)) + a2a
    assert lower <= full.makespan_s * (1 + 1e-12)
    assert simulate_within(plan, cm, lower * 0.99) is None
    assert simulate_within(plan, cm, lower * 1.01) is not None
