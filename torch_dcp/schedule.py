"""Division scheduling: group each rank's tiles into ``T`` divisions (DCP paper §4.3, Listing 3).

Division 0 holds the tiles whose inputs are all local, so it runs while the first transfers
are in flight. The remaining tiles are ordered so that tiles sharing a remote input are
adjacent, and cut into divisions ``1 .. T-1`` by the cumulative remote input cost (bytes,
weighted by link class when a topology is given: an inter-node byte costs what it takes on
the rank's share of the node's links); a remote block is fetched once, in the first division
that needs it, and stays for later divisions. Divisions ``1 .. T-2`` fetch equal shares and
the last one half a share (:func:`division_shares`): partial outputs and gradients return
home right after the last division that uses them (the plan compiler launches those
transfers there), overlapping the remaining compute, but the last division's partials have no
compute left to hide behind, and they are larger than the inputs (accumulation dtype; dQ and
dK/dV both). On the paper's microbenchmark batches (DGX H100 and A100 presets, ``T = 4``) the
halved last division is 3-7 % faster in the simulator than equal shares on most causal and
sparse batches. With ``T == 1`` everything is one division.

With a *local tail* (``local_tail = f > 0``, ``T >= 3``) the last division instead runs the last
fraction ``f`` of each rank's local compute (tiles whose inputs are all local, by FLOPs) and the
remote tiles fill divisions ``1 .. T-2``: every partial result then travels home while the
local tail computes, at the price of one division fewer to pipeline the fetches. That wins
where few bytes cross but their returns are slow (sparse masks, a few blocks over a single
network rail: up to 14 % less simulated time on the paper's A100 batches) and loses where the
fetches need every division (causal batches); :func:`torch_dcp.plan` times both on the
simulator for dcp's chosen placement and keeps the faster (on four A100 batches where the
tail wins, timing it for every candidate placement found nothing faster). The remote
divisions keep the halved last share: equal shares were 1-12 % slower with the tail.

With *node first* (``node_first=True``, ``T >= 3``, a topology of several nodes) a rank's remote
tiles whose inputs all live in its own node run in division 1, and the tiles with an input from
another node fill divisions ``2 .. T-1`` (cut as above): the fast intra-node fetches open the
pass, and the compute they feed hides the first inter-node fetches, which otherwise only the
local division 0 would hide (a causal document split over many ranks leaves each rank little
local work). A rank without such intra-node tiles keeps the plain cut. On the paper's 8 causal
batches over 4 x 8 A100s (GQA 8/2), dcp's chosen placement divided node first at ``T = 6`` ran
0.5-14 % faster in the simulator than its plain cut at ``T = 4``; some λ and shared-question
batches run slower, so :func:`torch_dcp.plan` times it as an alternative for dcp's chosen
placement and keeps it where faster.
"""

from __future__ import annotations

import numpy as np

from .planners.base import Placement
from .topology import Topology
from .workload import Buf, item_token_bytes

__all__ = ["assign_divisions", "division_shares", "fetch_item_bytes", "mixes_nodes", "node_tiers"]


def fetch_item_bytes(placement: Placement) -> tuple[np.ndarray, np.ndarray]:
    """Forward bytes to fetch a remote query block and a remote key/value block.

    Returns ``(q_bytes, kv_bytes)``, float64 ``[n_blocks]`` each.
    """
    wl = placement.workload
    itb = item_token_bytes(wl.batch)
    return wl.block_len * float(itb[(False, Buf.Q)]), wl.block_len * float(itb[(False, Buf.KV)])


def division_shares(divisions: int) -> np.ndarray:
    """Shares of a rank's remote input cost fetched by divisions ``1 .. T-1``: equal, but the
    last one half (float64 ``[T - 1]``, summing to 1; empty for ``T == 1``)."""
    if divisions < 2:
        return np.zeros(0)
    w = np.full(divisions - 1, 2.0)
    w[-1] = 1.0
    return w / w.sum()


