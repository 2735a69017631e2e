"""Topology: ranks grouped in nodes, with the two link classes between them (NVLink/NVSwitch
ports inside a node, network rails between nodes), and named presets of real clusters."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Topology", "TOPOLOGY_PRESETS"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Ranks of the DCP group, ``ranks_per_node`` consecutive ranks per node.

    Defaults are the DCP paper's microbenchmark cluster (§7.1): 4 nodes × 8 A100-80GB,
    NVSwitch inside a node, 4×100 Gbps EFA between nodes (:data:`TOPOLOGY_PRESETS` also has
    an H100 DGX cluster).

    Between nodes a node has ``nics_per_node`` network cards (rails), ``inter_bandwidth`` in
    all; each rank sits on one rail (consecutive ranks share a rail when there are fewer rails
    than ranks: 2 GPUs per 12.5 GB/s rail in the paper's cluster), so one transfer gets one
    rail's bandwidth, not the node's. Which rail a point-to-point transfer between nodes rides
    is :meth:`rail_out_index` (out of the sender's node) and :meth:`rail_index` of the receiver
    (into its node).

    Attributes:
        n_nodes: nodes.
        ranks_per_node: ranks on every node.
        intra_bandwidth: bytes/s one rank can send to the other ranks of its node (A100
            NVSwitch: 300 GB/s per direction).
        intra_latency: seconds per intra-node transfer.
        inter_bandwidth: bytes/s of one node's network links to other nodes, all rails
            together, per direction (4 × 100 Gbps = 50 GB/s).
        inter_latency: seconds per inter-node transfer.
        nics_per_node: network cards (rails) per node.
        in_network_reduction: the network reduces and multicasts in the switches (InfiniBand
            SHARP, NVLink SHARP across nodes; NCCL's CollNet / NVLS algorithms): collectives
            bring each remote shard into a node once. False (the default): NCCL's ring across
            nodes, every ring link into a node carrying ``W - 1`` shards
            (:mod:`torch_dcp.cost.collectives`).
        pxn: NCCL's PXN (PCI x NVLink, on by default: ``NCCL_P2P_PXN_LEVEL=2``, "use PXN as much
            as possible"; NCCL ``src/graph/paths.cc``): a point-to-point transfer to a rank of
            another node leaves the sender's node through the card of the GPU with the
            receiver's local rank, reached over NVLink, so it rides one rail at both ends, the
            receiver's (rail-optimized networks). False: the sender's own rail out.

    Raises:
        ValueError: non-positive counts, bandwidths, or negative latencies.
    """

    n_nodes: int = 4
    ranks_per_node: int = 8
    intra_bandwidth: float = 300e9
    intra_latency: float = 3e-6
    inter_bandwidth: float = 50e9
    inter_latency: float = 15e-6
    nics_per_node: int = 4
    in_network_reduction: bool = False
    pxn: bool = True

    def __post_init__(self):
        for name in ("n_nodes", "ranks_per_node", "nics_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"Topology.{name} must be a positive integer, got {v!r}")
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Topology.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Topology.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("in_network_reduction", "pxn"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"Topology.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def world_size(self) -> int:
        return self.n_nodes * self.ranks_per_node

    @property
    def rails_per_node(self) -> int:
        """Rails the node's ranks use: ``min(nics_per_node, ranks_per_node)`` (a rank uses one)."""
        return min(self.nics_per_node, self.ranks_per_node)

    @property
    def rail_bandwidth(self) -> float:
        """Bytes/s of one rail per direction: ``inter_bandwidth / nics_per_node``, or the
        node's share per rank when there are more cards than ranks."""
        return self.inter_bandwidth / self.rails_per_node

    def rail_of(self, rank: Any) -> Any:
        """Rail (inside its node) of ``rank``'s inter-node transfers (an int or an int array)."""
        local = np.asarray(rank) % self.ranks_per_node
        rail = local * self.rails_per_node // self.ranks_per_node
        return int(rail) if isinstance(rank, (int, np.integer)) else rail

    def rail_index(self, rank: Any) -> Any:
        """Rail of ``rank`` numbered over the cluster, ``node * rails_per_node + rail_of(rank)``."""
        return self.node_of(rank) * self.rails_per_node + self.rail_of(rank)

    def rail_out_index(self, src: Any, dst: Any) -> Any:
        """Rail (numbered over the cluster, as :meth:`rail_index`) on which a point-to-point
        transfer ``src -> dst`` between nodes leaves ``src``'s node: with :attr:`pxn` the rail
        of ``dst``'s local rank on ``src``'s node, else ``src``'s own (ints or int arrays)."""
        if not self.pxn:
            return self.rail_index(src)
        return self.node_of(src) * self.rails_per_node + self.rail_of(dst)

    def link_seconds(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> dict[tuple[str, str], np.ndarray]:
        """Seconds every link is busy carrying the transfers ``src[i] -> dst[i]`` of
        ``nbytes[i]`` bytes: inside a node the sender's NVLink port out and the receiver's port
        in (``intra_bandwidth``), between nodes the rail out of :meth:`rail_out_index` and the
        receiver's rail in (``rail_bandwidth``; PXN's NVLink hop to the card is not charged: at
        NVLink speed it carries the transfer in a fraction of its time on the rail). Keys
        ``("port", "out" | "in")``: float64 ``[world_size]``;
        ``("rail", "out" | "in")``: float64 ``[n_nodes * rails_per_node]`` by :meth:`rail_index`."""
        src, dst, nbytes = (np.atleast_1d(np.asarray(a)) for a in (src, dst, nbytes))
        inter = self.node_of(src) != self.node_of(dst)
        out = {}
        rails = {"out": self.rail_out_index(src[inter], dst[inter]), "in": self.rail_index(dst[inter])}
        for way, ends in (("out", src), ("in", dst)):
            out[("port", way)] = np.bincount(ends[~inter], weights=nbytes[~inter],
                                             minlength=self.world_size) / self.intra_bandwidth
            out[("rail", way)] = np.bincount(rails[way], weights=nbytes[inter],
                                             minlength=self.n_nodes * self.rails_per_node) / self.rail_bandwidth
        return out

    @classmethod
    def preset(cls, name: str, n_nodes: int = 4) -> "Topology":
        """A named cluster of ``n_nodes`` nodes (:data:`TOPOLOGY_PRESETS`).

        Raises:
            ValueError: unknown name.
        """
        if name not in TOPOLOGY_PRESETS:
            raise ValueError(f"unknown topology preset {name!r}; available: {sorted(TOPOLOGY_PRESETS)}")
        return dataclasses.replace(TOPOLOGY_PRESETS[name], n_nodes=n_nodes)

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
    def from_mesh(cls, mesh: Any, ranks_per_node: int | None = None, *, dims: "str | tuple[str, ...] | None" = None,
                  **links: float) -> "Topology":
        """Topology of the DCP group of a live ``DeviceMesh`` (or a process group).

        The DCP group is a one-dimensional mesh or group as is, or the dimension(s) ``dims`` of a
        multi-dimensional mesh (e.g. ``("dp_replicate", "dp_shard")`` beside ``"tp"``; several
        dimensions are flattened in row-major order): this rank's ranks along them, the other
        dimensions held at this rank's coordinates. Its ranks are grouped into nodes by host
        name (gathered over the mesh's ranks: every rank of the mesh calls this), or, with
        ``ranks_per_node`` given, as ``torchrun`` lays processes out: consecutive global ranks,
        ``ranks_per_node`` per node. With tensor parallelism filling a node (``tp`` =
        ``ranks_per_node``), every DCP rank is on a node of its own.

        Args:
            mesh: a ``DeviceMesh`` or a process group.
            ranks_per_node: processes per node (global ranks ``n·ranks_per_node ..`` share node
                ``n``); ``None``: by host name.
            dims: the DCP dimension name(s) of a multi-dimensional mesh (``None`` for a 1-D mesh).
            links: bandwidths and latencies, as the class's fields.

        Raises:
            ValueError: a multi-dimensional mesh without ``dims``, an unknown dimension name,
                ``dims`` with a process group, ``ranks_per_node`` that is not a positive integer,
                or DCP ranks whose nodes hold different numbers of them or are not consecutive
                in the group.
        """
        import socket

        import torch.distributed as dist

        members, group = _dcp_members(mesh, dims)
        if ranks_per_node is None:
            if group is None:  # several dimensions: host names of every rank of the mesh
                everyone = [int(r) for r in mesh.mesh.flatten().tolist()]
                whole = dist.get_world_size() == len(everyone)
                names: list[Any] = [None] * len(everyone)
                dist.all_gather_object(names, socket.gethostname(),
                                       group=None if whole else dist.new_group(everyone, use_local_synchronization=True))
                host = dict(zip(everyone, names))
                hosts = [host[r] for r in members]
            else:
                hosts = [None] * len(members)
                dist.all_gather_object(hosts, socket.gethostname(), group=group)
        else:
            if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, (int, np.integer)) \
                    or ranks_per_node <= 0:
                raise ValueError(f"Topology.from_mesh: ranks_per_node must be a positive integer, got {ranks_per_node!r}")
            hosts = [r // int(ranks_per_node) for r in members]
        n_nodes, per_node = _consecutive_nodes(hosts, members)
        return cls(n_nodes=n_nodes, ranks_per_node=per_node, **links)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Topology":
        return cls(**d)


def _dcp_members(mesh: Any, dims: "str | tuple[str, ...] | None") -> tuple[list[int], Any]:
    """The global ranks of this rank's DCP group in group order, and its process group (``None``
    when ``dims`` names several dimensions of a mesh: no group is created here)."""
    import torch.distributed as dist

    if not hasattr(mesh, "get_group"):
        if dims is not None:
            raise ValueError("Topology.from_mesh: dims= names dimensions of a DeviceMesh, got a process group")
        return list(dist.get_process_group_ranks(mesh)), mesh
    if dims is None:
        if mesh.ndim != 1:
            raise ValueError(f"Topology.from_mesh: a {mesh.ndim}-D mesh needs dims= (the DCP dimension names among "
                             f"{mesh.mesh_dim_names})")
        group = mesh.get_group()
        return list(dist.get_process_group_ranks(group)), group
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    known = tuple(mesh.mesh_dim_names or ())
    unknown = [d for d in names if d not in known]
    if unknown or not names:
        raise ValueError(f"Topology.from_mesh: unknown mesh dimension(s) {unknown or list(names)}; the mesh has {known}")
    if len(names) == 1:
        group = mesh.get_group(names[0])
        return list(dist.get_process_group_ranks(group)), group
    coord = mesh.get_coordinate()
    axes = [known.index(d) for d in names]
    index = tuple(slice(None) if i in axes else coord[i] for i in range(mesh.ndim))
    sub = mesh.mesh[index].permute(*np.argsort(np.argsort(axes)).tolist())  # the kept axes in the order of dims
    return [int(r) for r in sub.flatten().tolist()], None


def _consecutive_nodes(hosts: list[Any], members: list[int]) -> tuple[int, int]:
    """``(n_nodes, ranks_per_node)`` of a group whose rank ``i`` is on node ``hosts[i]``.

    Raises:
        ValueError: a node's ranks are not consecutive in the group, or nodes hold different
            numbers of them.
    """
    order: list[Any] = []
    for h in hosts:
        if not order or order[-1] != h:
            order.append(h)
    if len(set(order)) != len(order):
        raise ValueError(f"Topology.from_mesh: the DCP ranks of one node are not consecutive in the group (global ranks "
                         f"{members} on nodes {hosts})")
    counts = {h: hosts.count(h) for h in order}
    if len(set(counts.values())) != 1:
        raise ValueError(f"Topology.from_mesh: nodes hold different numbers of DCP ranks: {counts}")
    return len(order), len(hosts) // len(order)


#: Named clusters (4 nodes each; :meth:`Topology.preset` changes the node count):
#:
#: * ``"a100"``: the DCP paper's (§7.1): 8 A100-80GB per node on NVSwitch (300 GB/s per
#:   direction per GPU), 4 × 100 Gbps EFA per node (4 rails of 12.5 GB/s, 2 GPUs each).
#: * ``"h100"``: DGX H100: 8 H100 per node on NVLink 4 (900 GB/s per GPU both directions
#:   together, 450 GB/s each way), 8 × 400 Gbps InfiniBand per node (one 50 GB/s rail per GPU).
TOPOLOGY_PRESETS: dict[str, Topology] = {
    "a100": Topology(),
    "h100": Topology(n_nodes=4, ranks_per_node=8, intra_bandwidth=450e9, intra_latency=3e-6,
                     inter_bandwidth=400e9, inter_latency=10e-6, nics_per_node=8),
}
