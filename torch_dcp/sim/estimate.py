"""A fast estimate of a plan's simulated time: division by division, in NumPy.

:func:`torch_dcp.sim.simulate.simulate` compiles every rank's programs and replays them event by
event; timing the dozens of candidates a default ``torch_dcp.plan(..., planner="dcp")`` offers
that way is most of its planning time. :func:`estimate_seconds` follows the same programs at
the level of divisions instead of instructions, with every rank and transfer of a division in
one array operation:

* rank ``r``'s division ``d`` computes for its attention launch (timed as the simulator times
  it: :func:`torch_dcp.sim.floors.division_launch_seconds`);
* the inputs of division ``d + 1`` are fetched while division ``d`` computes (the compiler
  launches phase ``2(d + 1)`` before division ``d``'s attention), and the partials whose last
  use was division ``d`` are returned while division ``d + 1`` computes; a transfer starts
  when both of its ranks have launched its phase;
* a link (an NVLink port per rank and direction inside a node, a rail per node and direction
  between nodes, as in the simulator) carries every transfer of a window one after another:
  each of them is taken to end when the link's whole load of the window has passed (a fluid
  model of the simulator's first-come, first-served queue);
* a rank starts division ``d + 1`` when its attention of ``d`` and every transfer of the phase
  it takes part in have ended; it finishes when its last division and every return it sends or
  receives have ended, plus its local copies and the final merge of its partials.

What it leaves out: relays waiting for the partials they pass on, and the gaps the simulator
back-fills across windows. It orders candidates; the simulator decides among the best few
(:func:`torch_dcp.plan`). How well it orders them is measured by ``python -m
torch_dcp.benchmarks scale --calibrate``.
"""

from __future__ import annotations

import numpy as np

from ..cost import CostModel
from ..plan import Plan
from ..plan.heads import HeadParallelPlan
from ..planners.base import Runtime
from .floors import division_launch_seconds
from ..workload import Buf, item_token_bytes

__all__ = ["estimate_seconds", "pass_estimate_seconds"]


def estimate_seconds(plan: Plan | HeadParallelPlan, cost_model: CostModel | None = None) -> float:
    """Estimated forward + backward time of ``plan`` (seconds; see the module docstring), a
    head-parallel plan's as its outer plan's plus its all-to-alls (as :func:`simulate` adds
    them), a plan on the all-gather runtime's as its closed form
    (:func:`torch_dcp.sim.runtimes.simulate_allgather`), a ring on its own runtime's by the
    ring's step formula (:func:`torch_dcp.sim.runtimes.ring_estimate_seconds`).

    Args:
        plan: a :class:`Plan` or :class:`~torch_dcp.plan.heads.HeadParallelPlan`.
        cost_model: kernel and memory times (default: the A100 table).
    """
    cm = cost_model or CostModel.a100()
    if isinstance(plan, HeadParallelPlan):
        from .runtimes import head_exchange_seconds

        return estimate_seconds(plan.outer, cm) + head_exchange_seconds(plan, cm)
    if plan.placement.runtime.gathers:  # both passes at once
        from .runtimes import simulate_allgather

        return simulate_allgather(plan, cm).makespan_s
    from .runtimes import ring_estimate_seconds, ring_priced_as_executor

    # a ring on its own runtime by its steps (TransformerEngine's always; torch_dcp's unless the
    # model prices it as the executor runs it)
    rt = plan.placement.runtime
    if rt is Runtime.TE_RING or (rt is Runtime.DCP_RING and not ring_priced_as_executor(cm)):
        return ring_estimate_seconds(plan, cm)
    return sum(pass_estimate_seconds(plan, cm, backward) for backward in (False, True))


def _transfers(plan: Plan, backward: bool) -> tuple[np.ndarray, ...]:
    """The pass's transfers: ``(src, dst, bytes, division, is_fetch)``; a fetch's division is
    the one that needs it (-1: the gateway's opening phase), a return's the last that used it
    (``T``: the closing phase)."""
    wl, t = plan.workload, plan.tables
    itb = item_token_bytes(plan.batch)
    blen = wl.block_len.astype(np.float64)
    per_tok = np.where(t["fetch_kind"] == 0, itb[(backward, Buf.Q)], itb[(backward, Buf.KV)])
    parts = [(t["fetch_src"], t["fetch_rank"], per_tok * blen[t["fetch_block"]], t["fetch_div"], True)]
    sides = (("q", Buf.DQ), ("kv", Buf.DKV)) if backward else (("q", Buf.OPART),)
    for side, kind in sides:
        parts.append((t[f"ret_{side}_rank"], t[f"ret_{side}_dst"], itb[(backward, kind)] * blen[t[f"ret_{side}_block"]],
                      t[f"ret_{side}_div"], False))
    src, dst, nbytes, div = (np.concatenate([np.asarray(p[i]) for p in parts]) for i in range(4))
    fetch = np.concatenate([np.full(len(p[0]), p[4]) for p in parts])
    return src.astype(np.int64), dst.astype(np.int64), nbytes.astype(np.float64), div.astype(np.int64), fetch


