"""Run a rank's program of a :class:`~torch_dcp.plan.Plan`, forward and backward.

Layout (THD, one packed sequence per rank): ``q: [S_local, H, D]``, ``k, v: [S_local, H_kv, D]``
with the rows in the order of ``plan.token_indices(rank)``. Outputs have the same layout;
``lse: [S_local, H]`` in the accumulation dtype (float32, float64 for float64 inputs).

The executor knows nothing about planners: it interprets the five instructions.
"""

from __future__ import annotations

import math
import time
from typing import Any, Generator, NamedTuple

import numpy as np
import torch

from .._interleave import interleave
from ..plan import (
    BlockwiseAttention,
    BlockwiseCopy,
    BlockwiseReduction,
    CommLaunch,
    CommWait,
    Plan,
    Program,
)
from ..workload import spans_to_indices
from .division import Division, build_division
from .kernels import AttentionKernel, get_kernel
from .reduce import ReductionIndex, reduce_fused, reduce_loop
from .transport import InProcessTransport, Mailbox, Transport

__all__ = ["RankExecutor", "InstructionTime", "dcp_attention", "emulate"]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def _idx(rows: np.ndarray, lens: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(spans_to_indices(rows, lens)).to(device)


class InstructionTime(NamedTuple):
    """Measured compute time of one instruction of a rank's program.

    Attributes:
        division: the division it belongs to (that of the latest ``BlockwiseAttention``; copies
            before the first one count for the first division).
        kind: ``"copy"`` (BlockwiseCopy), ``"pack"`` (gathering a CommLaunch's messages),
            ``"attention"``, ``"unpack"`` (scattering a CommWait's messages, the wait itself not
            counted) or ``"reduction"``.
        seconds: elapsed device time (CUDA events on CUDA, ``time.perf_counter`` around a
            synchronised region elsewhere).
        backward: whether it is in the backward program.
    """

    division: int
    kind: str
    seconds: float
    backward: bool


class _Clock:
    """Times regions of device work: CUDA events on CUDA (resolved lazily), wall clock with a
    device synchronisation elsewhere."""

    def __init__(self):
        self._items: list[tuple[int, str, Any, Any, bool]] = []

    @staticmethod
    def _sync(device: torch.device) -> None:
        mod = getattr(torch, device.type, None)
        if device.type != "cpu" and mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()

    def start(self, device: torch.device) -> Any:
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        self._sync(device)
        return time.perf_counter()

    def stop(self, device: torch.device, token: Any, division: int, kind: str, backward: bool) -> None:
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._items.append((division, kind, token, ev, backward))
        else:
            self._sync(device)
            self._items.append((division, kind, token, time.perf_counter(), backward))

    def results(self) -> list[InstructionTime]:
        out = []
        for division, kind, a, b, backward in self._items:
            if isinstance(a, float):
                sec = b - a
            else:
                b.synchronize()
                sec = a.elapsed_time(b) / 1e3
            out.append(InstructionTime(division, kind, float(sec), backward))
        return out

    def clear(self) -> None:
        self._items.clear()


class RankExecutor:
    """Executes rank ``rank``'s programs of ``plan``.

    Args:
        plan: the step's plan (the same on every rank).
        rank: this rank in the DCP group.
        transport: how messages move (:class:`~torch_dcp.executor.transport.TorchDistributedTransport`
            on a process group, or an in-process one).
        kernel: attention kernel (``"auto"``, ``"sdpa"``, ``"reference"``, ``"flex"`` or an
            instance; default ``"auto"``: chosen on the first call by the inputs' device, see
            :func:`~torch_dcp.executor.kernels.get_kernel`). A kernel with
            ``forward_division``/``backward_division`` methods gets each ``BlockwiseAttention``
            whole (one call per division); others get one call per group of tiles sharing a
            query block.
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        reduction: ``"fused"`` (a few launches per ``BlockwiseReduction``), ``"loop"`` (one
            step per destination block, the reference) or ``"auto"`` (default: fused, except
            gradient sums on CPU, where the loop measured faster for few large blocks).
        timings: record the compute time of every instruction (see :attr:`timings`).

    Attributes:
        bytes_sent, bytes_received: bytes this executor has moved so far (all calls).
        kernel: the kernel in use (None until the first call when chosen automatically).

    Raises:
        ValueError: ``rank`` outside the plan, a transport group of another size, an unknown
            kernel or reduction.
    """

    def __init__(self, plan: Plan, rank: int, transport: Transport, kernel: str | AttentionKernel | None = None,
                 scale: float | None = None, reduction: str = "auto", timings: bool = False):
        group_size = getattr(transport, "world_size", None)
        if group_size is not None and group_size != plan.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks, the transport's group has {group_size}")
        self.plan = plan
        self.rank = int(rank)
        self.transport = transport
        self._kernel_spec = kernel
        self.kernel: AttentionKernel | None = None if kernel is None or kernel == "auto" else get_kernel(kernel)
        if reduction not in ("auto", "fused", "loop"):
            raise ValueError(f"reduction must be 'auto', 'fused' or 'loop', got {reduction!r}")
        self.reduction = reduction
        self.record_timings = bool(timings)
        self._clock = _Clock()
        self._divisions: dict[int, tuple[BlockwiseAttention, Division]] = {}
        self._reductions: dict[tuple[int, str], tuple[BlockwiseReduction, ReductionIndex]] = {}
        b = plan.batch
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(b.head_dim)
        self.dtype = _TORCH_DTYPES[b.dtype]
        self.acc = _TORCH_DTYPES[b.acc_dtype]
        self.local_rows = plan.local_tokens(self.rank)
        wl = plan.workload
        self._blen = wl.block_len
        self._mask_cache: dict[tuple[int, bytes], torch.Tensor | None] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

    # ------------------------------------------------------------------ checks
    def _check(self, name: str, t: torch.Tensor, heads: int) -> None:
        b = self.plan.batch
        want = (self.local_rows, heads, b.head_dim)
        # keys/values may also come with their heads repeated to the query heads
        ok = tuple(t.shape) == want or (heads == b.n_kv_heads and tuple(t.shape) == (self.local_rows, b.n_heads, b.head_dim))
        if t.dim() != 3 or not ok:
            raise ValueError(f"{name}: expected shape {list(want)} ([S_local, heads, head_dim]) on rank {self.rank}, got {list(t.shape)}")
        if t.dtype != self.dtype:
            raise ValueError(f"{name}: expected dtype {self.dtype} (the plan's BatchSpec.dtype), got {t.dtype}")

    @property
    def timings(self) -> list[InstructionTime]:
        """Compute time of every instruction run so far with ``timings=True``, in program order
        (synchronises the device on CUDA)."""
        return self._clock.results()

    def reset_timings(self) -> None:
        """Forget the recorded timings."""
        self._clock.clear()

    def _resolve_kernel(self, device: torch.device) -> None:
        if self.kernel is None:
            self.kernel = get_kernel(self._kernel_spec, device=device)

    # ------------------------------------------------------------------ public API
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward attention of this rank's tokens; blocks on communication.

        ``k``, ``v`` have ``H_kv`` heads, or ``H`` (heads repeated). ``scale`` overrides the
        executor's softmax scale for this call.

        Returns ``(out [S_local, H, D] in q.dtype, lse [S_local, H])``.

        Raises:
            ValueError: wrong shapes or dtype.
        """
        return _drain(self.forward_steps(q, k, v, scale))

    def backward(self, q, k, v, out, lse, dout, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of this rank's Q, K, V (complete: partials computed on other ranks are
        received and summed). Returns ``(dq, dk, dv)`` in the input dtype."""
        return _drain(self.backward_steps(q, k, v, out, lse, dout, scale))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Differentiable forward: :func:`dcp_attention` with this executor."""
        return dcp_attention(q, k, v, self)

    # ------------------------------------------------------------------ programs
    def forward_steps(self, q, k, v, scale: float | None = None) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`forward` as a generator that yields while waiting for messages."""
        b = self.plan.batch
        self._check("q", q, b.n_heads)
        self._check("k", k, b.n_kv_heads)
        self._check("v", v, b.n_kv_heads)
        prog = self.plan.program(self.rank, backward=False)
        dev = q.device
        self._resolve_kernel(dev)
        rows = prog.buffer_rows
        h, d = b.n_heads, b.head_dim
        ws = {
            "q": [q.new_empty(rows["qws"], h, d)],
            "kv": [k.new_empty(rows["kvws"], k.shape[1], d), v.new_empty(rows["kvws"], v.shape[1], d)],
            "opart": [torch.zeros(rows["opart"], h, d, dtype=self.acc, device=dev),
                      torch.full((rows["opart"], h), -math.inf, dtype=self.acc, device=dev)],
        }
        local = {"q": [q], "kv": [k, v]}
        out = torch.zeros(self.local_rows, h, d, dtype=self.acc, device=dev)
        lse = torch.full((self.local_rows, h), -math.inf, dtype=self.acc, device=dev)
        final = {"o": [out, lse]}
        yield from self._run(prog, ws, local, final, backward=False, scale=scale)
        return out.to(q.dtype), lse

    def backward_steps(self, q, k, v, out, lse, dout,
                       scale: float | None = None) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """:meth:`backward` as a generator that yields while waiting for messages."""
        b = self.plan.batch
        for name, t, heads in (("q", q, b.n_heads), ("k", k, b.n_kv_heads), ("v", v, b.n_kv_heads),
                               ("out", out, b.n_heads), ("dout", dout, b.n_heads)):
            self._check(name, t, heads)
        prog = self.plan.program(self.rank, backward=True)
        dev = q.device
        self._resolve_kernel(dev)
        rows = prog.buffer_rows
        h, d = b.n_heads, b.head_dim
        delta = (dout.to(self.acc) * out.to(self.acc)).sum(-1)
        ws = {
            "q": [q.new_empty(rows["qws"], h, d), dout.new_empty(rows["qws"], h, d),
                  torch.empty(rows["qws"], h, dtype=self.acc, device=dev),
                  torch.empty(rows["qws"], h, dtype=self.acc, device=dev)],
            "kv": [k.new_empty(rows["kvws"], k.shape[1], d), v.new_empty(rows["kvws"], v.shape[1], d)],
            "dq": [torch.zeros(rows["dqws"], h, d, dtype=self.acc, device=dev)],
            "dkv": [torch.zeros(rows["dkvws"], k.shape[1], d, dtype=self.acc, device=dev),
                    torch.zeros(rows["dkvws"], v.shape[1], d, dtype=self.acc, device=dev)],
        }
        local = {"q": [q, dout, lse.to(self.acc), delta], "kv": [k, v]}
        dq = torch.zeros(self.local_rows, h, d, dtype=self.acc, device=dev)
        dk = torch.zeros(self.local_rows, k.shape[1], d, dtype=self.acc, device=dev)
        dv = torch.zeros(self.local_rows, v.shape[1], d, dtype=self.acc, device=dev)
        final = {"dq": [dq], "dkv": [dk, dv]}
        yield from self._run(prog, ws, local, final, backward=True, scale=scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    # ------------------------------------------------------------------ interpreter
    def _run(self, prog: Program, ws: dict[str, list[torch.Tensor]], local: dict[str, list[torch.Tensor]],
             final: dict[str, list[torch.Tensor]], backward: bool, scale: float | None) -> Generator[None, None, None]:
        dev = ws["q"][0].device
        blen = self._blen
        pending: dict[int, tuple[Any, CommLaunch]] = {}
        bufname = {"opart": "opart", "dqws": "dq", "dkvws": "dkv"}
        timed = self.record_timings
        clock = self._clock
        division = next((int(i.division) for i in prog.instructions if isinstance(i, BlockwiseAttention)), 0)
        for ins in prog.instructions:
            t0 = clock.start(dev) if timed and not isinstance(ins, CommWait) else None
            if isinstance(ins, BlockwiseCopy):
                kind = "copy"
                lens = blen[ins.blocks]
                src = _idx(ins.src_rows, lens, dev)
                dst = _idx(ins.dst_rows, lens, dev)
                for s, t in zip(local[ins.kind], ws[ins.kind]):
                    t.index_copy_(0, dst, s.index_select(0, src).to(t.dtype))
            elif isinstance(ins, CommLaunch):
                kind = "pack"
                sends: dict[int, list[torch.Tensor]] = {}
                for tr in ins.sends:
                    idx = _idx(tr.rows, blen[tr.blocks], dev)
                    for t in ws[tr.kind]:
                        sends.setdefault(tr.peer, []).append(_as_bytes(t.index_select(0, idx)))
                recvs: dict[int, int] = {}
                for tr in ins.recvs:
                    n = int(blen[tr.blocks].sum())
                    recvs[tr.peer] = recvs.get(tr.peer, 0) + sum(n * _row_bytes(t) for t in ws[tr.kind])
                msgs = [(peer, torch.cat(parts)) for peer, parts in sends.items()]
                self.bytes_sent += sum(m.numel() for _, m in msgs)
                handle = self.transport.launch(ins.phase, msgs, list(recvs.items()))
                pending[ins.phase] = (handle, ins)
            elif isinstance(ins, CommWait):
                kind = "unpack"
                handle, launch = pending.pop(ins.phase)
                got = yield from self.transport.wait(handle)
                t0 = clock.start(dev) if timed else None
                offsets = {peer: 0 for peer in got}
                for tr in launch.recvs:
                    msg = got[tr.peer]
                    n = int(blen[tr.blocks].sum())
                    idx = _idx(tr.rows, blen[tr.blocks], dev)
                    for t in ws[tr.kind]:
                        nbytes = n * _row_bytes(t)
                        part = _from_bytes(msg, offsets[tr.peer], nbytes, t.dtype, (n, *t.shape[1:]))
                        t.index_copy_(0, idx, part)
                        offsets[tr.peer] += nbytes
                self.bytes_received += sum(m.numel() for m in got.values())
            elif isinstance(ins, BlockwiseAttention):
                kind = "attention"
                division = int(ins.division)
                self._attention(ins, ws, backward, self.scale if scale is None else float(scale))
            elif isinstance(ins, BlockwiseReduction):
                kind = "reduction"
                src = ws[bufname[ins.src]]
                dst = final[ins.dst] if ins.dst in final else ws[bufname[ins.dst]]
                self._reduce(ins, src, dst)
            else:  # pragma: no cover
                raise RuntimeError(f"unknown instruction {ins!r}")
            if t0 is not None:
                clock.stop(dev, t0, division, kind, backward)
        if pending:
            raise RuntimeError(f"rank {self.rank}: phases {sorted(pending)} never waited")

    def _mask(self, q_block: int, kv_blocks: np.ndarray, device: torch.device) -> torch.Tensor | None:
        wl = self.plan.workload
        key = (q_block, kv_blocks.tobytes())
        if key in self._mask_cache:
            return self._mask_cache[key]
        # a group of full tiles needs no mask
        mask: torch.Tensor | None = None
        tq_lo = np.searchsorted(wl.tile_q, q_block, side="left")
        tq_hi = np.searchsorted(wl.tile_q, q_block, side="right")
        row_kv = wl.tile_kv[tq_lo:tq_hi]
        pos = np.searchsorted(row_kv, kv_blocks)
        full = wl.tile_full[tq_lo:tq_hi][pos]
        if not full.all():
            b = self.plan.batch
            doc, qpos = wl.block_positions(np.array([q_block]))
            starts, ends = b.key_ranges(doc, qpos)
            _, kpos = wl.block_positions(kv_blocks)
            m = (kpos[None, :, None] >= starts[:, None, :]) & (kpos[None, :, None] < ends[:, None, :])
            mask = torch.from_numpy(m.any(axis=2)).to(device)
        if len(self._mask_cache) < 4096:
            self._mask_cache[key] = mask
        return mask

    def division(self, ins: BlockwiseAttention) -> Division:
        """The :class:`~torch_dcp.executor.division.Division` of an instruction (cached)."""
        hit = self._divisions.get(id(ins))
        if hit is None or hit[0] is not ins:
            hit = (ins, build_division(ins, self.plan.workload))
            self._divisions[id(ins)] = hit
        return hit[1]

    def _attention(self, ins: BlockwiseAttention, ws: dict[str, list[torch.Tensor]], backward: bool, scale: float) -> None:
        kernel = self.kernel
        if hasattr(kernel, "forward_division"):
            div = self.division(ins)
            dev = ws["q"][0].device
            out_rows = _cached_index(div, "out_rows", dev)
            if not backward:
                out, lse = kernel.forward_division(ws["q"][0], ws["kv"][0], ws["kv"][1], div, scale, self.acc)
                ws["opart"][0].index_copy_(0, out_rows, out.to(self.acc))
                ws["opart"][1].index_copy_(0, out_rows, lse.to(self.acc))
            else:
                dq, dk, dv = kernel.backward_division(ws["q"][0], ws["kv"][0], ws["kv"][1], *ws["q"][1:], div, scale,
                                                      self.acc)
                kv_rows = _cached_index(div, "kv_rows", dev)
                ws["dq"][0].index_add_(0, out_rows, dq.to(self.acc))
                ws["dkv"][0].index_add_(0, kv_rows, dk.to(self.acc))
                ws["dkv"][1].index_add_(0, kv_rows, dv.to(self.acc))
            return
        blen = self._blen
        dev = ws["q"][0].device
        for g in range(len(ins.q_block)):
            qb = int(ins.q_block[g])
            q0, n = int(ins.q_row[g]), int(blen[qb])
            lo, hi = int(ins.kv_ptr[g]), int(ins.kv_ptr[g + 1])
            kvb = ins.kv_block[lo:hi]
            kidx = _idx(ins.kv_row[lo:hi], blen[kvb], dev)
            mask = self._mask(qb, kvb, dev)
            k = ws["kv"][0].index_select(0, kidx)
            v = ws["kv"][1].index_select(0, kidx)
            o0 = int(ins.out_row[g])
            if not backward:
                q = ws["q"][0][q0:q0 + n]
                out, lse = kernel.forward(q, k, v, mask, scale, self.acc)
                ws["opart"][0][o0:o0 + n] = out
                ws["opart"][1][o0:o0 + n] = lse
            else:
                q, do, lse, delta = (t[q0:q0 + n] for t in ws["q"])
                dq, dk, dv = kernel.backward(q, k, v, do, lse, delta, mask, scale, self.acc)
                ws["dq"][0][o0:o0 + n] += dq
                ws["dkv"][0].index_add_(0, kidx, dk)
                ws["dkv"][1].index_add_(0, kidx, dv)

    def _reduce(self, ins: BlockwiseReduction, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        mode = self.reduction
        if mode == "auto":
            mode = "loop" if ins.op == "sum" and dst[0].device.type == "cpu" else "fused"
        if mode == "loop":
            reduce_loop(ins, self._blen, src, dst)
            return
        key = (id(ins), str(dst[0].device))
        hit = self._reductions.get(key)
        if hit is None or hit[0] is not ins:
            hit = (ins, ReductionIndex(ins, self._blen, dst[0].device))
            self._reductions[key] = hit
        reduce_fused(ins, self._blen, src, dst, index=hit[1])


def _cached_index(div: Division, name: str, device: torch.device) -> torch.Tensor:
    key = (name, str(device))
    t = div.cache.get(key)
    if t is None:
        t = div.cache[key] = torch.from_numpy(getattr(div, name)).to(device)
    return t


def _row_bytes(t: torch.Tensor) -> int:
    return int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(msg: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    part = msg[offset:offset + nbytes]
    if offset % torch.empty((), dtype=dtype).element_size():
        part = part.clone()
    return part.view(dtype).reshape(shape)


def _drain(gen: Generator) -> Any:
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


class _DCPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, executor):
        out, lse = executor.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.executor = executor
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.executor.backward(q, k, v, out, lse, dout.contiguous())
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


def emulate(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor | None = None,
            kernel: str | AttentionKernel | None = None, scale: float | None = None, reduction: str = "auto",
            timings: bool = False) -> Any:
    """Run every rank of ``plan`` in this process on the in-process transport.

    Args:
        q: ``[T, H, D]``, k, v: ``[T, H_kv, D]``: the whole batch in global token order
            (``T = plan.batch.total_tokens``), dtype the plan's.
        grad_out: ``[T, H, D]`` gradient of the output, for a backward pass too.
        kernel, scale, reduction: as for :class:`RankExecutor`.
        timings: also measure every rank's compute (the ranks run one after another on one
            device, so each instruction's time is that rank's own).

    Returns:
        ``out: [T, H, D]`` when ``grad_out`` is None, else ``(out, dq, dk, dv)``, all in
        global token order. With ``timings=True``: ``(that, times)`` where ``times`` maps each
        rank to its list of :class:`InstructionTime` ``(division, kind, seconds, backward)``,
        forward program first, in program order.

    Raises:
        ValueError: shapes or dtypes that do not match the plan's batch.
        RuntimeError: the plan deadlocks (a rank waits for a message nobody sends).
    """
    b = plan.batch
    T = b.total_tokens
    for name, t, heads in (("q", q, b.n_heads), ("k", k, b.n_kv_heads), ("v", v, b.n_kv_heads)) + (
            (("grad_out", grad_out, b.n_heads),) if grad_out is not None else ()):
        if tuple(t.shape) != (T, heads, b.head_dim):
            raise ValueError(f"emulate: {name} must be [{T}, {heads}, {b.head_dim}] (total tokens, heads, head_dim), got {list(t.shape)}")
    mailbox = Mailbox()
    ranks = range(plan.world_size)
    idx = [torch.from_numpy(plan.token_indices(r)).to(q.device) for r in ranks]
    kern = get_kernel(kernel, device=q.device)  # one kernel instance (and its caches) for all ranks
    execs = [RankExecutor(plan, r, InProcessTransport(mailbox, r), kernel=kern, scale=scale, reduction=reduction,
                          timings=timings) for r in ranks]
    local = [(q[i], k[i], v[i]) for i in idx]
    fwd = interleave([e.forward_steps(*x) for e, x in zip(execs, local)], lambda: mailbox.events)
    out = torch.empty_like(q)
    for i, (o, _) in zip(idx, fwd):
        out[i] = o
    if grad_out is None:
        return (out, {r: e.timings for r, e in zip(ranks, execs)}) if timings else out
    bwd = interleave([e.backward_steps(*x, o, lse, grad_out[i]) for e, x, (o, lse), i in zip(execs, local, fwd, idx)],
                     lambda: mailbox.events)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for i, (a, bk, c) in zip(idx, bwd):
        dq[i], dk[i], dv[i] = a, bk, c
    if timings:
        return (out, dq, dk, dv), {r: e.timings for r, e in zip(ranks, execs)}
    return out, dq, dk, dv
