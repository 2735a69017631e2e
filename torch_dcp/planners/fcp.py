"""FCP, reproduced as a planner (seed: fcp-talk.md).

* Block distributor: documents are cut into fixed-size blocks (``block_size``); blocks are
  assigned longest-processing-time first (their query rows' FLOPs, largest first) to the
  rank with the lowest score ``load + bytes_per_flop^-1 * traffic`` among the ranks with
  memory room: compute balance first, the traffic the assignment adds (key/value blocks
  of already-placed neighbours that would have to move) weighed in through the cluster's
  compute-to-communication ratio, memory within ``1 + eps_memory`` of the mean. Tiles
  follow their queries, so key/value blocks travel.
* Communication planner: the key/value transfers form a bipartite multigraph senders ×
  receivers; repeated maximum bipartite matching (SciPy, Hopcroft-Karp) cuts it into
  congestion-free rounds in which every rank sends at most one block and receives at most
  one. A tile runs in the round after its input arrives (block-wise pipelining): round ``k``
  of the transfers becomes scheduling round ``k + 1`` of the plan, local tiles round 0.
"""

from __future__ import annotations

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from ..workload import Buf, Workload, item_token_bytes
from .base import Placement

__all__ = ["plan_fcp", "fcp_layout", "congestion_free_rounds"]

#: FLOPs one byte of traffic is worth in the assignment score (the talk's GPU-Y cluster:
#: (FLOP/s) / (byte/s) = 2500).
FLOPS_PER_BYTE = 2500.0


def congestion_free_rounds(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Round of every transfer ``src[i] -> dst[i]`` such that in each round every rank sends
    at most one transfer and receives at most one (repeated maximum bipartite matching).

    Returns int64 ``[n]``.
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_bipartite_matching

    src = np.asarray(src, np.int64)
    dst = np.asarray(dst, np.int64)
    n = len(src)
    rounds = np.full(n, -1, np.int64)
    if n == 0:
        return rounds
    size = int(max(src.max(), dst.max())) + 1
    r = 0
    while (rounds < 0).any():
        pending = np.nonzero(rounds < 0)[0]
        # one edge per (sender, receiver) pair: the first pending transfer between them
        pair = src[pending] * size + dst[pending]
        uniq, first = np.unique(pair, return_index=True)
        s, d = uniq // size, uniq % size
        graph = csr_matrix((np.ones(len(uniq)), (s, d)), shape=(size, size))
        match = maximum_bipartite_matching(graph, perm_type="column")  # sender -> receiver
        senders = np.nonzero(match >= 0)[0]
        chosen = pending[first[np.searchsorted(uniq, senders * size + match[senders])]]
        rounds[chosen] = r
        r += 1
    return rounds


def plan_fcp(batch: BatchSpec, topology: Topology, block_size: int = 1024, eps_memory: float = 0.1) -> Placement:
    """FCP placement and congestion-free transfer rounds (see module docstring).

    Raises:
        ValueError: bad ``block_size`` or a negative ``eps_memory``.
    """
    wl, home = fcp_layout(batch, topology, block_size, eps_memory)
    nb, w = wl.n_blocks, topology.world_size
    tile_rank = home[wl.tile_q]
    # congestion-free rounds of the key/value transfers; a tile runs in the round after its
    # input arrives
    remote = home[wl.tile_kv] != tile_rank
    pair_code = tile_rank[remote] * nb + wl.tile_kv[remote]
    uniq, inv = np.unique(pair_code, return_inverse=True)
    dst, blk = uniq // nb, uniq % nb
    rounds = congestion_free_rounds(home[blk], dst)
    tile_round = np.zeros(wl.n_tiles, np.int64)
    tile_round[np.nonzero(remote)[0]] = rounds[inv.reshape(-1)] + 1
    return Placement(wl, w, home, tile_rank, planner="fcp", tile_round=tile_round)


def fcp_layout(batch: BatchSpec, topology: Topology, block_size: int = 1024,
               eps_memory: float = 0.1) -> tuple[Workload, np.ndarray]:
    """FCP's block layout alone (no transfer rounds): the uniform workload and every block's
    rank, int64 ``[n_blocks]`` (longest-processing-time order, locality-aware, memory within
    ``1 + eps_memory`` of the mean where it fits).

    Raises:
        ValueError: bad ``block_size`` or a negative ``eps_memory``.
    """
    if eps_memory < 0:
        raise ValueError(f"eps_memory must be >= 0, got {eps_memory}")
    w = topology.world_size
    wl = Workload.uniform(batch, block_size)
    nb = wl.n_blocks
    flops = wl.tile_flops_fwd + wl.tile_flops_bwd
    row_flops = np.bincount(wl.tile_q, weights=flops, minlength=nb)
    itb = item_token_bytes(batch)
    kv_bytes = wl.block_len * float(itb[(False, Buf.KV)] + itb[(True, Buf.KV)] + itb[(True, Buf.DKV)])
    # neighbours: (q, kv) pairs of distinct blocks, both directions
    off = wl.tile_q != wl.tile_kv
    nq, nkv = wl.tile_q[off], wl.tile_kv[off]
    # for block b: as a query row it needs kv blocks nkv (weight kv_bytes[kv]); as a key/value
    # block it is needed by query rows nq (weight kv_bytes[b])
    nbr = np.concatenate([nkv, nq])
    owner = np.concatenate([nq, nkv])
    weight = np.concatenate([kv_bytes[nkv], kv_bytes[nkv]])
    order_n = np.argsort(owner, kind="stable")
    nbr, owner, weight = nbr[order_n], owner[order_n], weight[order_n]
    ptr = np.concatenate(([0], np.cumsum(np.bincount(owner, minlength=nb))))

    cap = (1.0 + eps_memory) * batch.total_tokens / w
    load = np.zeros(w)
    tokens = np.zeros(w)
    home = np.full(nb, -1, np.int64)
    for b in np.lexsort((np.arange(nb), -row_flops)):
        lo, hi = ptr[b], ptr[b + 1]
        placed = home[nbr[lo:hi]] >= 0
        kept = np.bincount(home[nbr[lo:hi]][placed], weights=weight[lo:hi][placed], minlength=w)
        traffic = weight[lo:hi][placed].sum() - kept
        score = load + traffic * FLOPS_PER_BYTE
        room = tokens + wl.block_len[b] <= cap
        r = int(np.argmin(np.where(room, score, np.inf))) if room.any() else int(np.argmin(tokens))
        home[b] = r
        load[r] += row_flops[b]
        tokens[r] += wl.block_len[b]
    return wl, home
