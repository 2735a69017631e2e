"""Static context parallelism at the CP size a user would choose, with data parallelism across
the CP groups.

A user of a static family (ring attention, all-gather CP, Ulysses, HCP) does not have to run one
CP group over the whole world: with ``W`` ranks they pick a CP size ``c`` dividing ``W``, form
``W / c`` groups of ``c`` consecutive ranks (whole nodes from ``c`` = one node's ranks up; the
whole world at ``c = W``) and data parallelism across the groups, the data loader handing every
group whole documents of the global batch. Every group then runs the family's plan of its own
documents on its own ranks; the step takes the slowest group's time (the groups meet at the
gradient reduction). :func:`static_cp_seconds` times every ``c`` a family can run and the best
of them is the family's figure (``benchmarks compare``); :func:`static_cp_runs` also gives each
``c``'s peak attention memory per rank (:func:`~torch_dcp.plan.memory.attention_memory`, the
largest over the groups).

The loader's split (:func:`split_documents`): whole documents, longest first, each to the group
holding the fewest tokens so far (greedy longest-processing-time balancing by tokens; ties to the
lower group), as a token-balancing data loader packs them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..batch import BatchSpec
from ..cost import CostModel
from ..planners.static import STATIC_FAMILIES, cp_sizes, group_batch, group_topology, split_documents
from ..topology import Topology

__all__ = ["STATIC_FAMILIES", "cp_sizes", "split_documents", "group_batch", "group_topology", "static_cp_seconds",
           "static_cp_runs", "StaticRun"]


class StaticRun(NamedTuple):
    """One CP size of a static family: the step's ``seconds`` (the slowest group) and
    ``peak_bytes``, the most attention memory on one rank of any group."""

    seconds: float
    peak_bytes: float


def static_cp_seconds(family: str, batch: BatchSpec, topology: Topology, cost_model: CostModel,
                      sizes: list[int] | None = None, runtime: Any = None) -> dict[int, float]:
    """Simulated forward + backward seconds of ``family`` at every CP size (``sizes``, default
    :func:`cp_sizes`): ``{c: seconds}`` (:func:`static_cp_runs`' times).

    Raises:
        ValueError: an unknown family, or a size that does not divide the world size.
    """
    return {c: run.seconds for c, run in static_cp_runs(family, batch, topology, cost_model, sizes, runtime).items()}


def static_cp_runs(family: str, batch: BatchSpec, topology: Topology, cost_model: CostModel,
                   sizes: list[int] | None = None, runtime: Any = None) -> dict[int, StaticRun]:
    """Every CP size (``sizes``, default :func:`cp_sizes`) of ``family``: ``{c: StaticRun}``,
    the seconds the slowest of the ``W / c`` groups takes, every group planned with the
    family's planner on its own documents (:func:`split_documents`) and ranks
    (:func:`group_topology`) and simulated as the family's implementation runs it
    (:func:`torch_dcp.sim.simulate.simulate`; ``runtime``: as that
    :class:`~torch_dcp.planners.base.Runtime` runs it instead, e.g. torch_dcp's executor), and
    the peak attention memory on one rank (:func:`~torch_dcp.plan.memory.attention_memory`). A
    group without documents takes no time and holds nothing.

    Raises:
        ValueError: an unknown family, or a size that does not divide the world size.
    """
    import torch_dcp

    from ..plan.memory import attention_memory
    from ..sim.simulate import simulate

    sizes = cp_sizes(family, batch, topology) if sizes is None else sizes
    out: dict[int, StaticRun] = {}
    for c in sizes:
        if topology.world_size % c:
            raise ValueError(f"CP size {c} does not divide the world size {topology.world_size}")
        groups = topology.world_size // c
        split = split_documents(batch.doc_lens, groups)
        topo = group_topology(topology, c)
        worst = peak = 0.0
        for g in range(groups):
            docs = np.flatnonzero(split == g)
            if len(docs) == 0:
                continue
            plan = torch_dcp.plan(group_batch(batch, docs), topo, planner=family, cost_model=cost_model)
            worst = max(worst, simulate(plan, cost_model, runtime=runtime).makespan_s)
            peak = max(peak, float(attention_memory(plan).max()))
        out[c] = StaticRun(worst, peak)
    return out