def assign_divisions(placement: Placement, divisions: int, topology: Topology | None = None,
                     local_tail: float = 0.0, node_first: bool = False) -> np.ndarray:
    """Division of every tile on its rank.

    With scheduling rounds (``placement.tile_round``, e.g. FCP's transfer rounds), round ``r`` gets its
    own divisions ``r T .. r T + T - 1``: rounds run one after another.

    Args:
        placement: blocks and tiles on ranks.
        divisions: ``T >= 1`` per round.
        topology: when given, each fetched byte is weighted by its link's time (inter-node
            bytes over the rank's share of the node's network links, intra-node bytes over
            the intra-node bandwidth), so divisions carry equal communication time rather
            than equal bytes.
        local_tail: fraction in ``[0, 1)`` of each rank's local compute run in the last
            division, after every remote tile (module docstring); 0 (default) or ``T < 3``:
            none.
        node_first: remote tiles with inputs from the rank's own node only in division 1, those
            with an input from another node in ``2 .. T-1`` (module docstring); needs
            ``topology`` (ignored on one node, for ``T < 3`` and with a local tail).

    Returns:
        int64 ``[n_tiles]`` in ``[0, T * n_rounds)``.

    Raises:
        ValueError: ``divisions`` is not a positive integer, ``local_tail`` is outside ``[0, 1)``,
            or ``node_first`` without a topology.
    """
    if isinstance(divisions, bool) or not isinstance(divisions, (int, np.integer)) or divisions < 1:
        raise ValueError(f"divisions must be a positive integer, got {divisions!r}")
    if not 0.0 <= local_tail < 1.0:
        raise ValueError(f"local_tail must lie in [0, 1), got {local_tail!r}")
    if node_first and topology is None:
        raise ValueError("node_first needs the topology (which ranks share a node)")
    cut = _node_first if node_first and local_tail == 0 and topology.n_nodes > 1 else _divisions
    n = placement.workload.n_tiles
    out = np.zeros(n, np.int64)
    rounds = placement.tile_round
    if rounds is None:
        out[:] = cut(placement, np.arange(n), divisions, topology, local_tail)
        return out
    for r in np.unique(rounds):
        tiles = np.nonzero(rounds == r)[0]
        out[tiles] = r * divisions + cut(placement, tiles, divisions, topology, local_tail)
    return out


def _node_first(placement: Placement, tiles: np.ndarray, divisions: int, topology: Topology,
                local_tail: float) -> np.ndarray:
    """Divisions with each rank's remote tiles fed from its own node only in division 1 and
    those with an input from another node in ``2 .. T-1``; a rank without the former keeps the
    plain cut (:func:`_divisions`)."""
    if divisions < 3 or len(tiles) == 0:
        return _divisions(placement, tiles, divisions, topology, local_tail)
    in_node, inter = node_tiers(placement, topology, tiles)
    on = _ranks_with_both(placement, tiles, in_node, inter)[placement.tile_rank[tiles]]
    out = np.zeros(len(tiles), np.int64)
    plain = np.nonzero(~on)[0]  # each rank's cut depends on its own tiles only
    out[plain] = _divisions(placement, tiles[plain], divisions, topology, local_tail)
    out[on & in_node] = 1
    far = np.nonzero(on & inter)[0]
    out[far] = 1 + _divisions(placement, tiles[far], divisions - 1, topology, 0.0)
    return out


