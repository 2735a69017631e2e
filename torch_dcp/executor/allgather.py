"""All-gather context parallelism as its authors run it: the runtime of a plan whose placement
runs on :attr:`~torch_dcp.planners.base.Runtime.DCP_ALLGATHER` (dcp's candidates) or
:attr:`~torch_dcp.planners.base.Runtime.ALLGATHER` (the baseline's plan).

PyTorch's ``context_parallel`` with its all-gather rotation
(``torch/distributed/tensor/experimental/_attention.py``) and TransformerEngine's
``AttnFuncWithCPAndKVAllGather`` gather the keys and values of the whole CP group with one NCCL
all-gather, attend locally, and (TransformerEngine) return dK/dV by one reduce-scatter. This
runtime does the same on the plan's layout (the zig-zag one, :func:`~torch_dcp.planners.allgather.plan_allgather`),
with none of the general executor's per-division steps:

* forward: this rank's K and V rows side by side, padded to the CP group's largest rank (as
  NCCL needs equal shards), one ``all_gather_into_tensor`` on the CP group; one attention call
  of the rank's queries over the gathered rows (its tiles: the mask's visible pairs, document
  by document; TransformerEngine makes one call per zig-zag half), whose output and LSE are the
  result (every tile of a query runs on its rank: nothing to merge);
* backward: K and V gathered again, one attention-backward call, the gathered rows' dK and
  dV in the K/V dtype (TransformerEngine's ``dkv`` buffers), one ``reduce_scatter_tensor`` back
  to their owners.

The CP group is the plan's (:meth:`~torch_dcp.planners.base.Placement.cp_group`): all ranks, or
``cp_size`` consecutive ones with whole documents (data parallelism across the groups). The
collectives go through the transport (:meth:`~torch_dcp.executor.transport.Transport.all_gather`),
so they are bounded by its timeout like every transfer; everything the call needs on the device
(row indices, the kernel's metadata) is built on the host and uploaded once, at
:meth:`AllGatherExecutor.prepare`.
"""

from __future__ import annotations

import math
from typing import Any, Generator, NamedTuple

import numpy as np
import torch

from ..plan import Plan
from ..planners.base import Runtime, whole_nodes
from .device_plan import rows_on
from .kernels import DivisionKernel
from .kernels.base import output_delta
from .reduce import add_rows, put_rows, take_rows
from .static import StaticRuntime
from .transport import TransferError, Transport, located

__all__ = ["AllGatherExecutor", "COLLECTIVE_PHASES", "gathered_rows", "collective_groups"]

#: transport phases of the collectives (above the head all-to-alls' phases)
COLLECTIVE_PHASES = {(False, "all-gather"): (1 << 20) + 8, (True, "all-gather"): (1 << 20) + 9,
                     (True, "reduce-scatter"): (1 << 20) + 10}


