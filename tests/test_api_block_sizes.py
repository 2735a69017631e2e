"""``torch_dcp.plan`` at several block sizes (``block_size="auto"`` or a sequence): the fastest
plan on the simulator kept, sparse masks also planned with 256-token blocks."""

from __future__ import annotations

import pytest

import torch_dcp
from torch_dcp import BatchSpec, BlockwiseCausal, Causal, Lambda, SharedQuestion, Topology
from torch_dcp.api import AUTO_BLOCK_SIZES, SPARSE_BLOCK_SIZE, auto_block_sizes
from torch_dcp.sim.simulate import simulate

LENS = [9000, 3000, 2000, 1500, 700, 400, 300, 100]


def _batch(mask):
    return BatchSpec(LENS, mask, n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")


def test_auto_block_sizes_add_small_blocks_for_sparse_masks_only():
    assert auto_block_sizes(_batch(Causal())) == AUTO_BLOCK_SIZES
    assert auto_block_sizes(_batch(SharedQuestion(0.2, 4))) == AUTO_BLOCK_SIZES
    for mask in (Lambda(sink=64, window=512), BlockwiseCausal(block=128, window_blocks=2, sink_blocks=1)):
        assert auto_block_sizes(_batch(mask)) == AUTO_BLOCK_SIZES + (SPARSE_BLOCK_SIZE,)
    # short documents: a window that covers them leaves the mask causal in effect
    assert auto_block_sizes(BatchSpec([300, 200], Lambda(sink=64, window=512), n_heads=2, n_kv_heads=2,
                                      head_dim=16)) == AUTO_BLOCK_SIZES


def test_the_fastest_block_size_is_kept():
    # a blockwise mask (128-token blocks) on 2 x 8 A100s: 256-token blocks beat 1024 (0.597 against 0.606 ms)
    batch = BatchSpec([20000, 16000, 9000, 5000, 3000, 2000, 1000], BlockwiseCausal(block=128, window_blocks=2,
                      sink_blocks=1), n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
    topo = Topology.preset("a100", n_nodes=2)
    cm = torch_dcp.CostModel.load("a100-executor")
    each = {b: torch_dcp.plan(batch, topo, block_size=b, cost_model=cm, head_parallel=1) for b in (1024, 256)}
    times = {b: simulate(p, cm).makespan_s for b, p in each.items()}
    best = torch_dcp.plan(batch, topo, block_size=[1024, 256], cost_model=cm, head_parallel=1)
    assert simulate(best, cm).makespan_s == pytest.approx(min(times.values()), rel=1e-9)
    assert times[256] < times[1024]
    assert best.workload.block_len.max() == 256
    assert {label.rsplit(" (B=", 1)[1] for label, _ in best.candidates} == {"1024)", "256)"}
    auto = torch_dcp.plan(batch, topo, block_size="auto", cost_model=cm, head_parallel=1)
    assert simulate(auto, cm).makespan_s <= min(times.values()) * (1 + 1e-9)


@pytest.mark.parametrize("bad,match", [("big", "block_size must be an integer in"), ([], "empty"),
                                       ([1024, 0], "block_size must lie in"), ([1024, 2.5], "must be an integer")])
def test_bad_block_sizes_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        torch_dcp.plan(_batch(Causal()), 4, block_size=bad, cost_model="a100")


def test_several_block_sizes_need_a_planner_that_times_candidates():
    with pytest.raises(ValueError, match="need a planner whose time objective"):
        torch_dcp.plan(_batch(Causal()), 4, planner="ring", block_size="auto")
    with pytest.raises(ValueError, match="need a planner whose time objective"):
        torch_dcp.plan(_batch(Causal()), 4, block_size=[512, 1024], objective="bytes")
