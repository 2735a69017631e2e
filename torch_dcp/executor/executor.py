"""Run a rank's program of a :class:`~torch_dcp.plan.Plan`, forward and backward.

Layout (THD, one packed sequence per rank): ``q: [S_local, H, D]``, ``k, v: [S_local, H_kv, D]``
with the rows in the order of ``plan.token_indices(rank)``. Outputs have the same layout;
``lse: [S_local, H]`` in the accumulation dtype (float32, float64 for float64 inputs).

The executor knows nothing about planners: it interprets the five instructions.
"""

from __future__ import annotations

import math
from typing import Any, Generator

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
from .kernels import AttentionKernel, get_kernel
from .transport import InProcessTransport, Mailbox, Transport

__all__ = ["RankExecutor", "dcp_attention", "emulate"]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def _idx(rows: np.ndarray, lens: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(spans_to_indices(rows, lens)).to(device)


class RankExecutor:
    """Executes rank ``rank``'s programs of ``plan``.

    Args:
        plan: the step's plan (the same on every rank).
        rank: this rank in the DCP group.
        transport: how messages move (:class:`~torch_dcp.executor.transport.TorchDistributedTransport`
            on a process group, or an in-process one).
        kernel: attention kernel (``"auto"``, ``"sdpa"``, ``"reference"`` or an instance;
            default ``"auto"``).
        scale: softmax scale; default ``1 / sqrt(head_dim)``.

    Attributes:
        bytes_sent, bytes_received: bytes this executor has moved so far (all calls).

    Raises:
        ValueError: ``rank`` outside the plan, or a transport group of another size.
    """

    def __init__(self, plan: Plan, rank: int, transport: Transport, kernel: str | AttentionKernel | None = None,
                 scale: float | None = None):
        group_size = getattr(transport, "world_size", None)
        if group_size is not None and group_size != plan.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks, the transport's group has {group_size}")
        self.plan = plan
        self.rank = int(rank)
        self.transport = transport
        self.kernel = get_kernel(kernel)
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
        for ins in prog.instructions:
            if isinstance(ins, BlockwiseCopy):
                lens = blen[ins.blocks]
                src = _idx(ins.src_rows, lens, dev)
                dst = _idx(ins.dst_rows, lens, dev)
                for s, t in zip(local[ins.kind], ws[ins.kind]):
                    t.index_copy_(0, dst, s.index_select(0, src).to(t.dtype))
            elif isinstance(ins, CommLaunch):
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
                handle, launch = pending.pop(ins.phase)
                got = yield from self.transport.wait(handle)
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
                self._attention(ins, ws, backward, self.scale if scale is None else float(scale))
            elif isinstance(ins, BlockwiseReduction):
                src = ws[bufname[ins.src]]
                dst = final[ins.dst] if ins.dst in final else ws[bufname[ins.dst]]
                self._reduce(ins, src, dst)
            else:  # pragma: no cover
                raise RuntimeError(f"unknown instruction {ins!r}")
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

    def _attention(self, ins: BlockwiseAttention, ws: dict[str, list[torch.Tensor]], backward: bool, scale: float) -> None:
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
                out, lse = self.kernel.forward(q, k, v, mask, scale, self.acc)
                ws["opart"][0][o0:o0 + n] = out
                ws["opart"][1][o0:o0 + n] = lse
            else:
                q, do, lse, delta = (t[q0:q0 + n] for t in ws["q"])
                dq, dk, dv = self.kernel.backward(q, k, v, do, lse, delta, mask, scale, self.acc)
                ws["dq"][0][o0:o0 + n] += dq
                ws["dkv"][0].index_add_(0, kidx, dk)
                ws["dkv"][1].index_add_(0, kidx, dv)

    def _reduce(self, ins: BlockwiseReduction, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        blen = self._blen
        for i in range(len(ins.dst_row)):
            n = int(blen[ins.dst_block[i]])
            d0 = int(ins.dst_row[i])
            srows = ins.src_row[ins.src_ptr[i]:ins.src_ptr[i + 1]].tolist()
            if ins.op == "sum":
                for s, t in zip(src, dst):
                    acc = torch.zeros_like(t[d0:d0 + n])
                    for r in srows:
                        acc += s[r:r + n]
                    t[d0:d0 + n] = acc
            elif ins.op == "lse_merge":
                o_out, lse_out = dst
                if not srows:
                    o_out[d0:d0 + n] = 0
                    lse_out[d0:d0 + n] = -math.inf
                    continue
                lses = torch.stack([src[1][r:r + n] for r in srows])  # [P, n, H]
                outs = torch.stack([src[0][r:r + n] for r in srows])  # [P, n, H, D]
                lse = torch.logsumexp(lses, dim=0)
                safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
                w = torch.exp(lses - safe)  # -inf partials weigh 0
                o_out[d0:d0 + n] = (w.unsqueeze(-1) * outs).sum(0).to(o_out.dtype)
                lse_out[d0:d0 + n] = lse
            else:  # pragma: no cover
                raise RuntimeError(f"unknown reduction {ins.op!r}")


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
            kernel: str | AttentionKernel | None = None, scale: float | None = None) -> Any:
    """Run every rank of ``plan`` in this process on the in-process transport.

    Args:
        q: ``[T, H, D]``, k, v: ``[T, H_kv, D]``: the whole batch in global token order
            (``T = plan.batch.total_tokens``), dtype the plan's.
        grad_out: ``[T, H, D]`` gradient of the output, for a backward pass too.
        kernel, scale: as for :class:`RankExecutor`.

    Returns:
        ``out: [T, H, D]`` when ``grad_out`` is None, else ``(out, dq, dk, dv)``, all in
        global token order.

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
    execs = [RankExecutor(plan, r, InProcessTransport(mailbox, r), kernel=kernel, scale=scale) for r in ranks]
    local = [(q[i], k[i], v[i]) for i in idx]
    fwd = interleave([e.forward_steps(*x) for e, x in zip(execs, local)], lambda: mailbox.events)
    out = torch.empty_like(q)
    for i, (o, _) in zip(idx, fwd):
        out[i] = o
    if grad_out is None:
        return out
    bwd = interleave([e.backward_steps(*x, o, lse, grad_out[i]) for e, x, (o, lse), i in zip(execs, local, fwd, idx)],
                     lambda: mailbox.events)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for i, (a, bk, c) in zip(idx, bwd):
        dq[i], dk[i], dv[i] = a, bk, c
    return out, dq, dk, dv
