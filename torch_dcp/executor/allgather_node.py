"""All-gather CP whose collectives cross each node once: the runtime of a plan whose placement
runs on :attr:`~torch_dcp.planners.base.Runtime.DCP_NODE_ALLGATHER`.

NCCL runs an all-gather over ranks of several nodes (without in-network reduction) as one ring:
every ring that enters a node carries all ``G - 1`` other shards over its rail. Here a CP group
of ``n`` whole nodes of ``r`` ranks (member ``j r + l``: node ``j``, local index ``l``) gathers
its keys and values in two levels, as hierarchical collectives do (MagiAttention's group-cast
on an (inter, intra) mesh; NCCL's own CollNet / NVLS with switch support): each shard crosses
into every other node of the group once, on its sender's rail, and is fanned out over NVLink
there. On the ranks ``(j, l)``:

* forward: this rank's K and V rows side by side, padded to the group's shard ``R``
  (:meth:`~torch_dcp.executor.allgather.AllGatherExecutor._shard`); one all-gather on its node's
  ``r`` members (the *near* buffer ``[r, R]``) and one on its rail, the ``n`` members of its
  local index (``[n, R]``), both posted at once; the attention of its tiles on the node's own
  keys runs as soon as the near buffer is in, while the rail's shards cross; then one all-gather
  on the node of the ``n - 1`` shards its rail brought (the *far* buffer ``[r, n - 1, R]``),
  the attention of the tiles on the other nodes' keys, and one LSE merge of the two partial
  outputs (the near buffer is freed before the far one is allocated);
* backward: the same gathers and two attention-backward calls; dK/dV of the near keys summed
  on the node by one reduce-scatter (posted after the far gather, so it runs during the far
  tiles' backward), those of the far keys by one reduce-scatter on the node (each node's
  partial sum of a shard), and the ``n`` node sums of this rank's shard by one reduce-scatter on
  its rail: every partial sum crosses a node once, in the K/V dtype as TransformerEngine's
  all-gather CP reduces them.

Bytes into a node per pass and gather: ``(n - 1) r R`` rows (each remote shard once) against
the ring's ``(G - 1) R`` per ring. Collectives are posted in the same order on every member
(each process group's are), and the far gather is posted once the rail's is complete: on a
device the host enqueues it after the near tiles' attention, so it runs behind that attention
(a side stream could start it sooner). The group's process groups are created at context
entry (:func:`~torch_dcp.executor.allgather.collective_groups`).
"""

from __future__ import annotations

import math
from typing import Any, Generator, NamedTuple

import numpy as np
import torch

from ..plan import Plan, ReduceOp
from ..planners.base import Runtime, whole_nodes
from .allgather import AllGatherExecutor
from .device_plan import host_to_device, rows_on
from .kernels import DivisionKernel
from .kernels.base import output_delta
from .reduce import add_gradients, merge_partials, put_rows, take_rows
from .transport import Transport

__all__ = ["NodeAllGatherExecutor", "NodeLayout", "node_layout", "NODE_PHASES"]

#: transport phases of the node-once collectives (above the all-gather runtime's)
NODE_PHASES = {name: (1 << 20) + 32 + i for i, name in enumerate(
    ("forward near", "forward rail", "forward far", "backward near", "backward rail", "backward far",
     "backward near sum", "backward far sum", "backward rail sum"))}


class NodeLayout(NamedTuple):
    """A CP group of whole nodes as this rank sees it: the group (ranks, ascending), this rank's
    node's members (``node``) and its rail's (``rail``: the members of its local index, one per
    node), its node index ``j`` and local index ``l`` in the group, ``n`` nodes of ``r`` ranks."""

    members: tuple[int, ...]
    node: tuple[int, ...]
    rail: tuple[int, ...]
    j: int
    l: int
    n: int
    r: int


