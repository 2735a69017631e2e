"""Megatron-Core's dynamic context parallelism, reproduced as a planner (seeds:
megatron-cp-hcp-dcp-notes.md, "Runtime CP size decision: BalancedCPScheduler", and
megatron-dynamic-cp-blog.md).

Every document gets a power-of-two CP group size from its length,
``cp = next_pow2(ceil(L / max_seqlen_per_rank))`` (at most the world size), and a per-rank cost
``L^2 / cp``. A scheduling round packs documents onto the ranks:

1. bucket documents by CP size, largest size first;
2. greedy fill: inside a bucket, documents go in order into the current group (aligned runs
   of ``cp`` ranks, starting with free ones) while its per-rank load stays within the
   bucket's fair share (bucket work / groups free for it), then into the next free group; a
   document that fits no free group joins the least-loaded group of its size;
3. the round closes when its columns are balanced (equal loads on all ranks) or the
   documents run out; the buckets left go to the next round;
4. trim: if the tallest column exceeds the round's mean by more than ``trim_tolerance`` and
   its last-placed document leaves the column no lower than the others when removed, that
   document goes back to the queue (next round);
5. fill idle ranks: while ranks are idle in a round, the smallest group whose neighbours are
   idle doubles its reach (its documents' CP size doubles);
6. repeat per round.

Inside a group a document is split zig-zag over its ``cp`` ranks (``2 cp`` chunks), tiles
follow their queries, and the group runs ring attention, as Megatron-Core does with
TransformerEngine's context parallelism: ``cp`` steps, key/value chunks (and dK/dV partials
in the backward) passed to the next rank of the group
(:attr:`~torch_dcp.planners.base.Routing.RING` with one ring per group). Rounds run one after
another, each its own run of divisions (as many as its largest group has ranks), separated
like Megatron's barriers.
"""

from __future__ import annotations

import math

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from ..workload import Workload, check_block_size
from .base import Placement, Routing
from .ring import zigzag_spans

__all__ = ["plan_megatron", "megatron_schedule"]


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def megatron_schedule(lengths: list[int] | np.ndarray, world_size: int, max_seqlen_per_rank: int,
                      trim_tolerance: float = 0.5) -> list[list[tuple[int, int, int]]]:
    """Megatron's BalancedCPScheduler on document lengths.

    Returns rounds; each round a list of ``(document, first_rank, cp_size)``.

    Raises:
        ValueError: non-positive ``max_seqlen_per_rank`` or ``world_size``.
    """
    if max_seqlen_per_rank <= 0 or world_size <= 0:
        raise ValueError(f"max_seqlen_per_rank and world_size must be positive, got {max_seqlen_per_rank}, {world_size}")
    lengths = [int(x) for x in lengths]
    top = 1 << int(math.log2(world_size))  # the largest power-of-two group that fits
    cp = [min(_next_pow2(math.ceil(n / max_seqlen_per_rank)), top) for n in lengths]
    queue = sorted(range(len(lengths)), key=lambda d: (-cp[d], -lengths[d], d))
    rounds: list[list[tuple[int, int, int]]] = []
    while queue:
        load = np.zeros(world_size)
        used = np.zeros(world_size, bool)
        placed: list[tuple[int, int, int]] = []
        for size in sorted({cp[d] for d in queue}, reverse=True):
            bucket = [d for d in queue if cp[d] == size]
            existing = sorted({s for (_, s, c) in placed if c == size})
            free = [s for s in range(0, world_size - size + 1, size) if not used[s:s + size].any()]
            groups = existing + free
            if not groups:
                continue  # this size waits for the next round
            share = sum(lengths[d] ** 2 / size for d in bucket) / len(groups)
            gi = 0
            for d in bucket:
                cost = lengths[d] ** 2 / size
                while gi < len(groups) and load[groups[gi]] > 0 and load[groups[gi]] + cost > share * (1 + 1e-9):
                    gi += 1
                s = groups[gi] if gi < len(groups) else min(groups, key=lambda g: (load[g], g))
                placed.append((d, s, size))
                load[s:s + size] += cost
                used[s:s + size] = True
            if used.all() and np.ptp(load) <= 1e-9 * load.max():
                break  # balanced: close the round
        # trim overshoot: the last document of the tallest column goes back if that evens out
        if len(placed) > 1:
            d, s, size = placed[-1]
            cost = lengths[d] ** 2 / size
            if load[s] > (1 + trim_tolerance) * load.mean():
                after = load.copy()
                after[s:s + size] -= cost
                if np.ptp(after) < np.ptp(load):
                    placed.pop()
                    load = after
        # fill idle ranks: double the reach of the smallest group whose buddy ranks are idle
        used = load > 0
        grown = True
        while grown and not used.all():
            grown = False
            for i in sorted(range(len(placed)), key=lambda i: (placed[i][2], load[placed[i][1]], i)):
                d, s, size = placed[i]
                lo = (s // (2 * size)) * (2 * size)
                if lo + 2 * size > world_size or used[lo:lo + 2 * size].sum() != size:
                    continue
                if any(c == size and ss != s and lo <= ss < lo + 2 * size for _, ss, c in placed):
                    continue
                load[s:s + size] -= lengths[d] ** 2 / size
                load[lo:lo + 2 * size] += lengths[d] ** 2 / (2 * size)
                placed[i] = (d, lo, 2 * size)
                used = load > 0
                grown = True
                break
        rounds.append(placed)
        done = {d for d, _, _ in placed}
        queue = [d for d in queue if d not in done]
    return rounds


def plan_megatron(batch: BatchSpec, topology: Topology, block_size: int | None = None,
                  max_seqlen_per_rank: int | None = None, trim_tolerance: float = 0.5) -> Placement:
    """Megatron dynamic-CP placement (see module docstring).

    Args:
        max_seqlen_per_rank: tokens one rank holds of a document before it needs a bigger CP
            group; default ``ceil(total_tokens / world_size)``.
        block_size: not used (chunks are ``L / 2 cp``), but it must be ``None`` or a valid
            block size, as for every planner.

    Raises:
        ValueError: ``block_size`` is not ``None`` or an integer in ``1 .. MAX_TOKENS``.
    """
    if block_size is not None:
        check_block_size(block_size)
    w = topology.world_size
    m = max_seqlen_per_rank or -(-batch.total_tokens // w)
    rounds = megatron_schedule(batch.doc_lens, w, m, trim_tolerance)
    doc_rank0 = np.zeros(batch.n_docs, np.int64)
    doc_cp = np.ones(batch.n_docs, np.int64)
    doc_round = np.zeros(batch.n_docs, np.int64)
    for r, placed in enumerate(rounds):
        for d, s, c in placed:
            doc_rank0[d], doc_cp[d], doc_round[d] = s, c, r
    # zig-zag chunks of every document over its group
    doc, start, end, member = zigzag_spans(batch.doc_lens, doc_cp)
    wl = Workload.from_spans(batch, doc, start, end)  # blocks in (doc, start) order: the spans' order
    block_rank = doc_rank0[doc] + member
    tile_rank = block_rank[wl.tile_q]
    # round r's divisions start after every earlier round's steps (its largest group's size)
    steps = np.zeros(len(rounds), np.int64)
    np.maximum.at(steps, doc_round, doc_cp)
    first_div = np.concatenate(([0], np.cumsum(steps)[:-1]))[doc_round]
    groups = np.stack([doc_rank0, doc_cp, first_div], axis=1)
    return Placement(wl, w, block_rank, tile_rank, planner="megatron",
                     routing=Routing.RING, ring_groups=groups)
