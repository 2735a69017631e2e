"""Ring attention as its authors run it: the runtime of a plan whose placement runs on
:attr:`~torch_dcp.planners.base.Runtime.DCP_RING` (dcp's candidates; inside head groups, HCP's
ring across them) or :attr:`~torch_dcp.planners.base.Runtime.TE_RING` (the baseline's plan).

TransformerEngine's ``AttnFuncWithCPAndKVP2P`` (and ring attention in general: Liu et al.,
*Ring Attention with Blockwise Transformers*, 2023, §3) keeps each rank's queries in place and
passes the key/value chunks around the ring of the CP group: in step ``s`` rank ``r`` attends to
the chunk of rank ``r - s`` while it sends that chunk on to ``r + 1`` and receives the next from
``r - 1``. This runtime does the same on the plan's layout (the zig-zag one,
:func:`~torch_dcp.planners.ring.plan_ring`), with none of the general executor's per-division
steps:

* forward: this rank's K and V rows side by side, padded to the group's largest rank (every
  message of the ring has one size); per step one attention call of the rank's tiles on the
  chunk held (the mask's visible pairs, document by document), its partial output and LSE
  written once and merged into the running output by one LSE merge
  (:func:`~torch_dcp.executor.reduce.merge_partials`);
* backward: K and V travel the ring again, and with them the chunk's dK/dV partials in the K/V
  dtype (TransformerEngine's ``dkv`` buffers): each rank adds its own before passing them on,
  and after the last step the partials of every chunk go one more hop, home. dQ is summed in
  place in the accumulation dtype.

Everything a step needs on the device (row indices, the kernel's metadata) is built on the host
and uploaded once, at :meth:`RingExecutor.prepare`. The transfers go through the transport
(bounded by its timeout, as every transfer), in phases of their own.
"""

from __future__ import annotations

import math
from typing import Any, Generator, NamedTuple

import numpy as np
import torch

from ..plan import Plan, ReduceOp
from ..planners.base import Runtime
from .allgather import gathered_rows
from .device_plan import host_to_device
from .executor import _Buffer, _Outputs, _partial_fields
from .kernels import DivisionKernel
from .kernels.base import output_delta
from .reduce import add_rows, merge_partials, take_rows
from .static import StaticRuntime
from .transport import TransferError, Transport, located

__all__ = ["RingExecutor", "RING_PHASES", "RING_RUNTIMES"]

#: the runtimes this executor runs
RING_RUNTIMES = (Runtime.DCP_RING, Runtime.TE_RING)
#: first transport phase of the ring's steps (above the collectives' phases): forward step ``s``
#: at ``+ s``, backward K/V at ``+ W + s``, backward dK/dV at ``+ 2 W + s``
RING_PHASES = (1 << 20) + 16
#: message kinds of a step
_KV, _DKV = 0, 1


class _Step(NamedTuple):
    """One ring step of the rank on a device: rows as slices or index tensors, the kernel's metadata."""

    q: Any  # packed query rows of the local tensors
    kv: Any  # packed key/value rows of the chunk held (kernel order, padding included)
    out: Any  # local rows of the kernel's query results
    kv_out: Any  # rows of the chunk held of the kernel's dK/dV results (repeats add up)
    merge: Any  # source rows of the LSE merge: (running row, step row) per result row
    n: int  # the kernel's query results
    meta: Any


