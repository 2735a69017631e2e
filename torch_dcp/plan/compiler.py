"""The plan compiler: from placement + divisions to every rank's forward and backward program.

Buffers of a rank (rows = tokens, see :class:`~torch_dcp.workload.Buf`):

* forward: ``Q`` (Q of local blocks, then fetched query blocks), ``KV`` (K and V, the same way),
  ``OPART`` (partial outputs with their LSE: one slot per (division, query block) computed
  here, merge slots, and slots for partials received from other ranks), and ``OUT`` (outputs
  and LSE in local token order).
* backward: ``Q`` holds Q, dO, LSE and ``delta = rowsum(dO * O)`` of each query block; ``KV`` K
  and V; ``DQ`` dQ accumulators of every ``Q`` row, then received dQ partials; ``DKV`` dK and dV
  accumulators likewise; outputs ``OUT_DQ`` and ``OUT_DKV``.

Row order is chosen so that data moves with few operations: fetched blocks are laid out by
(division, sending peer, block), so every receive of a phase lands in one contiguous run of
rows per peer; received partials likewise; a division's groups run by (home rank, query block),
so partial outputs returned to one peer sit side by side.

Communication runs in phases, numbered ``2d`` (fetching the inputs of division ``d``; phase
``-2`` opens the pass with the blocks a node's gateway fetches before division 0) and
``2d + 1`` (returning partial outputs or gradients whose last use was division ``d``; phase
``2T + 1`` closes the pass with the sums a node's reducer sends on after the last division,
see :func:`~torch_dcp.plan.routes.node_routes`). Every rank launches phases in the same order,
``-2, 0, 2, 1, 4, 3, ..., 2T - 1, 2T + 1``, skipping the ones it takes no part in, so
point-to-point messages match pairwise in order.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Iterable, NamedTuple

import numpy as np

from ..workload import Buf
from .ir import (
    BlockwiseAttention,
    BlockwiseCopy,
    BlockwiseReduction,
    CommLaunch,
    CommWait,
    Instruction,
    PlanError,
    Program,
    ReduceOp,
    Transfer,
)

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

__all__ = ["compile_program"]


def _i64(a: Iterable[int] | np.ndarray) -> np.ndarray:
    return np.asarray(a if isinstance(a, np.ndarray) else list(a), dtype=np.int64)


def _runs(*cols: np.ndarray) -> list[tuple[int, int, tuple[int, ...]]]:
    """Runs of equal consecutive rows over the columns ``cols`` (1-D, of one length): ``(start,
    end, key)`` of each, ``key`` its columns' values as Python ints (taken once for all runs,
    not row by row: a program has dozens of transfers)."""
    n = len(cols[0])
    if n == 0:
        return []
    change = np.zeros(n, bool)
    change[0] = True
    for c in cols:
        change[1:] |= c[1:] != c[:-1]
    starts = np.flatnonzero(change)
    keys = zip(*(c[starts].tolist() for c in cols))
    return list(zip(starts.tolist(), starts[1:].tolist() + [n], keys))


def _cumulative_tokens(blen: np.ndarray, blocks: np.ndarray) -> list[int]:
    """Tokens of ``blocks[:i]`` for every ``i`` (``len(blocks) + 1`` Python ints): a run's
    tokens are a difference of two."""
    return [0] + np.cumsum(blen[blocks]).tolist()


def _row_array(row_map: dict[int, int], n_blocks: int) -> np.ndarray:
    """``row_map`` (block -> first row) as an int64 array ``[n_blocks]``, -1 where absent."""
    a = np.full(n_blocks, -1, np.int64)
    if row_map:
        a[np.fromiter(row_map.keys(), np.int64, len(row_map))] = np.fromiter(row_map.values(), np.int64, len(row_map))
    return a


def _reduction(op: ReduceOp, src: Buf, dst: Buf, entries: list[tuple[int, int, list[int]]]) -> BlockwiseReduction:
    n = len(entries)
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum([len(e[2]) for e in entries], out=ptr[1:])
    return BlockwiseReduction(op, src, dst, np.fromiter((e[0] for e in entries), np.int64, n),
                              np.fromiter((e[1] for e in entries), np.int64, n), ptr,
                              np.fromiter(itertools.chain.from_iterable(e[2] for e in entries), np.int64, int(ptr[-1])))


def _by_rank(rank_col: np.ndarray, *order_by: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a table grouped by ``rank_col``, each rank's rows sorted by ``order_by`` (last
    one first, as ``np.lexsort``; ties in table order), as CSR: the rows one rank after
    another, and every rank's offset (``world + 1``)."""
    order = np.lexsort((*order_by, rank_col))
    return order, np.searchsorted(rank_col[order], np.arange(world + 1))


