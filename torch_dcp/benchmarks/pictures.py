"""Pictures of one benchmark plan (PNG): placement map, rank-to-rank traffic, simulated timeline.

    python -m torch_dcp.benchmarks pictures --out docs --batch longtail --mask lambda --planner dcp

Needs matplotlib (``pip install 'torch-dcp[benchmarks]'``).
"""

from __future__ import annotations

from ..api import plan as make_plan
from ..batch import BatchSpec
from ..topology import Topology
from .common import MASKS, planner_batches

__all__ = ["write_pictures"]


def write_pictures(out: str, batch_name: str, mask: str, planner: str, block_size: int,
                   topology: Topology | None = None) -> list[str]:
    """Write ``placement.png``, ``traffic.png`` and ``timeline.png`` of one benchmark plan
    into ``out``; returns the paths."""
    from pathlib import Path

    from ..sim.simulate import simulate
    from . import viz

    Path(out).mkdir(parents=True, exist_ok=True)
    batch = BatchSpec(planner_batches()[batch_name], MASKS[mask], n_heads=8, n_kv_heads=2, head_dim=128)
    plan = make_plan(batch, topology or Topology(), planner=planner, block_size=block_size,
                     cost_model="a100")  # the table the timeline is drawn with
    paths = [viz.placement_map(plan, Path(out) / "placement.png"), viz.traffic_matrix(plan, Path(out) / "traffic.png"),
             viz.timeline(simulate(plan), Path(out) / "timeline.png",
                          title=f"{planner}, {batch_name} batch, {mask} mask: simulated attention (A100 table)")]
    for pth in paths:
        print(pth)
    return [str(pth) for pth in paths]
