"""Routes: which rank sends every fetched block and where every partial result goes next.

A plan's routes are two tables, built from its placement, tile divisions and
:class:`~torch_dcp.planners.base.Routing` by one function per routing (:data:`ROUTERS`):

* fetches, one row per (rank, kind, block) a rank receives: ``fetch_rank``, ``fetch_kind`` (0
  query block, 1 key/value block), ``fetch_block``, ``fetch_div`` (the division whose fetch phase
  brings it) and ``fetch_src`` (the rank it comes from: the block's home, or a rank that received
  it in an earlier division and passes it on -- a relay);
* returns, per side (``q``: partial outputs forward and dQ backward; ``kv``: dK/dV backward),
  one row per (rank, non-local block) whose partial the rank sends on: ``ret_{side}_rank``,
  ``_block``, ``_div`` (sent after that division; ``T``, one past the last, is the plan's
  closing return phase) and ``_dst`` (the block's home, or a rank that adds its own partial --
  if it has one -- before sending the sum on later).

A relay is only correct if the relaying rank holds what it passes on when it launches the
transfer: :func:`check_routes` proves that for every row (source fetched strictly earlier,
next hop returns strictly later), and the compiler then places the waits accordingly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..planners.base import Routing
from ..workload import Buf, item_token_bytes
from .ir import PlanError

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

__all__ = ["ROUTERS", "route_tables", "check_routes", "direct_routes", "ring_routes", "node_routes"]

_SIDES = ("q", "kv")


def direct_routes(plan: "Plan") -> dict[str, np.ndarray]:
    """Every fetch from the block's home, every return straight home.

    A rank fetches each (kind, block) its tiles need once, in the first division that uses it,
    and returns a block's partial after the last division that uses it.
    """
    wl, pl = plan.workload, plan.placement
    nb = wl.n_blocks
    tr, td = pl.tile_rank, plan.tile_division
    out: dict[str, np.ndarray] = {}
    ranks, kinds, blocks, divs = [], [], [], []
    for kind, tb in ((0, wl.tile_q), (1, wl.tile_kv)):
        remote = pl.block_rank[tb] != tr
        code = tr[remote] * nb + tb[remote]
        # one sort: each (rank, block) a run, its first and last division reduced over the run
        order = np.argsort(code, kind="stable")
        code, div = code[order], td[remote][order]
        start = np.nonzero(np.concatenate(([True], code[1:] != code[:-1])))[0] if len(code) else order
        uniq = code[start]
        first, last = np.minimum.reduceat(div, start), np.maximum.reduceat(div, start)
        ranks.append(uniq // nb)
        blocks.append(uniq % nb)
        kinds.append(np.full(len(uniq), kind))
        divs.append(first)
        side = _SIDES[kind]
        out[f"ret_{side}_rank"] = uniq // nb
        out[f"ret_{side}_block"] = uniq % nb
        out[f"ret_{side}_div"] = last
        out[f"ret_{side}_dst"] = pl.block_rank[uniq % nb]
    out["fetch_rank"] = np.concatenate(ranks)
    out["fetch_kind"] = np.concatenate(kinds)
    out["fetch_block"] = np.concatenate(blocks)
    out["fetch_div"] = np.concatenate(divs)
    out["fetch_src"] = pl.block_rank[out["fetch_block"]]
    return {k: np.asarray(v, np.int64) for k, v in out.items()}


def ring_routes(plan: "Plan") -> dict[str, np.ndarray]:
    """Ring attention's routes (see :attr:`Routing.RING`), around each document's ring
    (:meth:`Placement.ring_group_of_docs`: all ranks, or Megatron's CP groups).

    Every rank ``r`` of a document's ring ``(first, n, base)`` receives every key/value block of
    the document held by another member ``h`` in division ``base + (r - h) mod n``, from its
    left neighbour in the ring, whether or not its own tiles use it (ring attention passes
    every chunk around the whole ring); dK/dV partials of those blocks go to the right
    neighbour after the same division, and from the last rank before ``h`` home. Queries never
    move.

    Raises:
        PlanError: a block lives outside its document's ring, a tile does not run on its query
            block's home rank, or runs in another division than its ring step.
    """
    wl, pl = plan.workload, plan.placement
    br = pl.block_rank
    groups = pl.ring_group_of_docs()
    first, n, base = (groups[wl.block_doc, i] for i in range(3))
    if np.any((br < first) | (br >= first + n)):
        raise PlanError("ring routes: a block lives outside its document's ring of ranks")
    if np.any(br[wl.tile_q] != pl.tile_rank):
        raise PlanError("ring routes: every tile must run on its query block's home rank")
    step, _ = pl.ring_steps()
    if np.any(plan.tile_division != step):
        raise PlanError("ring routes: tile divisions must be ring steps, first division + (rank - key/value home) "
                        "mod ring size")
    # every (member, block) pair of each ring, but the block's home
    block = np.repeat(np.arange(wl.n_blocks, dtype=np.int64), n)
    j = np.arange(len(block)) - np.repeat(np.cumsum(n) - n, n)
    f, m, b0 = first[block], n[block], base[block]
    rank = f + j
    keep = rank != br[block]
    block, rank, f, m, b0 = block[keep], rank[keep], f[keep], m[keep], b0[keep]
    div = b0 + (rank - br[block]) % m
    order = np.lexsort((block, rank))
    block, rank, f, m, div = block[order], rank[order], f[order], m[order], div[order]
    z = np.zeros(0, np.int64)
    return {
        "fetch_rank": rank, "fetch_kind": np.ones(len(rank), np.int64), "fetch_block": block, "fetch_div": div,
        "fetch_src": f + (rank - f - 1) % m,
        "ret_q_rank": z, "ret_q_block": z, "ret_q_div": z, "ret_q_dst": z,
        "ret_kv_rank": rank, "ret_kv_block": block, "ret_kv_div": div, "ret_kv_dst": f + (rank - f + 1) % m,
    }


def node_routes(plan: "Plan") -> dict[str, np.ndarray]:
    """Direct routes with every inter-node fetch deduplicated and every inter-node return
    pre-reduced per node (see :attr:`Routing.NODE`).

    * Fetches: of the ranks of one node fetching the same (kind, block) from another node, one
      (the node's gateway for that block) fetches it from the home one division before any of
      them needs it (before division 0: in the opening phase, division ``-1``); the others get
      it from the gateway in their own divisions.
    * Returns: of the ranks of one node returning partials of the same block to another node,
      one of those finishing last (the node's reducer for that block) gets the others'
      partials over NVLink, adds them to its own and sends the sum home once. It sends after
      its own last division, or one division later when another rank of its node finishes in
      the same division (after the last division: the plan's closing return phase, ``2T + 1``).

    Gateways and reducers are chosen to spread the load over links (greedily, largest group
    first; see :class:`_LinkLoads`): a gateway's rail carries the block into the node and its
    NVLink port out the relays; a reducer's NVLink port in carries the partials and its rail
    the sum. Choosing the first rank every time puts most of a node's traffic on one rail
    (3.3x the mean rail bytes on the paper's corpus batch on DGX H100).
    """
    t = direct_routes(plan)
    topo = plan.topology
    nb = max(plan.workload.n_blocks, 1)
    loads = _LinkLoads(plan)
    fr, fk, fb = t["fetch_rank"], t["fetch_kind"], t["fetch_block"]
    fd, src = t["fetch_div"].copy(), t["fetch_src"].copy()
    node = topo.node_of(fr)
    remote = np.nonzero(node != topo.node_of(src))[0]
    fetch_bytes = loads.fetch_bytes(fk, fb)
    # groups with a choice: two or more ranks of a node fetching one (kind, block) from another
    # node (earliest division first), or returning partials of one block to another node
    # (latest division first)
    groups = {"fetch": _groups((node * 2 + fk) * nb + fb, remote, (fr[remote], fd[remote]))}
    ret = {side: (t[f"ret_{side}_div"].copy(), t[f"ret_{side}_dst"].copy()) for side in _SIDES}
    for side in _SIDES:
        rr, rb = t[f"ret_{side}_rank"], t[f"ret_{side}_block"]
        rd, rt = ret[side]
        out = np.nonzero(topo.node_of(rr) != topo.node_of(rt))[0]
        groups[side] = _groups(topo.node_of(rr) * nb + rb, out, (rr[out], -rd[out]))
    loads.charge_fixed(t, groups, fetch_bytes)
    # every group a job: its bytes, its members' ranks, and how many of them may be chosen (a
    # reducer: only those finishing in the group's last division, its first rows)
    kinds = ("fetch", *_SIDES)
    size, ranks, lengths, allowed = [], [], [], []
    for kind in kinds:
        rows, ptr = groups[kind]
        first, length = rows[ptr[:-1]], np.diff(ptr)
        lengths.append(length)
        if kind == "fetch":
            size.append(np.asarray(fetch_bytes[first], np.float64))
            ranks.append(fr[rows])
            allowed.append(length)
        else:
            size.append(np.asarray(loads.return_bytes(kind, t[f"ret_{kind}_block"][first]), np.float64))
            ranks.append(t[f"ret_{kind}_rank"][rows])
            rd = ret[kind][0][rows]
            top = rd == np.repeat(rd[ptr[:-1]], length)
            allowed.append(np.bincount(np.repeat(np.arange(len(length)), length)[top], minlength=len(length)))
    size_a = np.concatenate(size)
    # the choices, one group after another in plain Python (groups hold a handful of ranks:
    # NumPy's per-call cost would dominate), largest first while links are open
    loads.to_lists()
    rank_l, size_l = np.concatenate(ranks).tolist(), size_a.tolist()
    length_l, allowed_l = np.concatenate(lengths).tolist(), np.concatenate(allowed).tolist()
    start_l = (np.cumsum(length_l) - length_l).tolist()
    n_fetch = len(lengths[0])
    chosen = [0] * len(size_l)  # each group's chosen member, as an index into its rows
    for i in np.argsort(-size_a, kind="stable").tolist():
        a = start_l[i]
        pick = loads.pick_gateway if i < n_fetch else loads.pick_reducer
        chosen[i] = pick(rank_l[a:a + allowed_l[i]], length_l[i], size_l[i])
    # written back in one go per table: the chosen row's new division, every other member's
    # new peer (the chosen rank)
    at = 0
    for kind, length, top in zip(kinds, lengths, allowed):
        rows, ptr = groups[kind]
        pick = rows[ptr[:-1] + np.asarray(chosen[at:at + len(length)], np.int64)]
        at += len(length)
        div_arr, peer_arr = (fd, src) if kind == "fetch" else ret[kind]
        own = t["fetch_rank"] if kind == "fetch" else t[f"ret_{kind}_rank"]
        first_div = div_arr[rows[ptr[:-1]]]
        keep = peer_arr[pick]
        peer_arr[rows] = np.repeat(own[pick], length)
        peer_arr[pick] = keep
        if kind == "fetch":  # strictly before every member's first use
            div_arr[pick] = first_div - 1
        else:  # strictly after every partial it adds: one later where another finishes with it
            div_arr[pick] = first_div + (top > 1)
    t["fetch_div"], t["fetch_src"] = fd, src
    for side in _SIDES:
        t[f"ret_{side}_div"], t[f"ret_{side}_dst"] = ret[side]
    return t


class _LinkLoads:
    """Seconds of traffic (both passes) on every NVLink port and network rail, in and out, as
    :func:`node_routes` assigns gateways and reducers."""

    def __init__(self, plan: "Plan"):
        topo = plan.topology
        self.topo, self.blen = topo, plan.workload.block_len
        itb = item_token_bytes(plan.batch)
        self.per_token = {  # bytes per token, forward + backward
            "fetch": np.array([itb[(False, Buf.Q)] + itb[(True, Buf.Q)], itb[(False, Buf.KV)] + itb[(True, Buf.KV)]]),
            "q": itb[(False, Buf.OPART)] + itb[(True, Buf.DQ)], "kv": itb[(True, Buf.DKV)]}
        n_rails = topo.n_nodes * topo.rails_per_node
        self.rail_id = topo.rail_index(np.arange(plan.world_size))
        self.rail = {"in": np.zeros(n_rails), "out": np.zeros(n_rails)}
        self.port = {"in": np.zeros(plan.world_size), "out": np.zeros(plan.world_size)}

    def fetch_bytes(self, kind: np.ndarray, block: np.ndarray) -> np.ndarray:
        return self.blen[block] * self.per_token["fetch"][kind]

    def return_bytes(self, side: str, block: Any) -> Any:
        return self.blen[block] * self.per_token[side]

    def add(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Charge transfers ``src -> dst`` of ``nbytes`` to their links."""
        for (link, way), seconds in self.topo.link_seconds(src, dst, nbytes).items():
            (self.rail if link == "rail" else self.port)[way] += seconds

    def charge_fixed(self, t: dict[str, np.ndarray], groups: dict, fetch_bytes: np.ndarray) -> None:
        """Charge every transfer whose links do not depend on the choices: routes outside the
        groups with a choice (``groups``: per table, CSR from :func:`_groups`), each group's hop
        from or to the block's home, and the NVLink hops of all its members (the chosen one's
        is refunded)."""
        topo = self.topo

        def members(kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """Every group's first row, all rows, and each row's group (in group order)."""
            rows, ptr = groups[kind]
            return rows[ptr[:-1]], rows, np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))

        # np.add.at adds in the order of its indices: the same sums as one group after another
        first, rows, group = members("fetch")
        keep = np.ones(len(t["fetch_rank"]), bool)
        keep[rows] = False
        b = fetch_bytes[first]
        np.add.at(self.rail["out"], self.rail_id[t["fetch_src"][first]], b / topo.rail_bandwidth)
        np.add.at(self.port["in"], t["fetch_rank"][rows], (b / topo.intra_bandwidth)[group])
        self.add(t["fetch_src"][keep], t["fetch_rank"][keep], fetch_bytes[keep])
        for side in _SIDES:
            rr, rb, rt = (t[f"ret_{side}_{c}"] for c in ("rank", "block", "dst"))
            first, rows, group = members(side)
            keep = np.ones(len(rr), bool)
            keep[rows] = False
            b = self.return_bytes(side, rb[first])
            np.add.at(self.rail["in"], self.rail_id[rt[first]], b / topo.rail_bandwidth)
            np.add.at(self.port["out"], rr[rows], (b / topo.intra_bandwidth)[group])
            self.add(rr[keep], rt[keep], self.return_bytes(side, rb[keep]))

    def to_lists(self) -> None:
        """The loads as Python lists from here on, for :meth:`_pick`'s per-group choices."""
        self.rail = {way: v.tolist() for way, v in self.rail.items()}
        self.port = {way: v.tolist() for way, v in self.port.items()}
        self.rail_of = self.rail_id.tolist()
        self.rail_bw, self.intra_bw = float(self.topo.rail_bandwidth), float(self.topo.intra_bandwidth)

    def _pick(self, ranks: list[int], n_members: int, nbytes: float, rail_way: str, port_way: str) -> int:
        rail, port = self.rail[rail_way], self.port[port_way]
        on_rail = nbytes / self.rail_bw
        hop = nbytes / self.intra_bw
        fan = hop * (n_members - 1)
        # ties (to the picosecond, whatever order the loads were summed in): the earliest in the
        # group's order (rounded as np.round(x, 12) rounds)
        g, best = -1, float("inf")
        rail_of = self.rail_of
        for i, r in enumerate(ranks):
            a, b = rail[rail_of[r]] + on_rail, port[r] + fan
            cost = round((b if b > a else a) * 1e12) / 1e12  # max(a, b), without its call
            if cost < best:
                g, best = i, cost
        r = ranks[g]
        rail[rail_of[r]] += on_rail
        port[r] += fan
        self.port["in" if port_way == "out" else "out"][r] -= hop  # its own hop was charged as a member's
        return g

    def pick_gateway(self, ranks: list[int], n_members: int, nbytes: float) -> int:
        """Index in ``ranks`` (a group of ``n_members``, all of them) of the gateway: its rail
        in and NVLink port out least loaded."""
        return self._pick(ranks, n_members, nbytes, "in", "out")

    def pick_reducer(self, ranks: list[int], n_members: int, nbytes: float) -> int:
        """Index in ``ranks`` (the first of a group of ``n_members``: those allowed) of the
        reducer: its rail out and NVLink port in least loaded."""
        return self._pick(ranks, n_members, nbytes, "out", "in")


def _groups(key: np.ndarray, rows: np.ndarray, order_by: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` grouped by ``key[rows]``, each group sorted by ``order_by`` (arrays over
    ``rows``, last one first, as ``np.lexsort``); only groups of two or more rows, as CSR: their
    rows one group after another, and the offsets of the groups (one more than groups)."""
    order = rows[np.lexsort((*order_by, key[rows]))]
    k = key[order]
    new = np.concatenate(([True], k[1:] != k[:-1])) if len(order) else np.zeros(0, bool)
    length = np.diff(np.append(np.nonzero(new)[0], len(order)))
    multi = length > 1
    ptr = np.concatenate(([0], np.cumsum(length[multi]))).astype(np.int64)
    return order[np.repeat(multi, length)], ptr


#: routing -> ``fn(plan) -> tables``: the one table of route builders.
ROUTERS: dict[Routing, Callable[["Plan"], dict[str, np.ndarray]]] = {
    Routing.DIRECT: direct_routes,
    Routing.RING: ring_routes,
    Routing.NODE: node_routes,
}


def route_tables(plan: "Plan") -> dict[str, np.ndarray]:
    """The routes of ``plan`` (by its placement's routing), checked by :func:`check_routes`.

    Raises:
        PlanError: routes that cannot run (see :func:`check_routes`).
    """
    tables = ROUTERS[plan.placement.routing](plan)
    check_routes(plan, tables)
    return tables


class _Keys:
    """Unique-key lookups: ``keys`` sorted once, for both the duplicate check and the lookups."""

    def __init__(self, keys: np.ndarray):
        self.order = np.argsort(keys, kind="stable")
        self.sorted = keys[self.order]

    def duplicates(self) -> bool:
        return bool(np.any(self.sorted[1:] == self.sorted[:-1]))

    def lookup(self, values: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``values`` at the positions of ``query`` in the (unique) keys: found mask, values."""
        sk = self.sorted
        pos = np.clip(np.searchsorted(sk, query), 0, max(len(sk) - 1, 0))
        found = (sk[pos] == query) if len(sk) else np.zeros(len(query), bool)
        return found, values[self.order][pos] if len(sk) else np.zeros(len(query), np.int64)


def check_routes(plan: "Plan", t: dict[str, np.ndarray]) -> None:
    """Prove that every route can run.

    * no rank fetches a block it holds, from itself, or the same (kind, block) twice; every
      fetch comes from the block's home or from a rank that fetched it in a strictly earlier
      division (its receive is complete before the relay's phase is launched);
    * no rank returns a partial to itself or twice; every return goes to the block's home or to
      a rank that returns the same block in a strictly later division (it waits for the partial
      and adds it before sending on).

    Raises:
        PlanError: naming the first route that breaks a rule.
    """
    br = plan.placement.block_rank
    nb = max(plan.workload.n_blocks, 1)
    fr, fk, fb, fd, fs = (t[f"fetch_{c}"] for c in ("rank", "kind", "block", "div", "src"))
    if np.any(br[fb] == fr) or np.any(fs == fr):
        raise PlanError("routes: a rank fetches a block it holds, or from itself")
    keys = _Keys((fr * 2 + fk) * nb + fb)
    if keys.duplicates():
        raise PlanError("routes: a rank fetches the same block twice")
    relay = br[fb] != fs
    found, src_div = keys.lookup(fd, (fs * 2 + fk) * nb + fb)
    bad = relay & ~(found & (src_div < fd))
    if np.any(bad):
        i = int(np.nonzero(bad)[0][0])
        raise PlanError(f"routes: rank {fr[i]} fetches block {fb[i]} from rank {fs[i]} in division {fd[i]}, "
                        f"which is not its home and does not hold it earlier")
    for side in _SIDES:
        rr, rb, rd, rt = (t[f"ret_{side}_{c}"] for c in ("rank", "block", "div", "dst"))
        if np.any(rt == rr) or np.any(br[rb] == rr):
            raise PlanError(f"routes: a {side} partial is returned by its home rank or to the sender itself")
        keys = _Keys(rr * nb + rb)
        if keys.duplicates():
            raise PlanError(f"routes: a rank returns its {side} partial of one block twice")
        relay = br[rb] != rt
        found, dst_div = keys.lookup(rd, rt * nb + rb)
        bad = relay & ~(found & (dst_div > rd))
        if np.any(bad):
            i = int(np.nonzero(bad)[0][0])
            raise PlanError(f"routes: rank {rr[i]} returns its {side} partial of block {rb[i]} to rank {rt[i]} after "
                            f"division {rd[i]}, which is not its home and does not pass it on later")
