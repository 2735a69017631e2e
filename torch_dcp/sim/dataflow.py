"""Dataflow simulation: how fast a plan's placement and routes would run if every tile started
as soon as its inputs are on its rank, instead of in the plan's ``T`` divisions.

:func:`~torch_dcp.sim.simulate.simulate` runs the plan's programs: a rank computes division ``d``
once every input of the division has arrived, fetches for a division start one division ahead,
and a relay passes a block on one division after it received it. This module keeps the same
placement, routes, cost model and links, and drops those barriers:

* every transfer is one message per block and starts as soon as its data is on the sender (a
  block at its home at time 0, a relayed block when it arrives at the relay, a partial result
  when the sender's last tile of that block is done and every partial relayed through it has
  arrived); links serve transfers in the order they become ready (blocks that are ready at the
  same time: the one needed in the earliest division first), one at a time per port or rail,
  back-filling gaps, as in :mod:`torch_dcp.sim.timeline`;
* per-tile readiness (``kernels_per_rank=None``): a free rank runs its ready tile of the
  earliest division; a tile takes its FLOPs' share of its division's kernel time (the
  throughput of the whole division's launch: optimistic for small tiles);
* static kernels (``kernels_per_rank=K``): each rank runs its tiles in the order the per-tile
  run started them, cut into ``K`` launches of equal FLOPs; a launch starts when the previous
  one is done and every input of its tiles has arrived, and takes the cost model's time for the
  whole launch. This is what an executor with a fixed kernel order, one event per received
  block and relays sent on arrival could run.

Each rank first copies its local blocks into its work buffers (as its program does) and, once
its last kernel is done and every partial result for it has arrived, runs all of its
program's reductions (relays' pre-sends included: a little pessimistic); the pass ends when
the last rank is done. Both models show what a finer-grained executor would gain on a given
plan; the plan IR and the executor run divisions, so :func:`torch_dcp.sim.simulate.simulate` stays
the time a plan is chosen and reported by.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from ..cost import CostModel
from ..plan import Plan
from ..plan import BlockwiseCopy, BlockwiseReduction
from .timeline import _earliest_common_gap, _Link, _memory_seconds, _row_bytes, _transfer_links
from ..workload import Buf, item_token_bytes

__all__ = ["simulate_dataflow", "DataflowResult", "DataflowPass"]


@dataclasses.dataclass(frozen=True)
class DataflowPass:
    """One pass of a dataflow run.

    Attributes:
        makespan_s: time until the last rank has computed and every partial result is home.
        busy_s: float64 ``[world_size]``, kernel time per rank.
        tile_start_s: float64 ``[n_tiles]``, when each tile (its launch, with static kernels)
            started.
    """

    makespan_s: float
    busy_s: np.ndarray
    tile_start_s: np.ndarray


@dataclasses.dataclass(frozen=True)
class DataflowResult:
    """Forward and backward dataflow runs; ``makespan_s`` is their sum (seconds)."""

    forward: DataflowPass
    backward: DataflowPass
    makespan_s: float


def simulate_dataflow(plan: Plan, cost_model: CostModel | None = None,
                      kernels_per_rank: int | None = None) -> DataflowResult:
    """Run ``plan``'s tiles as soon as their inputs are present (see the module docstring).

    Args:
        cost_model: kernel and memory times (default: the A100 table).
        kernels_per_rank: ``None``: per-tile readiness; ``K >= 1``: ``K`` launches per rank in
            the per-tile run's order.

    Raises:
        ValueError: ``kernels_per_rank`` is not a positive integer.
    """
    if kernels_per_rank is not None and (isinstance(kernels_per_rank, bool) or not isinstance(kernels_per_rank, int)
                                         or kernels_per_rank < 1):
        raise ValueError(f"kernels_per_rank must be None or a positive integer, got {kernels_per_rank!r}")
    cm = cost_model or CostModel.a100()
    passes = []
    for backward in (False, True):
        run = _DataflowPass(plan, cm, backward).run()
        if kernels_per_rank is not None:
            run = _DataflowPass(plan, cm, backward, _kernels(plan, run.tile_start_s, kernels_per_rank, backward)).run()
        passes.append(run)
    return DataflowResult(passes[0], passes[1], passes[0].makespan_s + passes[1].makespan_s)


def _kernels(plan: Plan, start: np.ndarray, k: int, backward: bool) -> np.ndarray:
    """Launch index of every tile on its rank: the rank's tiles by start time, cut into ``k``
    runs of equal FLOPs (int64 ``[n_tiles]``)."""
    wl = plan.workload
    flops = wl.tile_flops_bwd if backward else wl.tile_flops_fwd
    tr = plan.placement.tile_rank
    out = np.zeros(len(tr), np.int64)
    order = np.lexsort((np.arange(len(tr)), start, tr))
    bounds = np.searchsorted(tr[order], np.arange(plan.world_size + 1))
    for a, b in zip(bounds[:-1], bounds[1:]):
        sel = order[a:b]
        if len(sel) == 0:
            continue
        f = flops[sel].astype(np.float64)
        before = (np.cumsum(f) - f) / max(float(f.sum()), 1e-300)  # FLOPs share before each tile
        out[sel] = np.minimum((before * k + 1e-9).astype(np.int64), k - 1)
    return out


class _DataflowPass:
    """Event-driven run of one pass; ``kernel_of`` (launch index per tile) selects static
    kernels, ``None`` per-tile readiness."""

    def __init__(self, plan: Plan, cm: CostModel, backward: bool, kernel_of: np.ndarray | None = None):
        self.plan, self.cm, self.backward = plan, cm, backward
        wl, pl, b = plan.workload, plan.placement, plan.batch
        self.itb = item_token_bytes(b)
        self.blen = wl.block_len
        self.w = plan.world_size
        self.tr = pl.tile_rank
        n = len(self.tr)
        flops = wl.tile_flops_bwd if backward else wl.tile_flops_fwd
        # launches: per tile (its division's kernel time by FLOPs share), or the static kernels
        group = plan.tile_division if kernel_of is None else kernel_of
        n_groups = int(group.max(initial=0)) + 1
        cell = self.tr * n_groups + group
        self.cost = np.zeros(n)
        order = np.argsort(cell, kind="stable")
        bounds = np.nonzero(np.diff(cell[order]))[0] + 1
        self.launches: list[np.ndarray] = []
        for sel in np.split(order, bounds) if n else []:
            f = float(flops[sel].sum())
            secs = cm.attention_seconds(float(wl.tile_pairs[sel].sum()) * b.n_heads, f, backward,
                                        not bool(wl.tile_full[sel].all()), b.head_dim, b.dtype)
            if kernel_of is None:
                self.cost[sel] = secs * flops[sel] / f if f > 0 else 0.0
            else:
                self.launches.append(sel)
                self.cost[sel[0]] = secs
        self.static = kernel_of is not None
        # memory-bound instructions of every rank's program: copies before, reductions after
        row_bytes = _row_bytes(self.itb, backward)
        self.copy_s, self.reduce_s = np.zeros(self.w), np.zeros(self.w)
        for r in range(self.w):
            for ins in plan.program(r, backward).instructions:
                if isinstance(ins, BlockwiseCopy):
                    self.copy_s[r] += _memory_seconds(cm, ins, self.blen, row_bytes)
                elif isinstance(ins, BlockwiseReduction):
                    self.reduce_s[r] += _memory_seconds(cm, ins, self.blen, row_bytes)
        # priority: the plan's division order on every rank
        prio = np.empty(n, np.int64)
        prio[np.lexsort((wl.tile_kv, wl.tile_q, plan.tile_division))] = np.arange(n)
        self.prio = prio
        self.links: dict[tuple, _Link] = {}
        self.events: list[tuple] = []
        self.seq = 0

    def _push(self, t: float, kind: str, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def _send(self, src: int, dst: int, nbytes: float, ready: float) -> float:
        used, inter = _transfer_links(self.plan.topology, self.links, src, dst)
        dur = self.cm.transfer_seconds(nbytes, self.plan.topology, inter)
        start = _earliest_common_gap(used, ready, dur)
        for lk in used:
            lk.reserve(start, start + dur)
        return start + dur

    def run(self) -> DataflowPass:
        plan, wl, t = self.plan, self.plan.workload, self.plan.tables
        br = plan.placement.block_rank
        tr, n, w = self.tr, len(self.tr), self.w
        kinds = (Buf.Q, Buf.KV)
        tile_blocks = (wl.tile_q, wl.tile_kv)
        # fetches passed on by (sender, kind, block), in the order the consumers need them
        fr, fk, fb, fs, fd = t["fetch_rank"], t["fetch_kind"], t["fetch_block"], t["fetch_src"], t["fetch_div"]
        forward_to: dict[tuple[int, int, int], list[int]] = {}
        for i in np.lexsort((fb, fk, fr, fd)).tolist():
            forward_to.setdefault((int(fs[i]), int(fk[i]), int(fb[i])), []).append(i)
        # tiles waiting for (rank, kind, block)
        missing = np.zeros(n, np.int64)
        waiting: dict[tuple[int, int, int], list[int]] = {}
        for k, tb in enumerate(tile_blocks):
            remote = np.nonzero(br[tb] != tr)[0]
            missing[remote] += 1
            for i in remote.tolist():
                waiting.setdefault((int(tr[i]), k, int(tb[i])), []).append(i)
        # partial results: (side, rank, block) -> tiles and relayed partials still to come
        sides = [("q", Buf.DQ if self.backward else Buf.OPART, wl.tile_q)]
        if self.backward:
            sides.append(("kv", Buf.DKV, wl.tile_kv))
        next_hop: dict[tuple[str, int, int], tuple[int, float]] = {}
        outstanding: dict[tuple[str, int, int], int] = {}
        for side, kind, tb in sides:
            for key in zip([side] * n, tr.tolist(), tb.tolist()):
                outstanding[key] = outstanding.get(key, 0) + 1
            rr, rb, rt = t[f"ret_{side}_rank"], t[f"ret_{side}_block"], t[f"ret_{side}_dst"]
            for r, blk, dst in zip(rr.tolist(), rb.tolist(), rt.tolist()):
                next_hop[(side, r, blk)] = (dst, float(self.blen[blk] * self.itb[(self.backward, kind)]))
                outstanding[(side, dst, blk)] = outstanding.get((side, dst, blk), 0) + 1
        ready: list[list[tuple[int, int]]] = [[] for _ in range(w)]
        seq_of = [[] for _ in range(w)]  # static: each rank's launches in order
        if self.static:
            for sel in self.launches:  # by (rank, launch index)
                seq_of[int(tr[sel[0]])].append(sel)
        pos = [0] * w
        running = [False] * w
        busy = self.copy_s.copy()
        done_at = self.copy_s.copy()  # per rank: last kernel done or last partial for it arrived
        start = np.zeros(n)

        def arrive(r: int, k: int, blk: int, now: float) -> None:
            for i in forward_to.get((r, k, blk), []):
                end = self._send(r, int(fr[i]), float(self.blen[blk] * self.itb[(self.backward, kinds[k])]), now)
                self._push(end, "arrive", (int(fr[i]), k, blk))
            for i in waiting.get((r, k, blk), []):
                missing[i] -= 1
                if missing[i] == 0:
                    heapq.heappush(ready[r], (int(self.prio[i]), i))

        def partial(key: tuple[str, int, int], now: float) -> None:
            outstanding[key] -= 1
            if outstanding[key]:
                return
            if key in next_hop:
                dst, nbytes = next_hop[key]
                self._push(self._send(key[1], dst, nbytes, now), "partial", (key[0], dst, key[2]))
            else:
                done_at[key[1]] = max(done_at[key[1]], now)

        for key in [key for key in next_hop if not outstanding.get(key)]:
            outstanding[key] = 1  # nothing computed here: sent at once (ring routes pass such sums on)
            partial(key, 0.0)
        for i in np.nonzero(missing == 0)[0].tolist():
            heapq.heappush(ready[int(tr[i])], (int(self.prio[i]), i))
        home = [(int(br[i]), k, i) for i in range(wl.n_blocks) for k in (0, 1)]
        # blocks at home at time 0: released in the order their first consumers need them
        first_need = {key: min(int(fd[j]) for j in js) for key, js in forward_to.items()}
        for r, k, blk in sorted(home, key=lambda h: (first_need.get(h, 1 << 30), self.copy_s[h[0]], h)):
            arrive(r, k, blk, float(self.copy_s[r]))
        for r in range(w):
            self._push(float(self.copy_s[r]), "free", r)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                r = payload[0]
                arrive(*payload, now)
                if not running[r]:
                    self._push(now, "free", r)
            elif kind == "partial":
                partial(payload, now)
            elif kind == "done":
                r, tiles = payload
                running[r] = False
                done_at[r] = max(done_at[r], now)
                for side, _, tb in sides:
                    for i in tiles:
                        partial((side, r, int(tb[i])), now)
                self._push(now, "free", r)
            else:  # a rank is free: start its next launch if it can
                r = payload
                if running[r]:
                    continue
                if self.static:
                    if pos[r] == len(seq_of[r]) or missing[seq_of[r][pos[r]]].any():
                        continue
                    tiles = seq_of[r][pos[r]].tolist()
                    pos[r] += 1
                else:
                    if not ready[r]:
                        continue
                    tiles = [heapq.heappop(ready[r])[1]]
                dur = float(self.cost[tiles].sum())
                start[tiles] = now
                busy[r] += dur
                running[r] = True
                self._push(now + dur, "done", (r, tiles))
        left = [key for key, v in outstanding.items() if v]
        if left or (self.static and any(pos[r] < len(seq_of[r]) for r in range(w))) or (missing > 0).any():
            raise RuntimeError(f"dataflow run stalled: partial results {left[:3]} or tiles never ran "
                               "(routes that do not deliver every input)")
        busy += self.reduce_s
        return DataflowPass(float((done_at + self.reduce_s).max(initial=0.0)), busy, start)
