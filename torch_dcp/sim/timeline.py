"""The timeline a plan's programs run on: each rank's compute stream and its links, forward and
backward (:func:`simulate_programs`), and the results every runtime's simulation returns
(:class:`SimResult`, :class:`PassResult`).

Each rank has one compute stream that runs ``BlockwiseCopy``, ``BlockwiseAttention`` and
``BlockwiseReduction`` one after another (times from the :class:`~torch_dcp.cost.CostModel`).
``CommLaunch`` starts the phase's transfers at the current compute time and does not block;
``CommWait`` blocks the compute stream until every transfer of the phase that involves the
rank has finished. A transfer (one message per sender, receiver and phase, as the executor
sends them) starts when both ends have launched the phase and the sender's outgoing link
and the receiver's incoming link are free, and takes the link class's latency + bytes over
bandwidth: concurrent transfers of one rank share its link one after another. A transfer
takes the earliest time from which all its links are free for its duration, so a link is
never left idle while a ready transfer could use it, even when a later transfer already holds
it (gaps are back-filled). Inside a node each rank has its own NVLink/NVSwitch port
(``Topology.intra_bandwidth`` per direction).
Between nodes a transfer uses a rail out of the sender's node (``Topology.rail_out_index``:
with NCCL's PXN, the receiver's rail) and the receiver's rail into its node
(``Topology.rail_bandwidth`` each; a node's rails together are its
``inter_bandwidth``): ranks on different rails send at once, ranks sharing a rail queue on it.

The ideal bound is the total compute time of all ranks spread perfectly evenly with no
exposed communication. The runtimes (:mod:`torch_dcp.sim.runtimes`) run their plans on this
timeline with their own costs; :func:`torch_dcp.sim.simulate.simulate` picks the plan's.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq

import numpy as np

from ..batch import BatchSpec
from ..cost import CostModel, Links
from ..cost.executor import memory_kind
from ..plan import BlockwiseAttention, BlockwiseCopy, BlockwiseReduction, CommLaunch, CommWait, Plan, dispatch
from ..workload import Buf, item_token_bytes
from .floors import kernel_floor_seconds, link_floor_seconds

__all__ = ["simulate_programs", "SimResult", "PassResult", "PRUNE_MARGIN", "instruction_bytes", "pass_row_bytes",
           "pass_local_bytes", "send_bytes"]


@dataclasses.dataclass(frozen=True)
class PassResult:
    """One pass (forward or backward).

    Attributes:
        makespan_s: time until the last rank finishes.
        busy_s, exposed_comm_s, idle_s, finish_s: float64 ``[world_size]`` per rank: compute
            time, time blocked in ``CommWait``, time idle after finishing until the makespan,
            and finish time.
        events: per rank, ``(kind, start_s, end_s)`` of every compute instruction and wait
            (for timelines).
    """

    makespan_s: float
    busy_s: np.ndarray
    exposed_comm_s: np.ndarray
    idle_s: np.ndarray
    finish_s: np.ndarray
    events: list[list[tuple[str, float, float]]]


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Forward + backward simulation of a plan.

    Attributes:
        forward, backward: the two passes.
        makespan_s: forward + backward makespans (seconds).
        ideal_s: total compute time of all ranks over the world size, both passes.
    """

    forward: PassResult
    backward: PassResult
    makespan_s: float
    ideal_s: float

    @property
    def ratio_to_ideal(self) -> float:
        """``makespan_s / ideal_s``: the plan's time over the compute floor (1.0 when empty)."""
        return self.makespan_s / self.ideal_s if self.ideal_s > 0 else 1.0


#: relative margin by which a run's lower bound must exceed the bound before
#: :func:`simulate_within` gives up (so that rounding never drops a run that would tie or win)
PRUNE_MARGIN = 1e-9

