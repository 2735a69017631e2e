"""Head parallelism: ``N`` ranks trade heads by all-to-all, then one outer plan runs over the
``W / N`` groups for ``H / N`` heads.

This is the all-to-all context parallelism of DeepSpeed-Ulysses (Jacobs et al., *DeepSpeed
Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence Transformer
Models*, 2023, §3: Q, K, V go from sequence- to head-sharded, attention runs over the whole
sequence for ``H / N`` heads, O comes back) and of Megatron-Core / TransformerEngine's
hierarchical context parallelism (``cp_comm_type="a2a+p2p"``: all-to-all inside a node, ring
attention between nodes), made one dimension of a dcp plan:

* ranks ``g N .. g N + N - 1`` form head group ``g`` (inside one node when ``N`` divides the
  ranks per node; whole nodes when ``N`` is a multiple of it); ``i = rank mod N`` is a rank's
  *inner index*;
* the outer plan (:class:`~torch_dcp.plan.Plan`) places blocks and tiles on the ``W / N``
  groups for a batch of ``H / N`` query heads (and ``H_kv / N`` key/value heads, or one
  replicated key/value head per rank when ``H_kv < N``); every rank of a group runs it for its
  own heads, exchanging blocks with the ranks of the same inner index in other groups (the
  same NIC rail: :meth:`HeadLayout.outer_topology`);
* group ``g``'s tokens (the outer plan's ``token_indices(g)``, ascending) are cut into ``N``
  contiguous chunks, as even as possible; rank ``(g, i)`` holds chunk ``i`` (all heads) for the
  token-level layers.

``N = 1`` is an ordinary plan; ``N = W`` on one node is Ulysses; the zig-zag ring outside with
``N`` = ranks per node is HCP.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import weakref
from collections import OrderedDict
from functools import cached_property
from typing import Any

import numpy as np

from ..batch import BatchSpec
from ..planners.base import Runtime
from ..topology import Topology
from .ir import PlanError
from .plan import Plan

__all__ = ["HeadLayout", "HeadParallelPlan", "head_parallel_sizes", "load_plan", "HEAD_MAGIC"]

#: outer batches by (id(batch), N): the last few made (:meth:`HeadLayout.outer_batch`)
_OUTER: "OrderedDict[tuple[int, int], tuple[weakref.ref, BatchSpec]]" = OrderedDict()
_OUTER_KEEP = 16

HEAD_MAGIC = b"TDCHEAD\0"
_HEAD_VERSION = 1
_LENGTHS = struct.Struct("<IQ")


def _pos_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Which heads and tokens each rank of a head group holds.

    Attributes:
        size: ``N``, ranks per head group.
        n_heads: ``H``, query heads of the batch.
        n_kv_heads: ``H_kv``, key/value heads of the batch.

    Raises:
        ValueError: ``N`` does not divide ``H``, or neither divides the other of ``N`` and
            ``H_kv`` (every rank's query heads must share whole key/value heads).
    """

    size: int
    n_heads: int
    n_kv_heads: int

    def __post_init__(self):
        n = _pos_int("head_parallel", self.size)
        if self.n_heads % n:
            raise ValueError(f"head_parallel={n} must divide the batch's n_heads={self.n_heads}")
        if self.n_kv_heads % n and n % self.n_kv_heads:
            raise ValueError(f"head_parallel={n} and n_kv_heads={self.n_kv_heads}: one must divide the other "
                             "(each rank holds whole key/value heads, or one replicated head)")

    @classmethod
    def of(cls, batch: BatchSpec, size: int) -> "HeadLayout":
        return cls(size, batch.n_heads, batch.n_kv_heads)

    @property
    def q_heads(self) -> int:
        """Query heads per rank, ``H / N``."""
        return self.n_heads // self.size

    @property
    def kv_heads(self) -> int:
        """Key/value heads per rank: ``H_kv / N``, or 1 (replicated) when ``H_kv < N``."""
        return max(1, self.n_kv_heads // self.size)

    @property
    def kv_replicas(self) -> int:
        """Ranks of a group holding the same key/value head (1 without replication)."""
        return max(1, self.size // self.n_kv_heads)

    def q_head_slice(self, inner: int) -> slice:
        """Query heads (of the full ``H``) of inner index ``inner``."""
        return slice(inner * self.q_heads, (inner + 1) * self.q_heads)

    def kv_head_slice(self, inner: int) -> slice:
        """Key/value heads (of the full ``H_kv``) of inner index ``inner``."""
        first = inner // self.kv_replicas * self.kv_heads
        return slice(first, first + self.kv_heads)

    def outer_batch(self, batch: BatchSpec) -> BatchSpec:
        """The batch the outer plan places: the same documents and masks, ``H / N`` query and
        :attr:`kv_heads` key/value heads. The same batch object and ``N`` give the same outer
        batch object while it is among the last few made (so that its blocks,
        ``Workload.uniform``, are made once per plan)."""
        if (batch.n_heads, batch.n_kv_heads) != (self.n_heads, self.n_kv_heads):
            raise ValueError(f"HeadLayout for heads {self.n_heads}/{self.n_kv_heads}, batch has "
                             f"{batch.n_heads}/{batch.n_kv_heads}")
        if self.size == 1:
            return batch
        key = (id(batch), self.size)
        hit = _OUTER.get(key)
        if hit is not None and hit[0]() is batch:
            _OUTER.move_to_end(key)
            return hit[1]
        masks = [batch.masks[m] for m in batch.doc_mask] if len(batch.masks) > 1 else batch.masks[0]
        outer = BatchSpec(batch.doc_lens, masks, n_heads=self.q_heads, n_kv_heads=self.kv_heads,
                          head_dim=batch.head_dim, dtype=batch.dtype)
        _OUTER[key] = (weakref.ref(batch), outer)
        while len(_OUTER) > _OUTER_KEEP:
            _OUTER.popitem(last=False)
        return outer

    def check_topology(self, topology: Topology) -> None:
        """Raises ``ValueError`` unless head groups are ``N`` ranks inside one node (``N``
        divides the ranks per node) or whole nodes (a multiple of it dividing the world size)."""
        n, rpn, w = self.size, topology.ranks_per_node, topology.world_size
        if not (rpn % n == 0 or (n % rpn == 0 and w % n == 0)):
            raise ValueError(f"head_parallel={n} must divide the ranks per node ({rpn}) or be a multiple of it "
                             f"dividing the world size ({w})")

    def outer_topology(self, topology: Topology) -> Topology:
        """The topology of the ``W / N`` groups as the outer plan sees them: one group per rank.

        All ``N`` ranks of a group run the outer programs at once, each over its own links,
        so a group counts as one rank with one rank's NVLink port and its share of the node's
        network: ``inter_bandwidth / ranks_per_node``, one rail each (a node of the outer
        topology holds the groups of one real node, or one group spanning whole nodes).

        Raises:
            ValueError: see :meth:`check_topology`.
        """
        self.check_topology(topology)
        n, rpn = self.size, topology.ranks_per_node
        if n == 1:
            return topology
        outer_rpn = max(1, rpn // n)
        return dataclasses.replace(topology, n_nodes=topology.world_size // n // outer_rpn, ranks_per_node=outer_rpn,
                                   inter_bandwidth=topology.inter_bandwidth * outer_rpn / rpn, nics_per_node=outer_rpn)

    def chunks(self, group_tokens: int) -> np.ndarray:
        """Token offsets ``[N + 1]`` of the inner ranks' chunks of a group's ``group_tokens``
        tokens (as even as possible, earlier chunks one token longer)."""
        n = self.size
        sizes = group_tokens // n + (np.arange(n) < group_tokens % n)
        return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


def head_parallel_sizes(batch: BatchSpec, topology: Topology) -> list[int]:
    """Every ``N > 1`` a plan of ``batch`` on ``topology`` may use (:class:`HeadLayout`'s rules),
    ascending."""
    out = []
    for n in range(2, topology.world_size + 1):
        try:
            HeadLayout.of(batch, n).check_topology(topology)
        except ValueError:
            continue
        out.append(n)
    return out


class HeadParallelPlan:
    """A plan with head parallelism ``N > 1``: the all-to-alls of every head group around an
    outer :class:`~torch_dcp.plan.Plan` over the ``W / N`` groups.

    It answers what a :class:`~torch_dcp.plan.Plan` answers for the whole DCP group (tokens
    per rank, statistics, validation, bytes and digest); :attr:`outer` runs the attention.

    Args:
        outer: the plan of the groups (its batch :meth:`HeadLayout.outer_batch`, its topology
            :meth:`HeadLayout.outer_topology`).
        batch: the whole batch (``H`` heads).
        topology: the whole DCP group.
        head_parallel: ``N``.
        label: the planner name reported (default ``"<outer planner>"``).
        keep_sharded: whether the backward finds the forward's head-sharded Q, K, V, O and LSE
            kept (default; as TransformerEngine's ``a2a`` keeps them and the ``torch_dcp::attention``
            op does, :meth:`~torch_dcp.executor.heads.HeadParallelExecutor.forward_keeping`):
            only dO travels in. ``False``: the backward's all-to-all in carries Q, K, V, O, LSE
            and dO again (what the executor does when it is given no state: PyTorch's own SDPA
            ops reached through DTensor).

    Raises:
        ValueError: ``N`` invalid for the batch or topology, or an outer plan of another batch
            or topology.
    """

    def __init__(self, outer: Plan, batch: BatchSpec, topology: Topology, head_parallel: int, label: str | None = None,
                 keep_sharded: bool = True):
        self.layout = HeadLayout.of(batch, head_parallel)
        want_topo = self.layout.outer_topology(topology)
        if outer.topology != want_topo:
            raise ValueError(f"HeadParallelPlan: outer plan's topology {outer.topology} is not the groups' {want_topo}")
        if outer.batch != self.layout.outer_batch(batch):
            raise ValueError("HeadParallelPlan: outer plan's batch is not the batch's outer batch (same documents "
                             "and masks, H / N heads)")
        self.outer, self.batch, self.topology = outer, batch, topology
        self.label = label or outer.planner
        self.keep_sharded = bool(keep_sharded)
        self._a2a_seconds: dict[tuple[bool, str, bool], float] = {}
        self.plan_seconds = outer.plan_seconds
        #: the ``source`` of the cost model that timed the candidates (:func:`torch_dcp.plan`; empty: none)
        self.cost_model = ""
        #: that cost model itself (None: none), what :func:`torch_dcp.sim.simulate` times the plan with
        self.cost_model_object = None
        #: ``(planner label, simulated seconds)`` of the candidates :func:`torch_dcp.plan` timed
        self.candidates: list[tuple[str, float]] = []

    # ------------------------------------------------------------------ basics
    @property
    def head_parallel(self) -> int:
        return self.layout.size

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def planner(self) -> str:
        return self.label

    @property
    def divisions(self) -> int:
        return self.outer.divisions

    @property
    def workload(self):
        return self.outer.workload

    def group_of(self, rank: int) -> tuple[int, int]:
        """``(group, inner index)`` of ``rank``.

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        if not 0 <= int(rank) < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return divmod(int(rank), self.layout.size)

    def attention_part(self, rank: int) -> tuple[Plan, int]:
        """The outer plan and ``rank``'s group: the programs ``rank`` runs between its all-to-alls."""
        return self.outer, self.group_of(rank)[0]

    def group_tokens(self, group: int) -> np.ndarray:
        """Global token indices of head group ``group``, ascending (its outer rank's tokens)."""
        return self.outer.token_indices(group)

    def token_indices(self, rank: int) -> np.ndarray:
        """Global token indices held by ``rank`` (a contiguous chunk of its group's), ascending.

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        g, i = self.group_of(rank)
        toks = self.group_tokens(g)
        off = self.layout.chunks(len(toks))
        return toks[off[i]:off[i + 1]]

    @cached_property
    def rank_tokens(self) -> np.ndarray:
        """Tokens every rank holds, int64 ``[W]`` (its chunk of its group's)."""
        return np.concatenate([np.diff(self.layout.chunks(int(t))) for t in self.outer.placement.rank_tokens()])

    def local_tokens(self, rank: int) -> int:
        """Tokens ``rank`` holds.

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        self.group_of(rank)
        return int(self.rank_tokens[rank])

    # ------------------------------------------------------------------ all-to-all
    def all_to_all_bytes(self, backward: bool, way: str | None = None) -> np.ndarray:
        """Bytes rank ``i`` sends to rank ``j`` in one pass's all-to-alls: float64 ``[W, W]``,
        non-zero only inside head groups.

        Forward: Q, K, V of a rank's chunk to the ranks holding their heads (``way="in"``), O
        and the LSE back (``"out"``; torch_dcp's attention op returns the LSE: ``H / N`` floats
        per token). Backward: dO in, with Q, K, V, O and the LSE again unless
        :attr:`keep_sharded`; dQ, dK, dV out (replicated key/value heads: every replica
        returns its partial, summed by the owner). ``way=None``: both. Where the outer plan
        runs on TransformerEngine's ring (its ``a2a`` and ``a2a+p2p`` CP, the baselines'
        Ulysses and HCP), as its source does (``AttnFuncWithCPAndQKVOA2A``; the ``a2a+p2p``
        path of ``AttnFuncWithCPAndKVP2P`` alike): the LSE stays head-sharded (not sent back),
        and the backward's all-to-all in carries O again with dO (it keeps Q, K, V and the LSE
        head-sharded, O in the sequence's layout).

        Raises:
            ValueError: ``way`` not ``"in"``, ``"out"`` or ``None``.
        """
        if way not in ("in", "out", None):
            raise ValueError(f"way must be 'in', 'out' or None, got {way!r}")
        lay, b, w = self.layout, self.batch, self.world_size
        n = lay.size
        e, lse = b.elem_size * b.head_dim, lay.q_heads * b.acc_size
        # per token: what a chunk sends to one peer on the way in, what a peer returns on the way out
        qkv = (lay.q_heads + 2 * lay.kv_heads) * e
        te = self.outer.placement.runtime is Runtime.TE_RING  # TransformerEngine's own all-to-alls
        if backward:
            again = lay.q_heads * e if te else (0 if self.keep_sharded else qkv + lay.q_heads * e + lse)
            per_in, per_out = lay.q_heads * e + again, qkv
        else:
            per_in, per_out = qkv, lay.q_heads * e + (0 if te else lse)  # the op returns the LSE with O
        per_in, per_out = (per_in if way != "out" else 0), (per_out if way != "in" else 0)
        chunk = self.rank_tokens.astype(np.float64)
        out = np.zeros((w, w))
        for g in range(w // n):
            ranks = np.arange(g * n, (g + 1) * n)
            blk = np.add.outer(chunk[ranks] * per_in, chunk[ranks] * per_out)  # i -> j: i's chunk in, j's chunk out
            np.fill_diagonal(blk, 0.0)
            out[np.ix_(ranks, ranks)] = blk
        return out

    def all_to_all_seconds(self, backward: bool, way: str | None = None) -> float:
        """Time of one pass's all-to-all(s), not overlapped with compute (as TransformerEngine's
        ``a2a`` runs them): per way, the busiest NVLink port or rail's bytes over its
        bandwidth plus the link latency (:meth:`all_to_all_bytes` for ``way``)."""
        if way is None:
            return self.all_to_all_seconds(backward, "in") + self.all_to_all_seconds(backward, "out")
        key = (bool(backward), way, self.keep_sharded)  # asked for by the floor, the estimate and the simulator
        if key not in self._a2a_seconds:
            self._a2a_seconds[key] = self._all_to_all_seconds(backward, way)
        return self._a2a_seconds[key]

    def _all_to_all_seconds(self, backward: bool, way: str) -> float:
        m = self.all_to_all_bytes(backward, way)
        topo = self.topology
        src, dst = np.nonzero(m)
        if len(src) == 0:
            return 0.0
        busy = max(float(v.max(initial=0.0)) for v in topo.link_seconds(src, dst, m[src, dst]).values())
        inter = bool((topo.node_of(src) != topo.node_of(dst)).any())
        return busy + (topo.inter_latency if inter else topo.intra_latency)

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, Any]:
        """:meth:`Plan.stats <torch_dcp.plan.Plan.stats>` of the whole group: the outer plan's
        transfers on every inner index plus the all-to-alls; ``head_parallel`` = ``N``."""
        n, w = self.layout.size, self.world_size
        o = self.outer.stats()
        a2a = [self.all_to_all_bytes(bw) for bw in (False, True)]
        inter = self.topology.node_of(np.arange(w))
        cross = inter[:, None] != inter[None, :]
        src, dst, nb, _ = self.outer.transfers()
        wo = self.outer.world_size  # rank g * N + i runs outer rank g's transfers
        recv = np.repeat(np.bincount(dst, weights=nb, minlength=wo), n) + sum(a.sum(axis=0) for a in a2a)
        send = np.repeat(np.bincount(src, weights=nb, minlength=wo), n) + sum(a.sum(axis=1) for a in a2a)
        tokens = self.rank_tokens.astype(np.float64)
        return {
            **o,
            "planner": self.planner,
            "world_size": w,
            "head_parallel": n,
            "comm_bytes": int(o["comm_bytes"] * n + sum(a.sum() for a in a2a)),
            "fwd_comm_bytes": int(o["fwd_comm_bytes"] * n + a2a[0].sum()),
            "bwd_comm_bytes": int(o["bwd_comm_bytes"] * n + a2a[1].sum()),
            "inter_node_bytes": int(o["inter_node_bytes"] * n + sum(a[cross].sum() for a in a2a)),
            "max_rank_recv_bytes": int(recv.max()),
            "max_rank_send_bytes": int(send.max()),
            "memory_imbalance": float(tokens.max() / tokens.mean()) if tokens.mean() > 0 else 1.0,
            "flops_fwd": o["flops_fwd"] * n,
            "flops_bwd": o["flops_bwd"] * n,
            "plan_seconds": self.plan_seconds,
        }

    def validate(self) -> None:
        """The outer plan's checks (:meth:`Plan.validate <torch_dcp.plan.Plan.validate>`) and
        that the ranks' chunks cover every token once.

        Raises:
            PlanError: naming what is wrong.
        """
        self.outer.validate()
        seen = np.concatenate([self.token_indices(r) for r in range(self.world_size)])
        if len(seen) != self.batch.total_tokens or len(np.unique(seen)) != len(seen):
            raise PlanError(f"head-parallel plan: ranks hold {len(seen)} tokens ({len(np.unique(seen))} distinct) "
                            f"of {self.batch.total_tokens}")

    # ------------------------------------------------------------------ serialisation
    def _header(self) -> bytes:
        return json.dumps({"head_parallel": self.layout.size, "batch_heads": [self.batch.n_heads, self.batch.n_kv_heads],
                           "topology": self.topology.to_dict(), "label": self.label,
                           "keep_sharded": self.keep_sharded},
                          sort_keys=True, separators=(",", ":")).encode()

    def to_bytes(self) -> bytes:
        """Magic, ``<IQ`` (version, header bytes), SHA-256 of what follows, a JSON header (``N``,
        the whole topology and heads), then the outer plan's own bytes (:meth:`Plan.to_bytes
        <torch_dcp.plan.Plan.to_bytes>`, checksummed itself)."""
        head, body = self._header(), self.outer.to_bytes()
        lengths = _LENGTHS.pack(_HEAD_VERSION, len(head))
        meta = json.dumps([list(c) for c in self.candidates]).encode()
        payload = head + struct.pack("<Q", len(meta)) + meta + body
        return HEAD_MAGIC + lengths + hashlib.sha256(lengths + payload).digest() + payload

    @classmethod
    def from_bytes(cls, data: bytes) -> "HeadParallelPlan":
        """Inverse of :meth:`to_bytes`.

        Raises:
            PlanError: not a head-parallel plan, another version, or changed bytes.
        """
        data = bytes(data)
        n = len(HEAD_MAGIC)
        if not data.startswith(HEAD_MAGIC):
            raise PlanError("not a torch_dcp head-parallel plan (bad magic)")
        if len(data) < n + _LENGTHS.size + 32:
            raise PlanError(f"truncated head-parallel plan: {len(data)} bytes")
        version, hlen = _LENGTHS.unpack_from(data, n)
        if version != _HEAD_VERSION:
            raise PlanError(f"head-parallel plan version {version} is not supported (this build reads {_HEAD_VERSION})")
        start = n + _LENGTHS.size + 32
        payload = data[start:]
        if hashlib.sha256(data[n:n + _LENGTHS.size] + payload).digest() != data[n + _LENGTHS.size:start]:
            raise PlanError("head-parallel plan checksum mismatch: the bytes were changed after serialisation")
        try:
            head = json.loads(payload[:hlen])
            (mlen,) = struct.unpack_from("<Q", payload, hlen)
            meta = json.loads(payload[hlen + 8:hlen + 8 + mlen])
            outer = Plan.from_bytes(payload[hlen + 8 + mlen:])
            ob = outer.batch
            h, hkv = head["batch_heads"]
            masks = [ob.masks[m] for m in ob.doc_mask] if len(ob.masks) > 1 else ob.masks[0]
            batch = BatchSpec(ob.doc_lens, masks, n_heads=h, n_kv_heads=hkv, head_dim=ob.head_dim, dtype=ob.dtype)
            plan = cls(outer, batch, Topology.from_dict(head["topology"]), head["head_parallel"], head["label"],
                       head["keep_sharded"])
            plan.candidates = [(str(a), float(t)) for a, t in meta]
            plan.cost_model = outer.cost_model  # recorded with the outer plan (torch_dcp.plan)
            return plan
        except PlanError:
            raise
        except Exception as err:  # noqa: BLE001 - one error type for every unreadable payload
            raise PlanError(f"unreadable head-parallel plan: {type(err).__name__}: {err}") from None

    def digest(self) -> str:
        """SHA-256 (hex) of the content: the header and the outer plan's digest."""
        return hashlib.sha256(HEAD_MAGIC + self._header() + self.outer.digest().encode()).hexdigest()

    def __repr__(self) -> str:
        return (f"HeadParallelPlan(planner={self.planner!r}, world_size={self.world_size}, "
                f"head_parallel={self.layout.size}, outer={self.outer!r})")



def load_plan(data: bytes) -> "Plan | HeadParallelPlan":
    """A plan from its bytes, whichever kind (:meth:`Plan.to_bytes <torch_dcp.plan.Plan.to_bytes>`
    or :meth:`HeadParallelPlan.to_bytes`).

    Raises:
        PlanError: neither kind's magic, or bytes that fail that kind's checks.
    """
    try:
        data = bytes(data)
    except TypeError:
        raise PlanError(f"a plan is bytes, got {type(data).__name__}") from None
    return (HeadParallelPlan if data.startswith(HEAD_MAGIC) else Plan).from_bytes(data)
