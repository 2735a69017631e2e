"""Static context parallelism at the CP size a user would choose, with data parallelism across
the CP groups.

A user of a static family (ring attention, all-gather CP, Ulysses, HCP) does not have to run one
CP group over the whole world: with ``W`` ranks they pick a CP size ``c`` dividing ``W``, form
``W / c`` groups of ``c`` consecutive ranks (whole nodes from ``c`` = one node's ranks up; the
whole world at ``c = W``) and data parallelism across the groups, the data loader handing every
group whole documents of the global batch. Every group then runs the family's plan of its own
documents on its own ranks; the step takes the slowest group's time (the groups meet at the
gradient reduction). :func:`static_cp_seconds` times every ``c`` a family can run and the best
of them is the family's figure (``benchmarks compare``).

The loader's split (:func:`split_documents`): whole documents, longest first, each to the group
holding the fewest tokens so far (greedy longest-processing-time balancing by tokens; ties to the
lower group), as a token-balancing data loader packs them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..batch import BatchSpec
from ..cost import CostModel
from ..planners.documents import longest_first
from ..topology import Topology

__all__ = ["STATIC_FAMILIES", "cp_sizes", "split_documents", "group_batch", "group_topology", "static_cp_seconds"]

#: the static families timed at every CP size (Megatron's dynamic CP chooses its own groups per
#: document and is timed as it is)
STATIC_FAMILIES = ("ring", "allgather", "ulysses", "hcp")


def cp_sizes(family: str, batch: BatchSpec, topology: Topology) -> list[int]:
    """The CP sizes ``c`` a user of ``family`` can choose on ``topology``: from one node's ranks
    to the whole world, ``c`` dividing the world size, whole nodes (``c`` a multiple of the
    ranks per node; ``c`` = the world on one node). ``ulysses`` needs ``c`` to divide the query
    heads and ``c`` and the key/value heads one the other; ``hcp`` spans at least two nodes (on
    one node it is Ulysses) with the node's ranks dividing the heads likewise.

    Raises:
        ValueError: an unknown family.
    """
    if family not in STATIC_FAMILIES:
        raise ValueError(f"unknown static family {family!r}; choose from {', '.join(STATIC_FAMILIES)}")
    w, r = topology.world_size, topology.ranks_per_node
    sizes = [c for c in range(min(r, w), w + 1) if w % c == 0 and (c % r == 0 or c == w)]

    def heads_ok(n: int) -> bool:
        h, hkv = batch.n_heads, batch.n_kv_heads
        return h % n == 0 and (n % hkv == 0 or hkv % n == 0)

    if family == "ulysses":
        return [c for c in sizes if heads_ok(c)]
    if family == "hcp":
        return [c for c in sizes if c > r and heads_ok(r)]
    return sizes


def split_documents(doc_lens: Any, groups: int) -> np.ndarray:
    """Which of ``groups`` data-parallel groups each document goes to (module docstring): int64
    ``[n_docs]``, whole documents balanced by tokens, longest first to the lightest group
    (:func:`torch_dcp.planners.documents.longest_first`).

    Raises:
        ValueError: ``groups`` is not a positive integer.
    """
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"groups must be a positive integer, got {groups!r}")
    return longest_first(doc_lens, groups)


def group_batch(batch: BatchSpec, docs: np.ndarray) -> BatchSpec:
    """The batch of documents ``docs`` (int indices, in the global batch's order) of ``batch``:
    their lengths and masks, the same heads, head_dim and dtype."""
    docs = np.sort(np.asarray(docs, np.int64))
    masks = [batch.masks[int(batch.doc_mask[d])] for d in docs]
    return BatchSpec(batch.doc_lens[docs].tolist(), masks if len(batch.masks) > 1 else batch.masks[0],
                     n_heads=batch.n_heads, n_kv_heads=batch.n_kv_heads, head_dim=batch.head_dim, dtype=batch.dtype)


def group_topology(topology: Topology, c: int) -> Topology:
    """One CP group of ``c`` consecutive ranks of ``topology``: ``c / ranks_per_node`` whole
    nodes, or ``c`` ranks of one node, with the topology's links."""
    if c >= topology.ranks_per_node:
        return dataclasses.replace(topology, n_nodes=c // topology.ranks_per_node)
    return dataclasses.replace(topology, n_nodes=1, ranks_per_node=c)


def static_cp_seconds(family: str, batch: BatchSpec, topology: Topology, cost_model: CostModel,
                      sizes: list[int] | None = None, runtime: Any = None) -> dict[int, float]:
    """Simulated forward + backward seconds of ``family`` at every CP size (``sizes``, default
    :func:`cp_sizes`): ``{c: seconds}``, each the slowest of the ``W / c`` groups, every group
    planned with the family's planner on its own documents (:func:`split_documents`) and ranks
    (:func:`group_topology`) and simulated as the family's implementation runs it
    (:func:`torch_dcp.simulate.simulate`; ``runtime``: as that
    :class:`~torch_dcp.planners.base.Runtime` runs it instead, e.g. torch_dcp's executor). A
    group without documents takes no time.

    Raises:
        ValueError: an unknown family, or a size that does not divide the world size.
    """
    import torch_dcp

    from ..simulate import simulate

    sizes = cp_sizes(family, batch, topology) if sizes is None else sizes
    out: dict[int, float] = {}
    for c in sizes:
        if topology.world_size % c:
            raise ValueError(f"CP size {c} does not divide the world size {topology.world_size}")
        groups = topology.world_size // c
        split = split_documents(batch.doc_lens, groups)
        topo = group_topology(topology, c)
        worst = 0.0
        for g in range(groups):
            docs = np.flatnonzero(split == g)
            if len(docs) == 0:
                continue
            plan = torch_dcp.plan(group_batch(batch, docs), topo, planner=family, cost_model=cost_model)
            worst = max(worst, simulate(plan, cost_model, runtime=runtime).makespan_s)
        out[c] = worst
    return out
