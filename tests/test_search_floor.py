"""The search floor (torch_dcp.sim.floors.search_floor_seconds): no placement of a batch's blocks
runs faster on torch_dcp's executor, and torch_dcp.plan skips dcp's own search where a static
runtime's plan is faster than it, without choosing a slower plan."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_dcp
from torch_dcp import BatchSpec, Causal, CostModel, Lambda, Placement, Topology, Workload, api
from torch_dcp.cost.auto import PRESET_DIR
from torch_dcp.masks import BlockwiseCausal, SharedQuestion
from torch_dcp.planners.dcp import dcp_candidates
from torch_dcp.sim.floors import division_launch_seconds, search_floor_seconds
from torch_dcp.sim.simulate import simulate

MODELS = {"cpu": str(PRESET_DIR / "cpu.json"), "h100-executor": "h100-executor", "a100": "a100"}
MASKS = {"causal": Causal(), "lambda": Lambda(sink=64, window=512), "blockwise": BlockwiseCausal(block=256),
         "shared_question": SharedQuestion()}


def _batch(lengths, mask, model):
    dtype = "float32" if model == "cpu" else "bfloat16"
    return BatchSpec(lengths, MASKS[mask], n_heads=4, n_kv_heads=2, head_dim=32 if model == "cpu" else 64,
                     dtype=dtype)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 2500), min_size=1, max_size=6), mask=st.sampled_from(sorted(MASKS)),
       model=st.sampled_from(sorted(MODELS)), world=st.sampled_from([2, 3, 4]), divisions=st.sampled_from([1, 2, 4]),
       block=st.sampled_from([128, 256]), seed=st.integers(0, 2**16))
def test_no_placement_beats_the_search_floor(lengths, mask, model, world, divisions, block, seed):
    """Every placement of the blocks (dcp's own and random ones), at any number of divisions:
    its launches sum to at least the least launch cost per pass, and its simulated time is at
    least the search floor."""
    batch = _batch(lengths, mask, model)
    cm = CostModel.load(MODELS[model])
    topo = Topology.single_node(world)
    wl = Workload.uniform(batch, block)
    least = {bw: cm.least_launch_seconds(wl, bw) for bw in (False, True)}
    floor = search_floor_seconds(wl, world, cm)
    assert floor == pytest.approx(sum(least.values()) / world)
    rng = np.random.default_rng(seed)
    placements = dcp_candidates(batch, topo, block, rivals=())
    placements.append(Placement(wl, world, rng.integers(0, world, wl.n_blocks), rng.integers(0, world, wl.n_tiles)))
    for p in placements:
        assert p.workload.n_tiles == wl.n_tiles
        plan = api.divide(p, topo, min(divisions, max(1, wl.n_tiles)))
        for bw in (False, True):
            assert division_launch_seconds(plan, cm, bw).sum() >= least[bw] * (1 - 1e-9)
        assert simulate(plan, cm).makespan_s >= floor * (1 - 1e-9)


def test_the_floor_counts_what_every_placement_pays():
    """On a CPU model the floor is most of the launches' cost (their calls, copies and work), not
    the FLOPs alone: within 10 % of one rank running every tile in one launch, well above the
    FLOPs at the kernel table's best throughput."""
    batch = _batch([4096, 2500, 1000, 596], "causal", "cpu")
    cm = CostModel.load(MODELS["cpu"])
    wl = Workload.uniform(batch, 256)
    tiles = np.arange(wl.n_tiles)
    for bw in (False, True):
        one = cm.launch_seconds(wl, tiles, np.zeros(wl.n_tiles, np.int64), 1, bw)[0]
        assert 0.9 * one <= cm.least_launch_seconds(wl, bw) <= one
        assert cm.least_launch_seconds(wl, bw) > 1.2 * cm.with_executor(None).least_launch_seconds(wl, bw)
    with pytest.raises(ValueError, match="world_size"):
        search_floor_seconds(wl, 0, cm)


@pytest.mark.parametrize("lengths", [[4096, 2500, 1000, 596], [4096, 4096]], ids=["mixed", "two-long"])
def test_plan_skips_the_search_where_a_static_runtime_wins(lengths, monkeypatch):
    """The main job's batches (4 ranks, causal, the CPU preset): a static runtime's plan is faster
    than the search floor at every head parallelism, so plan() times the rivals alone there, and
    its plan is no slower than with the full search."""
    batch = _batch(lengths, "causal", "cpu")
    cm = CostModel.load(MODELS["cpu"])
    topo = Topology.single_node(4)
    hopeless, statics = api._hopeless_searches(batch, topo, "dcp", [1, 2, 4], 256, 2, "dcp", {}, cm)
    assert sorted(hopeless) == [1, 2, 4]
    assert set(hopeless.values()) == {Workload.uniform(batch, 256).n_tiles}
    fast = torch_dcp.plan(batch, topo, block_size=256, divisions=2, cost_model=cm)
    # all-gather CP's plans made for the check are the candidates, each once (the ring runtime's,
    # priced as the executor on a CPU, are not: the ring rival is the same)
    made = sorted(p.planner for n in (1, 2, 4) for p in statics[n] if p.planner.startswith("dcp:allgather"))
    assert all(any(p.planner.startswith("dcp:allgather/cp") for p in statics[n]) for n in (1, 2, 4))
    assert sorted(label for label, _ in fast.candidates if label in made) == made
    own = {"dcp", "dcp:bytes"}
    assert not any(label.split("/")[0].split(" ")[0] in own for label, _ in fast.candidates)
    monkeypatch.setattr(api, "_hopeless_searches", lambda *args: ({}, {}))
    full = torch_dcp.plan(batch, topo, block_size=256, divisions=2, cost_model=cm)
    assert any(label.split("/")[0] in own for label, _ in full.candidates)
    assert simulate(fast, cm).makespan_s <= simulate(full, cm).makespan_s * (1 + 1e-9)
    # the search is kept where the caller leaves out the static runtimes (nothing to beat)
    assert api._hopeless_searches(batch, topo, "dcp", [1, 2, 4], 256, 2, "dcp",
                                  {"rivals": ("ring", "documents")}, cm) == ({}, {})


def test_explicit_divisions_are_checked_against_the_blocks_tiles_when_the_search_is_skipped():
    batch = _batch([4096, 2500, 1000, 596], "causal", "cpu")
    cm = CostModel.load(MODELS["cpu"])
    n_tiles = Workload.uniform(batch, 256).n_tiles
    with pytest.raises(ValueError, match=f"divisions must lie in 1..{n_tiles}"):
        torch_dcp.plan(batch, 4, block_size=256, divisions=n_tiles + 1, cost_model=cm)


def test_a_ring_runtime_priced_as_the_executor_is_not_timed_twice():
    """A CPU calibration prices torch_dcp's ring runtime as the executor runs the same layout, the
    ring rival's (``dcp:ring``): plan() times the rival alone; without that rival, or with a GPU
    preset (the runtime's own count per step), the ring runtime is a candidate."""
    topo = Topology.single_node(4)
    cpu = CostModel.load(MODELS["cpu"])
    batch = _batch([4096, 2500, 1000, 596], "causal", "cpu")
    labels = [label for label, _ in torch_dcp.plan(batch, topo, block_size=256, cost_model=cpu,
                                                   head_parallel=1).candidates]
    assert "dcp:ring" in labels and not any(label.startswith("dcp:ring/cp") for label in labels)
    alone = torch_dcp.plan(batch, topo, block_size=256, cost_model=cpu, head_parallel=1, rivals=("static",))
    assert any(label.startswith("dcp:ring/cp4") for label, _ in alone.candidates)
    gpu = torch_dcp.plan(_batch([4096, 2500, 1000, 596], "causal", "h100-executor"), topo, block_size=256,
                         cost_model="h100-executor", head_parallel=1)
    assert any(label.startswith("dcp:ring/cp4") for label, _ in gpu.candidates)
