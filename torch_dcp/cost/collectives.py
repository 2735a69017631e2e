"""NCCL's all-gather and reduce-scatter on a :class:`~torch_dcp.Topology` (seconds).

The model of a collective over every rank of the topology (``W = n r`` ranks, ``n`` nodes of
``r``), ``shard_bytes`` per rank (NCCL needs equal shards: the largest rank's, the others padded
to it), by the algorithm NCCL runs there (:class:`Algorithm`, from the topology):

* ``RING`` (the default): NCCL's ring over all ``W`` ranks. Each rank receives the ``W - 1``
  other shards from its ring neighbour, inside a node over its NVLink / NVSwitch port:
  ``(W - 1) shard / intra_bandwidth``; across nodes every ring that enters a node carries the
  ``W - 1`` shards too, the node's rings spread over its rails (NCCL runs a channel per NIC):
  ``(W - 1) shard / inter_bandwidth``. Latency: one step per ring hop, ``W - n`` of them inside
  nodes and ``n - 1`` across (NCCL's tuning model, ``src/graph/tuning.cc``: ``nsteps = W - 1``,
  ``nInterSteps = n - 1``). Without in-network reduction NCCL runs all-gather and
  reduce-scatter across nodes with the ring (PAT only with one GPU per node; the CollNet and
  NVLS algorithms need IB SHARP or NVLink SHARP).
* ``NODE_ONCE`` (``Topology(in_network_reduction=True)``: IB SHARP / NVLink SHARP, NCCL's
  CollNet / NVLS): every remote shard enters each node once, over all of the node's rails,
  ``(n - 1) r shard / inter_bandwidth``, and each rank receives the node's other ``r - 1``
  shards for all ``n`` nodes over NVLink, ``(r - 1) n shard / intra_bandwidth``; latency
  ``(r - 1) intra_latency + (n - 1) inter_latency``.

Either way the stages stream chunks through NVLink and the NICs at once, so the slower one
bounds the collective. On one node both are NVLink rings. A reduce-scatter moves the same bytes
the other way (each rank ends with its own shard of the sum); the additions are memory-bound and
hidden behind the transfers, so it takes the all-gather's time. Sources: NCCL's performance
notes (``nccl-tests`` ``doc/PERFORMANCE.md``: an all-gather's ``busBW = algBW (W - 1) / W``,
every rank receiving ``W - 1`` shards), NCCL's ``src/graph/tuning.cc`` (the ring's steps, the
algorithms enabled per topology), with the topology's NVLink and rail bandwidths.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["Algorithm", "algorithm_of", "allgather_seconds", "reduce_scatter_seconds"]


class Algorithm(enum.Enum):
    """How NCCL runs all-gather and reduce-scatter across the nodes (module docstring)."""

    RING = "ring"
    NODE_ONCE = "node_once"


def algorithm_of(topology: Any) -> Algorithm:
    """The algorithm of ``topology``: ``NODE_ONCE`` with in-network reduction, else ``RING``."""
    return Algorithm.NODE_ONCE if getattr(topology, "in_network_reduction", False) else Algorithm.RING


def allgather_seconds(shard_bytes: float, topology: Any, algorithm: Algorithm | None = None) -> float:
    """Seconds of an NCCL all-gather of ``shard_bytes`` bytes per rank over every rank of
    ``topology`` (module docstring); ``algorithm`` defaults to the topology's
    (:func:`algorithm_of`); 0 on one rank or for empty shards.

    Raises:
        ValueError: ``shard_bytes`` is negative.
    """
    if shard_bytes < 0:
        raise ValueError(f"shard_bytes must be >= 0, got {shard_bytes}")
    n, r = topology.n_nodes, topology.ranks_per_node
    w = n * r
    if w == 1 or shard_bytes == 0:
        return 0.0
    inter_bw = topology.rail_bandwidth * topology.rails_per_node
    if (algorithm or algorithm_of(topology)) is Algorithm.NODE_ONCE:
        latency = (r - 1) * topology.intra_latency + (n - 1) * topology.inter_latency
        intra = (r - 1) * n * shard_bytes / topology.intra_bandwidth
        inter = (n - 1) * r * shard_bytes / inter_bw
    else:
        latency = (w - n) * topology.intra_latency + (n - 1) * topology.inter_latency
        intra = (w - 1) * shard_bytes / topology.intra_bandwidth
        inter = (w - 1) * shard_bytes / inter_bw if n > 1 else 0.0
    return latency + max(intra, inter)


def reduce_scatter_seconds(shard_bytes: float, topology: Any, algorithm: Algorithm | None = None) -> float:
    """Seconds of an NCCL reduce-scatter leaving ``shard_bytes`` bytes on every rank of
    ``topology``: the all-gather's (module docstring).

    Raises:
        ValueError: ``shard_bytes`` is negative.
    """
    return allgather_seconds(shard_bytes, topology, algorithm)
