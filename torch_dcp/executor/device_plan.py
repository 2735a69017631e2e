"""The device plan: everything a rank's executor needs for one step, built ahead on the host.

:meth:`DevicePlan.build` walks a rank's forward and backward programs once (through the
instruction table) and turns every instruction into a *step* of token-row indices: gather and
scatter indices, each division's kernel metadata (:meth:`DivisionKernel.prepare`), reduction
indices, message layouts. Index runs that are contiguous become slices (no index at all), so
most messages are sent from and received into the work buffers in place. All arrays are packed
into one contiguous byte buffer (NumPy, on the host): building it is part of planning and can
run off the critical path.

:meth:`DevicePlan.upload` moves that buffer to the device with one copy (from pinned memory,
non-blocking on CUDA) and binds every step to views of it. After that, a step issues only
kernel launches and transfers: no NumPy, no host-device copies, no synchronisation.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..plan import (
    BlockwiseAttention,
    BlockwiseCopy,
    BlockwiseReduction,
    CommLaunch,
    CommWait,
    Plan,
    ReduceOp,
    dispatch,
)
from ..workload import Buf, spans_to_indices
from .division import build_division
from .wire import NARROWED

from .kernels.base import kernel_rows

if TYPE_CHECKING:  # pragma: no cover
    from .kernels.base import DivisionKernel

__all__ = ["DevicePlan", "PassPlan", "Rows", "host_to_device", "rows_on"]


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` without the host waiting for the device: on CUDA
    through pinned memory with a non-blocking copy (a copy from pageable memory would block
    the host until the device's stream reached it); pinned only where a CUDA driver is there
    (a CUDA build of PyTorch without one, e.g. under ``FakeTensorMode``, has no pinned
    memory). ``host`` itself on CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda" and torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)

_NAMES = itertools.count()  # unique array names


def rows_on(idx: np.ndarray, device: torch.device) -> Any:
    """Row indices ``idx`` for a device call: a slice where they are contiguous and ascending
    (a view, no gather), else an int64 tensor uploaded to ``device`` once."""
    n = len(idx)
    if n == 0 or (idx[-1] - idx[0] + 1 == n and np.all(np.diff(idx) == 1)):
        a = int(idx[0]) if n else 0
        return slice(a, a + n)
    return host_to_device(torch.from_numpy(np.ascontiguousarray(idx, np.int64)), device)


@dataclasses.dataclass(frozen=True)
class Rows:
    """Token rows of a buffer: ``start:stop`` when contiguous (``array`` None), else the
    int64 index array ``array`` (a name in the device plan's arrays) of ``n`` rows."""

    n: int
    start: int = 0
    stop: int = 0
    array: str | None = None

    def bind(self, views: dict[str, torch.Tensor]) -> slice | torch.Tensor:
        return slice(self.start, self.stop) if self.array is None else views[self.array]


# ---------------------------------------------------------------------- steps (one per instruction)
@dataclasses.dataclass(frozen=True)
class CopyStep:
    """Local inputs of ``kind`` into rows ``[0, n)`` of its work buffer."""

    handler: ClassVar[str] = "on_copy"
    kind: Buf
    n: int


@dataclasses.dataclass(frozen=True)
class Message:
    """One message of a phase: ``rows`` of buffer ``kind`` to or from ``peer``. A send's rows
    that are not contiguous are read from the phase's gathered rows of that kind
    (``gathered = (start, stop)`` there)."""

    peer: int
    kind: Buf
    rows: Rows
    gathered: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class LaunchStep:
    """Post a phase: per kind at most one gather of send rows, then every message at once.
    ``narrow``: the rows of every dK/dV send of the phase, in message order, where the executor
    casts them to the K/V dtype in one operation (:mod:`torch_dcp.executor.wire`; None: no such
    send), each message's ``(start, stop)`` in them in ``narrow_spans``."""

    handler: ClassVar[str] = "on_launch"
    phase: int
    gathers: tuple[tuple[Buf, Rows], ...]
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    narrow: Rows | None = None
    narrow_spans: tuple[tuple[int, int] | None, ...] = ()


@dataclasses.dataclass(frozen=True)
class WaitStep:
    """Complete a phase; receives that did not land in place are scattered (one per kind)."""

    handler: ClassVar[str] = "on_wait"
    phase: int


@dataclasses.dataclass(frozen=True)
class AttentionStep:
    """One division: gather packed query rows (``q``) and key/value rows (``kv``), run the
    kernel, write the partial output at ``out`` (``OPART`` forward) or add the gradients at
    ``out`` (``DQ``) and ``kv_out`` (``DKV``) backward."""

    handler: ClassVar[str] = "on_attention"
    division: int
    q: Rows
    kv: Rows
    out: Rows
    kv_out: Rows | None
    n_q: int
    n_k: int
    kernel_arrays: tuple[str, ...]
    kernel_static: Any


@dataclasses.dataclass(frozen=True)
class ReductionStep:
    """``dst`` rows get the ``op`` of ``p`` source rows each (``src``: ``n * p`` rows, row-major;
    a missing partial points at the source buffer's null row, which weighs nothing)."""

    handler: ClassVar[str] = "on_reduction"
    op: ReduceOp
    src_buf: Buf
    dst_buf: Buf
    n: int
    p: int
    src: Rows
    dst: Rows


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """One pass of a rank: its steps, buffer sizes (rows, without the null row), whether a
    reduction reads the null row, and whether every partial row must start as it.
    ``received``: per kind, the rows ``(start, stop)`` its receives fill, where they fill that
    run exactly (the compiler lays a pass's received partials side by side)."""

    backward: bool
    steps: tuple[Any, ...]
    buffer_rows: dict[Buf, int]
    needs_null_row: bool
    fills_null: bool = False  # forward: every partial row starts as the null row (a kernel leaves rows out)
    received: dict[Buf, tuple[int, int]] = dataclasses.field(default_factory=dict)


class _Builder:
    """Consumer of the instruction table: one step per instruction, arrays collected."""

    def __init__(self, plan: Plan, rank: int, kernel: "DivisionKernel", backward: bool, arrays: dict[str, np.ndarray],
                 divisions: dict[int, tuple]):
        self.plan, self.rank, self.kernel, self.backward = plan, rank, kernel, backward
        self.blen = plan.workload.block_len
        self.arrays = arrays
        self.divisions = divisions  # division -> (Division, q Rows, kv Rows, kernel arrays, layout): both passes
        self.prog = plan.program(rank, backward)
        self.needs_null = False
        self.fill_null = False

    def add(self, a: np.ndarray) -> str:
        """Register an array for upload; returns its name."""
        name = f"a{next(_NAMES)}"
        self.arrays[name] = np.ascontiguousarray(a)
        return name

    def rows(self, idx: np.ndarray) -> Rows:
        n = len(idx)
        if n == 0 or (idx[-1] - idx[0] + 1 == n and np.all(np.diff(idx) == 1)):
            a = int(idx[0]) if n else 0
            return Rows(n, a, a + n)
        return Rows(n, array=self.add(np.asarray(idx, np.int64)))

    def tokens(self, starts: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        return spans_to_indices(starts, self.blen[blocks])

    def block_rows(self, starts: np.ndarray, blocks: np.ndarray) -> Rows:
        """:meth:`rows` of whole blocks at ``starts`` (contiguity checked per block first)."""
        lens = self.blen[blocks]
        if len(starts) and np.array_equal(starts[1:], starts[:-1] + lens[:-1]):
            n = int(lens.sum())
            return Rows(n, int(starts[0]), int(starts[0]) + n)
        return self.rows(self.tokens(starts, blocks))

    def on_copy(self, ins: BlockwiseCopy) -> CopyStep:
        n = int(self.blen[ins.blocks].sum())
        if not (np.array_equal(self.tokens(ins.src_rows, ins.blocks), np.arange(n))
                and np.array_equal(ins.dst_rows, ins.src_rows)):
            raise ValueError("device plan: a BlockwiseCopy must copy the local rows in order (rows 0 .. S-1)")
        return CopyStep(ins.kind, n)

    def on_launch(self, ins: CommLaunch) -> LaunchStep:
        gathers, sends, pending = [], [], {}
        order = lambda m: (m.peer, int(m.kind))  # noqa: E731 - both ends post messages in this order
        # the dK/dV sends' rows in message order, for the executor's one cast to the K/V dtype
        # (where the inputs' dtype is narrower than the accumulation dtype)
        b = self.plan.batch
        cast = b.dtype != b.acc_dtype
        wire = sorted(((tr.peer, int(tr.kind)), self.tokens(tr.rows, tr.blocks)) for tr in ins.sends
                      if cast and tr.kind in NARROWED)
        for tr in ins.sends:
            if cast and tr.kind in NARROWED:  # sent from the phase's cast rows (narrow_spans)
                sends.append(Message(tr.peer, tr.kind, Rows(tr.tokens)))
                continue
            rows = self.block_rows(tr.rows, tr.blocks)
            if rows.array is None:
                sends.append(Message(tr.peer, tr.kind, rows))
            else:
                pending.setdefault(tr.kind, []).append((tr.peer, self.arrays.pop(rows.array)))
        for kind, parts in pending.items():
            gathers.append((kind, self.rows(np.concatenate([idx for _, idx in parts]))))
            off = 0
            for peer, idx in parts:
                sends.append(Message(peer, kind, Rows(len(idx)), gathered=(off, off + len(idx))))
                off += len(idx)
        recvs = []
        for tr in ins.recvs:
            rows = self.block_rows(tr.rows, tr.blocks)
            if rows.array is not None:  # the compiler lays every receive out contiguously
                raise ValueError(f"device plan: phase {ins.phase} receives from rank {tr.peer} into scattered rows")
            recvs.append(Message(tr.peer, tr.kind, rows))
        sends = sorted(sends, key=order)
        narrow, spans = None, ()
        if wire:
            narrow = self.rows(np.concatenate([idx for _, idx in wire]))
            ends = np.cumsum([len(idx) for _, idx in wire]).tolist()
            at = {key: (e - len(idx), e) for (key, idx), e in zip(wire, ends)}
            spans = tuple(at.get(order(m)) for m in sends)
        return LaunchStep(ins.phase, tuple(gathers), tuple(sends), tuple(sorted(recvs, key=order)), narrow, spans)

    def on_wait(self, ins: CommWait) -> WaitStep:
        return WaitStep(ins.phase)

    def on_attention(self, ins: BlockwiseAttention) -> AttentionStep:
        # the forward and backward instructions of a division read the same rows: one layout
        d = int(ins.division)
        if d not in self.divisions:
            div = build_division(ins, self.plan.workload)
            layout = self.kernel.prepare(div)
            # the kernel's own row orders composed with the division's rows: one gather each
            _, kv_rows, q_idx, kv_idx = kernel_rows(div, layout)
            names = [(key, self.add(a)) for key, a in layout.arrays.items()]
            self.divisions[d] = (div, layout.q_order, kv_rows, self.rows(q_idx), self.rows(kv_idx), tuple(names),
                                 layout.static)
        div, q_order, kv_rows, q, kv, names, static = self.divisions[d]
        if q_order is None:
            out = self.block_rows(ins.out_row, ins.q_block)
        else:  # rows the kernel leaves out get no partial: the forward's partials start as the null row
            out = self.rows(self.tokens(ins.out_row, ins.q_block)[q_order])
            self.fill_null |= not self.backward and len(q_order) < div.n_q
        return AttentionStep(d, q, kv, out, self.rows(kv_rows) if self.backward else None,
                             div.n_q if q_order is None else len(q_order), len(kv_rows), names, static)

    def on_reduction(self, ins: BlockwiseReduction) -> ReductionStep:
        lens = self.blen[ins.dst_block]
        nsrc = np.diff(ins.src_ptr)
        p = int(nsrc.max()) if len(nsrc) else 0
        n = int(lens.sum())
        null = self.prog.buffer_rows[ins.src]  # the row past the buffer: zeros, LSE -inf
        seg = np.repeat(np.arange(len(lens)), lens)
        off = spans_to_indices(np.zeros(len(lens), np.int64), lens)
        slot = np.arange(p, dtype=np.int64)[None, :]
        valid = slot < nsrc[seg][:, None]
        src = np.full((n, p), null, np.int64)
        if p and len(ins.src_row):
            pick = np.minimum(ins.src_ptr[seg][:, None] + slot, len(ins.src_row) - 1)
            src = np.where(valid, ins.src_row[pick] + off[:, None], null)
        self.needs_null |= bool((~valid).any())
        return ReductionStep(ins.op, ins.src, ins.dst, n, p, self.rows(src.reshape(-1)),
                             self.block_rows(ins.dst_row, ins.dst_block))

    def build(self) -> PassPlan:
        steps = tuple(dispatch(self, ins) for ins in self.prog.instructions)
        return PassPlan(self.backward, steps, dict(self.prog.buffer_rows), self.needs_null, self.fill_null,
                        _received(steps))


def _received(steps: tuple[Any, ...]) -> dict[Buf, tuple[int, int]]:
    """Per kind, the run of rows ``(start, stop)`` that ``steps``' receives fill exactly (a kind
    whose receives leave gaps or overlap: left out)."""
    spans: dict[Buf, list[tuple[int, int]]] = {}
    for step in steps:
        if isinstance(step, LaunchStep):
            for m in step.recvs:
                spans.setdefault(m.kind, []).append((m.rows.start, m.rows.stop))
    out = {}
    for kind, got in spans.items():
        got.sort()
        if all(a[1] == b[0] for a, b in zip(got, got[1:])):
            out[kind] = (got[0][0], got[-1][1])
    return out


class DevicePlan:
    """A rank's steps for both passes and their index arrays, packed in one host buffer.

    Args:
        plan: the step's plan.
        rank: this rank.
        kernel: the division kernel the steps are prepared for.

    Attributes:
        forward, backward: the two :class:`PassPlan`.
        nbytes: size of the packed buffer.
        build_seconds: host time it took to build (programs compiled, arrays, packing).

    Raises:
        ValueError: ``rank`` outside the plan, or a program this executor cannot lay out.
    """

    def __init__(self, plan: Plan, rank: int, kernel: "DivisionKernel"):
        t0 = time.perf_counter()
        self.plan, self.rank, self.kernel = plan, int(rank), kernel
        arrays: dict[str, np.ndarray] = {}
        divisions: dict[int, tuple] = {}
        self.forward = _Builder(plan, rank, kernel, False, arrays, divisions).build()
        self.backward = _Builder(plan, rank, kernel, True, arrays, divisions).build()
        # one byte buffer, every array 16-byte aligned
        self._layout: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}
        off = 0
        for name, a in arrays.items():
            self._layout[name] = (off, a.dtype, a.shape)
            off += -(-a.nbytes // 16) * 16
        host = np.zeros(max(off, 16), np.uint8)
        for name, a in arrays.items():
            o = self._layout[name][0]
            host[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
        self.host = torch.from_numpy(host)
        self.nbytes = int(host.nbytes)
        self.build_seconds = time.perf_counter() - t0
        self._uploads: dict[torch.device, UploadedPlan] = {}

    def pass_plan(self, backward: bool) -> PassPlan:
        return self.backward if backward else self.forward

    def upload(self, device: torch.device | str) -> "UploadedPlan":
        """Copy the buffer to ``device`` (one copy; pinned and non-blocking on CUDA) and bind
        every step's indices and kernel metadata to views of it. Done once per device: a later
        call (e.g. the executor's :meth:`~torch_dcp.executor.RankExecutor.prepare` after a
        data loader uploaded the plan ahead) returns the same :class:`UploadedPlan`."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device in self._uploads:
            return self._uploads[device]
        buf = host_to_device(self.host, device)
        views: dict[str, torch.Tensor] = {}
        for name, (off, dt, shape) in self._layout.items():
            nb = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            tdt = torch.from_numpy(np.zeros(0, dt)).dtype
            views[name] = buf[off:off + nb].view(tdt).view(shape)
        self._uploads[device] = up = UploadedPlan(self, device, views)
        return up


class UploadedPlan:
    """A :class:`DevicePlan` on a device: steps with their indices bound (slices or tensors)."""

    def __init__(self, dp: DevicePlan, device: torch.device, views: dict[str, torch.Tensor]):
        self.device_plan, self.device = dp, device
        self.bound = {False: [self._bind(s, views) for s in dp.forward.steps],
                      True: [self._bind(s, views) for s in dp.backward.steps]}

    def _bind(self, step: Any, views: dict[str, torch.Tensor]) -> tuple[Any, dict[str, Any]]:
        b: dict[str, Any] = {}
        if isinstance(step, LaunchStep):
            b["gathers"] = [(k, r.bind(views)) for k, r in step.gathers]
            b["sends"] = [(m, m.rows.bind(views)) for m in step.sends]
            b["recvs"] = [(m, m.rows.bind(views)) for m in step.recvs]
            b["narrow"] = None if step.narrow is None else step.narrow.bind(views)
        elif isinstance(step, AttentionStep):
            b["q"], b["kv"], b["out"] = step.q.bind(views), step.kv.bind(views), step.out.bind(views)
            b["kv_out"] = step.kv_out.bind(views) if step.kv_out is not None else None
            b["meta"] = self.device_plan.kernel.bind({k: views[n] for k, n in step.kernel_arrays}, step.kernel_static)
        elif isinstance(step, ReductionStep):
            b["src"], b["dst"] = step.src.bind(views), step.dst.bind(views)
        return step, b