def simulate_programs(plan: Plan, cm: CostModel, bound: float = float("inf"),
                      pass_type: "type[_Pass] | None" = None) -> SimResult | None:
    """:func:`simulate_within` of ``plan``'s programs with ``cm``, each pass run by
    ``pass_type`` (default: the executor's, :class:`_Pass`)."""
    pass_type = pass_type or _Pass
    fwd = _on_shared_cores(plan, cm, pass_type(plan, cm, False).run(), False)
    if bound < float("inf"):
        floor = max(kernel_floor_seconds(plan, cm, True), link_floor_seconds(plan, True))
        if fwd.makespan_s + floor > bound * (1.0 + PRUNE_MARGIN):
            return None
    bwd = _on_shared_cores(plan, cm, pass_type(plan, cm, True).run(), True)
    ideal = (fwd.busy_s.sum() + bwd.busy_s.sum()) / plan.world_size
    return SimResult(fwd, bwd, fwd.makespan_s + bwd.makespan_s, float(ideal))


def _shared_links(cm: CostModel, world: int) -> "Links | None":
    """The model's links where ``world`` ranks share fewer cores than ranks, else None."""
    links = cm.links
    return links if links is not None and links.shares_cores and links.world_size == world else None


def _pass_traffic(plan: Plan, backward: bool) -> tuple[float, int]:
    """Bytes and transfers of one pass of ``plan``."""
    _, _, nb, fwd = plan.transfers()
    mine = fwd != backward
    return float(nb[mine].sum()), int(mine.sum())


def _on_shared_cores(plan: Plan, cm: CostModel, res: PassResult, backward: bool) -> PassResult:
    """``res`` on ranks that share fewer cores than there are ranks (a model whose measured
    :class:`~torch_dcp.cost.Links` say so, e.g. gloo ranks on a CPU): the pass takes at least
    the ranks' busy time plus its transfers' host costs, spread over the cores
    (:meth:`~torch_dcp.cost.Links.shared_seconds`); the ranks then finish together."""
    links = _shared_links(cm, plan.world_size)
    if links is None:
        return res
    span = links.shared_seconds(float(res.busy_s.sum()), *_pass_traffic(plan, backward))
    if span <= res.makespan_s:
        return res
    return dataclasses.replace(res, makespan_s=span, idle_s=span - res.finish_s,
                               finish_s=np.full_like(res.finish_s, span))

class _Link:
    """Busy intervals of one link, sorted by start (non-overlapping)."""

    __slots__ = ("starts", "ends")

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []

    def reserve(self, start: float, end: float) -> None:
        if end <= start:
            return
        if not self.starts or start > self.starts[-1]:  # after every interval: the usual case
            self.starts.append(start)
            self.ends.append(end)
            return
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)


def _row_bytes(itb: dict, backward: bool) -> dict[Buf, int]:
    """Bytes per token row of each buffer a pass copies or reduces: the rows transfers move."""
    return {Buf.Q: itb[(backward, Buf.Q)], Buf.KV: itb[(backward, Buf.KV)], Buf.OPART: itb[(False, Buf.OPART)],
            Buf.DQ: itb[(True, Buf.DQ)], Buf.DKV: itb[(True, Buf.DKV)]}


def instruction_bytes(ins: BlockwiseCopy | BlockwiseReduction, blen: np.ndarray, row_bytes: dict[Buf, int]) -> float:
    """Bytes a copy (read + write of its rows) or a reduction (every source slot read, the
    destination written) moves; ``row_bytes``: per token row of each buffer (:func:`pass_row_bytes`)."""
    if isinstance(ins, BlockwiseCopy):
        return 2.0 * float(blen[ins.blocks].sum()) * row_bytes[ins.kind]
    n_src = np.diff(ins.src_ptr)
    return float(((n_src + 1) * blen[ins.dst_block]).sum()) * row_bytes[ins.src]


def pass_row_bytes(batch: BatchSpec, backward: bool) -> dict[Buf, int]:
    """Bytes per token row of each buffer a pass copies, reduces or sends."""
    return _row_bytes(item_token_bytes(batch), backward)


