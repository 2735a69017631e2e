"""Topology: ranks grouped in nodes, with the two link classes between them."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Topology"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Ranks of the DCP group, ``ranks_per_node`` consecutive ranks per node.

    Defaults are the DCP paper's microbenchmark cluster (§7.1): 4 nodes × 8 A100-80GB,
    NVSwitch inside a node, 4×100 Gbps EFA between nodes.

    Attributes:
        n_nodes: nodes.
        ranks_per_node: ranks on every node.
        intra_bandwidth: bytes/s one rank can send to the other ranks of its node (A100
            NVSwitch: 300 GB/s per direction).
        intra_latency: seconds per intra-node transfer.
        inter_bandwidth: bytes/s of one node's network links to other nodes, shared by its
            ranks (4 × 100 Gbps = 50 GB/s).
        inter_latency: seconds per inter-node transfer.

    Raises:
        ValueError: non-positive counts, bandwidths, or negative latencies.
    """

    n_nodes: int = 4
    ranks_per_node: int = 8
    intra_bandwidth: float = 300e9
    intra_latency: float = 3e-6
    inter_bandwidth: float = 50e9
    inter_latency: float = 15e-6

    def __post_init__(self):
        for name in ("n_nodes", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"Topology.{name} must be a positive integer, got {v!r}")
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Topology.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Topology.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def world_size(self) -> int:
        return self.n_nodes * self.ranks_per_node

    def node_of(self, rank: Any) -> Any:
        """Node index of ``rank`` (an int or an int array)."""
        if isinstance(rank, (int, np.integer)):
            return int(rank) // self.ranks_per_node
        return np.asarray(rank) // self.ranks_per_node

    @classmethod
    def single_node(cls, world_size: int, **links: float) -> "Topology":
        """All ``world_size`` ranks on one node."""
        return cls(n_nodes=1, ranks_per_node=world_size, **links)

    @classmethod
    def coerce(cls, topology: "Topology | int") -> "Topology":
        """A Topology as is; an int ``W`` as :meth:`single_node`\\ ``(W)``.

        Raises:
            ValueError: neither a Topology nor a positive int.
        """
        if isinstance(topology, Topology):
            return topology
        if isinstance(topology, (int, np.integer)) and not isinstance(topology, bool) and topology > 0:
            return cls.single_node(int(topology))
        raise ValueError(f"topology must be a Topology or a positive world size, got {topology!r}")

    @classmethod
    def from_mesh(cls, mesh: Any, ranks_per_node: int | None = None, **links: float) -> "Topology":
        """Topology of a live one-dimensional ``DeviceMesh`` (or a process group).

        Ranks are grouped into nodes by host name (gathered over the mesh's group), unless
        ``ranks_per_node`` is given. Ranks of one node must be consecutive in the group.

        Raises:
            ValueError: the mesh is not one-dimensional, or hosts hold different numbers of
                ranks or non-consecutive ranks.
        """
        import socket

        import torch.distributed as dist

        if hasattr(mesh, "get_group"):
            if mesh.ndim != 1:
                raise ValueError(f"Topology.from_mesh: expected a 1-D DeviceMesh, got {mesh.ndim}-D")
            group = mesh.get_group()
        else:
            group = mesh
        world = dist.get_world_size(group)
        if ranks_per_node is None:
            hosts: list[Any] = [None] * world
            dist.all_gather_object(hosts, socket.gethostname(), group=group)
            names = []
            for h in hosts:
                if not names or names[-1] != h:
                    names.append(h)
            if len(set(names)) != len(names):
                raise ValueError(f"Topology.from_mesh: ranks of one host are not consecutive: {hosts}")
            counts = {h: hosts.count(h) for h in names}
            if len(set(counts.values())) != 1:
                raise ValueError(f"Topology.from_mesh: hosts hold different numbers of ranks: {counts}")
            ranks_per_node = world // len(names)
        if world % ranks_per_node:
            raise ValueError(f"Topology.from_mesh: ranks_per_node={ranks_per_node} does not divide {world}")
        return cls(n_nodes=world // ranks_per_node, ranks_per_node=ranks_per_node, **links)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Topology":
        return cls(**d)