def pass_estimate_seconds(plan: Plan, cost_model: CostModel, backward: bool) -> float:
    """Estimated makespan of one pass of ``plan`` (seconds; see the module docstring; on the
    all-gather runtime its closed form, :func:`torch_dcp.sim.runtimes.simulate_allgather`)."""
    if plan.placement.runtime.gathers:
        from .runtimes import simulate_allgather

        result = simulate_allgather(plan, cost_model)
        return (result.backward if backward else result.forward).makespan_s
    cm, topo = cost_model, plan.topology
    w, n_div = plan.world_size, plan.divisions
    launch = division_launch_seconds(plan, cm, backward)  # [W, T]
    src, dst, nbytes, div, fetch = _transfers(plan, backward)
    # one message per (phase, sender, receiver), as the executor sends them
    phase = np.where(fetch, 2 * div, 2 * div + 1)
    key = (phase + 2) * (w * w) + src * w + dst
    # np.unique(key, return_inverse=True) with one sort and without its generic wrapping
    order = np.argsort(key, kind="stable")
    first = np.ones(len(key), bool)
    first[1:] = key[order[1:]] != key[order[:-1]]
    uniq = key[order[first]]
    inv = np.empty(len(key), np.int64)
    inv[order] = np.cumsum(first) - 1
    msg_bytes = np.bincount(inv, weights=nbytes, minlength=len(uniq))
    m_phase = uniq // (w * w) - 2
    m_src, m_dst = (uniq % (w * w)) // w, uniq % w
    inter = topo.node_of(m_src) != topo.node_of(m_dst)
    dur = np.where(inter, topo.inter_latency + msg_bytes / topo.rail_bandwidth,
                   topo.intra_latency + msg_bytes / topo.intra_bandwidth)
    # the window a message travels in: fetches of d during division d - 1 (the opening phases
    # before division 0: windows -2 and -1), returns of d during division d + 1
    fetch_m = m_phase % 2 == 0
    window = np.where(fetch_m, np.where(m_phase < 0, -2, m_phase // 2 - 1), (m_phase - 1) // 2 + 1)
    # links: port out / in of a rank inside a node, rail out / in of a node between nodes
    n_rails = topo.n_nodes * topo.rails_per_node
    out_link = np.where(inter, 2 * w + topo.rail_out_index(m_src, m_dst), m_src)
    in_link = np.where(inter, 2 * w + n_rails + topo.rail_index(m_dst), w + m_dst)
    n_links = 2 * w + 2 * n_rails
    n_win = n_div + 4  # windows -2 .. T + 1
    wslot = window + 2
    # every message's duration added to its two links' loads in message order (as np.add.at;
    # a link is either a sender's or a receiver's, so no bin mixes the two)
    cells = np.concatenate([wslot * n_links + out_link, wslot * n_links + in_link])
    load = np.bincount(cells, weights=np.concatenate([dur, dur]), minlength=n_win * n_links).reshape(n_win, n_links)
    busy = np.maximum(load[wslot, out_link], load[wslot, in_link])  # each message's link's load

    # local copies before the first division, the final merge after the last (memory time)
    itb = item_token_bytes(plan.batch)
    local = np.bincount(plan.placement.block_rank, weights=plan.workload.block_len, minlength=w).astype(np.float64)
    q_row, kv_row = itb[(backward, Buf.Q)], itb[(backward, Buf.KV)]
    merged = np.bincount(m_dst[~fetch_m], weights=msg_bytes[~fetch_m], minlength=w)
    out_row = (itb[(True, Buf.DQ)] + itb[(True, Buf.DKV)]) if backward else itb[(False, Buf.OPART)]
    copies = cm.memory_seconds_array(2.0 * local * (q_row + kv_row))
    final = cm.memory_seconds_array(2.0 * local * out_row + merged)

    clock = copies.copy()

    def run_phase(sel: np.ndarray, start_of: np.ndarray) -> np.ndarray:
        """End of the messages ``sel`` for every rank taking part (0 for the others), each
        starting when both of its ranks launched it (``start_of[rank]``)."""
        end = np.maximum(start_of[m_src[sel]], start_of[m_dst[sel]]) + busy[sel]
        done = np.zeros(w)
        np.maximum.at(done, np.concatenate([m_src[sel], m_dst[sel]]), np.concatenate([end, end]))
        return done

    # the opening phases, waited before division 0
    for p in (-2, 0):
        sel = m_phase == p
        if sel.any():
            clock = np.maximum(clock, run_phase(sel, clock))
    ret_end = np.zeros(w)
    for d in range(n_div):
        start = clock
        att_end = start + launch[:, d]
        sel = m_phase == 2 * (d + 1)
        fetched = run_phase(sel, start) if d + 1 < n_div and sel.any() else np.zeros(w)
        sel = m_phase == 2 * d + 1
        if sel.any():
            ret_end = np.maximum(ret_end, run_phase(sel, att_end))
        clock = np.maximum(att_end, fetched)
    sel = m_phase == 2 * n_div + 1  # the closing phase
    if sel.any():
        ret_end = np.maximum(ret_end, run_phase(sel, clock))
    return float((np.maximum(clock, ret_end) + final).max(initial=0.0))