def pass_local_bytes(plan: Plan, backward: bool) -> np.ndarray:
    """float64 ``[W]``: bytes of each rank's local rows in a pass (its Q and K/V rows), the size
    the executor's per-pass costs scale with (:meth:`ExecutorCosts.pass_seconds`)."""
    itb = item_token_bytes(plan.batch)
    local = np.bincount(plan.placement.block_rank, weights=plan.workload.block_len,
                        minlength=plan.world_size).astype(np.float64)
    return local * (itb[(backward, Buf.Q)] + itb[(backward, Buf.KV)])


def send_bytes(ins: CommLaunch, row_bytes: dict[Buf, int]) -> float:
    """Bytes a ``CommLaunch`` sends (the executor gathers them); ``row_bytes``: per token row of
    each buffer (:func:`pass_row_bytes`)."""
    return float(sum(tr.tokens * row_bytes[tr.kind] for tr in ins.sends))


def _memory_seconds(cm: CostModel, ins: BlockwiseCopy | BlockwiseReduction, blen: np.ndarray,
                    row_bytes: dict[Buf, int]) -> float:
    """Time of a copy or a reduction (:func:`instruction_bytes`): the executor's costs where the
    model has them, else bytes over the memory bandwidth."""
    nbytes = instruction_bytes(ins, blen, row_bytes)
    ex = cm.executor
    if ex is None:
        return cm.memory_seconds(nbytes)
    costs = ex.memory(memory_kind(ins))
    return 0.0 if costs is None else float(costs.seconds(nbytes))


def _transfer_links(topology, links: dict[tuple, _Link], src: int, dst: int) -> tuple[list[_Link], bool]:
    """The links a transfer from ``src`` to ``dst`` occupies (created in ``links`` on first
    use): the rail out of the sender's node (``Topology.rail_out_index``) and the receiver's
    rail into its node between nodes, their NVLink/NVSwitch ports inside one; and whether it
    crosses nodes."""
    ns, nd = topology.node_of(src), topology.node_of(dst)
    inter = bool(ns != nd)
    out_rail = topology.rail_of(dst if topology.pxn else src)  # Topology.rail_out_index, inside the node
    names = [("rail out", ns, out_rail), ("rail in", nd, topology.rail_of(dst))] if inter else \
        [("out", src), ("in", dst)]
    for name in names:
        if name not in links:
            links[name] = _Link()
    return [links[name] for name in names], inter


def _earliest_common_gap(links: list[_Link], ready: float, dur: float) -> float:
    """Earliest ``t >= ready`` at which every link is free for ``dur`` seconds: ``t`` moves to
    the end of the first busy interval of a link that overlaps ``[t, t + dur)`` until none does
    (written out, no call per link and step: it runs for every transfer simulated)."""
    t = ready
    bisect_right = bisect.bisect_right
    while True:
        moved = False
        for lk in links:
            starts, ends = lk.starts, lk.ends
            if not ends or t >= ends[-1]:  # after every interval (ends are sorted too)
                continue
            i = bisect_right(starts, t) - 1
            if i >= 0 and ends[i] > t:
                t, moved = ends[i], True
            elif i + 1 < len(starts) and starts[i + 1] < t + dur:
                t, moved = ends[i + 1], True
        if not moved:
            return t


