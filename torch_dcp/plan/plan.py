"""Plan: what every rank does in one attention step, forward and backward.

A :class:`Plan` is defined by compact arrays -- the workload (blocks and tiles), the
placement (block and tile ranks) and the schedule (tile divisions) -- from which every
rank's programs are compiled deterministically (:mod:`~torch_dcp.plan.compiler`), checked
(:mod:`~torch_dcp.plan.validator`) and serialised (:mod:`~torch_dcp.plan.serialize`).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Any

import numpy as np

from ..batch import BatchSpec
from ..planners.base import Placement, Runtime
from ..topology import Topology
from ..workload import Buf, Workload
from .compiler import compile_program
from .ir import Program
from .routes import route_tables
from .serialize import plan_digest, plan_from_bytes, plan_to_bytes
from .validator import validate_pass

__all__ = ["Plan"]


class Plan:
    """A compiled DCP step: placement + divisions, and every rank's programs.

    Build one with :func:`torch_dcp.plan`. Programs are compiled lazily per rank
    (:meth:`program`) and are a deterministic function of the stored arrays.

    Raises:
        ValueError: the topology's world size differs from the placement's, or the
            division array is malformed.
    """

    def __init__(
        self,
        placement: Placement,
        topology: Topology,
        tile_division: np.ndarray,
        divisions: int,
        plan_seconds: float = 0.0,
    ):
        if topology.world_size != placement.world_size:
            raise ValueError(
                f"Plan: topology has {topology.world_size} ranks, placement {placement.world_size}"
            )
        td = np.ascontiguousarray(tile_division, dtype=np.int64)
        if td.shape != (placement.workload.n_tiles,) or (td.size and (td.min() < 0 or td.max() >= divisions)):
            raise ValueError(f"Plan: tile_division must be [n_tiles] in [0, {divisions})")
        td.setflags(write=False)
        self.placement = placement
        self.topology = topology
        self.tile_division = td
        self.divisions = int(divisions)
        self.plan_seconds = float(plan_seconds)
        #: the ``source`` of the cost model that timed the candidates (:func:`torch_dcp.plan`; empty: none)
        self.cost_model = ""
        #: that cost model itself (None: none), what :func:`torch_dcp.sim.simulate` times the plan with
        self.cost_model_object = None
        #: ``(planner label, simulated seconds)`` of the candidates :func:`torch_dcp.plan` timed
        self.candidates: list[tuple[str, float]] = []
        self._programs: dict[tuple[int, bool], Program] = {}
        self._memo: dict[Any, tuple[Any, Any]] = {}

    # ------------------------------------------------------------------ basics
    @property
    def workload(self) -> Workload:
        return self.placement.workload

    @property
    def batch(self) -> BatchSpec:
        return self.placement.workload.batch

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def planner(self) -> str:
        return self.placement.planner

    def _check_rank(self, rank: int) -> int:
        if not 0 <= int(rank) < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return int(rank)

    def attention_part(self, rank: int) -> tuple["Plan", int]:
        """The plan and rank whose programs ``rank`` runs (for its device plan): itself here;
        a head-parallel plan's outer plan and group (:mod:`torch_dcp.plan.heads`)."""
        return self, self._check_rank(rank)

    def with_heads(self, n_heads: int, n_kv_heads: int, head_dim: int, dtype: str) -> "Plan":
        """This plan's placement and divisions for the same documents and masks with other
        heads, head_dim or dtype (a plan depends on the heads only through the bytes and FLOPs
        per token): what :func:`torch_dcp.context_parallel` runs when it learns the attention's
        shape from the first SDPA call. Returns ``self`` when nothing differs.

        Raises:
            ValueError: counts the :class:`~torch_dcp.BatchSpec` refuses (e.g. ``n_kv_heads``
                not dividing ``n_heads``), or an unknown dtype.
        """
        d = self.batch.to_dict()
        new = dict(d, n_heads=int(n_heads), n_kv_heads=int(n_kv_heads), head_dim=int(head_dim), dtype=str(dtype))
        if new == d:
            return self
        batch = BatchSpec.from_dict(new)
        workload = Workload.from_arrays(batch, self.workload.arrays(), block_size=self.workload.block_size)
        placement = dataclasses.replace(self.placement, workload=workload)
        out = Plan(placement, self.topology, self.tile_division, self.divisions, self.plan_seconds)
        out.cost_model, out.candidates = self.cost_model, list(self.candidates)
        return out

    def with_mask(self, mask: Any) -> "Plan":
        """This plan's token blocks on the same ranks, for the same documents under ``mask``
        (a :mod:`torch_dcp.masks` spec): the new mask's tiles each on its query block's rank
        (owner computes; key/value blocks fetched straight from their home), in as many
        divisions (:func:`torch_dcp.schedule.assign_divisions`). What
        :func:`torch_dcp.context_parallel` runs when, without a named mask, the first SDPA call
        says ``is_causal=False``: its buffers are sharded already, so the token layout stays.

        Raises:
            ValueError: a mask the batch's documents cannot take.
        """
        from ..planners.base import Routing
        from ..schedule import assign_divisions

        d = self.batch.to_dict()
        batch = BatchSpec.from_dict(dict(d, masks=[mask.to_dict()], doc_mask=[0] * self.batch.n_docs))
        workload = Workload.from_arrays(batch, self.workload.arrays(), block_size=self.workload.block_size)
        placement = Placement(workload, self.world_size, self.placement.block_rank,
                              self.placement.block_rank[workload.tile_q], planner=self.planner, routing=Routing.DIRECT)
        divisions = max(1, min(self.divisions, workload.n_tiles))
        out = Plan(placement, self.topology, assign_divisions(placement, divisions, self.topology), divisions,
                   self.plan_seconds)
        out.cost_model = self.cost_model
        return out

    def local_blocks(self, rank: int) -> np.ndarray:
        """Block ids homed on ``rank``, in global token order (int64)."""
        return np.nonzero(self.placement.block_rank == self._check_rank(rank))[0]

    def token_indices(self, rank: int) -> np.ndarray:
        """Global token indices held by ``rank``, in the rank's local order (ascending).

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        return self.workload.tokens_of_blocks(self.local_blocks(rank))

    def local_tokens(self, rank: int) -> int:
        """Tokens held by ``rank``."""
        return int(self.workload.block_len[self.local_blocks(rank)].sum())

    def buffer_sizes(self, rank: int) -> dict[str, int]:
        """Rows of every buffer of ``rank``'s forward and backward programs."""
        f, b = self.program(rank, False), self.program(rank, True)
        return {"local": f.local_rows, **{f"fwd_{k.name.lower()}": v for k, v in f.buffer_rows.items()},
                **{f"bwd_{k.name.lower()}": v for k, v in b.buffer_rows.items()}}

    # ------------------------------------------------------------------ global tables
    @cached_property
    def tables(self) -> dict[str, np.ndarray]:
        """Routes of all ranks' fetches and returns (see :mod:`~torch_dcp.plan.routes`).

        Raises:
            PlanError: routes that cannot run.
        """
        return route_tables(self)

    # ------------------------------------------------------------------ compile
    def program(self, rank: int, backward: bool = False) -> Program:
        """The forward (or backward) program of ``rank`` (compiled once, cached)."""
        rank = self._check_rank(rank)
        key = (rank, bool(backward))
        if key not in self._programs:
            self._programs[key] = compile_program(self, rank, bool(backward))
        return self._programs[key]

    def memo(self, key: Any, owner: Any, compute: Any) -> Any:
        """``compute()`` once per ``(key, owner)``: a figure the planner asks for several times
        (a floor, an estimate and a simulation each time the same launches with the same cost
        model ``owner``, compared by identity). A plan's placement, routes and divisions do not
        change once it is built, so neither does the figure; an array comes back read-only."""
        hit = self._memo.get(key)
        if hit is not None and hit[0] is owner:
            return hit[1]
        value = compute()
        for a in value if isinstance(value, tuple) else (value,):
            if isinstance(a, np.ndarray):
                a.setflags(write=False)
        self._memo[key] = (owner, value)
        return value

    # ------------------------------------------------------------------ statistics
    def transfers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every block transfer of the plan, forward and backward.

        Returns ``(src, dst, nbytes, forward)``: int64 ranks, float64 bytes and a bool
        forward flag, one entry per (fetched or returned block, rank pair, pass). A plan on the
        all-gather runtime moves no blocks of its own: its collectives' bytes as NCCL's ring
        algorithm moves them, one entry per (rank, its successor in its CP group's ring,
        collective): ``G - 1`` shards of the group's largest rank (:func:`_ring_collectives`);
        crossing each node once, its near, rail and far collectives' (:func:`_node_collectives`).
        """
        return self.memo("transfers", None, self._transfers)

    def _transfers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self.placement.runtime is Runtime.DCP_NODE_ALLGATHER:
            return _node_collectives(self)
        if self.placement.runtime.gathers:
            return _ring_collectives(self)
        wl, t = self.workload, self.tables
        itb = self.placement.token_bytes()
        src, dst, nbytes, fwd = [], [], [], []
        # fetches: from the block's home (or a relay) to the fetching rank, forward and backward
        is_q = t["fetch_kind"] == 0
        for backward in (False, True):
            per_tok = np.where(is_q, itb[(backward, Buf.Q)], itb[(backward, Buf.KV)])
            src.append(t["fetch_src"])
            dst.append(t["fetch_rank"])
            nbytes.append(per_tok * wl.block_len[t["fetch_block"]])
            fwd.append(np.full(len(is_q), not backward))
        # returns: from the computing rank to the block's home (or a relay)
        for backward, side, kind in ((False, "q", Buf.OPART), (True, "q", Buf.DQ), (True, "kv", Buf.DKV)):
            blocks = t[f"ret_{side}_block"]
            src.append(t[f"ret_{side}_rank"])
            dst.append(t[f"ret_{side}_dst"])
            nbytes.append(itb[(backward, kind)] * wl.block_len[blocks])
            fwd.append(np.full(len(blocks), not backward))
        return (np.concatenate(src).astype(np.int64), np.concatenate(dst).astype(np.int64),
                np.concatenate(nbytes).astype(np.float64), np.concatenate(fwd))

    def traffic_matrix(self) -> np.ndarray:
        """Bytes sent from rank ``i`` to rank ``j``, forward + backward: float64 ``[W, W]``."""
        src, dst, nb, _ = self.transfers()
        w = self.world_size
        return np.bincount(src * w + dst, weights=nb, minlength=w * w).reshape(w, w)

    def stats(self) -> dict[str, Any]:
        """Figures of the plan.

        Returns a dict with ``comm_bytes`` (bytes moved between ranks, forward + backward),
        ``fwd_comm_bytes``, ``bwd_comm_bytes``, ``inter_node_bytes``, ``max_rank_recv_bytes``,
        ``max_rank_send_bytes``, ``compute_imbalance`` (max / mean attention FLOPs over
        ranks), ``memory_imbalance`` (max / mean resident Q/K/V/O bytes), ``flops_fwd`` and
        ``flops_bwd`` (totals), ``n_blocks``, ``n_tiles``, ``world_size``, ``divisions``,
        ``planner``, ``plan_seconds``.
        """
        wl, pl = self.workload, self.placement
        br = pl.block_rank
        w = self.world_size
        src_a, dst_a, nb_a, fwd_a = self.transfers()
        node = self.topology.node_of
        inter = node(src_a) != node(dst_a)
        flops = pl.rank_flops()
        mem = np.bincount(br, weights=wl.block_bytes(), minlength=w)
        return {
            "planner": self.planner,
            "world_size": w,
            "divisions": self.divisions,
            "n_blocks": wl.n_blocks,
            "n_tiles": wl.n_tiles,
            "comm_bytes": int(nb_a.sum()),
            "fwd_comm_bytes": int(nb_a[fwd_a].sum()),
            "bwd_comm_bytes": int(nb_a[~fwd_a].sum()),
            "inter_node_bytes": int(nb_a[inter].sum()),
            "max_rank_recv_bytes": int(np.bincount(dst_a, weights=nb_a, minlength=w).max()),
            "max_rank_send_bytes": int(np.bincount(src_a, weights=nb_a, minlength=w).max()),
            "compute_imbalance": float(flops.max() / flops.mean()) if flops.mean() > 0 else 1.0,
            "memory_imbalance": float(mem.max() / mem.mean()) if mem.mean() > 0 else 1.0,
            "flops_fwd": float(wl.tile_flops_fwd.sum()),
            "flops_bwd": float(wl.tile_flops_bwd.sum()),
            "plan_seconds": self.plan_seconds,
        }

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check the compiled programs of every rank by running them symbolically.

        Proves: every tile is computed exactly once per pass, on its planned rank; every tile's
        inputs are present in the buffers when it runs; every send has a matching receive
        (same phase, peer, kind and blocks) and nothing is left unreceived; partial outputs
        and gradients are merged without counting a tile twice; and every rank ends with the
        complete outputs (forward) and dQ, dK, dV (backward) of its blocks. It also checks what
        the executor assumes of the layout: local blocks are copied in local token order to the
        same rows, every block lies inside its buffer's rows, every message is received into
        one contiguous run of rows, and outputs are written at their blocks' local rows.

        Raises:
            PlanError: naming the rank, instruction and what is wrong.
        """
        for backward in (False, True):
            validate_pass(self, backward)

    # ------------------------------------------------------------------ serialisation
    def to_bytes(self) -> bytes:
        """Serialise (no pickle): magic, format version, JSON header, raw little-endian arrays
        (block spans, block and tile ranks, tile divisions in the narrowest integer types;
        the tiles themselves are recomputed from the batch on load)."""
        return plan_to_bytes(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Plan":
        """Inverse of :meth:`to_bytes`.

        Raises:
            PlanError: not a plan, an unsupported format version, or a corrupt payload.
        """
        return plan_from_bytes(cls, data)

    def digest(self) -> str:
        """SHA-256 (hex) of the plan's content (everything but timing metadata): equal plans
        have equal digests on every rank and every run."""
        return plan_digest(self)

    def __repr__(self) -> str:
        return (f"Plan(planner={self.planner!r}, world_size={self.world_size}, divisions={self.divisions}, "
                f"n_blocks={self.workload.n_blocks}, n_tiles={self.workload.n_tiles})")


def _ring_collectives(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`Plan.transfers` of a plan on the all-gather runtime: per CP group of ``G`` ranks
    (shards of ``R`` rows, its largest rank's), the forward's all-gather of K/V and the
    backward's all-gather and reduce-scatter of dK/dV (K/V dtype), each sending ``(G - 1) R``
    rows from every rank to the next in the group's ring (NCCL's ring algorithm)."""
    pl, w = plan.placement, plan.world_size
    c = pl.cp_size or w
    itb = pl.token_bytes()
    rows = np.repeat(pl.rank_tokens().reshape(w // c, c).max(axis=1), c).astype(np.float64)
    ranks = np.arange(w)
    succ = ranks // c * c + (ranks % c + 1) % c
    keep = (rows > 0) & (c > 1)
    src, dst, rows = ranks[keep], succ[keep], rows[keep] * (c - 1)
    per_row = ((False, itb[(False, Buf.KV)]), (True, itb[(True, Buf.KV)]), (True, itb[(True, Buf.DKV)]))
    return (np.tile(src, 3).astype(np.int64), np.tile(dst, 3).astype(np.int64),
            np.concatenate([rows * b for _, b in per_row]), np.repeat([not bw for bw, _ in per_row], len(src)))



def _node_collectives(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`Plan.transfers` of a plan on the node-once all-gather runtime
    (:mod:`torch_dcp.executor.allgather_node`): per CP group of ``n`` nodes of ``r`` ranks
    (shards of ``R`` rows), each collective as NCCL's ring on its group: in each pass the near
    all-gather (``(r - 1) R`` rows to the next rank of the node), the rail's (``(n - 1) R`` to
    the rank of the same local index on the next node) and the far one (``(r - 1)(n - 1) R`` on
    the node); in the backward the same three reduce-scatters of dK/dV (K/V dtype)."""
    pl, w, r = plan.placement, plan.world_size, plan.topology.ranks_per_node
    c = pl.cp_size or w
    n = c // r
    itb = pl.token_bytes()
    rows = np.repeat(pl.rank_tokens().reshape(w // c, c).max(axis=1), c).astype(np.float64)
    ranks = np.arange(w)
    node_next = ranks // r * r + (ranks % r + 1) % r
    rail_next = ranks // c * c + (ranks % c + r) % c
    keep = rows > 0
    src, dst, nbytes, fwd = [], [], [], []
    for backward, per_row in ((False, itb[(False, Buf.KV)]), (True, itb[(True, Buf.KV)]), (True, itb[(True, Buf.DKV)])):
        for nxt, shards in ((node_next, r - 1), (rail_next, n - 1), (node_next, (r - 1) * (n - 1))):
            if shards:
                src.append(ranks[keep])
                dst.append(nxt[keep])
                nbytes.append(rows[keep] * shards * per_row)
                fwd.append(np.full(int(keep.sum()), not backward))
    return (np.concatenate(src).astype(np.int64), np.concatenate(dst).astype(np.int64), np.concatenate(nbytes),
            np.concatenate(fwd))