def node_tiers(placement: Placement, topology: Topology,
               tiles: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Where the inputs of every tile (of ``tiles``, default all) come from: ``(in_node,
    inter)``, bool arrays over the tiles: remote inputs from the tile's rank's own node only, and
    an input from another node (a tile with both inputs on its rank is neither)."""
    wl = placement.workload
    tiles = np.arange(wl.n_tiles) if tiles is None else tiles
    rank = placement.tile_rank[tiles]
    q_home, kv_home = placement.block_rank[wl.tile_q[tiles]], placement.block_rank[wl.tile_kv[tiles]]
    node = topology.node_of(rank)
    inter = (topology.node_of(q_home) != node) | (topology.node_of(kv_home) != node)
    return ~inter & ((q_home != rank) | (kv_home != rank)), inter


def _ranks_with_both(placement: Placement, tiles: np.ndarray, in_node: np.ndarray, inter: np.ndarray) -> np.ndarray:
    """bool ``[world_size]``: ranks running some of ``tiles`` of each tier."""
    rank, w = placement.tile_rank[tiles], placement.world_size
    return (np.bincount(rank[in_node], minlength=w) > 0) & (np.bincount(rank[inter], minlength=w) > 0)


def mixes_nodes(placement: Placement, topology: Topology) -> bool:
    """Whether a node-first schedule of ``placement`` differs from the plain cut: several nodes,
    and some rank runs both tiles fed from its own node only and tiles with an input from
    another node."""
    if topology.n_nodes < 2:
        return False
    tiles = np.arange(placement.workload.n_tiles)
    return bool(_ranks_with_both(placement, tiles, *node_tiers(placement, topology, tiles)).any())


def _local_tail(placement: Placement, tiles: np.ndarray, divisions: int, topology: Topology | None,
                fraction: float) -> np.ndarray:
    """Divisions with the remote tiles in ``1 .. T-2`` and the last ``fraction`` of every
    rank's local compute (in tile order, by forward + backward FLOPs) in ``T - 1``."""
    out = _divisions(placement, tiles, divisions - 1, topology, 0.0)
    wl = placement.workload
    rank = placement.tile_rank[tiles]
    local = np.nonzero((placement.block_rank[wl.tile_q[tiles]] == rank)
                       & (placement.block_rank[wl.tile_kv[tiles]] == rank))[0]
    if len(local) == 0:
        return out
    order = local[np.argsort(rank[local], kind="stable")]
    flops = (wl.tile_flops_fwd + wl.tile_flops_bwd)[tiles[order]]
    done, total = _rank_prefix(rank[order], flops, placement.world_size)
    out[order[done >= (1.0 - fraction) * total - 1e-9 * total]] = divisions - 1
    return out


def _rank_prefix(r: np.ndarray, weights: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """For items sorted by rank ``r``: ``(weight of the rank's earlier items, the rank's total
    weight)`` of every item."""
    cum = np.cumsum(weights)
    before = np.concatenate(([0.0], cum))[np.searchsorted(r, r, side="left")]
    return cum - weights - before, np.bincount(r, weights=weights, minlength=world_size)[r]


def _divisions(placement: Placement, tiles: np.ndarray, divisions: int, topology: Topology | None,
               local_tail: float) -> np.ndarray:
    """Divisions (``[0, T)``) of the tiles ``tiles`` (a set scheduled together)."""
    if local_tail > 0 and divisions >= 3:
        return _local_tail(placement, tiles, divisions, topology, local_tail)
    wl = placement.workload
    out = np.zeros(len(tiles), np.int64)
    if divisions == 1 or len(tiles) == 0:
        return out
    rank = placement.tile_rank[tiles]
    q_remote = placement.block_rank[wl.tile_q[tiles]] != rank
    kv_remote = placement.block_rank[wl.tile_kv[tiles]] != rank
    remote = np.nonzero(q_remote | kv_remote)[0]
    if len(remote) == 0:
        return out
    q_bytes, kv_bytes = fetch_item_bytes(placement)
    nb = wl.n_blocks
    # remote inputs as integer keys; a local input gets a key that never counts
    kv_key = np.where(kv_remote[remote], wl.tile_kv[tiles[remote]], -1)
    q_key = np.where(q_remote[remote], wl.tile_q[tiles[remote]], -1)
    r = rank[remote]
    order = np.lexsort((q_key, kv_key, r))  # group by rank, then shared key/value input, then query
    remote, kv_key, q_key, r = remote[order], kv_key[order], q_key[order], r[order]
    n_r = len(remote)

    def first_use_bytes(keys: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        # bytes of input `keys` charged at its first use on each rank (0 for local / repeats)
        valid = keys >= 0
        code = np.where(valid, r * (nb + 1) + keys, -1)
        _, first = np.unique(code, return_index=True)
        charge = np.zeros(n_r)
        first = first[code[first] >= 0]
        charge[first] = nbytes[keys[first]]
        if topology is not None:
            inter = topology.node_of(placement.block_rank[keys[first]]) != topology.node_of(r[first])
            charge[first] *= np.where(inter, topology.ranks_per_node / topology.inter_bandwidth,
                                      1.0 / topology.intra_bandwidth)
        return charge

    new_bytes = first_use_bytes(kv_key, kv_bytes) + first_use_bytes(q_key, q_bytes)
    done, total = _rank_prefix(r, new_bytes, placement.world_size)
    frac = np.where(total > 0, done / np.where(total > 0, total, 1), 0.0)
    bounds = np.cumsum(division_shares(divisions))[:-1]  # where divisions 2 .. T-1 start
    div = 1 + np.searchsorted(bounds, frac + 1e-9, side="right")
    out[remote] = np.clip(div, 1, divisions - 1)
    return out