class _Pass:
    """Discrete-event simulation of one pass: the rank with the earliest clock always moves
    next, so transfers become ready (both ends launched) in time order and the links serve
    them first come, first served. A consumer of the instruction table (``on_*``)."""

    def __init__(self, plan: Plan, cm: CostModel, backward: bool):
        self.plan, self.cm, self.backward = plan, cm, backward
        self.itb = plan.placement.token_bytes()
        self.blen = plan.workload.block_len
        self.row_bytes = _row_bytes(self.itb, backward)
        w = plan.world_size
        self.pc = [0] * w
        # per rank, as Python floats while the pass runs (NumPy arrays in its result)
        self.clock = [0.0] * w
        self.busy = [0.0] * w
        self.exposed = [0.0] * w
        self.events: list[list[tuple[str, float, float]]] = [[] for _ in range(w)]
        # one outgoing and one incoming NVLink/NVSwitch port per rank, one outgoing and one
        # incoming link per network rail of every node
        self.links: dict[tuple, _Link] = {}
        # (src, dst) -> its links, whether it crosses nodes, latency, bandwidth
        self.pair_links: dict[tuple[int, int], tuple[list[_Link], bool, float, float]] = {}
        self.node_l = plan.topology.node_of(np.arange(w)).tolist()
        self.rail_l = plan.topology.rail_of(np.arange(w)).tolist()
        self.launched: dict[tuple[int, int, int], list[float | None]] = {}  # key -> [send t, recv t]
        self.nbytes: dict[tuple[int, int, int], float] = {}
        self.end_of: dict[tuple[int, int, int], float] = {}
        self.phase_keys: list[dict[int, list[tuple[int, int, int]]]] = [{} for _ in range(w)]
        self.blocked: dict[int, list[tuple[int, int, int]]] = {}
        self.packed: dict[tuple[int, int], bool] = {}
        self.heap = [(0.0, r) for r in range(w)]

    # ------------------------------------------------------------------ compute instructions
    def _compute(self, r: int, t: float, kind: str, dur: float) -> None:
        self.events[r].append((kind, t, t + dur))
        self.busy[r] += dur
        self.clock[r] = t + dur
        self.pc[r] += 1
        heapq.heappush(self.heap, (self.clock[r], r))

    def on_copy(self, ins: BlockwiseCopy, r: int, t: float) -> None:
        self._compute(r, t, "copy", _memory_seconds(self.cm, ins, self.blen, self.row_bytes))

    def _attention_seconds(self, launches: list[BlockwiseAttention]) -> list[float]:
        """:meth:`CostModel.launch_seconds` of every launch, in one call."""
        if not launches:
            return []
        tiles = np.concatenate([ins.tile for ins in launches]).astype(np.int64)
        cell = np.repeat(np.arange(len(launches)), [len(ins.tile) for ins in launches])
        return self.cm.launch_seconds(self.plan.workload, tiles, cell, len(launches), self.backward).tolist()

    def on_attention(self, ins: BlockwiseAttention, r: int, t: float) -> None:
        self._compute(r, t, "attention", self.attention_s[id(ins)])

    def on_reduction(self, ins: BlockwiseReduction, r: int, t: float) -> None:
        self._compute(r, t, "reduction", _memory_seconds(self.cm, ins, self.blen, self.row_bytes))

    # ------------------------------------------------------------------ communication
    def _schedule(self, key: tuple[int, int, int]) -> None:
        topo = self.plan.topology
        s, r = self.launched[key]
        _, src, dst = key
        hit = self.pair_links.get((src, dst))
        if hit is None:  # as _transfer_links, with the ranks' nodes and rails looked up once per pass
            ns, nd = self.node_l[src], self.node_l[dst]
            inter = ns != nd
            out_rail = self.rail_l[dst if topo.pxn else src]
            names = (("rail out", ns, out_rail), ("rail in", nd, self.rail_l[dst])) if inter else \
                (("out", src), ("in", dst))
            for name in names:
                if name not in self.links:
                    self.links[name] = _Link()
            hit = self.pair_links[(src, dst)] = ([self.links[name] for name in names], inter,
                                                 topo.inter_latency if inter else topo.intra_latency,
                                                 topo.rail_bandwidth if inter else topo.intra_bandwidth)
        used, inter, latency, bandwidth = hit
        dur = latency + self.nbytes.get(key, 0.0) / bandwidth  # CostModel.transfer_seconds
        start = _earliest_common_gap(used, max(s, r), dur)
        for lk in used:
            lk.reserve(start, start + dur)
        self.end_of[key] = start + dur

    def on_launch(self, ins: CommLaunch, r: int, t: float) -> None:
        if self.cm.executor is not None and ins.sends and not self.packed.get((r, ins.phase)):
            # the executor gathers the rows it sends (compute), then posts the transfers
            self.packed[(r, ins.phase)] = True
            sent = send_bytes(ins, self.row_bytes)
            self.pc[r] -= 1  # _compute moves on; this instruction still posts its transfers
            self._compute(r, t, "pack", float(self.cm.executor.pack.seconds(sent)))
            return
        # this rank's messages of the phase (one per peer and direction, sends first), each
        # marked launched at its end; the message's bytes add up its transfers' (kinds)
        launched, nbytes, phase = self.launched, self.nbytes, ins.phase
        keys: dict[tuple[int, int, int], None] = {}
        for tr in ins.sends:
            key = (phase, r, tr.peer)
            slot = launched.get(key)
            if slot is None:
                slot = launched[key] = [None, None]
            nbytes[key] = nbytes.get(key, 0.0) + float(tr.tokens) * self.itb[(self.backward, tr.kind)]
            slot[0] = t
            keys[key] = None
        for tr in ins.recvs:
            key = (phase, tr.peer, r)
            slot = launched.get(key)
            if slot is None:
                slot = launched[key] = [None, None]
            slot[1] = t
            keys[key] = None
        scheduled = False
        for key in keys:
            if None not in launched[key] and key not in self.end_of:
                self._schedule(key)
                scheduled = True
        self.phase_keys[r][ins.phase] = list(keys)
        self.pc[r] += 1
        # ranks waiting on transfers that just got scheduled may go on (none other can)
        for q, need in list(self.blocked.items()) if scheduled else ():
            if all(k in self.end_of for k in need):
                del self.blocked[q]
                heapq.heappush(self.heap, (self.clock[q], q))
        heapq.heappush(self.heap, (t, r))

    def on_wait(self, ins: CommWait, r: int, t: float) -> None:
        need = self.phase_keys[r].get(ins.phase, [])
        if not all(k in self.end_of for k in need):
            self.blocked[r] = need
            return
        end = max([t] + [self.end_of[k] for k in need])
        if end > t:
            self.events[r].append(("wait", t, end))
        self.exposed[r] += end - t
        self.clock[r] = end
        self.pc[r] += 1
        heapq.heappush(self.heap, (end, r))

    def run(self) -> PassResult:
        plan = self.plan
        w = plan.world_size
        progs = [plan.program(r, self.backward).instructions for r in range(w)]
        launches = [ins for prog in progs for ins in prog if isinstance(ins, BlockwiseAttention)]
        self.attention_s = dict(zip(map(id, launches), self._attention_seconds(launches)))  # the programs hold them
        ex = self.cm.executor
        if ex is not None:  # the pass's own costs (allocations, delta, final conversions) before its program
            for r, sec in enumerate(np.atleast_1d(ex.pass_seconds(pass_local_bytes(plan, self.backward),
                                                                  self.backward)).tolist()):
                if sec > 0:
                    self.events[r].append(("pass", 0.0, sec))
                    self.busy[r] += sec
                    self.clock[r] = sec
            self.heap = [(self.clock[r], r) for r in range(w)]
        while self.heap:
            t, r = heapq.heappop(self.heap)
            if self.pc[r] < len(progs[r]):
                dispatch(self, progs[r][self.pc[r]], r, t)
        if self.blocked or any(self.pc[r] < len(progs[r]) for r in range(w)):
            raise RuntimeError(f"simulation deadlock: ranks {sorted(self.blocked)} wait for messages never sent")
        clock = np.asarray(self.clock, np.float64)
        makespan = float(clock.max()) if w else 0.0
        return PassResult(makespan, np.asarray(self.busy, np.float64), np.asarray(self.exposed, np.float64),
                          makespan - clock, clock, self.events)
