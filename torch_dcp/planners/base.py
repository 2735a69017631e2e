"""Placement: the common result type of every planner."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from ..workload import Workload, item_token_bytes

__all__ = ["Placement", "Routing", "Runtime", "whole_nodes"]


class Routing(enum.Enum):
    """How blocks and partial results travel between ranks (the plan's routes, see
    :mod:`torch_dcp.plan.routes`).

    * ``DIRECT``: every fetched block comes straight from its home rank and every partial
      result goes straight back to it (an all-gather pattern: a block needed by ``n`` ranks
      leaves its home ``n`` times).
    * ``RING``: ring attention (Liu et al., *Ring Attention with Blockwise Transformers*,
      2023, §3; TransformerEngine's context parallelism): tiles run on their query's rank,
      division ``s`` of rank ``r`` holds the tiles whose key/value blocks live on rank
      ``r - s`` (mod ``W``), and every rank's key/value blocks travel once around the ring,
      each rank receiving them from rank ``r - 1`` and passing them on to ``r + 1`` the next
      step; in the backward the dK/dV partials travel with them, each rank adding its own
      before passing them on, and the last one sends the sums home.
    * ``NODE``: like ``DIRECT``, but every block and every partial result crosses into or out
      of a node at most once: of the ranks of a node that fetch a block from another node,
      one (its gateway) fetches it from the home one division earlier than any of them needs
      it (before division 0: in an opening phase), and the others get it from the gateway
      over NVLink; partial results of one block that several ranks of a node return to
      another node are added on one of them (a reducer, among the last to finish) and sent
      home once (or to another rank of the home's node, a relay that passes it on over
      NVLink one division later). Gateways, reducers and relays are chosen to even out the
      load of rails and NVLink ports.
    * ``RAILS`` (dcp's default on several nodes): like ``NODE``, but a block's gateway may be
      any rank of the node, one that only passes it on, so that the crossings spread over the
      node's rails where the ranks that need the blocks sit on few (a window-masked document
      split between two nodes). Each extra hop waits for the rank that relays it, so neither
      routing is always faster: the planner times both (:func:`torch_dcp.plan`'s other
      schedules of its fastest plan).
    """

    DIRECT = "direct"
    RING = "ring"
    NODE = "node"
    RAILS = "rails"


class Runtime(enum.Enum):
    """Which implementation runs a plan, so which costs the simulator charges it
    (:func:`torch_dcp.sim.simulate.simulate`; the models are in :mod:`torch_dcp.sim.runtimes`).

    * ``EXECUTOR``: torch_dcp's own executor (:mod:`torch_dcp.executor`): the plan's programs,
      division by division, charged the cost model's executor costs where it has them; partial
      outputs and dQ travel in the accumulation dtype (float32), dK/dV partials in the K/V dtype.
    * ``TE_RING``: TransformerEngine's P2P ring (``AttnFuncWithCPAndKVP2P``) on the zig-zag
      layout: per ring step one attention call and one output merge (forward) or gradient sum
      (backward), the kernels alone; dK/dV partials travel in the K/V dtype.
    * ``ALLGATHER``: an NCCL all-gather of K/V (PyTorch's ``context_parallel``,
      TransformerEngine's ``AttnFuncWithCPAndKVAllGather``) on the CP group before the
      attention and, in the backward, TransformerEngine's reduce-scatter of dK/dV in the K/V
      dtype, costed as NCCL's collectives on the topology, compute not overlapped with them.
    * ``DCP_ALLGATHER``: torch_dcp's own all-gather CP
      (:class:`~torch_dcp.executor.allgather.AllGatherExecutor`): the same collectives, one
      attention call per rank, charged as torch_dcp's executor charges one division and one
      pass (the cost model's executor costs: its gathers, writes and allocations), how dcp's
      candidates run a static configuration; a plan of ``ALLGATHER`` runs on it too.
    * ``DCP_NODE_ALLGATHER``: torch_dcp's all-gather CP for CP groups of whole nodes
      (:class:`~torch_dcp.executor.allgather_node.NodeAllGatherExecutor`): each K/V shard
      crosses into every other node of the group once, over its sender's rail, and is fanned out
      over NVLink there; the attention of the tiles on the node's own keys runs while the shards
      cross; dK/dV partials are summed inside a node before they cross back (two attention
      calls per rank and pass, one LSE merge).
    * ``DCP_RING``: torch_dcp's own ring (:class:`~torch_dcp.executor.ring.RingExecutor`) on
      the zig-zag layout, as TransformerEngine's ring runs it: per step one attention call over
      the K/V chunk held and one merge of its partial output, the chunk passed on to the next
      rank while the step computes, dK/dV partials travelling with it in the K/V dtype; charged
      its own device operations per step. How dcp's candidates run ring attention, and, inside
      head groups, HCP's ring across them.

    The executor of a plan follows its runtime
    (:data:`~torch_dcp.executor.runtime.RUNTIME_EXECUTORS`); a runtime without one of its own
    (``TE_RING``) runs on torch_dcp's ring runtime (as ``DCP_RING``).
    """

    EXECUTOR = "executor"
    TE_RING = "te-ring"
    ALLGATHER = "nccl-allgather"
    DCP_ALLGATHER = "dcp-allgather"
    DCP_NODE_ALLGATHER = "dcp-node-allgather"
    DCP_RING = "dcp-ring"

    @property
    def gathers(self) -> bool:
        """Whether the plan runs as all-gather CP (its collectives, not its routes' transfers;
        the CP group's keys and values gathered on every rank)."""
        return self in (Runtime.ALLGATHER, Runtime.DCP_ALLGATHER, Runtime.DCP_NODE_ALLGATHER)


def whole_nodes(cp_size: int, ranks_per_node: int) -> bool:
    """Whether CP groups of ``cp_size`` consecutive ranks are two or more whole nodes: where
    ``Runtime.DCP_NODE_ALLGATHER`` can run (a node group and a rail group inside each CP group;
    dcp offers it where nodes have two or more ranks, as on one rank a node gathers as the ring)."""
    return cp_size % ranks_per_node == 0 and cp_size // ranks_per_node >= 2

@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every token block lives and where every tile is computed.

    A block's home rank holds its Q, K, V, O (and LSE, dO, dQ, dK, dV) and the token-level
    layers of its tokens; a tile's rank computes it.

    Attributes:
        workload: the blocks and tiles placed.
        world_size: ranks of the DCP group.
        block_rank: int64 ``[n_blocks]``, home rank of every block.
        tile_rank: int64 ``[n_tiles]``, rank computing every tile.
        planner: name of the planner that produced it.
        tile_round: optional int64 ``[n_tiles]``: scheduling rounds that run one after
            another (FCP's transfer rounds), each divided by the scheduler; ``None`` for one round.
        routing: how blocks and partials travel (:class:`Routing`).
        ring_groups: for ``Routing.RING``, optional int64 ``[n_docs, 3]``: every document's
            ring, ``(first rank, ranks, first division)``: its blocks live on ranks
            ``first .. first + ranks - 1`` and travel around them in divisions ``first
            division ..`` (Megatron's CP groups and rounds); ``None``: one ring of all ranks
            from division 0.
        runtime: which implementation runs the plan (:class:`Runtime`).
        cp_size: for a static family's runtime, ranks per CP group: the world is cut into
            groups of ``cp_size`` consecutive ranks, each holding whole documents and running
            its own collectives (data parallelism across the groups,
            :mod:`torch_dcp.planners.static`); ``None``: one group of all ranks.
    """

    workload: Workload
    world_size: int
    block_rank: np.ndarray
    tile_rank: np.ndarray
    planner: str = "custom"
    tile_round: np.ndarray | None = None
    routing: Routing = Routing.DIRECT
    ring_groups: np.ndarray | None = None
    runtime: Runtime = Runtime.EXECUTOR
    cp_size: int | None = None

    def __post_init__(self):
        w = self.workload
        br = np.ascontiguousarray(self.block_rank, dtype=np.int64)
        tr = np.ascontiguousarray(self.tile_rank, dtype=np.int64)
        if br.shape != (w.n_blocks,):
            raise ValueError(f"Placement.block_rank: expected shape ({w.n_blocks},), got {br.shape}")
        if tr.shape != (w.n_tiles,):
            raise ValueError(f"Placement.tile_rank: expected shape ({w.n_tiles},), got {tr.shape}")
        for name, a in (("block_rank", br), ("tile_rank", tr)):
            if a.size and (a.min() < 0 or a.max() >= self.world_size):
                raise ValueError(f"Placement.{name}: ranks must lie in [0, {self.world_size})")
        br.setflags(write=False)
        tr.setflags(write=False)
        object.__setattr__(self, "block_rank", br)
        object.__setattr__(self, "tile_rank", tr)
        if self.tile_round is not None:
            rd = np.ascontiguousarray(self.tile_round, dtype=np.int64)
            if rd.shape != (w.n_tiles,) or (rd.size and rd.min() < 0):
                raise ValueError(f"Placement.tile_round: expected non-negative shape ({w.n_tiles},), got {rd.shape}")
            rd.setflags(write=False)
            object.__setattr__(self, "tile_round", rd)
        if not isinstance(self.routing, Routing):
            raise ValueError(f"Placement.routing must be a Routing, got {self.routing!r}")
        if not isinstance(self.runtime, Runtime):
            raise ValueError(f"Placement.runtime must be a Runtime, got {self.runtime!r}")
        if self.cp_size is not None:
            c = self.cp_size
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1 or self.world_size % c:
                raise ValueError(f"Placement.cp_size must be None or a positive integer dividing the world size "
                                 f"{self.world_size}, got {c!r}")
            object.__setattr__(self, "cp_size", int(c))
            group = br // int(c)
            doc_group = np.full(w.batch.n_docs, -1, np.int64)
            doc_group[w.block_doc] = group
            if np.any(doc_group[w.block_doc] != group):
                raise ValueError(f"Placement.cp_size: a document's blocks lie in two CP groups of {c} ranks")
        if self.ring_groups is not None:
            g = np.ascontiguousarray(self.ring_groups, dtype=np.int64)
            n_docs = w.batch.n_docs
            if (g.shape != (n_docs, 3) or (g.size and (g[:, 0].min() < 0 or g[:, 1].min() < 1 or g[:, 2].min() < 0
                                                       or (g[:, 0] + g[:, 1]).max() > self.world_size))):
                raise ValueError(f"Placement.ring_groups: expected [{n_docs}, 3] rows (first rank, ranks >= 1, first "
                                 f"division) inside [0, {self.world_size}), got shape {g.shape}")
            g.setflags(write=False)
            object.__setattr__(self, "ring_groups", g)

    def alone(self) -> "Placement | None":
        """This placement as its ranks run it alone, or None: where every tile runs on its
        query's and its key/value block's home and every document lies on one rank, nothing
        moves, so each rank runs its part as one attention call per pass over its own rows, on
        torch_dcp's all-gather runtime with CP groups of one rank (``Runtime.DCP_ALLGATHER``,
        ``cp_size=1``: nothing gathered), without the executor's steps per division; None
        where a block would move or a document spans ranks, or the placement runs on another
        runtime than torch_dcp's executor."""
        wl, home = self.workload, self.block_rank
        if self.runtime is not Runtime.EXECUTOR or self.tile_round is not None:
            return None
        if np.any(home[wl.tile_q] != self.tile_rank) or np.any(home[wl.tile_kv] != self.tile_rank):
            return None
        doc_rank = np.full(wl.batch.n_docs, -1, np.int64)
        doc_rank[wl.block_doc] = home
        if np.any(doc_rank[wl.block_doc] != home):
            return None
        return dataclasses.replace(self, routing=Routing.DIRECT, ring_groups=None, runtime=Runtime.DCP_ALLGATHER,
                                   cp_size=1)

    def cp_group(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s CP group (:attr:`cp_size`; all ranks where it is None),
        ascending."""
        c = self.cp_size or self.world_size
        first = int(rank) // c * c
        return tuple(range(first, first + c))

    def ring_group_of_docs(self) -> np.ndarray:
        """``ring_groups``, or one ring of all ranks from division 0 for every document:
        int64 ``[n_docs, 3]``."""
        if self.ring_groups is not None:
            return self.ring_groups
        g = np.zeros((self.workload.batch.n_docs, 3), np.int64)
        g[:, 1] = self.world_size
        return g

    def ring_steps(self) -> tuple[np.ndarray, int]:
        """Ring attention's divisions: tile ``t`` runs in its document's first division plus
        ``(tile rank - key/value home) mod ranks``; returns ``(tile_division [n_tiles],
        number of divisions)``."""
        wl = self.workload
        g = self.ring_group_of_docs()
        tg = g[wl.block_doc[wl.tile_q]]
        step = tg[:, 2] + (self.tile_rank - self.block_rank[wl.tile_kv]) % tg[:, 1]
        n = int((g[:, 1] + g[:, 2]).max()) if len(g) else 1
        return step.astype(np.int64), max(n, 1)

    def token_bytes(self) -> dict[tuple[bool, int], int]:
        """:func:`~torch_dcp.workload.item_token_bytes` of the batch: what every runtime moves per
        token of each transfer kind."""
        return item_token_bytes(self.workload.batch)

    def rank_flops(self, backward: bool = False) -> np.ndarray:
        """Attention FLOPs per rank, float64 ``[world_size]``."""
        f = self.workload.tile_flops_bwd if backward else self.workload.tile_flops_fwd
        return np.bincount(self.tile_rank, weights=f, minlength=self.world_size)

    def rank_tokens(self) -> np.ndarray:
        """Resident tokens per rank, int64 ``[world_size]``."""
        return np.bincount(self.block_rank, weights=self.workload.block_len, minlength=self.world_size).astype(np.int64)