class RingExecutor(StaticRuntime):
    """Runs rank ``rank``'s part of a ring plan (see the module).

    Args:
        plan: a plan whose placement runs as a ring (:data:`RING_RUNTIMES`) with every tile on
            its query's rank.
        rank: this rank in the DCP group (the ring is the plan's ranks in order).
        transport: the DCP group's transport.
        kernel: attention kernel (as for :class:`~torch_dcp.executor.executor.RankExecutor`).
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        timings: record the attention calls' times (:attr:`timings`).
        device_plan: must be ``None`` (this runtime builds its own metadata).

    Raises:
        ValueError: a plan of another runtime, a tile away from its query's rank, ``rank``
            outside the plan, or a device plan.
    """

    def __init__(self, plan: Plan, rank: int, transport: Transport, kernel: str | DivisionKernel | None = None,
                 scale: float | None = None, timings: bool = False, device_plan: Any = None):
        pl = plan.placement
        if pl.runtime not in RING_RUNTIMES:
            raise ValueError(f"RingExecutor runs plans of runtime {Runtime.DCP_RING.value!r} or "
                             f"{Runtime.TE_RING.value!r}, got {pl.runtime.value!r}")
        if device_plan is not None:
            raise ValueError("RingExecutor builds its own metadata: device_plan must be None (a DevicePlan is the "
                             "general executor's)")
        if np.any(pl.tile_rank != pl.block_rank[plan.workload.tile_q]):
            raise ValueError("RingExecutor: every tile must run on its query block's rank")
        self._bind(plan, rank, transport, scale)
        self.world = plan.world_size
        self.row, self.shard_rows = gathered_rows(plan, tuple(range(self.world)))
        self._init_runtime(kernel, timings)
        self._steps: list[_Step | None] = []

    # ------------------------------------------------------------------ preparation
    def prepare(self, device: torch.device | str) -> list[_Step | None]:
        """Choose the kernel for ``device``, build every step's rows and the kernel's metadata
        on the host and upload them (once per device): in step ``s`` the rank's tiles on the
        chunk it holds (rank ``r - s``'s), one call each."""
        device = torch.device(device)
        if self._device == device:
            return self._steps
        self._choose_kernel(device)
        wl, pl, r, s = self.plan.workload, self.plan.placement, self.shard_rows, self.local_rows
        mine = pl.tile_rank == self.rank
        steps: list[_Step | None] = []
        for step in range(self.world):
            home = (self.rank - step) % self.world
            ins = self._instruction(np.flatnonzero(mine & (pl.block_rank[wl.tile_kv] == home)), self.rank * r, home * r)
            if ins is None:
                steps.append(None)
                continue
            call = self._kernel_call(ins, device)
            n = len(call.q_rows)
            merge = np.stack((call.q_rows, s + np.arange(n)), 1).reshape(-1)
            steps.append(_Step(call.q, call.kv, call.out,
                               host_to_device(torch.from_numpy(np.ascontiguousarray(call.kv_rows, np.int64)), device),
                               host_to_device(torch.from_numpy(merge.astype(np.int64)), device), n, call.meta))
        self._device, self._steps = device, steps
        return steps

    # ------------------------------------------------------------------ transfers
    def _pass_on(self, phase: int, kind: int, send: torch.Tensor, recv: torch.Tensor, what: str) -> Any:
        """Post ``send`` to the next rank and a receive of ``recv`` from the previous one."""
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        flat_s, flat_r = send.reshape(-1).view(torch.uint8), recv.reshape(-1).view(torch.uint8)
        self.bytes_sent += flat_s.numel()
        self.bytes_received += flat_r.numel()
        try:
            return self.transport.launch(phase, [(nxt, kind, flat_s)], [(prev, kind, flat_r)])
        except TransferError as err:
            raise located(err, self._where(phase, what)) from None

    def _wait(self, handle: Any, phase: int, what: str) -> Generator[None, None, None]:
        try:
            yield from self.transport.wait(handle)
        except TransferError as err:
            raise located(err, self._where(phase, what)) from None

    def _where(self, phase: int, what: str) -> str:
        return f"torch_dcp (plan {self.plan.digest()[:12]}): ring step {what} (phase={phase})"

    def _held(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's K and V rows side by side, ``[R, 2 H_kv D]`` (rows past its own: padding,
        never read)."""
        held = torch.empty(self.shard_rows, 2 * k.shape[1] * k.shape[2], dtype=k.dtype, device=k.device)
        torch.cat((k.flatten(1), v.flatten(1)), 1, out=held[:self.local_rows])
        return held

    # ------------------------------------------------------------------ passes
    def forward_steps(self, q, k, v, scale: float | None = None, keep: bool = False) -> Generator[None, None, tuple]:
        """:meth:`forward` as a generator that yields while a transfer is not complete."""
        self._check_inputs(q, k, v)
        steps = self.prepare(q.device)
        s, h, d, hkv, w = self.local_rows, q.shape[1], q.shape[2], k.shape[1], self.world
        scale = self.scale if scale is None else float(scale)
        held = self._held(k, v)
        nxt = torch.empty_like(held) if w > 1 else None
        # the running output and LSE (rows [0, S)), then the step's partials (rows [S, S + n))
        part = _Buffer(s + max((st.n for st in steps if st is not None), default=0),
                       _partial_fields(h, d, self.acc, self.acc), q.device)
        running = _Outputs(o=part.fields["o"][:s], lse=part.fields["lse"][:s])
        first = steps[0] if steps else None
        # the first step writes every row in order: straight into the running output
        direct = first is not None and isinstance(first.out, slice) and first.out == slice(0, s)
        if not direct:  # rows that see no key: output 0, LSE -inf
            running.fields["o"].zero_()
            running.fields["lse"].fill_(-math.inf)
        for i, st in enumerate(steps):
            phase = RING_PHASES + i
            handle = self._pass_on(phase, _KV, held, nxt, f"{i} (forward)") if i < w - 1 else None
            if st is not None:
                o, lse = self._timed(i, False, lambda: self.kernel.forward(
                    take_rows(q, st.q), *take_rows(held, st.kv).unflatten(1, (2 * hkv, d)).split(hkv, 1), st.meta,
                    scale, self.acc))
                rows = slice(0, s) if i == 0 and direct else slice(s, s + st.n)
                if part.flat is not None:  # the row is o then lse: one write
                    torch.cat((o.flatten(1), lse), 1, out=part.flat[rows])
                else:
                    part.fields["o"][rows].copy_(o)
                    part.fields["lse"][rows].copy_(lse)
                if rows.start:
                    merge_partials(ReduceOp.LSE_MERGE, part, running, st.merge, st.out, st.n, 2)
            if handle is not None:
                yield from self._wait(handle, phase, f"{i} (forward)")
                held, nxt = nxt, held
        result = running.fields["o"].to(q.dtype), running.fields["lse"].contiguous()
        return result + (torch.empty(0, dtype=torch.uint8, device=q.device),) if keep else result

    def backward_steps(self, q, k, v, out, lse, dout, scale: float | None = None,
                       state: torch.Tensor | None = None) -> Generator[None, None, tuple]:
        """:meth:`backward` as a generator that yields while a transfer is not complete."""
        self._check_backward(q, k, v, out, lse, dout)
        steps = self.prepare(q.device)
        s, h, d, hkv, w, r = self.local_rows, q.shape[1], q.shape[2], k.shape[1], self.world, self.shard_rows
        scale = self.scale if scale is None else float(scale)
        delta = output_delta(dout, out, self.acc)
        lse = lse.to(self.acc)
        if any(st is not None and not isinstance(st.q, slice) for st in steps):
            # the query side's rows side by side (written once): one gather of them per step
            side = _Buffer(s, [("q", q.dtype, (h, d)), ("do", dout.dtype, (h, d)), ("lse", self.acc, (h,)),
                               ("delta", self.acc, (h,))], q.device)
            for name, t in (("q", q), ("do", dout), ("lse", lse), ("delta", delta)):
                side.fields[name].copy_(t)
        else:
            side = None
        held = self._held(k, v)
        nxt = torch.empty_like(held) if w > 1 else None
        # the chunk's dK/dV partials, travelling with it: [2, R, H_kv D] (dK rows, then dV rows)
        dkv = torch.zeros(2, r, hkv * d, dtype=k.dtype, device=q.device)
        dkv_nxt = torch.empty_like(dkv) if w > 1 else None
        dq = torch.zeros(s, h, d, dtype=self.acc, device=q.device)
        for i, st in enumerate(steps):
            kv_phase, dkv_phase = RING_PHASES + w + i, RING_PHASES + 2 * w + i
            handle = self._pass_on(kv_phase, _KV, held, nxt, f"{i} (backward K/V)") if i < w - 1 else None
            if st is not None:
                kp, vp = take_rows(held, st.kv).unflatten(1, (2 * hkv, d)).split(hkv, 1)
                if side is None or isinstance(st.q, slice):
                    qp, dop, lsep, deltap = (take_rows(t, st.q) for t in (q, dout, lse, delta))
                else:
                    f = side.view_rows(take_rows(side.words, st.q))
                    qp, dop, lsep, deltap = f["q"], f["do"], f["lse"], f["delta"]
                g_q, g_k, g_v = self._timed(i, True, lambda: self.kernel.backward(qp, kp, vp, dop, lsep, deltap,
                                                                                  st.meta, scale, self.acc))
                add_rows(dq, st.out, g_q)
                add_rows(dkv[0], st.kv_out, g_k.flatten(1))
                add_rows(dkv[1], st.kv_out, g_v.flatten(1))
            if w > 1:  # the partials on to the next rank (after the last step: home)
                back = self._pass_on(dkv_phase, _DKV, dkv, dkv_nxt, f"{i} (backward dK/dV)")
                if handle is not None:
                    yield from self._wait(handle, kv_phase, f"{i} (backward K/V)")
                    held, nxt = nxt, held
                yield from self._wait(back, dkv_phase, f"{i} (backward dK/dV)")
                dkv, dkv_nxt = dkv_nxt, dkv
        return dq.to(q.dtype), dkv[0, :s].view(s, hkv, d), dkv[1, :s].view(s, hkv, d)
