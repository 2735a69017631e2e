"""Run a rank's program of a :class:`~torch_dcp.plan.Plan`, forward and backward.

Layout (THD, one packed sequence per rank): ``q: [S_local, H, D]``, ``k, v: [S_local, H_kv, D]``
with the rows in the order of ``plan.token_indices(rank)``. Outputs have the same layout;
``lse: [S_local, H]`` in the accumulation dtype (float32, float64 for float64 inputs).

The executor knows nothing about planners. It runs the rank's
:class:`~torch_dcp.executor.device_plan.DevicePlan` -- the programs turned into steps with all
indices built on the host ahead of time and uploaded once -- through the instruction table's
handlers (``on_copy``, ``on_launch``, ``on_wait``, ``on_attention``, ``on_reduction``). Inside a
step it only launches kernels and posts transfers: per division at most one gather per input
buffer, the kernel, one write of its results; messages go out of and come into the work
buffers in place wherever their rows are contiguous, but for dK/dV partials, which travel in the
K/V dtype (:mod:`~torch_dcp.executor.wire`).

Work buffers hold one row per token with typed fields side by side (``Buf.Q`` in the backward:
Q, dO, LSE, delta), so a row moves -- gathered, sent, received -- as one unit. A partial
output's row (``Buf.OPART``) holds O in the inputs' dtype, as an attention kernel computes it
on a GPU, and its LSE in the accumulation dtype: it is kept, sent and received so (half the
bytes of a float32 O for bfloat16 inputs), and merged in the accumulation dtype; on CUDA a
division's output is written into such rows in one launch (the Triton LSE merge of one partial).
"""

from __future__ import annotations

import math
from typing import Any, Generator

import torch

from ..plan import Plan, ReduceOp
from ..workload import Buf
from .device_plan import AttentionStep, CopyStep, DevicePlan, LaunchStep, ReductionStep, UploadedPlan, WaitStep
from .kernels import DivisionKernel, get_kernel
from .kernels.base import output_delta
from .reduce import add_gradients, merge_partials, put_rows, take_rows, triton_runs_on
from .timing import InstructionTime, _Clock
from .transport import TransferError, Transport, located
from .wire import keeps_wire, narrowed, wire_receives, wire_sends

