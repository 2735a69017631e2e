"""The DCP planner: hypergraph partitioning of tiles and token blocks (DCP paper §4.2).

Hypergraph:

* vertices: every tile (weight: its FLOPs) and every token block (weight: its resident
  bytes). A block vertex carries its Q, K, V, O, LSE and the token-level layers of its
  tokens, so they stay together.
* nets: for every block ``b``, a query net (``b`` and all tiles with query block ``b``) and a
  key/value net (``b`` and all tiles with key/value block ``b``), weighted by the bytes one
  extra rank on the net costs, forward and backward (query net: Q fetch, O partial + LSE
  return, Q/dO/LSE/delta fetch, dQ return; key/value net: K, V fetch twice, dK/dV return).

With these weights the connectivity-minus-one objective ``sum_e w_e (lambda_e - 1)`` is exactly
the ``comm_bytes`` of the resulting plan. The partitioner works on a coarsened model -- every
tile joins its query block (so key/value blocks are what travels, the cheap side under GQA), a
block weighs its share of memory plus its query row's share of compute, and the key/value nets
carry the traffic -- two-level:
nodes first (tolerance ``eps_inter``), then ranks inside each node (``eps_intra``), so the
first level minimises inter-node bytes (from :data:`CONTIGUOUS_NODES` nodes on, the ranks
inside a node get the cheapest contiguous runs of its blocks instead, and the node level
runs with ``eps_inter`` alone). Mt-KaHyPar takes one weight per vertex, so a
rebalancing pass on the full hypergraph then moves the blocks (memory) and tiles (compute)
that add the least traffic (inter-node bytes counted double) until every rank is within
``1 + eps_memory`` of the mean resident bytes and ``1 + eps_compute`` of the mean FLOPs.
The node level runs with ``eps_inter`` and, as a second candidate, with ``eps_intra`` (a loose
node level can leave more compute for the rebalancing pass to move than it saved); the block
layouts of the greedy, FCP and Megatron planners and of a zig-zag split go through the same
rebalancing as fallback candidates (with the time objective, greedy layouts at eight looser
compute bounds, 1.2-2.0, too: keeping more documents whole is often fastest where links are
the bottleneck, and which bound wins varies from batch to batch). With ``objective="bytes"``
the candidate with the least ``comm_bytes`` wins. With ``objective="time"`` (default) each
candidate is also rebalanced to looser compute bounds (up to ``max_compute_imbalance``): where
the network is the bottleneck, spreading a document's compute perfectly evenly costs more in
transfers than it saves. Memory (token) balance is kept at ``1 + eps_memory`` either way: the
token-level layers of a training step depend on it.

The estimate (:func:`estimate_seconds`: the busiest rank's compute or link time, whichever is
longer) only orders the placements of one call. :func:`dcp_candidates` returns every distinct
placement it tried (or the ``shortlist`` best by that estimate), best estimate first, and the
compute-balanced one with the fewest bytes (the ``"bytes"`` objective's choice, labelled
``"dcp:bytes"``), followed by ring attention's, Megatron's and all-gather CP's own plans and
whole documents per rank (data parallelism; inside head groups, Ulysses at that CP size with
data parallelism across the groups) (``rivals``, labelled ``"dcp:ring"`` etc., when their
resident tokens meet the same memory bound), all run by torch_dcp's executor, and all-gather CP
at every CP size a user could pick run as its authors run it (``"static"``, labelled
``"dcp:allgather/cpC"``: one NCCL all-gather of K/V per CP group and one attention call per
rank, :class:`~torch_dcp.executor.allgather.AllGatherExecutor`; inside head groups at CP groups
of one head group, Ulysses' own shape), and ring attention on its own runtime over groups of up
to 8 ranks (``"dcp:ring/cpW"``, :class:`~torch_dcp.executor.ring.RingExecutor`; inside head
groups, HCP's ring across them). :func:`torch_dcp.plan` estimates every candidate's time division by division
(:func:`torch_dcp.sim.estimate.estimate_seconds`, which sees the phases and the links), simulates
the best few by that estimate and every labelled rival (skipping those whose floor is above the
fastest so far), and keeps the fastest, so a dcp plan is never slower than the rivals' (as
torch_dcp's executor runs them) or the bytes objective's on the simulator (the fastest placement is then also timed with a local tail,
:func:`torch_dcp.schedule.assign_divisions`, kept where faster). Timing the extra greedy
layouts among the candidates cuts dcp's simulated time by up to 52 % on the paper's
microbenchmark batches (``python -m torch_dcp.benchmarks paper``; A100 cluster, long-tail
causal at scale 0.5: 3.75 to 1.93 ms).

Solver: Mt-KaHyPar (deterministic preset, one thread, fixed seed): the same batch and seed
give the same placement, hence the same ``Plan.digest()``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..batch import BatchSpec
from ..topology import Topology
from ..workload import Buf, Workload, item_token_bytes
from .allgather import plan_allgather
from .documents import plan_documents
from .base import Placement, Routing, Runtime, whole_nodes
from .megatron import plan_megatron
from .partition import _partition_csr
from .ring import plan_ring

#: planners whose placements dcp's time objective also offers (:func:`dcp_candidates`)
_RIVALS = {"ring": plan_ring, "megatron": plan_megatron, "allgather": plan_allgather, "documents": plan_documents}

__all__ = ["plan_dcp", "dcp_candidates", "DEFAULT_RIVALS", "OWN_RIVALS", "DCPHypergraph", "estimate_seconds",
           "zigzag_tiles_bound", "RIVAL_TILE_BUDGET", "RING_RUNTIME_MAX_RANKS", "offers_ring_runtime",
           "CONTIGUOUS_NODES", "EPS_MEMORY"]

#: dcp's default memory tolerance: every rank holds at most ``1 + EPS_MEMORY`` times the mean
#: resident bytes (the DCP paper balances memory as tightly as it can, §4.2)
EPS_MEMORY = 0.1

#: compute bounds (max/mean - 1) of the extra greedy layouts the time objective starts from
_GREEDY_BOUNDS = (0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0)

#: the rivals :func:`dcp_candidates` offers when not told otherwise
DEFAULT_RIVALS = ("ring", "megatron", "allgather", "documents", "static")
#: the rivals on torch_dcp's executor only: dcp's own plans, without the static CP runtimes
OWN_RIVALS = tuple(r for r in DEFAULT_RIVALS if r != "static")

#: rivals laid out zig-zag (every document cut into ``2W`` chunks), and the most tiles such a
#: rival may hold to be built among the candidates (:func:`zigzag_tiles_bound`): ring attention
#: on 1M tokens / 256 ranks holds tens of millions (85 s and 12.9 GB to plan on one core)
_ZIGZAG_RIVALS = ("ring", "allgather")
RIVAL_TILE_BUDGET = 1 << 22
#: ring attention on its own runtime (``Runtime.DCP_RING``) is a candidate on groups of at most
#: this many ranks (one node, or HCP's ring across the head groups of a few nodes): beyond, its
#: ``W`` steps of small launches never won on the paper's batches (ring at 32 ranks: 1.7-2x the
#: best static configuration, ``benchmarks compare``) and simulating them costs planning time
RING_RUNTIME_MAX_RANKS = 8


def offers_ring_runtime(world_size: int) -> bool:
    """Whether dcp's candidates include ring attention on its own runtime over a group of
    ``world_size`` ranks: a ring of 2 to :data:`RING_RUNTIME_MAX_RANKS`."""
    return 1 < int(world_size) <= RING_RUNTIME_MAX_RANKS


def zigzag_tiles_bound(batch: BatchSpec, world_size: int) -> int:
    """At most how many tiles the zig-zag layout of ``batch`` over ``world_size`` ranks has
    (ring attention's and all-gather CP's: every document in ``min(2W, length)`` chunks, every
    pair of its chunks a tile at most)."""
    chunks = np.minimum(2 * world_size, np.asarray(batch.doc_lens, np.int64))
    return int((chunks * chunks).sum())


class DCPHypergraph:
    """The hypergraph of a workload, in CSR arrays (vertices: tiles, then blocks).

    Attributes:
        n_vertices: ``n_tiles + n_blocks``.
        net_ptr, net_pins: CSR of the ``2 * n_blocks`` nets (query net of block ``b`` is net
            ``b``, key/value net is ``n_blocks + b``).
        pin_net: ``[len(net_pins)]`` the net of every pin.
        net_owner: ``[2 * n_blocks]`` the block vertex of every net (its data's home).
        net_weight: float64 ``[2 * n_blocks]``, bytes per extra rank on the net.
        flops, mem: float64 ``[n_vertices]`` compute and memory weights.
    """

    def __init__(self, wl: Workload):
        nt, nb = wl.n_tiles, wl.n_blocks
        itb = item_token_bytes(wl.batch)
        q_w = itb[(False, Buf.Q)] + itb[(False, Buf.OPART)] + itb[(True, Buf.Q)] + itb[(True, Buf.DQ)]
        kv_w = itb[(False, Buf.KV)] + itb[(True, Buf.KV)] + itb[(True, Buf.DKV)]
        self.n_tiles, self.n_blocks = nt, nb
        self.n_vertices = nt + nb
        self.net_weight = np.concatenate([wl.block_len * float(q_w), wl.block_len * float(kv_w)])
        # pins: block vertex + its tiles, for query nets then key/value nets
        tiles = np.arange(nt)
        net_of_pin = np.concatenate([np.arange(nb), wl.tile_q, nb + np.arange(nb), nb + wl.tile_kv])
        vert_of_pin = np.concatenate([nt + np.arange(nb), tiles, nt + np.arange(nb), tiles])
        order = np.argsort(net_of_pin, kind="stable")
        self.net_pins = vert_of_pin[order]
        self.net_ptr = np.concatenate(([0], np.cumsum(np.bincount(net_of_pin, minlength=2 * nb))))
        self.pin_net = net_of_pin[order]
        self.net_owner = nt + np.concatenate([np.arange(nb), np.arange(nb)])
        self.flops = np.concatenate([wl.tile_flops_fwd + wl.tile_flops_bwd, np.zeros(nb)])
        self.mem = np.concatenate([np.zeros(nt), wl.block_bytes()])
        # vertex -> nets (each tile is on 2 nets, each block on 2 nets)
        self.vertex_nets = np.stack([
            np.concatenate([wl.tile_q, np.arange(nb)]),
            np.concatenate([nb + wl.tile_kv, nb + np.arange(nb)]),
        ], axis=1)

    def km1(self, part: np.ndarray, k: int) -> float:
        """``sum_e w_e (lambda_e - 1)`` of a partition (bytes)."""
        key = self.pin_net * k + part[self.net_pins]
        if len(self.net_weight) * k <= 4 * len(key):  # a table of (net, part) pairs is cheaper than sorting
            present = np.zeros(len(self.net_weight) * k, bool)
            present[key] = True
            lam = present.reshape(-1, k).sum(axis=1)
        else:
            lam = np.bincount(np.unique(key) // k, minlength=len(self.net_weight))
        return float((self.net_weight * np.maximum(lam - 1, 0)).sum())


#: nodes from which the ranks inside each node get contiguous runs of the node's blocks
#: (:func:`~torch_dcp.planners.partition._contiguous_partition`) rather than Mt-KaHyPar's partition: at 1M tokens / 256 ranks
#: (32 nodes of about 33 blocks) its 57 calls took about 80 ms each, most of the plan's time;
#: on the paper's 4 x 8 clusters the runs gave the same plans but on one batch (A100, corpus,
#: lambda), 3.6 % slower, so the paper's clusters keep Mt-KaHyPar there
CONTIGUOUS_NODES = 16


def _rebalance(hg: DCPHypergraph, part: np.ndarray, w: int, weight: np.ndarray, movable: np.ndarray,
               eps: float, topology: Topology) -> np.ndarray:
    """Move ``movable`` vertices off ranks whose ``weight`` exceeds ``(1 + eps) * mean``, each
    move the one that adds the least traffic (inter-node bytes counted double)."""
    total = weight[movable].sum()
    if total <= 0:
        return part
    cap = (1.0 + eps) * total / w
    load = np.bincount(part[movable], weights=weight[movable], minlength=w)
    n_nets = len(hg.net_weight)
    cnt = np.bincount(hg.pin_net * w + part[hg.net_pins], minlength=n_nets * w).reshape(n_nets, w)
    node = np.arange(w) // topology.ranks_per_node
    double = np.where(node[:, None] != node[None, :], 2.0, 1.0)  # [r, t]: inter-node bytes count double
    net0, net1 = hg.vertex_nets[:, 0], hg.vertex_nets[:, 1]
    wn0, wn1 = hg.net_weight[net0], hg.net_weight[net1]
    weighted = movable[weight[movable] > 0]
    for _ in range(4 * len(movable) + 8):
        r = int(np.argmax(load))
        excess = load[r] - cap
        if excess <= 1e-9 * cap:
            break
        cand = weighted[part[weighted] == r]
        if len(cand) == 0:
            break
        n0, n1, w0, w1, wc = net0[cand], net1[cand], wn0[cand], wn1[cand], weight[cand]
        # cost of moving candidate c to rank t: nets gaining rank t minus nets losing rank r
        c0, c1 = cnt[n0], cnt[n1]  # [c, w]
        gain_t = (c0 == 0) * w0[:, None] + (c1 == 0) * w1[:, None]  # [c, w]
        lose_r = (c0[:, r] == 1) * w0 + (c1[:, r] == 1) * w1  # [c]
        cost = gain_t * double[r] - lose_r[:, None]
        room = load[None, :] + wc[:, None] <= cap
        room[:, r] = False
        if not room.any():
            # nothing fits whole: move the smallest candidate to the least-loaded rank
            c = int(np.argmin(wc))
            t = int(np.argmin(load))
            if t == r or load[t] + weight[cand[c]] >= load[r]:
                break
            moves = [(c, t)]
        else:
            # prefer cheap moves that remove much of the excess; take several per round
            score = np.where(room, cost / np.minimum(wc, excess)[:, None], np.inf)
            best_t = np.argmin(score, axis=1)
            best = score[np.arange(len(cand)), best_t]
            order = np.argsort(best, kind="stable")[:64]
            order = order[np.isfinite(best[order])]
            # each candidate's cheapest target with room at the start of the round is still the
            # cheapest with room unless the moves before filled it (loads only grow here): then
            # the cheapest with room left (a tie: the lower rank); plain Python but for that
            loads, cap_f, left = load.tolist(), float(cap), float(excess)
            moves = []
            for c, t, size in zip(order.tolist(), best_t[order].tolist(), wc[order].tolist()):
                if left <= 1e-9 * cap_f:
                    break
                if not loads[t] + size <= cap_f:
                    # np.argmin over the ranks other than r with room left (scores finite): the
                    # first of the lowest, in plain Python (a few per round; 32-long rows)
                    t, low = -1, np.inf
                    for u, (lu, su) in enumerate(zip(loads, score[c].tolist())):
                        if su < low and u != r and lu + size <= cap_f:
                            t, low = u, su
                    if t < 0:
                        continue
                moves.append((c, t))
                loads[t] += size  # reserve room (undone below, applied once)
                left -= size
            wc_l = wc.tolist()
            for c, t in moves:
                loads[t] -= wc_l[c]
            load = np.asarray(loads)
        if moves:
            vs = cand[[c for c, _ in moves]]
            ts = np.asarray([t for _, t in moves], np.int64)
            nets = hg.vertex_nets[vs]  # [moves, 2]
            np.add.at(cnt, (nets.ravel(), np.full(nets.size, r)), -1)
            np.add.at(cnt, (nets.ravel(), np.repeat(ts, nets.shape[1])), 1)
            part[vs] = ts
            loads = load.tolist()
            for wv, t in zip(weight[vs].tolist(), ts.tolist()):
                loads[r] -= wv
                loads[t] += wv
            load = np.asarray(loads)
    return part


def dcp_candidates(
    batch: BatchSpec,
    topology: Topology,
    block_size: int = 1024,
    eps_inter: float = 0.4,
    eps_intra: float = 0.1,
    eps_compute: float = 0.1,
    eps_memory: float = EPS_MEMORY,
    seed: int = 0,
    objective: str = "time",
    max_compute_imbalance: float = 2.0,
    flops_per_second: float = 1.6e14,
    node_routes: bool = True,
    shortlist: int | None = None,
    rivals: tuple[str, ...] = DEFAULT_RIVALS,
    search: bool = True,
    contiguous_ranks: bool | None = None,
) -> list[Placement]:
    """DCP hypergraph placements, best first (see module docstring).

    Args:
        batch, topology, block_size: the step, the cluster, tokens per block.
        eps_inter, eps_intra: partitioner imbalance tolerance between and inside nodes
            (DCP paper §7.1: 0.4 and 0.1).
        eps_compute, eps_memory: per-rank bounds the rebalancing pass enforces (memory
            always; compute as the tightest bound tried, see ``objective``).
        seed: partitioner seed (the same seed gives the same placement).
        objective: ``"bytes"``: the candidate with the fewest ``comm_bytes`` at compute
            imbalance ``<= 1 + eps_compute``. ``"time"`` (default): every candidate is also
            rebalanced to looser compute bounds (up to ``max_compute_imbalance``) and the
            one with the least estimated attention time wins (:func:`estimate_seconds`):
            where links are the bottleneck, keeping a document on fewer ranks beats
            spreading its compute evenly.
        max_compute_imbalance: the loosest compute bound (max/mean) ``"time"`` accepts.
        flops_per_second: attention throughput of one rank for the estimate (default:
            an A100 at about 160 TFLOP/s, forward and backward together).
        node_routes: on several nodes, route fetches through one gateway rank per node
            (:attr:`~torch_dcp.planners.base.Routing.RAILS`: a block crosses into a node once,
            the crossings spread over the rails); ``False`` fetches every block from its home.
        shortlist: with ``"time"``, how many of its own placements ranked by estimated time
            to return (default ``None``: all of them), followed by the bytes objective's choice
            (duplicates dropped); ``"bytes"`` returns only its choice.
        rivals: with ``"time"``, the placements of these planners (``"ring"``,
            ``"megatron"``, ``"allgather"``, ``"documents"``: every document whole on one rank,
            :func:`~torch_dcp.planners.documents.plan_documents`) follow the shortlist, labelled ``"dcp:<name>"``,
            when their resident bytes are within ``1 + eps_memory`` of the mean as dcp's own
            are (ring and all-gather only while their zig-zag layout holds at most
            :data:`RIVAL_TILE_BUDGET` tiles, :func:`zigzag_tiles_bound`); :func:`torch_dcp.plan`
            times every candidate with the simulator and keeps the fastest, so dcp's plan is
            never slower than theirs as torch_dcp's executor runs them (on the simulator's cost
            model; their own implementations: ``benchmarks compare``).
            ``"static"``: all-gather CP run as its authors run it (``Runtime.DCP_ALLGATHER``,
            :class:`~torch_dcp.executor.allgather.AllGatherExecutor`) at every CP size a user
            could pick (:func:`~torch_dcp.planners.static.cp_sizes`, whole documents split over
            the CP groups), labelled ``"dcp:allgather/cpC"``, and ring attention as its
            authors run it (``Runtime.DCP_RING``, :class:`~torch_dcp.executor.ring.RingExecutor`)
            over groups of at most :data:`RING_RUNTIME_MAX_RANKS` ranks, labelled
            ``"dcp:ring/cpW"`` (inside head groups: HCP); where a CP group is two or more whole
            nodes, also its all-gather crossing each node once (``Runtime.DCP_NODE_ALLGATHER``,
            :class:`~torch_dcp.executor.allgather_node.NodeAllGatherExecutor`), labelled
            ``"dcp:allgather/cpC/node"``; under the same memory and tile
            bounds: so the plan :func:`torch_dcp.plan` keeps is never slower on the simulator
            than those static configurations.
        search: ``False``: none of dcp's own placements, only the time objective's rivals
            (:func:`torch_dcp.plan` passes it where no placement of the batch's blocks can beat a
            static runtime's plan, :func:`~torch_dcp.sim.floors.search_floor_seconds`).
        contiguous_ranks: the ranks inside a node get the cheapest contiguous runs of its blocks
            (:func:`~torch_dcp.planners.partition._contiguous_partition`) rather than
            Mt-KaHyPar's partition; ``None`` (default): from :data:`CONTIGUOUS_NODES` nodes on.
            :func:`torch_dcp.plan` passes ``True`` for the outer plans of head parallelism
            (on the paper's 128 ``compare`` batches: the same plans on 126, two faster, in
            about 10 % less planning time).

    Returns:
        Placements, the planner's own best first (at least one, unless ``search`` is False).

    Raises:
        ValueError: bad block size, tolerances or objective.
        ImportError: Mt-KaHyPar is not installed.
    """
    for name, v in (("eps_inter", eps_inter), ("eps_intra", eps_intra), ("eps_compute", eps_compute),
                    ("eps_memory", eps_memory)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    if objective not in ("time", "bytes"):
        raise ValueError(f"objective must be 'time' or 'bytes', got {objective!r}")
    if objective == "time" and not max_compute_imbalance >= 1.0 + eps_compute:
        raise ValueError(f"max_compute_imbalance must be >= 1 + eps_compute, got {max_compute_imbalance!r}")
    if not flops_per_second > 0:
        raise ValueError(f"flops_per_second must be positive, got {flops_per_second!r}")
    if shortlist is not None and (isinstance(shortlist, bool) or not isinstance(shortlist, (int, np.integer))
                                  or shortlist < 1):
        raise ValueError(f"shortlist must be None or an integer >= 1, got {shortlist!r}")
    unknown = [r for r in rivals if r not in _RIVALS and r != "static"]
    if unknown:
        raise ValueError(f"rivals must be among {sorted(_RIVALS) + ['static']}, got {unknown}")
    if not search:
        return _rival_placements(batch, topology, block_size, rivals, eps_memory) if objective == "time" else []
    wl = Workload.uniform(batch, block_size)
    hg = DCPHypergraph(wl)
    w = topology.world_size
    rpn, nn = topology.ranks_per_node, topology.n_nodes
    # coarse model for the partitioner: every tile joins its query block (tiles follow their
    # queries); a block vertex weighs its share of memory plus its row's share of compute,
    # and the key/value nets carry the traffic
    nb, nt = wl.n_blocks, wl.n_tiles
    row_flops = np.bincount(wl.tile_q, weights=hg.flops[:nt], minlength=nb)
    mem = hg.mem[nt:]
    node_w = row_flops / max(row_flops.sum(), 1e-300) + mem / max(mem.sum(), 1e-300)
    kv_pins_net = np.concatenate([np.arange(nb), wl.tile_kv])
    kv_pins_vert = np.concatenate([np.arange(nb), wl.tile_q])
    pairs = np.unique(kv_pins_net * nb + kv_pins_vert)  # a block may appear once per net
    net_of, vert = pairs // nb, pairs % nb
    ptr = np.concatenate(([0], np.cumsum(np.bincount(net_of, minlength=nb))))
    net_w = hg.net_weight[nb:]
    allb = np.arange(nb)
    partitions = []
    # the node level with the paper's tolerance, and with the ranks' own: a loose node level
    # can leave more compute for the rebalancing pass to move than it saves in traffic
    # (on many nodes the paper's alone: at 1M tokens / 256 ranks either gave the same plan, and
    # each call on 32 nodes took about 1.5 s)
    tolerances = {eps_inter} if nn >= CONTIGUOUS_NODES else {eps_inter, min(eps_inter, eps_intra)}
    contiguous = nn >= CONTIGUOUS_NODES if contiguous_ranks is None else bool(contiguous_ranks)
    for node_eps in sorted(tolerances, reverse=True):
        node_of = _partition_csr(nb, ptr, vert, node_w, net_w, allb, nn, node_eps, seed)
        block_part = np.zeros(nb, np.int64)
        for node in range(nn):
            sel = allb[node_of == node]
            block_part[sel] = node * rpn + _partition_csr(nb, ptr, vert, node_w, net_w, sel, rpn, eps_intra, seed,
                                                          contiguous=contiguous)
        partitions.append(block_part)
        if nn == 1:
            break
    tiles = np.arange(nt)
    blocks = nt + np.arange(nb)
    # candidates: the partitioner's, and the block layouts of the greedy, FCP and Megatron
    # planners and of a zig-zag split (ring attention's layout on these blocks) as fallbacks
    # the partitioner must beat; each is rebalanced
    from .fcp import fcp_layout
    from .greedy import plan_greedy

    megatron = plan_megatron(batch, topology)  # a block layout to start from, and a rival
    candidates = partitions + [plan_greedy(batch, topology, block_size).block_rank,
                               fcp_layout(batch, topology, block_size)[1], _zigzag(wl, w),
                               _on_blocks(megatron, wl)]
    # with the time objective, greedy layouts at looser compute bounds too: they keep more
    # documents whole, often the fastest plans where links are the bottleneck (the estimate
    # alone does not see it), and which bound wins varies from batch to batch
    for bound in _GREEDY_BOUNDS if objective == "time" else ():
        if eps_compute < bound <= max_compute_imbalance - 1.0:
            layout = plan_greedy(batch, topology, block_size, eps_compute=bound).block_rank
            if not any(np.array_equal(layout, c) for c in candidates):
                candidates.append(layout)
    # looser compute bounds for the time objective, loosest first: each rebalancing continues
    # from the previous one
    looser = []
    if objective == "time":
        looser = sorted({b for b in (max_compute_imbalance - 1.0, 0.5, 0.25) if b > eps_compute}, reverse=True)
    tried: list[tuple[tuple, int, np.ndarray]] = []
    balanced: list[tuple[tuple, int, np.ndarray]] = []  # the tight compute bound: the bytes objective's field
    for cand in candidates:
        mem_part = np.concatenate([cand[wl.tile_q], cand]).astype(np.int64)
        mem_part = _rebalance(hg, mem_part, w, hg.mem, blocks, eps_memory, topology)
        tries = [_rebalance(hg, mem_part.copy(), w, hg.flops, tiles, eps_compute, topology)]
        part = mem_part
        for bound in looser:
            part = _rebalance(hg, part.copy(), w, hg.flops, tiles, bound, topology)
            tries.append(part)
        for i, part in enumerate(tries):
            key = (hg.km1(part, w), _inter_km1(hg, part, topology))
            if i == 0:
                balanced.append((key, len(tried), part))
            if objective == "time":
                key = (estimate_seconds(hg, part, topology, flops_per_second),) + key
            tried.append((key, len(tried), part))
    tried.sort(key=lambda x: x[:2])
    routing = Routing.RAILS if node_routes and nn > 1 else Routing.DIRECT
    # the time objective's shortlist by estimate, and the bytes objective's choice (the estimate
    # only ranks: the simulator may prefer the balanced plan)
    ranked = [part for _, _, part in tried][:shortlist] if objective == "time" else []  # None: all
    fewest = min(balanced, key=lambda x: x[:2])[2]
    ranked.append(fewest)
    chosen: list[np.ndarray] = []
    for part in ranked:
        if not any(np.array_equal(part, c) for c in chosen):
            chosen.append(part)
    # the bytes objective's choice is labelled among the time objective's candidates (a rival
    # that torch_dcp.plan always times)
    bytes_label = "dcp:bytes" if objective == "time" else "dcp"
    out = [Placement(wl, w, p[blocks], p[tiles], planner=bytes_label if np.array_equal(p, fewest) else "dcp",
                     routing=routing) for p in chosen]
    if objective == "time":
        out += _rival_placements(batch, topology, block_size, rivals, eps_memory, megatron)
    return out


def _rival_placements(batch: BatchSpec, topology: Topology, block_size: int, rivals: tuple[str, ...],
                      eps_memory: float, megatron: Placement | None = None) -> list[Placement]:
    """The time objective's rivals (``rivals`` of :func:`dcp_candidates`) within its memory and
    tile bounds: labelled ``"dcp:<name>"``, on torch_dcp's executor, then the static runtimes."""
    out = []
    w = topology.world_size
    for name in (r for r in rivals if r != "static"):
        if name in _ZIGZAG_RIVALS and zigzag_tiles_bound(batch, w) > RIVAL_TILE_BUDGET:
            continue  # ring / all-gather CP at hundreds of ranks: a plan of minutes and GBs
        if name == "megatron":
            rival = megatron if megatron is not None else plan_megatron(batch, topology)
        else:
            rival = _RIVALS[name](batch, topology, block_size)
        tokens = rival.rank_tokens()
        if tokens.max() <= (1.0 + eps_memory) * tokens.mean():
            # run by torch_dcp's executor, not by the rival's own implementation
            out.append(dataclasses.replace(rival, planner=f"dcp:{name}", runtime=Runtime.EXECUTOR))
    if "static" in rivals:
        out += _static_runtimes(batch, topology, eps_memory)
    return out


def _static_runtimes(batch: BatchSpec, topology: Topology, eps_memory: float) -> list[Placement]:
    """All-gather CP on its own runtime at every CP size a user could pick, and ring attention on
    its own over the whole group where it has at most :data:`RING_RUNTIME_MAX_RANKS` ranks (the
    ``"static"`` rival of :func:`dcp_candidates`)."""
    from .static import cp_sizes

    out = []
    w = topology.world_size
    if offers_ring_runtime(w) and zigzag_tiles_bound(batch, w) <= RIVAL_TILE_BUDGET:
        ring = plan_ring(batch, topology)
        tokens = ring.rank_tokens()
        if tokens.max() <= (1.0 + eps_memory) * tokens.mean():
            out.append(dataclasses.replace(ring, planner=f"dcp:ring/cp{w}", runtime=Runtime.DCP_RING))
    for c in cp_sizes("allgather", batch, topology):
        if zigzag_tiles_bound(batch, c) > RIVAL_TILE_BUDGET:
            continue
        p = plan_allgather(batch, topology, cp_size=c)
        tokens = p.rank_tokens()
        if tokens.max() <= (1.0 + eps_memory) * tokens.mean():
            out.append(dataclasses.replace(p, planner=f"dcp:allgather/cp{c}", runtime=Runtime.DCP_ALLGATHER))
            if topology.ranks_per_node > 1 and whole_nodes(c, topology.ranks_per_node):
                out.append(dataclasses.replace(p, planner=f"dcp:allgather/cp{c}/node",
                                               runtime=Runtime.DCP_NODE_ALLGATHER))
    return out


def plan_dcp(batch: BatchSpec, topology: Topology, block_size: int = 1024, **options) -> Placement:
    """The DCP planner's own best placement (:func:`dcp_candidates` ``[0]``; same arguments,
    no rivals). :func:`torch_dcp.plan` with ``planner="dcp"`` goes further: it times the
    shortlist and the rivals with the simulator and keeps the fastest."""
    options["rivals"] = ()
    return dcp_candidates(batch, topology, block_size, **options)[0]


def estimate_seconds(hg: DCPHypergraph, part: np.ndarray, topology: Topology, flops_per_second: float) -> float:
    """Bottleneck estimate of a placement's attention time (forward + backward, seconds):
    the most loaded rank's compute, or its link time if longer -- a rank's own intra-node
    bytes over ``intra_bandwidth``, or its node's inter-node bytes over ``inter_bandwidth``
    (each link carries both directions at once, so a byte pair of in and out counts once).
    Communication is taken as overlapped with compute (the divisions' purpose).

    Args:
        hg: the hypergraph; part: rank of every vertex ``[n_vertices]``.
    """
    w, rpn = topology.world_size, topology.ranks_per_node
    compute = np.bincount(part, weights=hg.flops, minlength=w) / flops_per_second
    n_nets = len(hg.net_weight)
    present = np.zeros((n_nets, w), bool)
    present[hg.pin_net, part[hg.net_pins]] = True
    owner = part[hg.net_owner]
    present[np.arange(n_nets), owner] = False  # the others on each net exchange w_e with its owner
    node = np.arange(w) // rpn
    inter = node[None, :] != node[owner][:, None]
    we = hg.net_weight[:, None]
    intra_rank = ((present & ~inter) * we).sum(0) + np.bincount(owner, ((present & ~inter) * we).sum(1), w)
    inter_b = (present & inter) * we
    inter_node = np.bincount(node, inter_b.sum(0), topology.n_nodes) + np.bincount(node[owner], inter_b.sum(1),
                                                                                   topology.n_nodes)
    link = np.maximum(intra_rank / (2 * topology.intra_bandwidth), inter_node[node] / (2 * topology.inter_bandwidth))
    return float(np.max(np.maximum(compute, link)))


def _on_blocks(placement: Placement, wl: Workload) -> np.ndarray:
    """Rank of every block of ``wl`` under another placement of the same batch (the rank
    holding the block's first token)."""
    other = placement.workload
    order = np.argsort(other.block_offset, kind="stable")
    i = np.searchsorted(other.block_offset[order], wl.block_offset, side="right") - 1
    return placement.block_rank[order[i]].astype(np.int64)


def _zigzag(wl: Workload, w: int) -> np.ndarray:
    """Block ranks of the zig-zag layout: each document's blocks in ``2w`` chunks, rank ``r``
    holding chunks ``r`` and ``2w - 1 - r``."""
    nb_doc = np.bincount(wl.block_doc, minlength=wl.batch.n_docs)
    first = np.concatenate(([0], np.cumsum(nb_doc)[:-1]))
    i = np.arange(wl.n_blocks) - first[wl.block_doc]
    chunk = i * (2 * w) // nb_doc[wl.block_doc]
    return np.where(chunk < w, chunk, 2 * w - 1 - chunk).astype(np.int64)


def _inter_km1(hg: DCPHypergraph, part: np.ndarray, topology: Topology) -> float:
    return hg.km1(part // topology.ranks_per_node, topology.n_nodes)
