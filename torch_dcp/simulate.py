"""Simulate a plan's per-rank programs as a timeline, forward and backward.

Each rank has one compute stream that runs ``BlockwiseCopy``, ``BlockwiseAttention`` and
``BlockwiseReduction`` one after another (times from the :class:`~torch_dcp.cost.CostModel`).
``CommLaunch`` starts the phase's transfers at the current compute time and does not block;
``CommWait`` blocks the compute stream until every transfer of the phase that involves the
rank has finished. A transfer (one message per sender, receiver and phase, as the executor
sends them) starts when both ends have launched the phase and the sender's outgoing link
and the receiver's incoming link are free, and takes the link class's latency + bytes over
bandwidth: concurrent transfers of one rank share its link one after another.

The ideal bound is the total compute time of all ranks spread perfectly evenly with no
exposed communication.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generator

import numpy as np

from ._interleave import interleave
from .cost import CostModel
from .plan import BlockwiseAttention, BlockwiseCopy, BlockwiseReduction, CommLaunch, CommWait, Plan
from .workload import item_token_bytes

__all__ = ["simulate", "SimResult", "PassResult"]


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
        return self.makespan_s / self.ideal_s if self.ideal_s > 0 else 1.0


def simulate(plan: Plan, cost_model: CostModel | None = None) -> SimResult:
    """Simulate ``plan`` on its topology with ``cost_model`` (default: the A100 table).

    Raises:
        RuntimeError: the programs deadlock (a plan that does not validate).
    """
    cm = cost_model or CostModel.a100()
    fwd = _Pass(plan, cm, backward=False).run()
    bwd = _Pass(plan, cm, backward=True).run()
    ideal = (fwd.busy_s.sum() + bwd.busy_s.sum()) / plan.world_size
    return SimResult(fwd, bwd, fwd.makespan_s + bwd.makespan_s, float(ideal))


class _Pass:
    def __init__(self, plan: Plan, cm: CostModel, backward: bool):
        self.plan, self.cm, self.backward = plan, cm, backward
        b = plan.batch
        self.itb = item_token_bytes(b)
        self.blen = plan.workload.block_len
        hd, kvd = b.n_heads * b.head_dim, b.n_kv_heads * b.head_dim
        e, a = b.elem_size, b.acc_size
        # bytes per token row of each buffer side, for copies and reductions
        self.copy_row = {"q": (2 * hd * e + 2 * b.n_heads * a) if backward else hd * e, "kv": 2 * kvd * e}
        self.red_row = {"opart": hd * a + b.n_heads * a, "dqws": hd * a, "dkvws": 2 * kvd * a}
        w = plan.world_size
        self.egress = np.zeros(w)
        self.ingress = np.zeros(w)
        self.launch_t: dict[tuple[int, int, int], float] = {}  # (phase, src, dst) -> sender launch
        self.post_t: dict[tuple[int, int, int], float] = {}  # (phase, src, dst) -> receiver launch
        self.nbytes: dict[tuple[int, int, int], float] = {}
        self.done: dict[tuple[int, int, int], float] = {}
        self.events_n = 0

    def _finish(self, key: tuple[int, int, int]) -> float | None:
        if key in self.done:
            return self.done[key]
        if key not in self.launch_t or key not in self.post_t:
            return None
        _, src, dst = key
        topo = self.plan.topology
        start = max(self.launch_t[key], self.post_t[key], self.egress[src], self.ingress[dst])
        end = start + self.cm.transfer_seconds(self.nbytes[key], topo, topo.node_of(src) != topo.node_of(dst))
        self.egress[src] = self.ingress[dst] = end
        self.done[key] = end
        self.events_n += 1
        return end

    def _rank(self, rank: int) -> Generator[None, None, tuple[float, float, float, list]]:
        plan, cm, wl = self.plan, self.cm, self.plan.workload
        prog = plan.program(rank, self.backward)
        t = busy = exposed = 0.0
        events: list[tuple[str, float, float]] = []
        mine: dict[int, list[tuple[int, int, int]]] = {}
        h = plan.batch.n_heads
        flops_of = wl.tile_flops_bwd if self.backward else wl.tile_flops_fwd
        for ins in prog.instructions:
            dur = 0.0
            if isinstance(ins, BlockwiseCopy):
                dur = cm.memory_seconds(2.0 * self.blen[ins.blocks].sum() * self.copy_row[ins.kind])
                kind = "copy"
            elif isinstance(ins, BlockwiseAttention):
                pairs = float(wl.tile_pairs[ins.tile].sum()) * h
                causal = not bool(wl.tile_full[ins.tile].all())
                dur = cm.attention_seconds(pairs, float(flops_of[ins.tile].sum()), self.backward, causal)
                kind = "attention"
            elif isinstance(ins, BlockwiseReduction):
                n_src = np.diff(ins.src_ptr)
                rows = self.blen[ins.dst_block]
                dur = cm.memory_seconds(float(((n_src + 1) * rows).sum()) * self.red_row[ins.src])
                kind = "reduction"
            elif isinstance(ins, CommLaunch):
                keys = []
                for tr, outgoing in [(x, True) for x in ins.sends] + [(x, False) for x in ins.recvs]:
                    key = (ins.phase, rank, tr.peer) if outgoing else (ins.phase, tr.peer, rank)
                    size = float(self.blen[tr.blocks].sum()) * self.itb[(self.backward, tr.kind)]
                    if outgoing:
                        self.nbytes[key] = self.nbytes.get(key, 0.0) + size
                        self.launch_t[key] = t
                    else:
                        self.post_t[key] = t
                    if key not in keys:
                        keys.append(key)
                mine[ins.phase] = keys
                self.events_n += 1
                continue
            elif isinstance(ins, CommWait):
                end = t
                for key in mine.pop(ins.phase):
                    while (fin := self._finish(key)) is None:
                        yield
                    end = max(end, fin)
                if end > t:
                    events.append(("wait", t, end))
                exposed += end - t
                t = end
                continue
            else:  # pragma: no cover
                raise RuntimeError(f"unknown instruction {ins!r}")
            events.append((kind, t, t + dur))
            t += dur
            busy += dur
        return t, busy, exposed, events

    def run(self) -> PassResult:
        w = self.plan.world_size
        res = interleave([self._rank(r) for r in range(w)], lambda: self.events_n)
        finish = np.array([r[0] for r in res])
        makespan = float(finish.max()) if w else 0.0
        return PassResult(makespan, np.array([r[1] for r in res]), np.array([r[2] for r in res]),
                          makespan - finish, finish, [r[3] for r in res])