def node_layout(plan: Plan, rank: int) -> NodeLayout:
    """Rank ``rank``'s :class:`NodeLayout` in its CP group (:meth:`~torch_dcp.planners.base.Placement.cp_group`)
    on the plan's topology.

    Raises:
        ValueError: a CP group that is not two or more whole nodes.
    """
    members = plan.placement.cp_group(rank)
    r, c = plan.topology.ranks_per_node, len(members)
    if not whole_nodes(c, r) or members[0] % r:
        raise ValueError(f"the node-once all-gather needs CP groups of two or more whole nodes of {r} ranks, got "
                         f"{list(members)}")
    j, l = divmod(members.index(int(rank)), r)
    return NodeLayout(members, members[j * r:(j + 1) * r], members[l::r], j, l, c // r, r)


class _Call(NamedTuple):
    """One attention call on a device: rows of the local tensors (``q``, ``out``), of its key
    buffer (``kv``), of its dK in the reduce-scatter's buffer (``dkv``; dV ``R`` rows further),
    and the kernel's metadata."""

    q: Any
    kv: Any
    out: Any
    dkv: Any
    meta: Any


class _Meta(NamedTuple):
    device: torch.device
    near: _Call | None
    far: _Call | None
    pairs: Any  # [2 S_local] rows of (near, far) results (with a null row) for the merge; None: one call
    null: tuple[torch.Tensor, torch.Tensor] | None  # the null row: output 0, LSE -inf


class _Parts(NamedTuple):
    """A buffer of rows for :func:`~torch_dcp.executor.reduce.merge_partials`."""

    fields: dict
    flat: Any = None


class NodeAllGatherExecutor(AllGatherExecutor):
    """Runs rank ``rank``'s part of a plan on ``Runtime.DCP_NODE_ALLGATHER`` (see the module).

    Same arguments as :class:`~torch_dcp.executor.allgather.AllGatherExecutor`.

    Raises:
        ValueError: a plan of another runtime, CP groups that are not two or more whole nodes of
            the plan's topology, and what :class:`~torch_dcp.executor.allgather.AllGatherExecutor` raises.
    """

    def __init__(self, plan: Plan, rank: int, transport: Transport, kernel: str | DivisionKernel | None = None,
                 scale: float | None = None, timings: bool = False, device_plan: Any = None):
        if plan.placement.runtime is not Runtime.DCP_NODE_ALLGATHER:
            raise ValueError(f"NodeAllGatherExecutor runs plans of runtime {Runtime.DCP_NODE_ALLGATHER.value!r}, got "
                             f"{plan.placement.runtime.value!r}")
        super().__init__(plan, rank, transport, kernel, scale, timings, device_plan)
        self.layout = lay = node_layout(plan, self.rank)
        # every block's first row in the near buffer [r, R] and in the far one [r, n - 1, R]
        big_r = max(self.shard_rows, 1)
        member, loc = self.row // big_r, self.row % big_r
        node, local = member // lay.r, member % lay.r
        inside = self.row >= 0
        near = inside & (node == lay.j)
        self.near_row = np.where(near, local * self.shard_rows + loc, -1)
        far_node = node - (node > lay.j)
        self.far_row = np.where(inside & ~near, (local * (lay.n - 1) + far_node) * self.shard_rows + loc, -1)

    # ------------------------------------------------------------------ preparation
    def _call(self, tiles: np.ndarray, kv_row: np.ndarray, device: torch.device) -> _Call | None:
        """``tiles`` as one call over the key buffer laid out by ``kv_row``."""
        ins = self._instruction(tiles, self.members.index(self.rank) * self.shard_rows, 0, kv_row)
        if ins is None:
            return None
        call = self._kernel_call(ins, device)
        r = self.shard_rows  # the reduce-scatter's buffers hold each member's dK rows, then its dV rows
        return _Call(call.q, call.kv, call.out, rows_on(call.kv_rows // r * 2 * r + call.kv_rows % r, device),
                     call.meta), call.q_rows

    def prepare(self, device: torch.device | str) -> _Meta:
        """Choose the kernel for ``device``, build both calls' rows and metadata on the host and
        upload them (once per device)."""
        device = torch.device(device)
        if self._meta is not None and self._meta.device == device:
            return self._meta
        self._choose_kernel(device)
        self._device = device
        pl, wl = self.plan.placement, self.plan.workload
        tiles = np.flatnonzero(pl.tile_rank == self.rank)
        on_node = self.near_row[wl.tile_kv[tiles]] >= 0
        near, far = (self._call(t, row, device) if t.size else None
                     for t, row in ((tiles[on_node], self.near_row), (tiles[~on_node], self.far_row)))
        pairs = null = None
        if near is not None and far is not None:  # each local row's two partials (the null row where it has none)
            s, (_, nq), (_, fq) = self.local_rows, near, far
            at = np.full((s, 2), len(nq) + len(fq), np.int64)
            at[nq, 0] = np.arange(len(nq))
            at[fq, 1] = len(nq) + np.arange(len(fq))
            pairs = host_to_device(torch.from_numpy(at.reshape(-1)), device)
            h, d = self.plan.batch.n_heads, self.plan.batch.head_dim
            null = (torch.zeros(1, h, d, dtype=self.acc, device=device),
                    torch.full((1, h), -math.inf, dtype=self.acc, device=device))
        self._meta = _Meta(device, None if near is None else near[0], None if far is None else far[0], pairs, null)
        return self._meta

    # ------------------------------------------------------------------ collectives
    def _gathers(self, backward: bool, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, ...]:
        """Post the near and the rail all-gathers of this rank's shard: ``(near buffer, rail
        buffer, near posted, rail posted)``."""
        lay, r = self.layout, self.shard_rows
        shard = self._shard(k, v)
        pas = "backward" if backward else "forward"
        near = shard.new_empty(lay.r * r, shard.shape[1])
        rail = shard.new_empty(lay.n * r, shard.shape[1])
        posted_near = self._post(backward, "all-gather", NODE_PHASES[f"{pas} near"], shard, near, lay.node, "node")
        posted_rail = self._post(backward, "all-gather", NODE_PHASES[f"{pas} rail"], shard, rail, lay.rail, "rail")
        return near, rail, posted_near, posted_rail

    def _others(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        """The other nodes' slots of a rail buffer ``t`` (``n`` slots of ``rows`` rows, this
        node's at slot ``j``): a view where they are contiguous, else a copy."""
        j, n = self.layout.j, self.layout.n
        if j in (0, n - 1):
            return t[rows:] if j == 0 else t[:(n - 1) * rows]
        return torch.cat((t[:j * rows], t[(j + 1) * rows:]))

    def _far(self, backward: bool, rail: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        """The far buffer: the other nodes' shards the rail brought, gathered on the node."""
        lay, r = self.layout, self.shard_rows
        far = rail.new_empty(lay.r * (lay.n - 1) * r, rail.shape[1])
        phase = NODE_PHASES[f"{'backward' if backward else 'forward'} far"]
        yield from self._complete(self._post(backward, "all-gather", phase, self._others(rail, r), far, lay.node,
                                             "node"))
        return far

    @staticmethod
    def _kv(buf: torch.Tensor, call: _Call, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = take_rows(buf, call.kv).unflatten(1, (2 * hkv, d))
        return kv[:, :hkv], kv[:, hkv:]

    # ------------------------------------------------------------------ passes
    def forward_steps(self, q, k, v, scale: float | None = None, keep: bool = False) -> Generator[None, None, tuple]:
        """:meth:`forward` as a generator that yields while a collective is not complete."""
        self._check_inputs(q, k, v)
        m, s, h, d, hkv, scale = self._pass_setup(q, k, scale)
        parts = []
        if self.shard_rows:  # a group without tokens gathers nothing
            near, rail, posted_near, posted_rail = self._gathers(False, k, v)
            yield from self._complete(posted_near)
            if m.near is not None:
                parts.append((m.near, self._timed(0, False, lambda: self.kernel.forward(
                    take_rows(q, m.near.q), *self._kv(near, m.near, hkv, d), m.near.meta, scale, self.acc))))
            del near, posted_near  # read: freed before the far buffer is allocated
            yield from self._complete(posted_rail)
            far = yield from self._far(False, rail)
            if m.far is not None:
                parts.append((m.far, self._timed(1, False, lambda: self.kernel.forward(
                    take_rows(q, m.far.q), *self._kv(far, m.far, hkv, d), m.far.meta, scale, self.acc))))
        out = q.new_empty(s, h, d)
        lse = torch.empty(s, h, dtype=self.acc, device=q.device)
        if len(parts) == 2:  # one LSE merge of the two partial outputs
            (_, (o1, l1)), (_, (o2, l2)) = parts
            src = _Parts({"o": torch.cat((o1, o2, m.null[0])), "lse": torch.cat((l1, l2, m.null[1]))})
            merge_partials(ReduceOp.LSE_MERGE, src, _Parts({"o": out, "lse": lse}), m.pairs, slice(0, s), s, 2)
        elif parts and parts[0][0].out == slice(0, s):
            call, (o, l) = parts[0]
            out.copy_(o)
            lse.copy_(l)
        else:  # rows that see no key: output 0, LSE -inf
            out.zero_()
            lse.fill_(-math.inf)
            for call, (o, l) in parts:
                put_rows(out, call.out, o)
                put_rows(lse, call.out, l)
        result = (out, lse)
        return result + (torch.empty(0, dtype=torch.uint8, device=q.device),) if keep else result

    def _dkv(self, slots: int, hkv: int, d: int, device: torch.device) -> tuple[_Parts, torch.Tensor]:
        """A reduce-scatter's input of ``slots`` members (``2 R`` rows each: dK rows, then dV
        rows) in the accumulation dtype, zeroed, as the fields :func:`~torch_dcp.executor.reduce.add_gradients`
        adds a call's dK and dV into (dV rows ``R`` further than dK's)."""
        r = self.shard_rows
        buf = torch.zeros(slots * 2 * r, hkv * d, dtype=self.acc, device=device)
        return _Parts({"dk": buf[:-r].view(-1, hkv, d), "dv": buf[r:].view(-1, hkv, d)}), buf

    def backward_steps(self, q, k, v, out, lse, dout, scale: float | None = None,
                       state: torch.Tensor | None = None) -> Generator[None, None, tuple]:
        """:meth:`backward` as a generator that yields while a collective is not complete."""
        self._check_backward(q, k, v, out, lse, dout)
        m, s, h, d, hkv, scale = self._pass_setup(q, k, scale)
        lay, r = self.layout, self.shard_rows
        if not r:
            return q.new_zeros(s, h, d), k.new_zeros(s, hkv, d), v.new_zeros(s, hkv, d)
        near, rail, posted_near, posted_rail = self._gathers(True, k, v)
        delta = output_delta(dout, out, self.acc) if m.near is not None or m.far is not None else None
        lse_acc = lse.to(self.acc)
        dq_all = torch.zeros(s, h, d, dtype=self.acc, device=q.device)

        def grads(division: int, call: _Call | None, buf: torch.Tensor, slots: int) -> torch.Tensor:
            """The call's dQ added into ``dq_all``, its dK / dV into a reduce-scatter's input of
            ``slots`` members, in the K/V dtype (as TransformerEngine's all-gather CP reduces them)."""
            dkv, buf_dkv = self._dkv(slots, hkv, d, q.device)
            if call is not None:
                qp, dop, lsep, deltap = (take_rows(t, call.q) for t in (q, dout, lse_acc, delta))
                dq, dk, dv = self._timed(division, True, lambda: self.kernel.backward(
                    qp, *self._kv(buf, call, hkv, d), dop, lsep, deltap, call.meta, scale, self.acc))
                add_gradients(dq_all, call.out, dq, dkv, call.dkv, dk, dv)
            return buf_dkv.to(k.dtype)

        yield from self._complete(posted_near)
        near_dkv = grads(0, m.near, near, lay.r)
        del near, posted_near  # read: freed before the far buffer is allocated
        yield from self._complete(posted_rail)
        far = rail.new_empty(lay.r * (lay.n - 1) * r, rail.shape[1])
        far_posted = self._post(True, "all-gather", NODE_PHASES["backward far"], self._others(rail, r), far, lay.node,
                                "node")
        # this node's sums of its near keys' dK/dV: on the node's stream after the far gather
        rail_in = k.new_empty(lay.n * 2 * r, hkv * d)
        mine_near = rail_in[lay.j * 2 * r:(lay.j + 1) * 2 * r]
        near_sum = self._post(True, "reduce-scatter", NODE_PHASES["backward near sum"], near_dkv, mine_near, lay.node,
                              "node")
        yield from self._complete(far_posted)
        far_dkv = grads(1, m.far, far, lay.r * (lay.n - 1))
        # this node's sums of the far keys' dK/dV, one slot per other node of the rail
        far_sums = self._others(rail_in, 2 * r) if lay.j in (0, lay.n - 1) else \
            k.new_empty((lay.n - 1) * 2 * r, hkv * d)
        yield from self._complete(self._post(True, "reduce-scatter", NODE_PHASES["backward far sum"], far_dkv, far_sums,
                                             lay.node, "node"))
        yield from self._complete(near_sum)
        if lay.j not in (0, lay.n - 1):  # the two ranges around this node's slot
            rail_in[:lay.j * 2 * r].copy_(far_sums[:lay.j * 2 * r])
            rail_in[(lay.j + 1) * 2 * r:].copy_(far_sums[lay.j * 2 * r:])
        mine = k.new_empty(2 * r, hkv * d)
        yield from self._complete(self._post(True, "reduce-scatter", NODE_PHASES["backward rail sum"], rail_in, mine,
                                             lay.rail, "rail"))
        return dq_all.to(q.dtype), mine[:s].view(s, hkv, d), mine[r:r + s].view(s, hkv, d)