__all__ = ["RankExecutor", "RowChecks", "InstructionTime", "dcp_attention"]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def _row_layout(fields: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list, int, int]:
    """``(spans, used bytes, int64 words per row)``: each field aligned to its element size, the
    row padded to 8 bytes; a span is ``(name, dtype, shape, byte offset, bytes)``."""
    off, spans = 0, []
    for name, dt, shape in fields:
        size = dt.itemsize
        off = -(-off // size) * size
        n = math.prod(shape) * size
        spans.append((name, dt, shape, off, n))
        off += n
    return spans, off, max(1, -(-off // 8))


class _Buffer:
    """Rows of typed fields side by side: ``words`` ``[rows, W]`` int64 (gathers, messages) and a
    typed view per field. ``flat`` is a typed ``[rows, F]`` view of the whole row when all fields
    share one dtype and fill it (else None)."""

    def __init__(self, rows: int, fields: list[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device,
                 storage: torch.Tensor | None = None):
        self.spans, off, words = _row_layout(fields)
        self.words = (storage[:rows * words].view(rows, words) if storage is not None else
                      torch.empty(rows, words, dtype=torch.int64, device=device))
        self.fields = self.view_rows(self.words)
        dts = {sp[1] for sp in self.spans}
        self.flat = self.words.view(torch.uint8)[:, :off].view(dts.pop()) if len(dts) == 1 and off == 8 * words else None
        #: ``(buffer, first row)``: rows received in the K/V dtype and kept there (torch_dcp.executor.wire)
        self.wire: tuple[_Buffer, int] | None = None

    @staticmethod
    def words_per_row(fields: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
        """int64 words of one row of this layout."""
        return _row_layout(fields)[2]

    def view_rows(self, words: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed field views of ``words`` rows of this layout (the buffer's own, or gathered)."""
        raw = words.view(torch.uint8)
        return {name: raw[:, o:o + n].view(dt).unflatten(1, shape) for name, dt, shape, o, n in self.spans}

    def message(self, rows: slice) -> torch.Tensor:
        """uint8 view of contiguous ``rows``."""
        return self.words[rows].reshape(-1).view(torch.uint8)


def _partial_fields(h: int, d: int, o_dtype: torch.dtype, acc: torch.dtype
                    ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The forward's partial-output row: ``o [h, d]`` in ``o_dtype`` and ``lse [h]`` in ``acc``
    (a plan's partials: ``o`` in the inputs' dtype, as the kernels compute it on a GPU and as it
    travels, merged in ``acc``; a ring's running output: ``acc``)."""
    return [("o", o_dtype, (h, d)), ("lse", acc, (h,))]


class _Outputs:
    """Separate contiguous result tensors, addressed like a buffer's fields."""

    def __init__(self, **fields: torch.Tensor):
        self.fields = fields
        self.flat = None


class _Run:
    """The buffers of one pass of one call."""

    def __init__(self, backward: bool):
        self.backward = backward
        self.bufs: dict[Buf, _Buffer] = {}
        self.local: dict[Buf, list[torch.Tensor]] = {}
        self.out: dict[Buf, torch.Tensor] = {}
        self.pending: dict[int, Any] = {}
        self.division = 0
        self.copied: set[Buf] = set()  # local inputs already in their buffers
        self.widen: dict[int, list] = {}  # phase -> (accumulator rows, received K/V-dtype rows) to cast


class RowChecks:
    """A rank's rows of a plan (``plan``, ``rank``, ``local_rows``, ``dtype``, ``acc``, ``scale``,
    byte counters; :meth:`_bind`) and the checks of its inputs against them: every executor of a
    plan's rows takes them alike."""

    plan: Plan
    rank: int
    local_rows: int
    dtype: torch.dtype

    def _bind(self, plan: Plan, rank: int, transport: Transport, scale: float | None) -> None:
        """Take ``plan``'s rows of ``rank`` on ``transport``.

        Raises:
            ValueError: a transport group of another size, or ``rank`` outside the plan.
        """
        group_size = getattr(transport, "world_size", None)
        if group_size is not None and group_size != plan.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks, the transport's group has {group_size}")
        if not 0 <= int(rank) < plan.world_size:
            raise ValueError(f"rank {rank} is outside [0, {plan.world_size})")
        self.plan, self.rank, self.transport = plan, int(rank), transport
        b = plan.batch
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(b.head_dim)
        self.dtype = _TORCH_DTYPES[b.dtype]
        self.acc = _TORCH_DTYPES[b.acc_dtype]
        self.local_rows = plan.local_tokens(self.rank)
        self.bytes_sent = 0
        self.bytes_received = 0

    def _check(self, name: str, t: torch.Tensor, heads: int, device: torch.device | None = None) -> None:
        """Raise ``ValueError`` naming what of ``t`` (``[S_local, heads, head_dim]``) differs
        from the plan: dims, sequence length, heads, head_dim, dtype or device."""
        b = self.plan.batch
        if t.dim() != 3:
            raise ValueError(f"{name}: expected [S_local, heads, head_dim] (3 dims) on rank {self.rank}, got shape "
                             f"{list(t.shape)}")
        s, h, d = t.shape
        if s != self.local_rows:
            raise ValueError(f"{name}: sequence length {s}, but rank {self.rank} holds {self.local_rows} tokens of the "
                             f"plan (shape {list(t.shape)})")
        # keys/values may also come with their heads repeated to the query heads
        if h != heads and not (heads == b.n_kv_heads and h == b.n_heads):
            want = f"{heads}" if heads == b.n_heads else f"{heads} (n_kv_heads) or {b.n_heads} (repeated)"
            raise ValueError(f"{name}: {h} heads, the plan's BatchSpec has {want} (shape {list(t.shape)})")
        if d != b.head_dim:
            raise ValueError(f"{name}: head_dim {d}, the plan's BatchSpec has {b.head_dim} (shape {list(t.shape)})")
        if t.dtype != self.dtype:
            raise ValueError(f"{name}: expected dtype {self.dtype} (the plan's BatchSpec.dtype), got {t.dtype}")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")

    def _check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        b = self.plan.batch
        self._check("q", q, b.n_heads)
        self._check("k", k, b.n_kv_heads, q.device)
        self._check("v", v, b.n_kv_heads, q.device)
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v have {k.shape[1]} and {v.shape[1]} heads; they must have the same")

    def _check_backward(self, q, k, v, out, lse, dout) -> None:
        """:meth:`_check_inputs`, and ``out``, ``dout`` like ``q``, ``lse`` the forward's."""
        b = self.plan.batch
        self._check_inputs(q, k, v)
        self._check("out", out, b.n_heads, q.device)
        self._check("dout", dout, b.n_heads, q.device)
        if tuple(lse.shape) != (self.local_rows, b.n_heads) or not lse.is_floating_point() or lse.device != q.device:
            raise ValueError(f"lse: expected a floating [S_local, heads] = {[self.local_rows, b.n_heads]} tensor on "
                             f"{q.device} (the forward's), got {lse.dtype} {list(lse.shape)} on {lse.device}")


class RankExecutor(RowChecks):
    """Executes rank ``rank``'s programs of ``plan``.

    Args:
        plan: the step's plan (the same on every rank).
        rank: this rank in the DCP group.
        transport: how messages move (:class:`~torch_dcp.executor.transport.TorchDistributedTransport`
            on a process group, or an in-process one).
        kernel: attention kernel (``"auto"``, ``"sdpa"``, ``"reference"``, ``"flex"`` or an
            instance; default ``"auto"``: chosen by the inputs' device, see
            :func:`~torch_dcp.executor.kernels.get_kernel`).
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        timings: record the compute time of every instruction (see :attr:`timings`).
        device_plan: a :class:`~torch_dcp.executor.device_plan.DevicePlan` built ahead for this
            rank and kernel (default: built on first use, or by :meth:`prepare`).

    Attributes:
        bytes_sent, bytes_received: bytes this executor has moved so far (all calls).
        kernel: the kernel in use (None until :meth:`prepare` or the first call when chosen
            automatically).
        device_plan: the rank's device plan (None until built).

    Raises:
        ValueError: ``rank`` outside the plan, a transport group of another size, an unknown
            kernel, or a device plan for another plan, rank or kernel.
    """

    takes_out = True  #: :meth:`forward_steps` writes into given outputs (a head-parallel layer's kept state)

    def __init__(self, plan: Plan, rank: int, transport: Transport, kernel: str | DivisionKernel | None = None,
                 scale: float | None = None, timings: bool = False, device_plan: DevicePlan | None = None):
        self._bind(plan, rank, transport, scale)
        self._kernel_spec = kernel
        self.kernel: DivisionKernel | None = None if kernel is None or kernel == "auto" else get_kernel(kernel)
        if device_plan is not None:
            if device_plan.plan is not plan or device_plan.rank != self.rank:
                raise ValueError("device_plan was built for another plan or rank")
            if self.kernel is not None and device_plan.kernel is not self.kernel:
                raise ValueError("device_plan was built for another kernel")
            self.kernel = device_plan.kernel
        self.device_plan = device_plan
        self._uploaded: UploadedPlan | None = None
        self._null_row: torch.Tensor | None = None  # the forward's null partial row, built by prepare()
        self.record_timings = bool(timings)
        self._clock = _Clock()

    # ------------------------------------------------------------------ preparation
    def prepare(self, device: torch.device | str) -> UploadedPlan:
        """Choose the kernel for ``device``, build the device plan if needed and upload it
        (once per device). Called by the first forward; call it ahead to keep it off the step."""
        device = torch.device(device)
        if self._uploaded is not None:
            if self._uploaded.device == device:
                return self._uploaded
            if self._kernel_spec in (None, "auto") and self._uploaded.device.type != device.type:
                self.kernel = self.device_plan = None  # the automatic kernel depends on the device type
        if self.kernel is None:
            self.kernel = get_kernel(self._kernel_spec, device=device, dtype=self.dtype, head_dim=self.plan.batch.head_dim)
        if self.device_plan is None:
            self.device_plan = DevicePlan(self.plan, self.rank, self.kernel)
        self._uploaded = self.device_plan.upload(device)
        # the forward's null row (output 0, LSE -inf), copied in with one operation per call
        b = self.plan.batch
        null = _Buffer(1, _partial_fields(b.n_heads, b.head_dim, self.dtype, self.acc), device)
        null.fields["o"].zero_()
        null.fields["lse"].fill_(-math.inf)
        self._null_row = null.words
        return self._uploaded

    @property
    def timings(self) -> list[InstructionTime]:
        """Compute time of every instruction run so far with ``timings=True``, in program order
        (synchronises the device on CUDA)."""
        return self._clock.results()

    def reset_timings(self) -> None:
        """Forget the recorded timings."""
        self._clock.clear()

    # ------------------------------------------------------------------ public API
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward attention of this rank's tokens; blocks on communication.

        ``k``, ``v`` have ``H_kv`` heads, or ``H`` (heads repeated). ``scale`` overrides the
        executor's softmax scale for this call.

        Returns ``(out [S_local, H, D] in q.dtype, lse [S_local, H])``.

        Raises:
            ValueError: a sequence length, head count, head_dim, dtype or device that does not
                match the plan's BatchSpec and this rank (the message names which), or ``k``
                and ``v`` with different head counts.
        """
        return _drain(self.forward_steps(q, k, v, scale))

    def forward_keeping(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward`, plus what the backward needs beyond the inputs and outputs as one
        uint8 tensor (nothing for this executor: empty; a head-parallel executor keeps its
        head-sharded tensors, :class:`~torch_dcp.executor.heads.HeadParallelExecutor`)."""
        return _drain(self.forward_steps(q, k, v, scale, keep=True))

    def state_nbytes(self, kv_heads: int, every_rank: bool = False) -> int:
        """Bytes of :meth:`forward_keeping`'s state for keys/values with ``kv_heads`` heads (of
        every rank together with ``every_rank``): 0."""
        return 0

    def backward(self, q, k, v, out, lse, dout, scale: float | None = None,
                 state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of this rank's Q, K, V (complete: partials computed on other ranks are
        received and summed). Returns ``(dq, dk, dv)`` in the input dtype.

        Raises:
            ValueError: as :meth:`forward`, for ``q, k, v, out, dout``; an ``lse`` that is not
                ``[S_local, H]`` floating point on the inputs' device.
        """
        return _drain(self.backward_steps(q, k, v, out, lse, dout, scale, state))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Differentiable forward: :func:`dcp_attention` with this executor."""
        return dcp_attention(q, k, v, self)

    # ------------------------------------------------------------------ passes
    def _alloc(self, run: _Run, backward: bool, h: int, hkv: int, d: int, e: torch.dtype, dev: torch.device) -> None:
        pp = self.device_plan.pass_plan(backward)
        rows, acc = pp.buffer_rows, self.acc
        q_fields = [("q", e, (h, d))]
        if backward:
            q_fields += [("do", e, (h, d)), ("lse", acc, (h,)), ("delta", acc, (h,))]
        run.bufs[Buf.Q] = _Buffer(rows[Buf.Q], q_fields, dev)
        run.bufs[Buf.KV] = _Buffer(rows[Buf.KV], [("k", e, (hkv, d)), ("v", e, (hkv, d))], dev)
        if backward:  # accumulators, plus a zero row for missing partials
            dq_f, dkv_f = [("dq", acc, (h, d))], [("dk", acc, (hkv, d)), ("dv", acc, (hkv, d))]
            n_dq = (rows[Buf.DQ] + 1) * _Buffer.words_per_row(dq_f)
            zeros = torch.zeros(n_dq + (rows[Buf.DKV] + 1) * _Buffer.words_per_row(dkv_f), dtype=torch.int64, device=dev)
            run.bufs[Buf.DQ] = _Buffer(rows[Buf.DQ] + 1, dq_f, dev, storage=zeros[:n_dq])
            run.bufs[Buf.DKV] = dkv = _Buffer(rows[Buf.DKV] + 1, dkv_f, dev, storage=zeros[n_dq:])
            got = pp.received.get(Buf.DKV)
            if got is not None and narrowed(Buf.DKV, acc, e) and keeps_wire(dkv.words):
                dkv.wire = (_Buffer(got[1] - got[0], [("dk", e, (hkv, d)), ("dv", e, (hkv, d))], dev), got[0])
        else:
            run.bufs[Buf.OPART] = op = _Buffer(rows[Buf.OPART] + 1, _partial_fields(h, d, e, acc), dev)
            if pp.needs_null_row or pp.fills_null:  # the row missing partials point at: output 0, LSE -inf
                # (every row, where a kernel leaves some rows of a division out); prepare() built it
                # for this device and the plan's heads, which _check_inputs holds the inputs to
                rows_to_fill = op.words if pp.fills_null else op.words[-1:]
                rows_to_fill.copy_(self._null_row.expand_as(rows_to_fill))

    def forward_steps(self, q, k, v, scale: float | None = None, keep: bool = False,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None) -> Generator[None, None, tuple]:
        """:meth:`forward` as a generator that yields while waiting for messages (``keep``: as
        :meth:`forward_keeping`; ``out``: ``(o, lse)`` to write the results into, shaped and
        typed as :meth:`forward` returns them, e.g. views of a head-parallel layer's kept state)."""
        self._check_inputs(q, k, v)
        up = self.prepare(q.device)
        run = _Run(False)
        h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        self._alloc(run, False, h, hkv, d, q.dtype, q.device)
        run.local = {Buf.Q: [q], Buf.KV: [k, v]}
        S = self.local_rows
        # the output in the inputs' dtype: the final reduction converts as it writes (no extra pass)
        shapes, got = [((S, h, d), q.dtype), ((S, h), self.acc)], [(tuple(t.shape), t.dtype) for t in out or ()]
        if out is not None and got != shapes:
            raise ValueError(f"out: expected o and lse shaped and typed {shapes}, got {got}")
        o, lse = out if out is not None else (torch.empty(*sh, dtype=dt, device=q.device) for sh, dt in shapes)
        run.out[Buf.OUT] = _Outputs(o=o, lse=lse)
        yield from self._run(up, run, self.scale if scale is None else float(scale))
        out = run.out[Buf.OUT]
        result = out.fields["o"].to(q.dtype), out.fields["lse"]
        return result + (torch.empty(0, dtype=torch.uint8, device=q.device),) if keep else result

    def backward_steps(self, q, k, v, out, lse, dout, scale: float | None = None,
                       state: torch.Tensor | None = None) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """:meth:`backward` as a generator that yields while waiting for messages (``state``:
        :meth:`forward_keeping`'s, not needed here)."""
        self._check_backward(q, k, v, out, lse, dout)
        up = self.prepare(q.device)
        run = _Run(True)
        h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        self._alloc(run, True, h, hkv, d, q.dtype, q.device)
        S, acc = self.local_rows, self.acc
        output_delta(dout, out, acc, into=run.bufs[Buf.Q].fields["delta"][:S])
        run.local = {Buf.Q: [q, dout, lse], Buf.KV: [k, v]}
        # the gradients in the inputs' dtypes, converted as the final reductions write them (a result
        # that is an accumulator itself is converted below); dK and dV apart: results that share
        # memory cannot leave a custom op
        run.out[Buf.OUT_DQ] = _Buffer(S, [("dq", q.dtype, (h, d))], q.device)
        run.out[Buf.OUT_DKV] = _Outputs(dk=torch.empty(S, hkv, d, dtype=k.dtype, device=q.device),
                                        dv=torch.empty(S, hkv, d, dtype=v.dtype, device=q.device))
        yield from self._run(up, run, self.scale if scale is None else float(scale))
        dkv = run.out[Buf.OUT_DKV].fields
        return run.out[Buf.OUT_DQ].fields["dq"].to(q.dtype), dkv["dk"].to(k.dtype), dkv["dv"].to(v.dtype)

    def _run(self, up: UploadedPlan, run: _Run, scale: float) -> Generator[None, None, None]:
        dev = up.device
        timed, clock = self.record_timings, self._clock
        for step, bound in up.bound[run.backward]:
            t0 = clock.start(dev) if timed and not isinstance(step, WaitStep) else None
            got = getattr(self, step.handler)(step, bound, run, scale)
            if got is not None:  # a wait: yields while the messages are not there
                yield from got
            if t0 is not None:
                clock.stop(dev, t0, run.division, _TIMED_KIND[step.handler], run.backward)
        if run.pending:
            raise RuntimeError(f"rank {self.rank}: phases {sorted(run.pending)} never waited")

    # ------------------------------------------------------------------ the table's handlers
    def on_copy(self, step: CopyStep, bound: dict, run: _Run, scale: float) -> None:
        if step.kind in run.copied:  # with another kind's rows, in one launch
            return
        buf, local = run.bufs[step.kind], run.local[step.kind]
        if triton_runs_on(buf.words) and _copy_at_once(run, step.n):
            return
        if (buf.flat is not None and 1 < len(local) == len(buf.fields) and all(t.dtype == buf.flat.dtype for t in local)
                and sum(math.prod(t.shape[1:]) for t in local) == buf.flat.shape[1]):
            # every field given, of one dtype, filling the row (K and V): one write of all of them
            torch.cat([t.flatten(1) for t in local], 1, out=buf.flat[:step.n])
            return
        for t, f in zip(local, buf.fields.values()):
            f[:step.n].copy_(t)

    def on_launch(self, step: LaunchStep, bound: dict, run: _Run, scale: float) -> None:
        # dK/dV partials leave in the K/V dtype, the phase's in one launch over the rows the device
        # plan gives where the inputs' dtype is narrower than the accumulator's (torch_dcp.executor.wire)
        wire = None if bound["narrow"] is None else wire_sends(run.bufs[Buf.DKV], bound["narrow"], self.acc, self.dtype)
        gathered = {kind: run.bufs[kind].words.index_select(0, rows) for kind, rows in bound["gathers"]}
        sends = []
        for (m, rows), span in zip(bound["sends"], step.narrow_spans or [None] * len(bound["sends"])):
            if span is not None:
                words = wire[span[0]:span[1]]
            else:
                words = run.bufs[m.kind].words[rows] if m.gathered is None else gathered[m.kind][slice(*m.gathered)]
            sends.append((m.peer, int(m.kind), words.reshape(-1).view(torch.uint8)))
        recvs = [(m.peer, int(m.kind), None if narrowed(m.kind, self.acc, self.dtype) else
                  run.bufs[m.kind].message(rows)) for m, rows in bound["recvs"]]
        wide = [i for i, r in enumerate(recvs) if r[2] is None]
        if wide:  # received in the K/V dtype: kept there, or cast into the accumulator rows when the phase completes
            msgs, casts = wire_receives(run.bufs[Buf.DKV], [bound["recvs"][i][1] for i in wide], self.dtype)
            if casts:
                run.widen[step.phase] = casts
            for i, msg in zip(wide, msgs):  # in place, in the order both ends post
                recvs[i] = recvs[i][:2] + (msg,)
        self.bytes_sent += sum(s[2].numel() for s in sends)
        self.bytes_received += sum(r[2].numel() for r in recvs)
        try:
            run.pending[step.phase] = self.transport.launch(step.phase, sends, recvs)
        except TransferError as err:  # a peer already gone: posting fails before any wait
            raise self._located(err, "CommLaunch", step.phase, run) from None

    def on_wait(self, step: WaitStep, bound: dict, run: _Run, scale: float) -> Generator[None, None, None]:
        return self._waited(self.transport.wait(run.pending.pop(step.phase)), step, run)

    def _waited(self, wait: Generator, step: WaitStep, run: _Run) -> Generator[None, None, None]:
        try:
            yield from wait
        except TransferError as err:
            raise self._located(err, "CommWait", step.phase, run) from None
        for dst, src in run.widen.pop(step.phase, ()):
            dst.copy_(src)

    def _located(self, err: TransferError, what: str, phase: int, run: _Run) -> TransferError:
        """``err`` (same type) saying where in the plan this rank was: the pass and the step."""
        where = "backward" if run.backward else "forward"
        return located(err, f"torch_dcp (plan {self.plan.digest()[:12]}): {where} pass, {what}(phase={phase})")

    def on_attention(self, step: AttentionStep, bound: dict, run: _Run, scale: float) -> None:
        run.division = step.division
        qb, kvb = run.bufs[Buf.Q], run.bufs[Buf.KV]
        q_rows, kv_rows = bound["q"], bound["kv"]
        if isinstance(q_rows, torch.Tensor) and isinstance(kv_rows, torch.Tensor) and triton_runs_on(qb.words):
            from .triton_rows import gather_rows_triton  # both gathers in one launch

            qw, kvw = gather_rows_triton(qb.words, q_rows, kvb.words, kv_rows)
        else:
            qw, kvw = take_rows(qb.words, q_rows), take_rows(kvb.words, kv_rows)
        qf, kvf = qb.view_rows(qw), kvb.view_rows(kvw)
        if not run.backward:
            out, lse = self.kernel.forward(qf["q"], kvf["k"], kvf["v"], bound["meta"], scale, self.acc)
            op = run.bufs[Buf.OPART]
            if isinstance(bound["out"], slice) and op.flat is not None:  # the row is o then lse: one write
                torch.cat((out.flatten(1), lse), 1, out=op.flat[bound["out"]])
            elif triton_runs_on(out):  # o (the inputs' dtype) and lse (float32) in one launch: the
                # LSE merge of one partial, which writes it unchanged (weight exp(0) = 1)
                merge_partials(ReduceOp.LSE_MERGE, _Outputs(o=out, lse=lse), op, slice(0, out.shape[0]), bound["out"],
                               out.shape[0], 1)
            else:
                put_rows(op.fields["o"], bound["out"], out)
                put_rows(op.fields["lse"], bound["out"], lse)
            return
        dq, dk, dv = self.kernel.backward(qf["q"], kvf["k"], kvf["v"], qf["do"], qf["lse"], qf["delta"], bound["meta"],
                                          scale, self.acc)
        add_gradients(run.bufs[Buf.DQ].fields["dq"], bound["out"], dq, run.bufs[Buf.DKV], bound["kv_out"], dk, dv)

    def on_reduction(self, step: ReductionStep, bound: dict, run: _Run, scale: float) -> None:
        src = run.bufs[step.src_buf]
        if (step.dst_buf in run.out and step.p == 1 and len(src.fields) == 1 and bound["src"] == slice(0, step.n)
                and bound["dst"] == slice(0, step.n)):
            # every row has one partial, already in place: the result is the accumulator itself
            # (one field only, so results never share memory)
            run.out[step.dst_buf] = _Outputs(**{k: f[:step.n] for k, f in src.fields.items()})
            return
        dst = run.out[step.dst_buf] if step.dst_buf in run.out else run.bufs[step.dst_buf]
        merge_partials(step.op, src, dst, bound["src"], bound["dst"], step.n, step.p)


def _copy_at_once(run: _Run, n: int) -> bool:
    """Every local input of ``run`` (Q and K, V: both the rank's ``n`` rows) into its field of
    its buffer in one Triton launch (:func:`~torch_dcp.executor.triton_rows.copy_rows_triton`),
    where each is a source it takes, of its field's dtype and size (a copy bit for bit); whether
    they were copied."""
    from .triton_rows import copy_rows_triton, row_copyable

    kinds = list(run.local)
    pairs = [(t, i, span) for i, kind in enumerate(kinds) for t, span in zip(run.local[kind], run.bufs[kind].spans)]
    if not all(row_copyable(t) and t.dtype == dt and math.prod(t.shape[1:]) * t.element_size() == nbytes
               for t, _, (_, dt, _, _, nbytes) in pairs):
        return False
    copy_rows_triton([t for t, _, _ in pairs], [run.bufs[kind].words for kind in kinds], [i for _, i, _ in pairs],
                     [span[3] for _, _, span in pairs], n)
    run.copied.update(kinds)
    return True


_TIMED_KIND = {"on_copy": "copy", "on_launch": "pack", "on_wait": "unpack", "on_attention": "attention",
               "on_reduction": "reduction"}


def _drain(gen: Generator) -> Any:
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


class _DCPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, executor):
        out, lse, state = executor.forward_keeping(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, state)
        ctx.executor = executor
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, state = ctx.saved_tensors
        dq, dk, dv = ctx.executor.backward(q, k, v, out, lse, dout.contiguous(), state=state)
        return dq, dk, dv, None


def dcp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, executor: RankExecutor) -> torch.Tensor:
    """Differentiable attention of one rank's tokens under a plan.

    Args:
        q: ``[S_local, H, D]``; k, v: ``[S_local, H_kv, D]``, rows in ``plan.token_indices(rank)``
            order, dtype the plan's.
        executor: the rank's :class:`RankExecutor`.

    Returns:
        ``out: [S_local, H, D]``. Its backward returns complete local dQ, dK, dV.
    """
    return _DCPAttention.apply(q, k, v, executor)