def gathered_rows(plan: Plan, members: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """``(row [n_blocks], R)``: the first row of every block of the CP group ``members`` in the
    gathered buffer (member ``i``'s rows at ``[i R, i R + its tokens)``, in its local order;
    ``R``: the group's most tokens on one rank), -1 for blocks outside the group."""
    pl, blen = plan.placement, plan.workload.block_len
    br = pl.block_rank
    tokens = np.bincount(br, weights=blen, minlength=plan.world_size).astype(np.int64)
    order = np.argsort(br, kind="stable")  # blocks by rank, each rank's in its (global) order
    first = np.concatenate(([0], np.cumsum(tokens)[:-1]))
    local = np.empty(len(br), np.int64)
    local[order] = np.cumsum(blen[order]) - blen[order] - first[br[order]]
    r = int(tokens[list(members)].max(initial=0))
    inside = (br >= members[0]) & (br <= members[-1])
    return np.where(inside, (br - members[0]) * r + local, -1), r


def collective_groups(plan: Any, rank: int) -> list[tuple[int, ...]]:
    """The CP groups holding ``rank`` whose process groups a context creates once, at entry
    (:func:`~torch_dcp.executor.groups.cp_subgroups`), as DCP-group ranks, ascending: for every
    head parallelism ``N`` dcp's candidates try (1, and those inside a node), every CP size a
    user of all-gather CP could pick over the ``W / N`` head groups
    (:func:`~torch_dcp.planners.static.cp_sizes`), and the plan's own; a CP group of outer
    ranks ``g`` holds the ranks ``g N + i`` of this rank's inner index ``i``. The whole DCP
    group and groups of one rank need none. For ``N > 1`` this rank's head group (the ``N``
    ranks of its outer rank, head parallelism's all-to-alls) comes first. Every rank lists its
    groups in the same order (``N``, then the size), so that members create each group at the
    same point. A CP group of
    two or more whole nodes is followed by this rank's node and rail groups inside it (the
    node-once all-gather's, :func:`~torch_dcp.executor.allgather_node.node_layout`), each listed
    once.
    """
    from ..plan.heads import HeadLayout, HeadParallelPlan, head_parallel_sizes
    from ..planners.static import cp_sizes

    batch, topo, w = plan.batch, plan.topology, plan.world_size
    wanted: dict[int, set[int]] = {1: set(cp_sizes("allgather", batch, topo))}
    for n in head_parallel_sizes(batch, topo):
        if n <= topo.ranks_per_node:
            lay = HeadLayout.of(batch, n)
            wanted[n] = set(cp_sizes("allgather", lay.outer_batch(batch), lay.outer_topology(topo)))
    own = plan.outer if isinstance(plan, HeadParallelPlan) else plan
    if own.placement.cp_size is not None:
        wanted.setdefault(w // own.world_size, set()).add(own.placement.cp_size)
    groups: list[tuple[int, ...]] = []
    for n in sorted(wanted):
        g, inner = divmod(int(rank), n)
        per_node = max(topo.ranks_per_node // n, 1)  # outer ranks per node
        head = tuple(g * n + j for j in range(n))  # head parallelism's all-to-alls
        if 1 < n < w and head not in groups:
            groups.append(head)
        for c in sorted(wanted[n]):
            first = g // c * c
            members = tuple((first + j) * n + inner for j in range(c))
            subsets = [members]
            if per_node > 1 and whole_nodes(c, per_node):  # the node-once all-gather's node and rail groups
                j, l = divmod(g - first, per_node)
                subsets += [members[j * per_node:(j + 1) * per_node], members[l::per_node]]
            groups += [m for m in subsets if 1 < len(m) < w and m not in groups]
    return groups


class _Meta(NamedTuple):
    """The rank's call on a device: rows as slices or index tensors, the kernel's metadata."""

    device: torch.device
    q: Any  # packed query rows of the local tensors
    kv: Any  # packed key/value rows of the gathered buffer (kernel order, padding included)
    out: Any  # local rows of the kernel's query results
    dkv: Any  # rows of the kernel's dK then dV results in the reduce-scatter's buffer
    meta: Any
    kv_once: bool = True  # every gathered row read once (a kernel may read one several times)


class AllGatherExecutor(StaticRuntime):
    """Runs rank ``rank``'s part of an all-gather CP plan (see the module).

    Args:
        plan: a plan whose placement runs as all-gather CP (``Runtime.gathers``) with every tile on its
            query's rank.
        rank: this rank in the DCP group.
        transport: the DCP group's transport (its collectives on the CP group).
        kernel: attention kernel (as for :class:`~torch_dcp.executor.executor.RankExecutor`).
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        timings: record the attention call's time (:attr:`timings`).
        device_plan: must be ``None`` (this runtime builds its own metadata).

    Raises:
        ValueError: a plan of another runtime, a tile away from its query's rank, ``rank``
            outside the plan, a transport group of another size, or a device plan.
    """

    def __init__(self, plan: Plan, rank: int, transport: Transport, kernel: str | DivisionKernel | None = None,
                 scale: float | None = None, timings: bool = False, device_plan: Any = None):
        pl = plan.placement
        if not pl.runtime.gathers:
            raise ValueError(f"AllGatherExecutor runs plans of runtime {Runtime.DCP_ALLGATHER.value!r} or "
                             f"{Runtime.ALLGATHER.value!r}, got {pl.runtime.value!r}")
        if device_plan is not None:
            raise ValueError("AllGatherExecutor builds its own metadata: device_plan must be None (a DevicePlan is "
                             "the general executor's)")
        wl = plan.workload
        if np.any(pl.tile_rank != pl.block_rank[wl.tile_q]):
            raise ValueError("AllGatherExecutor: every tile must run on its query block's rank")
        self._bind(plan, rank, transport, scale)
        self.members = pl.cp_group(self.rank)
        self.row, self.shard_rows = gathered_rows(plan, self.members)
        if np.any(self.row[wl.tile_kv[pl.tile_rank == self.rank]] < 0):
            raise ValueError(f"AllGatherExecutor: rank {self.rank} has tiles on keys outside its CP group "
                             f"{list(self.members)}")
        self._init_runtime(kernel, timings)
        self._meta: _Meta | None = None

    # ------------------------------------------------------------------ preparation
    def prepare(self, device: torch.device | str) -> _Meta:
        """Choose the kernel for ``device``, build the call's rows and the kernel's metadata
        on the host and upload them (once per device)."""
        device = torch.device(device)
        if self._meta is not None and self._meta.device == device:
            return self._meta
        self._choose_kernel(device)
        self._device = device
        # the rank's tiles as one call over the gathered rows
        tiles = np.flatnonzero(self.plan.placement.tile_rank == self.rank)
        ins = self._instruction(tiles, self.members.index(self.rank) * self.shard_rows, 0)
        if ins is None:
            self._meta = _Meta(device, None, None, None, None, None)
            return self._meta
        call = self._kernel_call(ins, device)
        # the reduce-scatter's buffer is member-major, [G, 2, R, H_kv D] (each member's dK rows, then
        # its dV rows), so that a member's summed dK and dV are contiguous rows of its shard
        r = self.shard_rows
        dk_rows = call.kv_rows // r * 2 * r + call.kv_rows % r
        self._meta = _Meta(device, call.q, call.kv, call.out, rows_on(np.concatenate((dk_rows, dk_rows + r)), device),
                           call.meta, len(np.unique(call.kv_rows)) == len(call.kv_rows))
        return self._meta

    # ------------------------------------------------------------------ collectives
    def _post(self, backward: bool, what: str, phase: int, inp: torch.Tensor, out: torch.Tensor,
              members: tuple[int, ...], group: str = "CP group") -> tuple[Any, str]:
        """Post ``what`` (``"all-gather"`` or ``"reduce-scatter"``) from ``inp`` into ``out`` on
        ``members`` (this rank's ``group``) in transport phase ``phase`` and count its ring bytes;
        returns what :meth:`_complete` takes. A failure says where this rank was."""
        where = f"torch_dcp (plan {self.plan.digest()[:12]}): {'backward' if backward else 'forward'} pass, {what} " \
                f"on the {group} {list(members)}"
        post = self.transport.all_gather if what == "all-gather" else self.transport.reduce_scatter
        try:
            c = post(phase, inp, out, members)
        except TransferError as err:
            raise located(err, where) from None
        # NCCL's ring: every rank sends and receives G - 1 shards
        nbytes = (len(members) - 1) * min(inp.numel(), out.numel()) * out.element_size()
        self.bytes_sent += nbytes
        self.bytes_received += nbytes
        return c, where

    def _complete(self, posted: tuple[Any, str]) -> Generator[None, None, None]:
        """Complete a collective :meth:`_post` posted (yields while it is not complete)."""
        c, where = posted
        try:
            yield from self.transport.finish(c)
        except TransferError as err:
            raise located(err, where) from None

    def _run_collective(self, backward: bool, what: str, inp: torch.Tensor,
                        out: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        """:meth:`_post` ``what`` on the CP group, then :meth:`_complete` it: ``out``."""
        yield from self._complete(self._post(backward, what, COLLECTIVE_PHASES[(backward, what)], inp, out,
                                             self.members))
        return out

    def _shard(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's K and V rows side by side, padded to the group's shard: ``[R, 2 H_kv D]``."""
        r = self.shard_rows
        shard = torch.empty(r, 2 * k.shape[1] * k.shape[2], dtype=k.dtype, device=k.device)
        torch.cat((k.flatten(1), v.flatten(1)), 1, out=shard[:self.local_rows])
        if r > self.local_rows:
            shard[self.local_rows:].zero_()  # padding rows: never read
        return shard

    def _gather(self, backward: bool, k: torch.Tensor, v: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        """K and V of the CP group: ``[G R, 2 H_kv D]`` (member ``i``'s rows at ``i R``)."""
        shard = self._shard(k, v)
        out = torch.empty(len(self.members) * self.shard_rows, shard.shape[1], dtype=shard.dtype, device=shard.device)
        return (yield from self._run_collective(backward, "all-gather", shard, out))

    def _scatter(self, dkv: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        """This rank's rows of the CP group's summed ``dkv`` (``[G 2 R, F]``): ``[2 R, F]``."""
        out = torch.empty(2 * self.shard_rows, dkv.shape[1], dtype=dkv.dtype, device=dkv.device)
        return (yield from self._run_collective(True, "reduce-scatter", dkv, out))

    # ------------------------------------------------------------------ passes
    def _pass_setup(self, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> tuple:
        """A checked pass's ``(metadata, S_local, H, D, H_kv, scale)``."""
        return (self.prepare(q.device), self.local_rows, q.shape[1], q.shape[2], k.shape[1],
                self.scale if scale is None else float(scale))

    def _keys(self, backward: bool, k: torch.Tensor, v: torch.Tensor,
              m: _Meta) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor]]:
        """The kernel's packed K and V: rows of the CP group's gathered K/V (of this rank's own
        where it is its group alone: no copy, no collective)."""
        hkv, d = k.shape[1], k.shape[2]
        if len(self.members) == 1:
            return (None, None) if m.kv is None else (take_rows(k, m.kv), take_rows(v, m.kv))
        gathered = yield from self._gather(backward, k, v)  # every member joins, with tiles or without
        if m.kv is None:
            return None, None
        kv = take_rows(gathered, m.kv).unflatten(1, (2 * hkv, d))
        return kv[:, :hkv], kv[:, hkv:]

    def forward_steps(self, q, k, v, scale: float | None = None, keep: bool = False) -> Generator[None, None, tuple]:
        """:meth:`forward` as a generator that yields while the collective is not complete."""
        self._check_inputs(q, k, v)
        m = self.prepare(q.device)
        s, h, d = self.local_rows, q.shape[1], q.shape[2]
        scale = self.scale if scale is None else float(scale)
        if self.shard_rows:  # a group without tokens gathers nothing
            kp, vp = yield from self._keys(False, k, v, m)
        if m.meta is not None:
            o, lse = self._timed(0, False, lambda: self.kernel.forward(take_rows(q, m.q), kp, vp, m.meta, scale,
                                                                       self.acc))
        if m.meta is not None and m.out == slice(0, s):
            out, lse = o.to(q.dtype), lse.to(self.acc)
        else:  # rows that see no key: output 0, LSE -inf
            out = q.new_zeros(s, h, d)
            lse_all = torch.full((s, h), -math.inf, dtype=self.acc, device=q.device)
            if m.meta is not None:
                put_rows(out, m.out, o)
                put_rows(lse_all, m.out, lse)
            lse = lse_all
        result = (out, lse)
        return result + (torch.empty(0, dtype=torch.uint8, device=q.device),) if keep else result

    def backward_steps(self, q, k, v, out, lse, dout, scale: float | None = None,
                       state: torch.Tensor | None = None) -> Generator[None, None, tuple]:
        """:meth:`backward` as a generator that yields while a collective is not complete."""
        self._check_backward(q, k, v, out, lse, dout)
        m, s, h, d, hkv, scale = self._pass_setup(q, k, scale)
        if self.shard_rows:
            kp, vp = yield from self._keys(True, k, v, m)
        alone = len(self.members) == 1
        if m.meta is not None:
            delta = output_delta(dout, out, self.acc)
            qp, dop, lsep, deltap = (take_rows(t, m.q) for t in (q, dout, lse.to(self.acc), delta))
            dq, dk, dv = self._timed(0, True, lambda: self.kernel.backward(qp, kp, vp, dop, lsep, deltap, m.meta, scale,
                                                                        self.acc))
            if m.out == slice(0, s):  # every row's gradient, in order
                dq_all = dq.to(q.dtype)
            else:
                dq_all = torch.zeros(s, h, d, dtype=self.acc, device=q.device)
                add_rows(dq_all, m.out, dq)
                dq_all = dq_all.to(q.dtype)
            if alone and m.dkv == slice(0, 2 * s):  # its own keys, every row in order: nothing to reduce
                return dq_all, dk.to(k.dtype), dv.to(v.dtype)
        else:
            dq_all = q.new_zeros(s, h, d)
        # dK and dV in the K/V dtype, as TransformerEngine's all-gather CP reduces them: written
        # where the kernel read every gathered row once, else added up in the accumulation dtype
        once, r = m.meta is None or m.kv_once, self.shard_rows
        dt = k.dtype if once else self.acc
        dkv = torch.zeros(len(self.members) * 2 * r, hkv * d, dtype=dt, device=q.device)
        if m.meta is not None:  # the kernel's dK and dV rows, in dkv's dtype (one copy)
            vals = torch.empty(2 * dk.shape[0], hkv * d, dtype=dt, device=q.device)
            (put_rows if once else add_rows)(dkv, m.dkv, torch.cat((dk.flatten(1), dv.flatten(1)), 0, out=vals))
        dkv = dkv.to(k.dtype)
        mine = dkv if alone else (yield from self._scatter(dkv))  # [2 R, H_kv D]: dK rows, then dV rows
        return dq_all, mine[:s].view(s, hkv, d), mine[r:r + s].view(s, hkv, d)
