"""Plan: what every rank does in one attention step, forward and backward.

A :class:`Plan` is defined by compact arrays -- the workload (blocks and tiles), the
placement (block and tile ranks) and the schedule (tile divisions) -- from which every
rank's programs are compiled deterministically. A program is a list of five instructions
(DCP paper §5): :class:`BlockwiseCopy`, :class:`CommLaunch`, :class:`CommWait`,
:class:`BlockwiseAttention`, :class:`BlockwiseReduction`.

Buffers of a rank (rows = tokens):

* forward: ``qws`` (Q of local blocks, then fetched query blocks), ``kvws`` (K and V, the
  same way), ``opart`` (partial outputs with their LSE: one slot per (division, query block)
  computed here, merge slots, and slots for partials received from other ranks), and the
  outputs ``o``/``lse`` in local token order.
* backward: ``qws`` holds Q, dO, LSE and ``delta = rowsum(dO * O)`` of each query block;
  ``kvws`` K and V; ``dqws`` dQ accumulators of every ``qws`` row, then received dQ
  partials; ``dkvws`` dK and dV accumulators likewise; outputs ``dq`` and ``dkv``.

Communication runs in phases, numbered ``2d`` (fetching the inputs of division ``d``) and
``2d + 1`` (returning partial outputs or gradients whose last use was division ``d``).
Every rank launches phases in the same order, ``0, 2, 1, 4, 3, ..., 2T - 1``, skipping the
ones it takes no part in, so point-to-point messages match pairwise in order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from functools import cached_property
from typing import Any, Generator, Iterable

import numpy as np

from ._interleave import interleave
from .batch import BatchSpec
from .masks import Ranges
from .planners.base import Placement
from .topology import Topology
from .workload import BWD_RETURN_KV, BWD_RETURN_Q, FWD_RETURN, KIND_KV, KIND_Q, Workload, item_token_bytes, smallest_int

__all__ = [
    "Plan",
    "Program",
    "Transfer",
    "BlockwiseCopy",
    "CommLaunch",
    "CommWait",
    "BlockwiseAttention",
    "BlockwiseReduction",
    "PlanError",
    "item_token_bytes",
]

FORMAT_MAGIC = b"TDCPLAN\0"
FORMAT_VERSION = 2



class PlanError(ValueError):
    """A plan is inconsistent (raised by :meth:`Plan.validate` and deserialisation)."""


# ---------------------------------------------------------------------- instructions
@dataclasses.dataclass(frozen=True)
class Transfer:
    """Blocks of one kind moving between this rank and ``peer``.

    ``rows[i]`` is the first row of ``blocks[i]`` in this rank's buffer for ``kind`` (the
    source of a send, the destination of a receive). Message order is ``blocks`` order.
    """

    peer: int
    kind: str
    blocks: np.ndarray
    rows: np.ndarray


@dataclasses.dataclass(frozen=True)
class BlockwiseCopy:
    """Copy local blocks of ``kind`` (``q`` or ``kv`` side) from the rank's inputs into its
    work buffers: rows ``src_rows[i]`` of the input to ``dst_rows[i]`` of the buffer."""

    kind: str
    blocks: np.ndarray
    src_rows: np.ndarray
    dst_rows: np.ndarray


@dataclasses.dataclass(frozen=True)
class CommLaunch:
    """Start the sends and receives of ``phase`` (asynchronous)."""

    phase: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class CommWait:
    """Wait until the receives (and sends) of ``phase`` are complete."""

    phase: int


@dataclasses.dataclass(frozen=True)
class BlockwiseAttention:
    """Attention over the tiles of one division, in groups sharing a query block.

    Group ``g``: query block ``q_block[g]`` at ``qws`` row ``q_row[g]``, key/value blocks
    ``kv_block[kv_ptr[g]:kv_ptr[g+1]]`` at ``kvws`` rows ``kv_row[...]`` (tiles ``tile[...]``).
    Forward writes the group's partial output and LSE to ``opart`` row ``out_row[g]``;
    backward adds dQ to ``dqws`` row ``out_row[g]`` and dK, dV to ``dkvws`` rows ``kv_row``.
    """

    division: int
    q_block: np.ndarray
    q_row: np.ndarray
    out_row: np.ndarray
    kv_ptr: np.ndarray
    kv_block: np.ndarray
    kv_row: np.ndarray
    tile: np.ndarray


@dataclasses.dataclass(frozen=True)
class BlockwiseReduction:
    """Reduce slots of ``src`` into ``dst``: destination ``i`` (block ``dst_block[i]`` at
    row ``dst_row[i]``) receives the LSE merge (``op="lse_merge"``) or the sum
    (``op="sum"``) of the ``src`` slots at rows ``src_row[src_ptr[i]:src_ptr[i+1]]``. An
    empty source list gives zeros (LSE ``-inf``)."""

    op: str
    src: str
    dst: str
    dst_block: np.ndarray
    dst_row: np.ndarray
    src_ptr: np.ndarray
    src_row: np.ndarray


Instruction = BlockwiseCopy | CommLaunch | CommWait | BlockwiseAttention | BlockwiseReduction


@dataclasses.dataclass(frozen=True)
class Program:
    """One rank's forward or backward program.

    Attributes:
        rank, backward: whose program and which pass.
        instructions: the program, in order.
        local_rows: tokens held by the rank.
        buffer_rows: rows of every work buffer (``qws``, ``kvws``, and ``opart`` forward or
            ``dqws``, ``dkvws`` backward).
    """

    rank: int
    backward: bool
    instructions: tuple[Instruction, ...]
    local_rows: int
    buffer_rows: dict[str, int]

    def describe(self) -> str:
        """Human-readable listing."""
        lines = [f"rank {self.rank} {'backward' if self.backward else 'forward'}: {self.buffer_rows}"]
        for ins in self.instructions:
            if isinstance(ins, CommLaunch):
                s = ", ".join(f"{t.kind}{t.blocks.tolist()}->{t.peer}" for t in ins.sends)
                r = ", ".join(f"{t.kind}{t.blocks.tolist()}<-{t.peer}" for t in ins.recvs)
                lines.append(f"  CommLaunch(phase={ins.phase}; send {s}; recv {r})")
            elif isinstance(ins, BlockwiseAttention):
                lines.append(f"  BlockwiseAttention(division={ins.division}, groups={len(ins.q_block)}, tiles={len(ins.tile)})")
            elif isinstance(ins, BlockwiseReduction):
                lines.append(f"  BlockwiseReduction({ins.op}, {ins.src}->{ins.dst}, {len(ins.dst_row)} slots)")
            else:
                lines.append(f"  {type(ins).__name__}({getattr(ins, 'phase', getattr(ins, 'kind', ''))})")
        return "\n".join(lines)


def _i64(a: Iterable[int] | np.ndarray) -> np.ndarray:
    return np.asarray(a if isinstance(a, np.ndarray) else list(a), dtype=np.int64)


# ---------------------------------------------------------------------- the plan
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
        self._programs: dict[tuple[int, bool], Program] = {}

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
        return {"local": f.local_rows, **{f"fwd_{k}": v for k, v in f.buffer_rows.items()},
                **{f"bwd_{k}": v for k, v in b.buffer_rows.items()}}

    # ------------------------------------------------------------------ global tables
    @cached_property
    def _tables(self) -> dict[str, np.ndarray]:
        """Fetches and returns of all ranks, vectorised.

        ``fetch_*``: one row per (rank, kind, block) a rank fetches, with its division;
        ``ret_q_*``/``ret_kv_*``: one row per (rank, remote query/key-value block) with the
        last division using it.
        """
        wl, pl = self.workload, self.placement
        nb = wl.n_blocks
        tr, td = pl.tile_rank, self.tile_division
        out: dict[str, np.ndarray] = {}
        ranks, kinds, blocks, divs, lasts = [], [], [], [], []
        for kind, tb in ((0, wl.tile_q), (1, wl.tile_kv)):
            remote = pl.block_rank[tb] != tr
            code = tr[remote] * nb + tb[remote]
            uniq, inv = np.unique(code, return_inverse=True)
            first = np.full(len(uniq), np.iinfo(np.int64).max)
            np.minimum.at(first, inv, td[remote])
            last = np.full(len(uniq), -1)
            np.maximum.at(last, inv, td[remote])
            ranks.append(uniq // nb)
            blocks.append(uniq % nb)
            kinds.append(np.full(len(uniq), kind))
            divs.append(first)
            lasts.append(last)
            out[f"ret_{'q' if kind == 0 else 'kv'}_rank"] = uniq // nb
            out[f"ret_{'q' if kind == 0 else 'kv'}_block"] = uniq % nb
            out[f"ret_{'q' if kind == 0 else 'kv'}_div"] = last
        out["fetch_rank"] = np.concatenate(ranks)
        out["fetch_kind"] = np.concatenate(kinds)
        out["fetch_block"] = np.concatenate(blocks)
        out["fetch_div"] = np.concatenate(divs)
        return out

    # ------------------------------------------------------------------ compile
    def program(self, rank: int, backward: bool = False) -> Program:
        """The forward (or backward) program of ``rank`` (compiled once, cached)."""
        rank = self._check_rank(rank)
        key = (rank, bool(backward))
        if key not in self._programs:
            self._programs[key] = _compile(self, rank, bool(backward))
        return self._programs[key]

    # ------------------------------------------------------------------ statistics
    def transfers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every block transfer of the plan, forward and backward.

        Returns ``(src, dst, nbytes, forward)``: int64 ranks, float64 bytes and a bool
        forward flag, one entry per (fetched or returned block, rank pair, pass).
        """
        wl, pl, t = self.workload, self.placement, self._tables
        itb = item_token_bytes(self.batch)
        br = pl.block_rank
        src, dst, nbytes, fwd = [], [], [], []
        # fetches: from the block's home to the fetching rank, forward and backward
        fk = np.where(t["fetch_kind"] == 0, KIND_Q, KIND_KV)
        for backward in (False, True):
            per_tok = np.where(fk == KIND_Q, itb[(backward, KIND_Q)], itb[(backward, KIND_KV)])
            src.append(br[t["fetch_block"]])
            dst.append(t["fetch_rank"])
            nbytes.append(per_tok * wl.block_len[t["fetch_block"]])
            fwd.append(np.full(len(fk), not backward))
        # returns: from the computing rank to the block's home
        for backward, side, kind in ((False, "q", FWD_RETURN), (True, "q", BWD_RETURN_Q), (True, "kv", BWD_RETURN_KV)):
            blocks = t[f"ret_{side}_block"]
            src.append(t[f"ret_{side}_rank"])
            dst.append(br[blocks])
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
        complete outputs (forward) and dQ, dK, dV (backward) of its blocks.

        Raises:
            PlanError: naming the rank, instruction and what is wrong.
        """
        for backward in (False, True):
            _Symbolic(self, backward).run()

    # ------------------------------------------------------------------ serialisation
    def _content(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        arrays = dict(self.workload.arrays())
        arrays["block_rank"] = self.placement.block_rank.astype(smallest_int(self.world_size))
        arrays["tile_rank"] = self.placement.tile_rank.astype(smallest_int(self.world_size))
        arrays["tile_division"] = self.tile_division.astype(smallest_int(self.divisions))
        batch = self.batch.to_dict()
        for i, m in enumerate(self.batch.masks):
            if isinstance(m, Ranges):
                arrays[f"mask{i}_starts"] = m.starts
                arrays[f"mask{i}_ends"] = m.ends
                batch["masks"][i] = {"type": "Ranges", "arrays": i}
        header = {
            "batch": batch,
            "topology": self.topology.to_dict(),
            "planner": self.planner,
            "divisions": self.divisions,
            "block_size": self.workload.block_size,
        }
        return header, arrays

    def to_bytes(self) -> bytes:
        """Serialise (no pickle): magic, format version, JSON header, raw little-endian arrays
        (block spans, block and tile ranks, tile divisions in the narrowest integer types;
        the tiles themselves are recomputed from the batch on load)."""
        header, arrays = self._content()
        body, specs, offset = [], [], 0
        for name in sorted(arrays):
            a = np.ascontiguousarray(arrays[name])
            a = a.astype(a.dtype.newbyteorder("<"), copy=False)
            raw = a.tobytes()
            specs.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
            pad = (-len(raw)) % 8
            body.append(raw + b"\0" * pad)
            offset += len(raw) + pad
        doc = {"content": {**header, "arrays": specs}, "meta": {"plan_seconds": self.plan_seconds}}
        text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return FORMAT_MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(text)) + text + b"".join(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Plan":
        """Inverse of :meth:`to_bytes`.

        Raises:
            PlanError: not a plan, an unsupported format version, or a corrupt payload.
        """
        data = bytes(data)
        if not data.startswith(FORMAT_MAGIC):
            raise PlanError("not a torch_dcp plan (bad magic)")
        n = len(FORMAT_MAGIC)
        try:
            version, hlen = struct.unpack_from("<IQ", data, n)
        except struct.error:
            raise PlanError("truncated plan header") from None
        if version != FORMAT_VERSION:
            raise PlanError(f"plan format version {version} is not supported (this build reads {FORMAT_VERSION})")
        start = n + struct.calcsize("<IQ")
        try:
            doc = json.loads(data[start:start + hlen])
            content = doc["content"]
            base = start + hlen
            arrays = {}
            for spec in content["arrays"]:
                dt = np.dtype(spec["dtype"])
                count = int(np.prod(spec["shape"])) if spec["shape"] else 1
                a = np.frombuffer(data, dtype=dt, count=count, offset=base + spec["offset"])
                arrays[spec["name"]] = a.reshape(spec["shape"]).astype(dt.newbyteorder("="))
            bd = content["batch"]
            for i, m in enumerate(bd["masks"]):
                if m.get("type") == "Ranges":
                    bd["masks"][i] = {"type": "Ranges", "starts": arrays[f"mask{i}_starts"], "ends": arrays[f"mask{i}_ends"]}
            batch = BatchSpec.from_dict(bd)
            topology = Topology.from_dict(content["topology"])
            wl = Workload.from_arrays(batch, arrays, block_size=content["block_size"])
            if len(arrays["tile_rank"]) != wl.n_tiles:
                raise ValueError(f"{len(arrays['tile_rank'])} tile ranks for {wl.n_tiles} tiles")
            placement = Placement(wl, topology.world_size, arrays["block_rank"], arrays["tile_rank"], planner=content["planner"])
            return cls(placement, topology, arrays["tile_division"], content["divisions"], doc["meta"]["plan_seconds"])
        except (KeyError, ValueError, TypeError, json.JSONDecodeError) as err:
            raise PlanError(f"corrupt plan payload: {err}") from None

    def digest(self) -> str:
        """SHA-256 (hex) of the plan's content (everything but timing metadata): equal plans
        have equal digests on every rank and every run."""
        header, arrays = self._content()
        h = hashlib.sha256(FORMAT_MAGIC + struct.pack("<I", FORMAT_VERSION))
        h.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
        for name in sorted(arrays):
            a = np.ascontiguousarray(arrays[name])
            h.update(name.encode() + a.dtype.str.encode() + str(a.shape).encode())
            h.update(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
        return h.hexdigest()

    def __repr__(self) -> str:
        return (f"Plan(planner={self.planner!r}, world_size={self.world_size}, divisions={self.divisions}, "
                f"n_blocks={self.workload.n_blocks}, n_tiles={self.workload.n_tiles})")


# ---------------------------------------------------------------------- compiler
def _compile(plan: Plan, rank: int, backward: bool) -> Program:
    wl, pl, t = plan.workload, plan.placement, plan._tables
    T = plan.divisions
    blen = wl.block_len
    br = pl.block_rank
    home = plan.local_blocks(rank)
    home_row = np.concatenate(([0], np.cumsum(blen[home])[:-1])).astype(np.int64)
    S = int(blen[home].sum())

    # rows of the work buffers: local blocks first, then fetched blocks by (division, block)
    mine = t["fetch_rank"] == rank
    rows: dict[str, dict[int, int]] = {}
    ws_size: dict[str, int] = {}
    for kind_id, kind in ((0, KIND_Q), (1, KIND_KV)):
        sel = np.nonzero(mine & (t["fetch_kind"] == kind_id))[0]
        sel = sel[np.lexsort((t["fetch_block"][sel], t["fetch_div"][sel]))]
        fb = t["fetch_block"][sel]
        r = dict(zip(home.tolist(), home_row.tolist()))
        starts = S + np.concatenate(([0], np.cumsum(blen[fb])[:-1])) if len(fb) else np.zeros(0, np.int64)
        r.update(zip(fb.tolist(), starts.tolist()))
        rows[kind] = r
        ws_size[kind] = S + int(blen[fb].sum())

    # fetch transfers per division: receives (I fetch) and sends (others fetch my blocks)
    kind_name = np.array([KIND_Q, KIND_KV])
    src_of = br[t["fetch_block"]]
    fetch_recv: dict[int, list[Transfer]] = {d: [] for d in range(T)}
    fetch_send: dict[int, list[Transfer]] = {d: [] for d in range(T)}
    for sel_mask, peer_arr, out in ((mine, src_of, fetch_recv), (src_of == rank, t["fetch_rank"], fetch_send)):
        sel = np.nonzero(sel_mask)[0]
        order = np.lexsort((t["fetch_block"][sel], t["fetch_kind"][sel], peer_arr[sel], t["fetch_div"][sel]))
        sel = sel[order]
        keys = np.stack([t["fetch_div"][sel], peer_arr[sel], t["fetch_kind"][sel]], axis=1)
        for grp in _runs(keys):
            d, peer, k = (int(x) for x in keys[grp[0]])
            kind = str(kind_name[k])
            blocks = t["fetch_block"][sel[grp]]
            # the sender sends from its own work buffer rows (its local rows)
            row_map = rows[kind]
            out[d].append(Transfer(peer, kind, blocks, _i64(row_map[b] for b in blocks.tolist())))

    # tiles of this rank, grouped by (division, query block)
    tiles = np.nonzero(pl.tile_rank == rank)[0]
    tiles = tiles[np.lexsort((wl.tile_kv[tiles], wl.tile_q[tiles], plan.tile_division[tiles]))]
    tdiv = plan.tile_division[tiles]
    tq = wl.tile_q[tiles]
    group_keys = np.stack([tdiv, tq], axis=1)
    groups = _runs(group_keys)

    instructions: list[Instruction] = [
        BlockwiseCopy(KIND_Q, home, home_row, home_row),
        BlockwiseCopy(KIND_KV, home, home_row, home_row),
    ]
    # partial-output / gradient slots
    part_rows = 0 if not backward else ws_size[KIND_Q]
    kv_part_rows = ws_size[KIND_KV]
    group_slot: dict[int, list[tuple[int, int]]] = {}  # q block -> [(division, opart row)]
    attn_by_div: dict[int, BlockwiseAttention] = {}
    for d in range(T):
        gs = [g for g in groups if tdiv[g[0]] == d]
        if not gs:
            continue
        q_block, q_row, out_row, kv_ptr = [], [], [], [0]
        kv_block, kv_row, tile_ids = [], [], []
        for g in gs:
            qb = int(tq[g[0]])
            q_block.append(qb)
            q_row.append(rows[KIND_Q][qb])
            if backward:
                out_row.append(rows[KIND_Q][qb])
            else:
                out_row.append(part_rows)
                group_slot.setdefault(qb, []).append((d, part_rows))
                part_rows += int(blen[qb])
            kvs = wl.tile_kv[tiles[g]]
            kv_block.extend(kvs.tolist())
            kv_row.extend(rows[KIND_KV][b] for b in kvs.tolist())
            tile_ids.extend(tiles[g].tolist())
            kv_ptr.append(len(kv_block))
        attn_by_div[d] = BlockwiseAttention(d, _i64(q_block), _i64(q_row), _i64(out_row), _i64(kv_ptr),
                                            _i64(kv_block), _i64(kv_row), _i64(tile_ids))

    # returns: partial outputs (forward) or gradient partials (backward) to block homes
    ret_send: dict[int, list[Transfer]] = {d: [] for d in range(T)}
    ret_recv: dict[int, list[Transfer]] = {d: [] for d in range(T)}
    pre_send_reductions: dict[int, list[tuple[int, int, list[int]]]] = {d: [] for d in range(T)}
    recv_slots: dict[str, dict[int, list[int]]] = {"q": {}, "kv": {}}
    sides = (("q", BWD_RETURN_Q if backward else FWD_RETURN),) + ((("kv", BWD_RETURN_KV),) if backward else ())
    for side, kind in sides:
        rr, rb, rd = t[f"ret_{side}_rank"], t[f"ret_{side}_block"], t[f"ret_{side}_div"]
        # sends: my remote blocks, to their homes, after their last division
        sel = np.nonzero(rr == rank)[0]
        sel = sel[np.lexsort((rb[sel], br[rb[sel]], rd[sel]))]
        keys = np.stack([rd[sel], br[rb[sel]]], axis=1)
        for grp in _runs(keys):
            d, peer = (int(x) for x in keys[grp[0]])
            blocks = rb[sel[grp]]
            send_rows = []
            for b in blocks.tolist():
                if backward:
                    send_rows.append(rows[KIND_Q if side == "q" else KIND_KV][b])
                else:
                    slots = [row for _, row in group_slot[b]]
                    if len(slots) == 1:
                        send_rows.append(slots[0])
                    else:
                        pre_send_reductions[d].append((b, part_rows, slots))
                        send_rows.append(part_rows)
                        part_rows += int(blen[b])
            ret_send[d].append(Transfer(peer, kind, blocks, _i64(send_rows)))
        # receives: partials of my blocks computed elsewhere
        sel = np.nonzero((br[rb] == rank) & (rr != rank))[0]
        sel = sel[np.lexsort((rb[sel], rr[sel], rd[sel]))]
        keys = np.stack([rd[sel], rr[sel]], axis=1)
        for grp in _runs(keys):
            d, peer = (int(x) for x in keys[grp[0]])
            blocks = rb[sel[grp]]
            dst_rows = []
            for b in blocks.tolist():
                if side == "q":
                    dst_rows.append(part_rows)
                    recv_slots["q"].setdefault(b, []).append(part_rows)
                    part_rows += int(blen[b])
                else:
                    dst_rows.append(kv_part_rows)
                    recv_slots["kv"].setdefault(b, []).append(kv_part_rows)
                    kv_part_rows += int(blen[b])
            ret_recv[d].append(Transfer(peer, kind, blocks, _i64(dst_rows)))

    # program order
    fetch_phases = [bool(fetch_send[d] or fetch_recv[d]) for d in range(T)]
    if fetch_phases[0]:
        instructions.append(CommLaunch(0, tuple(fetch_send[0]), tuple(fetch_recv[0])))
        instructions.append(CommWait(0))
    ret_phases = []
    for d in range(T):
        if d + 1 < T and fetch_phases[d + 1]:
            instructions.append(CommLaunch(2 * (d + 1), tuple(fetch_send[d + 1]), tuple(fetch_recv[d + 1])))
        if d in attn_by_div:
            instructions.append(attn_by_div[d])
        if pre_send_reductions[d]:
            red = pre_send_reductions[d]
            instructions.append(_reduction("lse_merge", "opart", "opart", red))
        if ret_send[d] or ret_recv[d]:
            instructions.append(CommLaunch(2 * d + 1, tuple(ret_send[d]), tuple(ret_recv[d])))
            ret_phases.append(2 * d + 1)
        if d + 1 < T and fetch_phases[d + 1]:
            instructions.append(CommWait(2 * (d + 1)))
    instructions.extend(CommWait(p) for p in ret_phases)

    # final reductions into the local outputs
    hb = home.tolist()
    if backward:
        for side, src, dst in (("q", "dqws", "dq"), ("kv", "dkvws", "dkv")):
            kind = KIND_Q if side == "q" else KIND_KV
            red = [(b, int(hr), [rows[kind][b]] + recv_slots[side].get(b, [])) for b, hr in zip(hb, home_row.tolist())]
            instructions.append(_reduction("sum", src, dst, red))
        buffer_rows = {"qws": ws_size[KIND_Q], "kvws": ws_size[KIND_KV], "dqws": part_rows, "dkvws": kv_part_rows}
    else:
        red = [(b, int(hr), [row for _, row in group_slot.get(b, [])] + recv_slots["q"].get(b, []))
               for b, hr in zip(hb, home_row.tolist())]
        instructions.append(_reduction("lse_merge", "opart", "o", red))
        buffer_rows = {"qws": ws_size[KIND_Q], "kvws": ws_size[KIND_KV], "opart": part_rows}
    return Program(rank, backward, tuple(instructions), S, buffer_rows)


def _reduction(op: str, src: str, dst: str, entries: list[tuple[int, int, list[int]]]) -> BlockwiseReduction:
    ptr = np.concatenate(([0], np.cumsum([len(e[2]) for e in entries]))).astype(np.int64)
    return BlockwiseReduction(
        op, src, dst,
        _i64(e[0] for e in entries), _i64(e[1] for e in entries), ptr,
        _i64(r for e in entries for r in e[2]),
    )


def _runs(keys: np.ndarray) -> list[np.ndarray]:
    """Index runs of equal consecutive rows of ``keys`` ``[n, k]``."""
    n = len(keys)
    if n == 0:
        return []
    change = np.ones(n, bool)
    change[1:] = np.any(keys[1:] != keys[:-1], axis=1)
    starts = np.nonzero(change)[0]
    return np.split(np.arange(n), starts[1:])


# ---------------------------------------------------------------------- symbolic validator
class _Symbolic:
    """Runs every rank's program on tags instead of tensors (see :meth:`Plan.validate`)."""

    def __init__(self, plan: Plan, backward: bool):
        self.plan = plan
        self.backward = backward
        self.mail: dict[tuple[int, int, int], list[tuple[str, list]]] = {}
        self.events = 0
        self.computed = np.zeros(plan.workload.n_tiles, np.int64)

    def fail(self, rank: int, ins: Any, msg: str) -> None:
        pas = "backward" if self.backward else "forward"
        where = f", {type(ins).__name__}" if ins is not None else ""
        raise PlanError(f"{pas} program of rank {rank}{where}: {msg}")

    def run(self) -> None:
        plan = self.plan
        gens = [self._rank(r) for r in range(plan.world_size)]
        try:
            finals = interleave(gens, lambda: self.events)
        except RuntimeError as err:
            raise PlanError(f"{'backward' if self.backward else 'forward'}: {err}") from None
        if self.mail:
            (phase, src, dst), _ = next(iter(self.mail.items()))
            raise PlanError(f"phase {phase}: a message from rank {src} to rank {dst} is never received")
        wl = plan.workload
        bad = np.nonzero(self.computed != 1)[0]
        if len(bad):
            raise PlanError(f"tile {bad[0]} computed {self.computed[bad[0]]} times (expected once)")
        need_q = {b: set() for b in range(wl.n_blocks)}
        need_kv = {b: set() for b in range(wl.n_blocks)}
        for i, (q, kv) in enumerate(zip(wl.tile_q.tolist(), wl.tile_kv.tolist())):
            need_q[q].add(i)
            need_kv[kv].add(i)
        expected = (("dq", need_q), ("dkv", need_kv)) if self.backward else (("o", need_q),)
        for rank, outs in enumerate(finals):
            for name, need in expected:
                outs.setdefault(name, {})
                for b, tiles in outs[name].items():
                    if tiles != need[b]:
                        raise PlanError(
                            f"rank {rank}: output {name} of block {b} covers {len(tiles)} of its {len(need[b])} tiles"
                        )
                homes = set(plan.local_blocks(rank).tolist())
                if set(outs[name]) != homes:
                    raise PlanError(f"rank {rank}: output {name} is not complete for its blocks")

    def _rank(self, rank: int) -> Generator[None, None, dict]:
        plan, wl, pl = self.plan, self.plan.workload, self.plan.placement
        prog = plan.program(rank, self.backward)
        # tags per buffer: row -> tag
        buf: dict[str, dict[int, Any]] = {"qws": {}, "kvws": {}, "opart": {}, "dqws": {}, "dkvws": {}}
        out: dict[str, dict[int, frozenset]] = {}
        launched: dict[int, CommLaunch] = {}
        home = set(plan.local_blocks(rank).tolist())
        bufname = {KIND_Q: "qws", KIND_KV: "kvws", FWD_RETURN: "opart", BWD_RETURN_Q: "dqws", BWD_RETURN_KV: "dkvws"}
        acc_of = {KIND_Q: (BWD_RETURN_Q, "dqws"), KIND_KV: (BWD_RETURN_KV, "dkvws")}
        for ins in prog.instructions:
            if isinstance(ins, BlockwiseCopy):
                for b, dst in zip(ins.blocks.tolist(), ins.dst_rows.tolist()):
                    if b not in home:
                        self.fail(rank, ins, f"copies block {b}, which is not local")
                    buf[bufname[ins.kind]][dst] = (ins.kind, b)
                    if self.backward:
                        acc_kind, acc = acc_of[ins.kind]
                        buf[acc][dst] = (acc_kind, b, frozenset())
            elif isinstance(ins, CommLaunch):
                if ins.phase in launched:
                    self.fail(rank, ins, f"phase {ins.phase} launched twice")
                launched[ins.phase] = ins
                by_peer: dict[int, list] = {}
                for tr in ins.sends:
                    if tr.peer == rank:
                        self.fail(rank, ins, "sends to itself")
                    tags = []
                    for b, row in zip(tr.blocks.tolist(), tr.rows.tolist()):
                        tag = buf[bufname[tr.kind]].get(row)
                        if tag is None or tag[0] != tr.kind or tag[1] != b:
                            self.fail(rank, ins, f"sends block {b} ({tr.kind}) from row {row}, which holds {tag}")
                        tags.append(tag)
                    by_peer.setdefault(tr.peer, []).append((tr.kind, tr.blocks.tolist(), tags))
                for peer, msgs in by_peer.items():
                    key = (ins.phase, rank, peer)
                    if key in self.mail:
                        self.fail(rank, ins, f"second message to rank {peer} in phase {ins.phase}")
                    self.mail[key] = msgs
                self.events += 1
            elif isinstance(ins, CommWait):
                if ins.phase not in launched:
                    self.fail(rank, ins, f"waits for phase {ins.phase}, never launched")
                launch = launched.pop(ins.phase)
                peers: dict[int, list[Transfer]] = {}
                for tr in launch.recvs:
                    peers.setdefault(tr.peer, []).append(tr)
                for peer, trs in peers.items():
                    key = (ins.phase, peer, rank)
                    while key not in self.mail:
                        yield
                    msgs = self.mail.pop(key)
                    expect = [(tr.kind, tr.blocks.tolist()) for tr in trs]
                    if [(k, b) for k, b, _ in msgs] != expect:
                        self.fail(rank, ins, f"phase {ins.phase}: rank {peer} sent {[(k, b) for k, b, _ in msgs]}, expected {expect}")
                    for tr, (_, _, tags) in zip(trs, msgs):
                        for row, tag in zip(tr.rows.tolist(), tags):
                            buf[bufname[tr.kind]][row] = tag
                            if self.backward and tr.kind in acc_of:
                                acc_kind, acc = acc_of[tr.kind]
                                buf[acc][row] = (acc_kind, tag[1], frozenset())
                self.events += 1
            elif isinstance(ins, BlockwiseAttention):
                for g in range(len(ins.q_block)):
                    qb = int(ins.q_block[g])
                    if buf["qws"].get(int(ins.q_row[g])) != (KIND_Q, qb):
                        self.fail(rank, ins, f"query block {qb} is not present at row {ins.q_row[g]}")
                    lo, hi = ins.kv_ptr[g], ins.kv_ptr[g + 1]
                    got: set[int] = set()
                    for kb, kr, tile in zip(ins.kv_block[lo:hi].tolist(), ins.kv_row[lo:hi].tolist(), ins.tile[lo:hi].tolist()):
                        if buf["kvws"].get(kr) != (KIND_KV, kb):
                            self.fail(rank, ins, f"key/value block {kb} is not present at row {kr}")
                        if wl.tile_q[tile] != qb or wl.tile_kv[tile] != kb:
                            self.fail(rank, ins, f"tile {tile} is not ({qb}, {kb})")
                        if pl.tile_rank[tile] != rank or plan.tile_division[tile] != ins.division:
                            self.fail(rank, ins, f"tile {tile} runs off its planned rank/division")
                        self.computed[tile] += 1
                        got.add(tile)
                        if self.backward:
                            self._accumulate(rank, ins, buf["dkvws"], kr, "dkv", kb, {tile})
                    if self.backward:
                        self._accumulate(rank, ins, buf["dqws"], int(ins.out_row[g]), "dq", qb, got)
                    else:
                        buf["opart"][int(ins.out_row[g])] = (FWD_RETURN, qb, frozenset(got))
            elif isinstance(ins, BlockwiseReduction):
                src = buf[ins.src]
                for i, (b, drow) in enumerate(zip(ins.dst_block.tolist(), ins.dst_row.tolist())):
                    union: set[int] = set()
                    for srow in ins.src_row[ins.src_ptr[i]:ins.src_ptr[i + 1]].tolist():
                        tag = src.get(srow)
                        if tag is None or tag[1] != b:
                            self.fail(rank, ins, f"reduces row {srow} into block {b}, but it holds {tag}")
                        if union & tag[2]:
                            self.fail(rank, ins, f"block {b}: a tile is counted twice")
                        union |= tag[2]
                    if ins.dst in buf:
                        buf[ins.dst][drow] = ({"opart": FWD_RETURN, "dqws": BWD_RETURN_Q, "dkvws": BWD_RETURN_KV}[ins.dst], b, frozenset(union))
                    else:
                        if b not in home:
                            self.fail(rank, ins, f"writes output of block {b}, which is not local")
                        out.setdefault(ins.dst, {})[b] = frozenset(union)
            else:  # pragma: no cover - programs hold only the five instructions
                self.fail(rank, ins, "unknown instruction")
        if launched:
            self.fail(rank, None, f"phases {sorted(launched)} launched but never waited")
        return out

    def _accumulate(self, rank, ins, buf, row, name, block, tiles) -> None:
        tag = buf.get(row)
        if tag is None or tag[1] != block:
            self.fail(rank, ins, f"{name} accumulator of block {block} missing at row {row}")
        if tag[2] & tiles:
            self.fail(rank, ins, f"{name} of block {block}: a tile is counted twice")
        buf[row] = (name, block, tag[2] | frozenset(tiles))
