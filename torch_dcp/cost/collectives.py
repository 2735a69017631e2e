"""NCCL's all-gather and reduce-scatter on a :class:`~torch_dcp.Topology` (seconds).

The model of a collective over every rank of the topology, ``shard_bytes`` per rank (NCCL
needs equal shards: the largest rank's, the others padded to it):

* inside a node, each rank receives the shards of the node's other ``r - 1`` ranks, for all
  ``n`` nodes, over its own NVLink/NVSwitch port: ``(r - 1) n shard / intra_bandwidth``;
* between nodes, every remote shard enters each node once, over all of the node's rails
  (NCCL runs one channel per NIC): ``(n - 1) r shard / inter_bandwidth``;
* NCCL pipelines the two stages (its ring and hierarchical algorithms stream chunks through
  NVLink and the NICs at once), so the slower one bounds the collective, plus one latency per
  step of each stage: ``(r - 1) intra_latency + (n - 1) inter_latency``.

A reduce-scatter moves the same bytes the other way (each rank ends with its own shard of the
sum); the additions are memory-bound and hidden behind the transfers, so it takes the
all-gather's time. Sources: NCCL's performance notes (``nccl-tests`` ``doc/PERFORMANCE.md``:
an all-gather's ``busBW = algBW (W - 1) / W``, every rank receiving ``W - 1`` shards) with the
topology's NVLink and rail bandwidths (:class:`~torch_dcp.Topology`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["allgather_seconds", "reduce_scatter_seconds"]


def allgather_seconds(shard_bytes: float, topology: Any) -> float:
    """Seconds of an NCCL all-gather of ``shard_bytes`` bytes per rank over every rank of
    ``topology`` (module docstring); 0 on one rank or for empty shards.

    Raises:
        ValueError: ``shard_bytes`` is negative.
    """
    if shard_bytes < 0:
        raise ValueError(f"shard_bytes must be >= 0, got {shard_bytes}")
    n, r = topology.n_nodes, topology.ranks_per_node
    if n * r == 1 or shard_bytes == 0:
        return 0.0
    latency = (r - 1) * topology.intra_latency + (n - 1) * topology.inter_latency
    intra = (r - 1) * n * shard_bytes / topology.intra_bandwidth
    inter = (n - 1) * r * shard_bytes / (topology.rail_bandwidth * topology.rails_per_node)
    return latency + max(intra, inter)


def reduce_scatter_seconds(shard_bytes: float, topology: Any) -> float:
    """Seconds of an NCCL reduce-scatter leaving ``shard_bytes`` bytes on every rank of
    ``topology``: the all-gather's (module docstring).

    Raises:
        ValueError: ``shard_bytes`` is negative.
    """
    return allgather_seconds(shard_bytes, topology)
