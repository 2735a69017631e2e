"""Pictures are written as PNG files."""

from __future__ import annotations

import torch_dcp
from torch_dcp import BatchSpec, Lambda, Topology
from torch_dcp.benchmarks import viz


def test_pictures(tmp_path):
    batch = BatchSpec([3000, 200, 900, 40], Lambda(sink=8, window=500), n_heads=8, n_kv_heads=2, head_dim=64)
    plan = torch_dcp.plan(batch, Topology(n_nodes=2, ranks_per_node=2), planner="dcp", block_size=128, head_parallel=1)
    paths = [viz.placement_map(plan, tmp_path / "p.png"), viz.traffic_matrix(plan, tmp_path / "t.png"),
             viz.timeline(torch_dcp.sim.simulate(plan), tmp_path / "s.png")]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    m = plan.traffic_matrix()
    assert m.shape == (4, 4) and m.sum() == plan.stats()["comm_bytes"] and (m.diagonal() == 0).all()
