"""Static context parallelism at the CP size a user would choose: CP groups of consecutive
ranks, data parallelism across them.

A user of a static family (ring attention, all-gather CP, Ulysses, HCP) does not have to run one
CP group over the whole world: with ``W`` ranks they pick a CP size ``c`` dividing ``W``, form
``W / c`` groups of ``c`` consecutive ranks (whole nodes from ``c`` = one node's ranks up; the
whole world at ``c = W``) and data parallelism across the groups, the data loader handing every
group whole documents of the global batch (:func:`split_documents`: whole documents, longest
first, each to the group holding the fewest tokens so far, as a token-balancing data loader
packs them). Megatron-Core creates such CP groups once for every size it may use
(``megatron/core/parallel_state.py``, ``initialize_model_parallel``).

torch_dcp offers every such configuration among dcp's candidates, run by the family's own
runtime (:class:`~torch_dcp.planners.base.Runtime`); ``benchmarks compare`` times them as the
baselines a user would tune.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from .documents import longest_first

__all__ = ["STATIC_FAMILIES", "cp_sizes", "split_documents", "group_batch", "group_topology"]

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
