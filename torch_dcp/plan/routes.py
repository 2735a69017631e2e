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

__all__ = ["ROUTERS", "route_tables", "check_routes", "direct_routes", "ring_routes", "node_routes", "rail_routes"]

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


def node_routes(plan: "Plan", outside: bool = False) -> dict[str, np.ndarray]:
    """Direct routes with every inter-node fetch deduplicated and every inter-node return
    pre-reduced per node (see :attr:`Routing.NODE`; ``outside``: :attr:`Routing.RAILS`).

    * Fetches: every (kind, block) that ranks of a node fetch from another node crosses into
      it once. One rank of the node (the block's gateway there) fetches it from the home one
      division before any other of them needs it (before division 0: in the opening phase,
      division ``-1``); the others get it from the gateway over NVLink. The gateway is one of
      the ranks that need the block or, with ``outside``, where that puts the crossing on less
      loaded links, another rank of the node, which only passes it on (so a block one rank
      needs may come through another rank's rail too).
    * Returns: of the ranks of one node returning partials of the same block to another node,
      one of those finishing last (the node's reducer for that block) gets the others'
      partials over NVLink, adds them to its own and sends the sum home once. It sends after
      its own last division, or one division later when another rank of its node finishes in
      the same division (after the last division: the plan's closing return phase, ``2T + 1``).
      Where the home's rail is loaded and a later phase is left, the sum (or a single rank's
      partial) crosses to another rank of the home's node instead (a relay holding no partial
      of that block), which sends it home over NVLink one division later.

    Gateways, reducers and relays are chosen to spread the load over links (greedily, largest
    first; see :class:`_LinkLoads`): a crossing rides the rail of
    :meth:`~torch_dcp.topology.Topology.rail_out_index` out of the sending node and the
    receiver's rail into its node (with NCCL's PXN, the receiver's rail at both ends). Choosing
    the first rank every time puts most of a node's traffic on one rail (3.3x the mean rail
    bytes on the paper's corpus batch on DGX H100); a window-masked document split between two
    nodes crosses on the rails of the few ranks at the split unless the gateways and relays
    are other ranks.
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
    # groups with a choice: the ranks of a node fetching one (kind, block) from another node
    # (earliest division first; with ``outside``, one rank too: its gateway may be another
    # rank), or two or more returning partials of one block to another node (latest first)
    groups = {"fetch": _groups((node * 2 + fk) * nb + fb, remote, (fr[remote], fd[remote]), 1 if outside else 2)}
    ret = {side: (t[f"ret_{side}_div"].copy(), t[f"ret_{side}_dst"].copy()) for side in _SIDES}
    for side in _SIDES:
        rr, rb = t[f"ret_{side}_rank"], t[f"ret_{side}_block"]
        rd, rt = ret[side]
        out = np.nonzero(topo.node_of(rr) != topo.node_of(rt))[0]
        groups[side] = _groups(topo.node_of(rr) * nb + rb, out, (rr[out], -rd[out]), 2)
    loads.charge_fixed(t, groups, fetch_bytes)
    # every group a job: its bytes, its members' ranks, how many of them may be chosen (a
    # reducer: only those finishing in the group's last division, its first rows), and the home
    kinds = ("fetch", *_SIDES)
    size, ranks, lengths, allowed, homes = [], [], [], [], []
    for kind in kinds:
        rows, ptr = groups[kind]
        first, length = rows[ptr[:-1]], np.diff(ptr)
        lengths.append(length)
        if kind == "fetch":
            size.append(np.asarray(fetch_bytes[first], np.float64))
            ranks.append(fr[rows])
            allowed.append(length)
            homes.append(src[first])
        else:
            size.append(np.asarray(loads.return_bytes(kind, t[f"ret_{kind}_block"][first]), np.float64))
            ranks.append(t[f"ret_{kind}_rank"][rows])
            rd = ret[kind][0][rows]
            top = rd == np.repeat(rd[ptr[:-1]], length)
            allowed.append(np.bincount(np.repeat(np.arange(len(length)), length)[top], minlength=len(length)))
            homes.append(ret[kind][1][first])
    size_a = np.concatenate(size)
    # the choices, one group after another in plain Python (groups hold a handful of ranks:
    # NumPy's per-call cost would dominate), largest first while links are open
    loads.to_lists()
    rank_l, size_l, home_l = np.concatenate(ranks).tolist(), size_a.tolist(), np.concatenate(homes).tolist()
    length_l, allowed_l = np.concatenate(lengths).tolist(), np.concatenate(allowed).tolist()
    start_l = (np.cumsum(length_l) - length_l).tolist()
    n_fetch = len(lengths[0])
    chosen = [0] * len(size_l)  # each group's chosen rank
    for i in np.argsort(-size_a, kind="stable").tolist():
        a = start_l[i]
        if i < n_fetch:
            chosen[i] = loads.pick_gateway(rank_l[a:a + length_l[i]], home_l[i], size_l[i], outside)
        else:
            chosen[i] = loads.pick_reducer(rank_l[a:a + allowed_l[i]], length_l[i], home_l[i], size_l[i])
    # written back in one go per table: every member's new peer (the chosen rank), the chosen
    # row's peer kept (the home) and its new division; a gateway that needs no block of its
    # own gets a fetch row
    at, added = 0, {}
    for kind, length, top in zip(kinds, lengths, allowed):
        rows, ptr = groups[kind]
        pick = np.asarray(chosen[at:at + len(length)], np.int64)
        at += len(length)
        div_arr, peer_arr = (fd, src) if kind == "fetch" else ret[kind]
        own = fr if kind == "fetch" else t[f"ret_{kind}_rank"]
        first_div, home = div_arr[rows[ptr[:-1]]], peer_arr[rows[ptr[:-1]]]
        is_pick = own[rows] == np.repeat(pick, length)
        picked, group_of = rows[is_pick], np.repeat(np.arange(len(length)), length)[is_pick]
        peer_arr[rows] = np.repeat(pick, length)
        peer_arr[picked] = home[group_of]
        if kind == "fetch":  # strictly before every other member's first use
            div_arr[picked] = first_div[group_of] - (length[group_of] > 1)
            apart = np.ones(len(length), bool)  # groups whose gateway is no member
            apart[group_of] = False
            g = np.nonzero(apart)[0]
            first = rows[ptr[:-1]][g]
            added = {"rank": pick[g], "kind": fk[first], "block": fb[first], "div": first_div[g] - 1, "src": home[g]}
        else:  # strictly after every partial it adds: one later where another finishes with it
            div_arr[picked] = first_div[group_of] + (top[group_of] > 1)
    t["fetch_div"], t["fetch_src"] = fd, src
    for c, v in added.items():
        t[f"fetch_{c}"] = np.concatenate([t[f"fetch_{c}"], v]).astype(np.int64)
    for side in _SIDES:
        t[f"ret_{side}_div"], t[f"ret_{side}_dst"] = ret[side]
        _relay_returns(plan, t, side, loads)
    return t


def _relay_returns(plan: "Plan", t: dict[str, np.ndarray], side: str, loads: "_LinkLoads") -> None:
    """Relays on the home's node for the ``side`` returns that cross nodes (see
    :func:`node_routes`), in place: a crossing whose division leaves a later phase may land on
    another rank of the home's node that returns no partial of the block, which sends it home
    one division later, where that puts the crossing on less loaded links."""
    topo, nb, T = plan.topology, max(plan.workload.n_blocks, 1), plan.divisions
    rr, rb, rd, rt = (t[f"ret_{side}_{c}"] for c in ("rank", "block", "div", "dst"))
    home = plan.placement.block_rank[rb]
    cross = np.nonzero((topo.node_of(rr) != topo.node_of(rt)) & (rt == home) & (rd < T))[0]
    if len(cross) == 0:
        return
    nbytes = np.asarray(loads.return_bytes(side, rb[cross]), np.float64)
    order = np.argsort(-nbytes, kind="stable")
    cross, nbytes = cross[order], nbytes[order]
    returners = set((rr * nb + rb).tolist())
    rpn = topo.ranks_per_node
    dst = rt.copy()
    for i, s, b, h, n in zip(cross.tolist(), rr[cross].tolist(), rb[cross].tolist(), home[cross].tolist(),
                             nbytes.tolist()):
        base = h // rpn * rpn
        others = [x for x in range(base, base + rpn) if x != h and x * nb + b not in returners]
        dst[i] = loads.pick_relay(s, h, others, n)
        returners.add(dst[i] * nb + b)  # one relay per (rank, block): its one return home
    relayed = np.nonzero(dst != rt)[0]
    t[f"ret_{side}_dst"] = dst
    for c, v in (("rank", dst[relayed]), ("block", rb[relayed]), ("div", rd[relayed] + 1), ("dst", rt[relayed])):
        t[f"ret_{side}_{c}"] = np.concatenate([t[f"ret_{side}_{c}"], v]).astype(np.int64)


class _LinkLoads:
    """Seconds of traffic (both passes) on every NVLink port and network rail, in and out, as
    :func:`node_routes` assigns gateways, reducers and relays."""

    def __init__(self, plan: "Plan"):
        topo = plan.topology
        self.topo, self.blen = topo, plan.workload.block_len
        itb = item_token_bytes(plan.batch)
        self.per_token = {  # bytes per token, forward + backward
            "fetch": np.array([itb[(False, Buf.Q)] + itb[(True, Buf.Q)], itb[(False, Buf.KV)] + itb[(True, Buf.KV)]]),
            "q": itb[(False, Buf.OPART)] + itb[(True, Buf.DQ)], "kv": itb[(True, Buf.DKV)]}
        n_rails = topo.n_nodes * topo.rails_per_node
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
        groups with a choice (``groups``: per table, CSR from :func:`_groups`) and the NVLink
        hops of all the groups' members (the chosen one's is refunded); a group's crossing is
        charged as it is chosen."""
        topo = self.topo

        def members(kind: str) -> tuple[np.ndarray, np.ndarray]:
            """All rows of the groups, and each row's group (in group order)."""
            rows, ptr = groups[kind]
            return rows, np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))

        # np.add.at adds in the order of its indices: the same sums as one group after another
        rows, group = members("fetch")
        keep = np.ones(len(t["fetch_rank"]), bool)
        keep[rows] = False
        np.add.at(self.port["in"], t["fetch_rank"][rows], fetch_bytes[rows] / topo.intra_bandwidth)
        self.add(t["fetch_src"][keep], t["fetch_rank"][keep], fetch_bytes[keep])
        for side in _SIDES:
            rr, rb, rt = (t[f"ret_{side}_{c}"] for c in ("rank", "block", "dst"))
            rows, group = members(side)
            keep = np.ones(len(rr), bool)
            keep[rows] = False
            np.add.at(self.port["out"], rr[rows], self.return_bytes(side, rb[rows]) / topo.intra_bandwidth)
            self.add(rr[keep], rt[keep], self.return_bytes(side, rb[keep]))

    def to_lists(self) -> None:
        """The loads as Python lists from here on, for the per-group choices."""
        topo = self.topo
        self.rail = {way: v.tolist() for way, v in self.rail.items()}
        self.port = {way: v.tolist() for way, v in self.port.items()}
        ranks = np.arange(topo.world_size)
        self.rail_base = (topo.node_of(ranks) * topo.rails_per_node).tolist()  # a node's first rail
        self.rail_of = topo.rail_of(ranks).tolist()
        self.pxn, self.rpn = bool(topo.pxn), topo.ranks_per_node
        self.rail_bw, self.intra_bw = float(topo.rail_bandwidth), float(topo.intra_bandwidth)

    def _charge(self, src: int, dst: int, on_rail: float, ports: tuple) -> None:
        """Add a crossing ``src -> dst`` of ``on_rail`` seconds and ``ports`` (``(way, rank,
        seconds)`` NVLink loads) to the links."""
        self.rail["out"][self.rail_base[src] + self.rail_of[dst if self.pxn else src]] += on_rail
        self.rail["in"][self.rail_base[dst] + self.rail_of[dst]] += on_rail
        for way, r, s in ports:
            self.port[way][r] += s

    # The picks below compare the most loaded link once a choice's loads are added, rounded to
    # the picosecond so that ties go to the first whatever order the loads were summed in; the
    # loops are written out (no helper call per candidate: they run for every group of every
    # candidate plan).

    def pick_gateway(self, members: list[int], home: int, nbytes: float, outside: bool) -> int:
        """The gateway (a rank) of a block that ``members`` of a node fetch from ``home``: the
        one, among them (and with ``outside`` the node's other ranks), whose crossing and NVLink
        port out (the fan-out) leave the most loaded link least loaded (a member first on a tie)."""
        on_rail, hop = nbytes / self.rail_bw, nbytes / self.intra_bw
        n = len(members)
        base = members[0] // self.rpn * self.rpn
        cands = members + [r for r in range(base, base + self.rpn) if r not in members] if outside else members
        rail_out, rail_in, port_out = self.rail["out"], self.rail["in"], self.port["out"]
        rail_of, rail_base, out_base = self.rail_of, self.rail_base, self.rail_base[home]
        fixed_out = None if self.pxn else rail_out[out_base + rail_of[home]]
        best, pick = None, 0
        for i, r in enumerate(cands):
            a = rail_out[out_base + rail_of[r]] if fixed_out is None else fixed_out
            b = rail_in[rail_base[r] + rail_of[r]]
            a = (a if a > b else b) + on_rail
            c = port_out[r] + hop * (n - 1 if i < n else n)
            key = round((a if a > c else c) * 1e12)
            if best is None or key < best:
                best, pick = key, i
        g = cands[pick]
        self._charge(home, g, on_rail, (("out", g, hop * (n - 1 if pick < n else n)),))
        if pick < n:  # its own hop was charged as a member's
            self.port["in"][g] -= hop
        return g

    def pick_reducer(self, allowed: list[int], n_members: int, home: int, nbytes: float) -> int:
        """The reducer (a rank) among ``allowed`` (the first of a group of ``n_members``) of
        partials returned to ``home``: its crossing and NVLink port in least loaded."""
        on_rail, hop = nbytes / self.rail_bw, nbytes / self.intra_bw
        fan = hop * (n_members - 1)
        rail_out, port_in, rail_of, rail_base = self.rail["out"], self.port["in"], self.rail_of, self.rail_base
        into = self.rail["in"][rail_base[home] + rail_of[home]]
        best, g = None, -1
        for r in allowed:
            a = rail_out[rail_base[r] + rail_of[home if self.pxn else r]]
            a = (a if a > into else into) + on_rail
            c = port_in[r] + fan
            key = round((a if a > c else c) * 1e12)
            if best is None or key < best:
                best, g = key, r
        self._charge(g, home, on_rail, (("in", g, fan),))
        self.port["out"][g] -= hop  # its own hop was charged as a member's
        return g

    def pick_relay(self, sender: int, home: int, others: list[int], nbytes: float) -> int:
        """Where ``sender``'s crossing return to ``home`` lands (charged already): ``home``, or
        one of ``others`` on its node (which sends it on over NVLink) whose links end least
        loaded (``home`` on a tie)."""
        on_rail, hop = nbytes / self.rail_bw, nbytes / self.intra_bw
        self._charge(sender, home, -on_rail, ())
        rail_out, rail_in, port_out = self.rail["out"], self.rail["in"], self.port["out"]
        rail_of, rail_base, out_base = self.rail_of, self.rail_base, self.rail_base[sender]
        into_home = self.port["in"][home] + hop
        best, g = None, home
        for x in [home] + others:
            a = rail_out[out_base + rail_of[x if self.pxn else sender]]
            b = rail_in[rail_base[x] + rail_of[x]]
            a = (a if a > b else b) + on_rail
            if x != home:
                c = port_out[x] + hop
                c = c if c > into_home else into_home
                a = a if a > c else c
            key = round(a * 1e12)
            if best is None or key < best:
                best, g = key, x
        self._charge(sender, g, on_rail, (("out", g, hop), ("in", home, hop)) if g != home else ())
        return g


