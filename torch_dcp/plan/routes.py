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

from typing import TYPE_CHECKING, Callable

import numpy as np

from ..planners.base import Routing
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
        uniq, inv = np.unique(code, return_inverse=True)
        first = np.full(len(uniq), np.iinfo(np.int64).max)
        np.minimum.at(first, inv, td[remote])
        last = np.full(len(uniq), -1)
        np.maximum.at(last, inv, td[remote])
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

    * Fetches: of the ranks of one node fetching the same (kind, block) from another node, the
      one needing it first (lowest rank on ties) fetches it from the home in the division
      before (for division 0: the opening phase, division ``-1``), the others from it in
      their own divisions.
    * Returns: of the ranks of one node returning partials of the same block to another node,
      the one finishing last (lowest rank on ties) is the node's reducer: the others send their
      partials to it over NVLink, it adds them to its own and sends the sum home once. It
      sends after its own last division, or one division later when another rank of its node
      finishes in the same division (after the last division: the plan's closing return phase,
      ``2T + 1``)."""
    t = direct_routes(plan)
    topo = plan.topology
    fr, fk, fb, fd = t["fetch_rank"], t["fetch_kind"], t["fetch_block"], t["fetch_div"].copy()
    src = t["fetch_src"].copy()
    node = topo.node_of(fr)
    remote = node != topo.node_of(src)
    sel = np.nonzero(remote)[0]
    if len(sel):
        nb = max(plan.workload.n_blocks, 1)
        key = (node * 2 + fk) * nb + fb
        order, first, group = _groups(key, sel, (fr[sel], fd[sel]))  # first division, then rank, leads
        size = np.bincount(group)
        gate = order[first]  # the gateway row of every group
        dedup = size[group] > 1
        rows = order[dedup & ~first]
        src[rows] = fr[gate[group[dedup & ~first]]]
        fd[gate[size > 1]] -= 1  # division -1: the opening phase
    t["fetch_div"], t["fetch_src"] = fd, src
    for side in _SIDES:
        _reduce_in_node(plan, t, side)
    return t


def _groups(key: np.ndarray, rows: np.ndarray, order_by: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """``rows`` grouped by ``key[rows]``, inside each group sorted by ``order_by`` (arrays over
    ``rows``, last one first, as ``np.lexsort``): ``(order, first, group)`` -- the sorted rows,
    whether each leads its group, and its group's index."""
    order = rows[np.lexsort((*order_by, key[rows]))]
    k = key[order]
    first = np.ones(len(order), bool)
    first[1:] = k[1:] != k[:-1]
    return order, first, np.cumsum(first) - 1


def _reduce_in_node(plan: "Plan", t: dict[str, np.ndarray], side: str) -> None:
    """Reroute ``side``'s direct inter-node returns through one reducer per (node, block) (see
    :func:`node_routes`), in place."""
    topo = plan.topology
    rr, rb = t[f"ret_{side}_rank"], t[f"ret_{side}_block"]
    rd, rt = t[f"ret_{side}_div"].copy(), t[f"ret_{side}_dst"].copy()
    node = topo.node_of(rr)
    sel = np.nonzero(node != topo.node_of(rt))[0]
    if len(sel):
        nb = max(plan.workload.n_blocks, 1)
        order, first, group = _groups(node * nb + rb, sel, (rr[sel], -rd[sel]))  # latest division, then rank, leads
        gate = order[first]  # the reducer of every group
        members = order[~first]
        reducer = gate[group[~first]]
        rt[members] = rr[reducer]
        tied = np.zeros(len(gate), bool)
        tied[group[~first][rd[members] == rd[reducer]]] = True
        rd[gate[tied]] += 1  # strictly after every partial it adds
    t[f"ret_{side}_div"], t[f"ret_{side}_dst"] = rd, rt


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


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` at the positions of ``query`` in the unique ``keys`` (found mask, values)."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    pos = np.clip(np.searchsorted(sk, query), 0, max(len(sk) - 1, 0))
    found = (sk[pos] == query) if len(sk) else np.zeros(len(query), bool)
    return found, values[order][pos] if len(sk) else np.zeros(len(query), np.int64)


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
    key = (fr * 2 + fk) * nb + fb
    if len(np.unique(key)) != len(key):
        raise PlanError("routes: a rank fetches the same block twice")
    relay = br[fb] != fs
    found, src_div = _lookup(key, fd, (fs * 2 + fk) * nb + fb)
    bad = relay & ~(found & (src_div < fd))
    if np.any(bad):
        i = int(np.nonzero(bad)[0][0])
        raise PlanError(f"routes: rank {fr[i]} fetches block {fb[i]} from rank {fs[i]} in division {fd[i]}, "
                        f"which is not its home and does not hold it earlier")
    for side in _SIDES:
        rr, rb, rd, rt = (t[f"ret_{side}_{c}"] for c in ("rank", "block", "div", "dst"))
        if np.any(rt == rr) or np.any(br[rb] == rr):
            raise PlanError(f"routes: a {side} partial is returned by its home rank or to the sender itself")
        key = rr * nb + rb
        if len(np.unique(key)) != len(key):
            raise PlanError(f"routes: a rank returns its {side} partial of one block twice")
        relay = br[rb] != rt
        found, dst_div = _lookup(key, rd, rt * nb + rb)
        bad = relay & ~(found & (dst_div > rd))
        if np.any(bad):
            i = int(np.nonzero(bad)[0][0])
            raise PlanError(f"routes: rank {rr[i]} returns its {side} partial of block {rb[i]} to rank {rt[i]} after "
                            f"division {rd[i]}, which is not its home and does not pass it on later")