def _rank_index(plan: "Plan") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every table's rows by the rank they belong to, in each program's order, sorted once for
    all ranks' programs (a plan compiles ``2 W`` of them): fetches by receiver (``in``) and by
    sender (``out``), by (division, peer, kind, block); tiles by (division, query block's home,
    query block, key/value block); returns by receiver and by sender, by (division, peer, block)."""
    wl, t, w = plan.workload, plan.tables, plan.world_size
    fr, fs, fb, fk, fd = (t[f"fetch_{c}"] for c in ("rank", "src", "block", "kind", "div"))
    index = {"fetch_in": _by_rank(fr, fb, fk, fs, fd, world=w), "fetch_out": _by_rank(fs, fb, fk, fr, fd, world=w),
             "tiles": _by_rank(plan.placement.tile_rank, wl.tile_kv, wl.tile_q, plan.placement.block_rank[wl.tile_q],
                               plan.tile_division, world=w)}
    for name in ("q", "kv"):
        rr, rb, rd, rt = (t[f"ret_{name}_{c}"] for c in ("rank", "block", "div", "dst"))
        index[f"ret_{name}_in"] = _by_rank(rt, rb, rr, rd, world=w)
        index[f"ret_{name}_out"] = _by_rank(rr, rb, rt, rd, world=w)
    return index


class _FetchLayout(NamedTuple):
    """What a rank's forward and backward programs share (:func:`_fetch_layout`): its local
    blocks and their rows, the rows of its ``Q`` and ``KV`` work buffers (block -> first row,
    dict and array), their sizes, and its fetch transfers received and sent per division."""

    home: np.ndarray
    home_row: np.ndarray
    local_rows: int
    rows: dict[Buf, dict[int, int]]
    ws_size: dict[Buf, int]
    row_of: dict[Buf, np.ndarray]
    fetch_recv: dict[int, list[Transfer]]
    fetch_send: dict[int, list[Transfer]]


def _mine(plan: "Plan", name: str, rank: int) -> np.ndarray:
    """``rank``'s rows of a table, in its program's order (:func:`_rank_index`)."""
    order, ptr = plan.memo("rank_index", None, lambda: _rank_index(plan))[name]
    return order[ptr[rank]:ptr[rank + 1]]


def _fetch_layout(plan: "Plan", rank: int) -> _FetchLayout:
    """The work buffers' rows and the fetch transfers of ``rank``: the same in both passes
    (the backward's ``Q`` rows carry more per token, not other rows), built once for both."""
    wl, t, T = plan.workload, plan.tables, plan.divisions
    blen = wl.block_len
    home = plan.local_blocks(rank)
    home_row = np.concatenate(([0], np.cumsum(blen[home])[:-1])).astype(np.int64)
    S = int(blen[home].sum())
    src_of = t["fetch_src"]
    kind_of = (Buf.Q, Buf.KV)

    # fetches, received (I fetch) and sent (others fetch my blocks), by (division, peer, kind, block)
    fb_all, fk_all, fd_all = t["fetch_block"], t["fetch_kind"], t["fetch_div"]
    fetches = []
    for sel, peer_arr in ((_mine(plan, "fetch_in", rank), src_of), (_mine(plan, "fetch_out", rank), t["fetch_rank"])):
        fetches.append((fb_all[sel], fk_all[sel], fd_all[sel], peer_arr[sel]))

    # rows of the work buffers: local blocks first, then fetched blocks by (division, peer, block)
    # (the receives of one kind, in their order)
    rows: dict[Buf, dict[int, int]] = {}
    ws_size: dict[Buf, int] = {}
    for kind_id, kind in enumerate(kind_of):
        fb = fetches[0][0][fetches[0][1] == kind_id]
        r = dict(zip(home.tolist(), home_row.tolist()))
        starts = S + np.concatenate(([0], np.cumsum(blen[fb])[:-1])) if len(fb) else np.zeros(0, np.int64)
        r.update(zip(fb.tolist(), starts.tolist()))
        rows[kind] = r
        ws_size[kind] = S + int(blen[fb].sum())

    row_of = {kind: _row_array(rows[kind], wl.n_blocks) for kind in kind_of}
    # fetch transfers per division (division -1: the opening phase, blocks a node's gateway
    # fetches before division 0)
    fetch_recv: dict[int, list[Transfer]] = {d: [] for d in range(-1, T)}
    fetch_send: dict[int, list[Transfer]] = {d: [] for d in range(-1, T)}
    for (blocks, kinds, divs, peers), out in zip(fetches, (fetch_recv, fetch_send)):
        # a sender sends from its local rows; a transfer's blocks and rows are slices of these
        block_rows = np.where(kinds == 0, row_of[Buf.Q][blocks], row_of[Buf.KV][blocks])
        cum = _cumulative_tokens(blen, blocks)
        for a, b, (d, peer, k) in _runs(divs, peers, kinds):
            out[d].append(Transfer(peer, kind_of[k], blocks[a:b], block_rows[a:b], cum[b] - cum[a]))

    return _FetchLayout(home, home_row, S, rows, ws_size, row_of, fetch_recv, fetch_send)


def compile_program(plan: "Plan", rank: int, backward: bool) -> Program:
    """The forward (or backward) :class:`Program` of ``rank`` (deterministic)."""
    wl, t = plan.workload, plan.tables
    T = plan.divisions
    blen = wl.block_len
    layout = plan.memo(("fetch_layout", rank), None, lambda: _fetch_layout(plan, rank))
    home, home_row, S = layout.home, layout.home_row, layout.local_rows
    rows, ws_size, row_of = layout.rows, layout.ws_size, layout.row_of
    fetch_recv, fetch_send = layout.fetch_recv, layout.fetch_send

    # tiles of this rank, grouped by (division, query block); groups by (home rank, query block)
    tiles = _mine(plan, "tiles", rank)
    tdiv = plan.tile_division[tiles]
    tq = wl.tile_q[tiles]
    tkv = wl.tile_kv[tiles]
    # groups: runs of equal (division, query block), in that order
    start = np.ones(len(tiles), bool)
    start[1:] = (tdiv[1:] != tdiv[:-1]) | (tq[1:] != tq[:-1])
    g_first = np.nonzero(start)[0]
    g_div, g_q = tdiv[g_first], tq[g_first]
    g_end = np.append(g_first[1:], len(tiles))

    instructions: list[Instruction] = [
        BlockwiseCopy(Buf.Q, home, home_row, home_row),
        BlockwiseCopy(Buf.KV, home, home_row, home_row),
    ]
    # partial-output / gradient slots: forward, one per group, in group order
    part_rows = 0 if not backward else ws_size[Buf.Q]
    kv_part_rows = ws_size[Buf.KV]
    if backward:
        g_out = row_of[Buf.Q][g_q]
    else:
        g_out = part_rows + np.concatenate(([0], np.cumsum(blen[g_q])[:-1])).astype(np.int64)
        part_rows += int(blen[g_q].sum())
    group_slot: dict[int, list[tuple[int, int]]] = {}  # q block -> [(division, opart row)]
    if not backward:
        for qb, d, row in zip(g_q.tolist(), g_div.tolist(), g_out.tolist()):
            group_slot.setdefault(qb, []).append((d, row))
    attn_by_div: dict[int, BlockwiseAttention] = {}
    bounds = np.searchsorted(g_div, np.arange(T + 1))
    for d in range(T):
        a, b = int(bounds[d]), int(bounds[d + 1])
        if a == b:
            continue
        ta, tb = int(g_first[a]), int(g_end[b - 1])
        kv_block = tkv[ta:tb]
        kv_ptr = np.concatenate(([0], g_end[a:b] - ta)).astype(np.int64)
        attn_by_div[d] = BlockwiseAttention(d, g_q[a:b].copy(), row_of[Buf.Q][g_q[a:b]], g_out[a:b].copy(), kv_ptr,
                                            kv_block.copy(), row_of[Buf.KV][kv_block], tiles[ta:tb].copy())

    # returns: partial outputs (forward) or gradient partials (backward), to the block's home or
    # to a rank that adds its own partial and passes the sum on (a relay); receives first, so
    # that a relay's send can include what it received
    # returns after division d go in phase 2d + 1; d = T is the closing phase after the last
    ret_send: dict[int, list[Transfer]] = {d: [] for d in range(T + 1)}
    ret_recv: dict[int, list[Transfer]] = {d: [] for d in range(T + 1)}
    pre_send_reductions: dict[tuple[int, ReduceOp, Buf], list[tuple[int, int, list[int]]]] = {}
    pre_send_waits: dict[int, set[int]] = {d: set() for d in range(T + 1)}
    recv_slots: dict[Buf, dict[int, list[int]]] = {Buf.Q: {}, Buf.KV: {}}
    recv_phase: dict[Buf, dict[int, set[int]]] = {Buf.Q: {}, Buf.KV: {}}
    hb = home.tolist()
    blen_l = blen.tolist()
    home_set = set(hb)
    sides = ((Buf.Q, Buf.DQ if backward else Buf.OPART),) + (((Buf.KV, Buf.DKV),) if backward else ())
    for side, kind in sides:
        name = "q" if side == Buf.Q else "kv"
        rr, rb, rd, rt = t[f"ret_{name}_rank"], t[f"ret_{name}_block"], t[f"ret_{name}_div"], t[f"ret_{name}_dst"]
        # receives: partials sent to me, by (division, peer, block)
        sel = _mine(plan, f"ret_{name}_in", rank)
        blocks_all = rb[sel]
        blocks_l, cum = blocks_all.tolist(), _cumulative_tokens(blen, blocks_all)
        for a, e, (d, peer) in _runs(rd[sel], rr[sel]):
            blocks = blocks_all[a:e]
            dst_rows = []
            for b in blocks_l[a:e]:
                if side == Buf.Q:
                    row, part_rows = part_rows, part_rows + blen_l[b]
                else:
                    row, kv_part_rows = kv_part_rows, kv_part_rows + blen_l[b]
                dst_rows.append(row)
                recv_slots[side].setdefault(b, []).append(row)
                recv_phase[side].setdefault(b, set()).add(2 * d + 1)
            ret_recv[d].append(Transfer(peer, kind, blocks, _i64(dst_rows), cum[e] - cum[a]))
        # sends: my partials of blocks held elsewhere, after the last division using them
        sel = _mine(plan, f"ret_{name}_out", rank)
        op = ReduceOp.SUM if backward else ReduceOp.LSE_MERGE
        blocks_all = rb[sel]
        blocks_l, cum = blocks_all.tolist(), _cumulative_tokens(blen, blocks_all)
        for a, e, (d, peer) in _runs(rd[sel], rt[sel]):
            blocks = blocks_all[a:e]
            send_rows = []
            for b in blocks_l[a:e]:
                if backward:
                    own = [rows[side][b]] if b in rows[side] else []
                else:
                    own = [row for _, row in group_slot.get(b, [])]
                relayed = recv_slots[side].pop(b, [])
                pre_send_waits[d] |= recv_phase[side].pop(b, set())
                slots = own + relayed
                if len(slots) == 1:  # its own partial, or one it passes on as received (waited above)
                    send_rows.append(slots[0])
                    continue
                if side == Buf.Q:
                    row, part_rows = part_rows, part_rows + blen_l[b]
                else:
                    row, kv_part_rows = kv_part_rows, kv_part_rows + blen_l[b]
                pre_send_reductions.setdefault((d, op, kind), []).append((b, row, slots))
                send_rows.append(row)
            ret_send[d].append(Transfer(peer, kind, blocks, _i64(send_rows), cum[e] - cum[a]))
    stray = [b for side in recv_slots.values() for b in side if b not in home_set]
    if stray:
        raise PlanError(f"rank {rank} receives partials of block {stray[0]}, which it neither holds nor passes on")

    # program order
    fetch_phases = {d: bool(fetch_send[d] or fetch_recv[d]) for d in range(-1, T)}
    if fetch_phases[-1]:  # the opening phase completes before division 0's fetch starts
        instructions.append(CommLaunch(-2, tuple(fetch_send[-1]), tuple(fetch_recv[-1])))
        instructions.append(CommWait(-2))
    if fetch_phases[0]:
        instructions.append(CommLaunch(0, tuple(fetch_send[0]), tuple(fetch_recv[0])))
        instructions.append(CommWait(0))
    ret_phases: list[int] = []
    waited: set[int] = set()
    for d in range(T + 1):
        if d + 1 < T and fetch_phases[d + 1]:
            instructions.append(CommLaunch(2 * (d + 1), tuple(fetch_send[d + 1]), tuple(fetch_recv[d + 1])))
        if d in attn_by_div:
            instructions.append(attn_by_div[d])
        for p in sorted(pre_send_waits[d] - waited):  # relayed partials must have arrived before they are added
            waited.add(p)
            if p not in ret_phases:
                raise PlanError(f"rank {rank}: a partial relayed after division {d} arrives in phase {p}, "
                                f"which is not earlier")
            ret_phases.remove(p)
            instructions.append(CommWait(p))
        for (dd, op, kind), entries in pre_send_reductions.items():
            if dd == d:
                instructions.append(_reduction(op, kind, kind, entries))
        if ret_send[d] or ret_recv[d]:
            instructions.append(CommLaunch(2 * d + 1, tuple(ret_send[d]), tuple(ret_recv[d])))
            ret_phases.append(2 * d + 1)
        if d + 1 < T and fetch_phases[d + 1]:
            instructions.append(CommWait(2 * (d + 1)))
    instructions.extend(CommWait(p) for p in ret_phases)

    # final reductions into the local outputs
    if backward:
        for side, src, dst in ((Buf.Q, Buf.DQ, Buf.OUT_DQ), (Buf.KV, Buf.DKV, Buf.OUT_DKV)):
            red = [(b, int(hr), [rows[side][b]] + recv_slots[side].get(b, [])) for b, hr in zip(hb, home_row.tolist())]
            instructions.append(_reduction(ReduceOp.SUM, src, dst, red))
        buffer_rows = {Buf.Q: ws_size[Buf.Q], Buf.KV: ws_size[Buf.KV], Buf.DQ: part_rows, Buf.DKV: kv_part_rows}
    else:
        red = [(b, int(hr), [row for _, row in group_slot.get(b, [])] + recv_slots[Buf.Q].get(b, []))
               for b, hr in zip(hb, home_row.tolist())]
        instructions.append(_reduction(ReduceOp.LSE_MERGE, Buf.OPART, Buf.OUT, red))
        buffer_rows = {Buf.Q: ws_size[Buf.Q], Buf.KV: ws_size[Buf.KV], Buf.OPART: part_rows}
    return Program(rank, backward, tuple(instructions), S, buffer_rows)