def _groups(key: np.ndarray, rows: np.ndarray, order_by: tuple[np.ndarray, ...],
            least: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` grouped by ``key[rows]``, each group sorted by ``order_by`` (arrays over
    ``rows``, last one first, as ``np.lexsort``); only groups of ``least`` or more rows, as CSR:
    their rows one group after another, and the offsets of the groups (one more than groups)."""
    order = rows[np.lexsort((*order_by, key[rows]))]
    k = key[order]
    new = np.concatenate(([True], k[1:] != k[:-1])) if len(order) else np.zeros(0, bool)
    length = np.diff(np.append(np.nonzero(new)[0], len(order)))
    multi = length >= least
    ptr = np.concatenate(([0], np.cumsum(length[multi]))).astype(np.int64)
    return order[np.repeat(multi, length)], ptr


def rail_routes(plan: "Plan") -> dict[str, np.ndarray]:
    """:func:`node_routes` with gateways anywhere on the receiving node (:attr:`Routing.RAILS`)."""
    return node_routes(plan, outside=True)


#: routing -> ``fn(plan) -> tables``: the one table of route builders.
ROUTERS: dict[Routing, Callable[["Plan"], dict[str, np.ndarray]]] = {
    Routing.DIRECT: direct_routes,
    Routing.RING: ring_routes,
    Routing.NODE: node_routes,
    Routing.RAILS: rail_routes,
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
