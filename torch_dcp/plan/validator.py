"""The symbolic validator: runs every rank's program on tags instead of tensors.

A tag records what a buffer row holds: ``(kind, block)`` for inputs, ``(kind, block, tiles)``
for partial results (the set of tiles summed into it). Running all ranks' programs
round-robin on tags proves what :meth:`torch_dcp.plan.Plan.validate` promises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from .._interleave import interleave
from ..workload import Buf
from .ir import (
    BlockwiseAttention,
    BlockwiseCopy,
    BlockwiseReduction,
    CommLaunch,
    CommWait,
    PlanError,
    Transfer,
    dispatch,
)

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

__all__ = ["validate_pass"]

#: the accumulator each input buffer's rows get in the backward
_ACCUMULATOR = {Buf.Q: Buf.DQ, Buf.KV: Buf.DKV}


def validate_pass(plan: "Plan", backward: bool) -> None:
    """Run every rank's forward (or backward) program symbolically.

    Raises:
        PlanError: naming the rank, instruction and what is wrong.
    """
    _Symbolic(plan, backward).run()


class _RankState:
    def __init__(self, plan: "Plan", rank: int, backward: bool):
        self.rank = rank
        self.buf: dict[Buf, dict[int, Any]] = {b: {} for b in (Buf.Q, Buf.KV, Buf.OPART, Buf.DQ, Buf.DKV)}
        self.out: dict[Buf, dict[int, frozenset]] = {}
        self.launched: dict[int, CommLaunch] = {}
        home = plan.local_blocks(rank)
        self.home_order = home.tolist()
        self.home = set(self.home_order)
        lens = plan.workload.block_len[home]
        #: first row of every local block in the rank's inputs and outputs (local token order)
        self.local_row = dict(zip(self.home_order, (np.cumsum(lens) - lens).tolist()))
        self.buffer_rows = plan.program(rank, backward).buffer_rows


class _Symbolic:
    """Consumer of the instruction table (``on_*``) over tags; one generator per rank."""

    def __init__(self, plan: "Plan", backward: bool):
        self.plan = plan
        self.backward = backward
        self.mail: dict[tuple[int, int, int], list[tuple[Buf, list, list]]] = {}
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
        need_q: dict[int, set[int]] = {b: set() for b in range(wl.n_blocks)}
        need_kv: dict[int, set[int]] = {b: set() for b in range(wl.n_blocks)}
        for i, (q, kv) in enumerate(zip(wl.tile_q.tolist(), wl.tile_kv.tolist())):
            need_q[q].add(i)
            need_kv[kv].add(i)
        expected = ((Buf.OUT_DQ, need_q), (Buf.OUT_DKV, need_kv)) if self.backward else ((Buf.OUT, need_q),)
        for rank, outs in enumerate(finals):
            for name, need in expected:
                got = outs.get(name, {})
                for b, tiles in got.items():
                    if tiles != need[b]:
                        raise PlanError(f"rank {rank}: output {name.name} of block {b} covers {len(tiles)} of its "
                                        f"{len(need[b])} tiles")
                if set(got) != set(plan.local_blocks(rank).tolist()):
                    raise PlanError(f"rank {rank}: output {name.name} is not complete for its blocks")

    def _rank(self, rank: int) -> Generator[None, None, dict]:
        st = _RankState(self.plan, rank, self.backward)
        for ins in self.plan.program(rank, self.backward).instructions:
            step = dispatch(self, ins, st)
            if step is not None:
                yield from step
        if st.launched:
            self.fail(rank, None, f"phases {sorted(st.launched)} launched but never waited")
        return st.out

    def check_rows(self, st: _RankState, ins: Any, kind: Buf, row: int, block: int) -> None:
        """Fail unless block ``block`` at ``row`` lies inside the rank's buffer ``kind`` (the
        executor allocates ``buffer_rows[kind]`` rows)."""
        n = st.buffer_rows.get(kind)
        end = row + int(self.plan.workload.block_len[block])
        if n is None or row < 0 or end > n:
            self.fail(st.rank, ins, f"block {block} at rows {row}..{end - 1} of buffer {kind.name}, which has "
                                    f"{n or 0} rows")

    # ------------------------------------------------------------------ the table's handlers
    def on_copy(self, ins: BlockwiseCopy, st: _RankState) -> None:
        # the executor copies its local inputs in order: rows 0 .. S-1 of the inputs to the
        # same rows of the work buffer
        blocks = ins.blocks.tolist()
        if blocks != st.home_order[:len(blocks)] or not np.array_equal(ins.dst_rows, ins.src_rows):
            self.fail(st.rank, ins, f"copies blocks {blocks[:8]} from rows {ins.src_rows[:8].tolist()} to rows "
                                    f"{ins.dst_rows[:8].tolist()}; the executor copies the local blocks "
                                    f"{st.home_order[:8]} in local order, to the same rows")
        for b, src, dst in zip(blocks, ins.src_rows.tolist(), ins.dst_rows.tolist()):
            if src != st.local_row[b]:
                self.fail(st.rank, ins, f"copies block {b} from input row {src}; its tokens start at local row "
                                        f"{st.local_row[b]}")
            self.check_rows(st, ins, ins.kind, dst, b)
            st.buf[ins.kind][dst] = (ins.kind, b)
            if self.backward:
                acc = _ACCUMULATOR[ins.kind]
                self.check_rows(st, ins, acc, dst, b)
                st.buf[acc][dst] = (acc, b, frozenset())

    def on_launch(self, ins: CommLaunch, st: _RankState) -> None:
        rank = st.rank
        if ins.phase in st.launched:
            self.fail(rank, ins, f"phase {ins.phase} launched twice")
        st.launched[ins.phase] = ins
        by_peer: dict[int, list] = {}
        for tr in ins.sends:
            if tr.peer == rank:
                self.fail(rank, ins, "sends to itself")
            tags = []
            for b, row in zip(tr.blocks.tolist(), tr.rows.tolist()):
                tag = st.buf[tr.kind].get(row)
                if tag is None or tag[0] != tr.kind or tag[1] != b:
                    self.fail(rank, ins, f"sends block {b} ({tr.kind.name}) from row {row}, which holds {tag}")
                tags.append(tag)
            by_peer.setdefault(tr.peer, []).append((tr.kind, tr.blocks.tolist(), tags))
        blen = self.plan.workload.block_len
        for tr in ins.recvs:
            for b, row in zip(tr.blocks.tolist(), tr.rows.tolist()):
                self.check_rows(st, ins, tr.kind, row, b)
            if len(tr.rows) and not np.array_equal(tr.rows[1:], tr.rows[:-1] + blen[tr.blocks[:-1]]):
                self.fail(rank, ins, f"receives blocks {tr.blocks.tolist()[:8]} from rank {tr.peer} into rows "
                                     f"{tr.rows.tolist()[:8]}; the executor receives a message into one contiguous "
                                     "run of rows, in block order")
        for peer, msgs in by_peer.items():
            key = (ins.phase, rank, peer)
            if key in self.mail:
                self.fail(rank, ins, f"second message to rank {peer} in phase {ins.phase}")
            self.mail[key] = msgs
        self.events += 1

    def on_wait(self, ins: CommWait, st: _RankState) -> Generator[None, None, None]:
        rank = st.rank
        if ins.phase not in st.launched:
            self.fail(rank, ins, f"waits for phase {ins.phase}, never launched")
        launch = st.launched.pop(ins.phase)
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
                self.fail(rank, ins, f"phase {ins.phase}: rank {peer} sent {[(k.name, b) for k, b, _ in msgs]}, "
                                     f"expected {[(k.name, b) for k, b in expect]}")
            for tr, (_, _, tags) in zip(trs, msgs):
                for row, tag in zip(tr.rows.tolist(), tags):
                    st.buf[tr.kind][row] = tag
                    if self.backward and tr.kind in _ACCUMULATOR:
                        acc = _ACCUMULATOR[tr.kind]
                        st.buf[acc][row] = (acc, tag[1], frozenset())
        self.events += 1

    def on_attention(self, ins: BlockwiseAttention, st: _RankState) -> None:
        rank, wl, pl, plan = st.rank, self.plan.workload, self.plan.placement, self.plan
        for g in range(len(ins.q_block)):
            qb = int(ins.q_block[g])
            if st.buf[Buf.Q].get(int(ins.q_row[g])) != (Buf.Q, qb):
                self.fail(rank, ins, f"query block {qb} is not present at row {ins.q_row[g]}")
            lo, hi = ins.kv_ptr[g], ins.kv_ptr[g + 1]
            got: set[int] = set()
            for kb, kr, tile in zip(ins.kv_block[lo:hi].tolist(), ins.kv_row[lo:hi].tolist(), ins.tile[lo:hi].tolist()):
                if st.buf[Buf.KV].get(kr) != (Buf.KV, kb):
                    self.fail(rank, ins, f"key/value block {kb} is not present at row {kr}")
                if wl.tile_q[tile] != qb or wl.tile_kv[tile] != kb:
                    self.fail(rank, ins, f"tile {tile} is not ({qb}, {kb})")
                if pl.tile_rank[tile] != rank or plan.tile_division[tile] != ins.division:
                    self.fail(rank, ins, f"tile {tile} runs off its planned rank/division")
                self.computed[tile] += 1
                got.add(tile)
                if self.backward:
                    self._accumulate(rank, ins, st.buf[Buf.DKV], kr, Buf.DKV, kb, {tile})
            if self.backward:
                self._accumulate(rank, ins, st.buf[Buf.DQ], int(ins.out_row[g]), Buf.DQ, qb, got)
            else:
                self.check_rows(st, ins, Buf.OPART, int(ins.out_row[g]), qb)
                st.buf[Buf.OPART][int(ins.out_row[g])] = (Buf.OPART, qb, frozenset(got))

    def on_reduction(self, ins: BlockwiseReduction, st: _RankState) -> None:
        rank = st.rank
        src = st.buf[ins.src]
        for i, (b, drow) in enumerate(zip(ins.dst_block.tolist(), ins.dst_row.tolist())):
            union: set[int] = set()
            for srow in ins.src_row[ins.src_ptr[i]:ins.src_ptr[i + 1]].tolist():
                tag = src.get(srow)
                if tag is None or tag[1] != b:
                    self.fail(rank, ins, f"reduces row {srow} into block {b}, but it holds {tag}")
                if union & tag[2]:
                    self.fail(rank, ins, f"block {b}: a tile is counted twice")
                union |= tag[2]
            if ins.dst in st.buf:
                self.check_rows(st, ins, ins.dst, drow, b)
                st.buf[ins.dst][drow] = (ins.dst, b, frozenset(union))
            else:
                if b not in st.home:
                    self.fail(rank, ins, f"writes output of block {b}, which is not local")
                if drow != st.local_row[b]:
                    self.fail(rank, ins, f"writes output {ins.dst.name} of block {b} at row {drow}; its tokens "
                                         f"start at local row {st.local_row[b]}")
                st.out.setdefault(ins.dst, {})[b] = frozenset(union)

    def _accumulate(self, rank: int, ins: Any, buf: dict, row: int, name: Buf, block: int, tiles: set) -> None:
        tag = buf.get(row)
        if tag is None or tag[1] != block:
            self.fail(rank, ins, f"{name.name} accumulator of block {block} missing at row {row}")
        if tag[2] & tiles:
            self.fail(rank, ins, f"{name.name} of block {block}: a tile is counted twice")
        buf[row] = (name, block, tag[2] | frozenset(tiles))
