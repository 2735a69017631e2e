"""``BlockwiseReduction``: the LSE merge of partial outputs and the sum of gradient partials.

Two implementations with the same results:

* :func:`reduce_loop` -- one step per destination block (Python loop); the reference.
* :func:`reduce_fused` -- a handful of launches for the whole instruction, whatever its
  number of blocks: one gather of every source row (sources padded to the largest number of
  partials ``P``; the padding weighs 0), the LSE merge as a batched ``[1, P] x [P, D]`` product
  per (row, head) (the sum as a sum over ``P``), and one indexed write. Large reductions run in
  chunks of destination rows to bound the gathered temporary.

Memory traffic of the fused path: the gather reads and writes ``P`` partials, the product
reads them again and writes the result -- about three times the minimum (each partial read
once, each result written once) that a single hand-written kernel would reach.

Shapes: LSE merge ``src = [o_part [S, H, D], lse_part [S, H]]``, ``dst = [o [S', H, D],
lse [S', H]]``; sum: any number of ``[S, ...]`` sources into as many ``[S', ...]``
destinations. Destinations are written (not accumulated); an empty source list gives zeros
(LSE ``-inf``). Partials with LSE ``-inf`` weigh nothing.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..plan import BlockwiseReduction
from ..workload import spans_to_indices

__all__ = ["reduce_loop", "reduce_fused", "ReductionIndex", "reduction_bytes"]


def reduce_loop(ins: BlockwiseReduction, block_len: np.ndarray, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    """Reference implementation, destination block by destination block.

    Raises:
        RuntimeError: unknown ``ins.op``.
    """
    for i in range(len(ins.dst_row)):
        n = int(block_len[ins.dst_block[i]])
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
        else:
            raise RuntimeError(f"unknown reduction {ins.op!r}")


class ReductionIndex:
    """Token-level index tensors of one reduction (built once per instruction and device).

    Attributes:
        n: destination rows ``N``; p: largest number of partials ``P`` (0: no sources at all).
        dst: int64 ``[N]`` destination rows.
        src: int64 ``[N, P]`` source row of every (destination row, partial); padding slots
            repeat the row's first partial (or row 0 when it has none).
        valid: bool ``[N, P]``, the slot is a real partial; all_valid: every slot is.
    """

    def __init__(self, ins: BlockwiseReduction, block_len: np.ndarray, device: torch.device):
        lens = np.asarray(block_len[ins.dst_block], np.int64)
        nsrc = np.diff(ins.src_ptr).astype(np.int64)
        self.n = int(lens.sum())
        self.p = int(nsrc.max()) if len(nsrc) else 0
        seg = np.repeat(np.arange(len(lens)), lens)  # destination slot of every row
        off = spans_to_indices(np.zeros(len(lens), np.int64), lens)  # row within its block
        slot = np.arange(self.p, dtype=np.int64)[None, :]
        valid = slot < nsrc[seg][:, None]
        src_rows = np.zeros((self.n, self.p), np.int64)
        if self.p:
            pick = ins.src_ptr[seg][:, None] + np.where(valid, slot, 0)
            pick = np.minimum(pick, len(ins.src_row) - 1)  # rows without sources: any index, masked below
            src_rows = np.where(nsrc[seg][:, None] > 0, ins.src_row[pick] + off[:, None], 0)
        self.dst = torch.from_numpy(spans_to_indices(ins.dst_row, lens)).to(device)
        self.src = torch.from_numpy(np.ascontiguousarray(src_rows, np.int64)).to(device)
        self.valid = torch.from_numpy(valid).to(device)
        self.all_valid = bool(valid.all())
        self._head_src: dict[int, torch.Tensor] = {}

    def head_src(self, heads: int) -> torch.Tensor:
        """int64 ``[N, heads, P]``: rows of a ``[S * heads, D]`` view (``row * heads + h``)."""
        if heads not in self._head_src:
            h = torch.arange(heads, device=self.src.device)
            self._head_src[heads] = (self.src[:, None, :] * heads + h[None, :, None]).contiguous()
        return self._head_src[heads]


def reduce_fused(ins: BlockwiseReduction, block_len: np.ndarray, src: list[torch.Tensor], dst: list[torch.Tensor],
                 index: ReductionIndex | None = None, max_chunk_bytes: int | None = None) -> None:
    """The reduction in a few launches (same results as :func:`reduce_loop` up to rounding).

    Args:
        index: the instruction's :class:`ReductionIndex` on ``dst``'s device (built when None).
        max_chunk_bytes: bound on the gathered temporary (``N * P`` rows); larger reductions
            run in chunks of destination rows. Default: 256 MiB on CUDA (few launches), 8 MiB
            elsewhere (the chunk stays in the CPU caches between the gather and the product).

    Raises:
        RuntimeError: unknown ``ins.op``.
    """
    if ins.op not in ("sum", "lse_merge"):
        raise RuntimeError(f"unknown reduction {ins.op!r}")
    idx = index if index is not None else ReductionIndex(ins, block_len, dst[0].device)
    if idx.n == 0:
        return
    if idx.p == 0:
        for i, t in enumerate(dst):
            t.index_fill_(0, idx.dst, -math.inf if (ins.op == "lse_merge" and i == 1) else 0)
        return
    if max_chunk_bytes is None:
        max_chunk_bytes = (256 << 20) if dst[0].device.type == "cuda" else (8 << 20)
    row_bytes = max(_row_elems(s) * s.element_size() for s in src)
    step = min(idx.n, max(1, int(max_chunk_bytes // max(1, row_bytes * idx.p))))
    # gather and product buffers, reused by every chunk (on CPU fresh large allocations cost
    # page faults that take longer than the gather itself)
    bufs: dict = {}
    for a in range(0, idx.n, step):
        b = min(idx.n, a + step)
        if ins.op == "sum":
            _sum_chunk(idx, a, b, step, src, dst, bufs)
        else:
            _merge_chunk(idx, a, b, step, src, dst, bufs)


def _row_elems(t: torch.Tensor) -> int:
    return int(np.prod(t.shape[1:], dtype=np.int64))


def _buffer(bufs: dict, name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``[rows, cols]`` view of a buffer kept for the whole reduction."""
    t = bufs.get((name, cols, dtype))
    if t is None or t.shape[0] < rows:
        t = bufs[(name, cols, dtype)] = torch.empty(rows, cols, dtype=dtype, device=device)
    return t[:rows]


def _sum_chunk(idx: ReductionIndex, a: int, b: int, step: int, src: list[torch.Tensor], dst: list[torch.Tensor],
               bufs: dict) -> None:
    n, p = b - a, idx.p
    rows = idx.src[a:b].reshape(-1)
    dst_rows = idx.dst[a:b]
    for i, (s, t) in enumerate(zip(src, dst)):
        f = _row_elems(s)
        flat = s.reshape(s.shape[0], f)
        g = _buffer(bufs, f"g{i}", step * p, f, s.dtype, s.device)[:n * p]
        torch.index_select(flat, 0, rows, out=g)
        if p == 1 and idx.all_valid:  # one partial per row: a gather and a write
            t.index_copy_(0, dst_rows, g.view(n, *s.shape[1:]).to(t.dtype))
            continue
        g = g.to(t.dtype).view(n, p, f)
        out = _buffer(bufs, f"o{i}", step, f, t.dtype, t.device)[:n]
        if idx.all_valid and g.device.type == "cuda":
            torch.sum(g, 1, out=out)
        elif idx.all_valid:  # on CPU a chain of adds beats a reduction over a short middle dim
            torch.add(g[:, 0], g[:, 1], out=out)
            for j in range(2, p):
                out.add_(g[:, j])
        else:
            torch.bmm(idx.valid[a:b].to(t.dtype).unsqueeze(1), g, out=out.view(n, 1, f))
        t.index_copy_(0, dst_rows, out.view(n, *s.shape[1:]))


def _merge_chunk(idx: ReductionIndex, a: int, b: int, step: int, src: list[torch.Tensor], dst: list[torch.Tensor],
                 bufs: dict) -> None:
    o_part, lse_part = src
    o_out, lse_out = dst
    n, p = b - a, idx.p
    s, h, d = o_part.shape
    hs = idx.head_src(h)[a:b]  # [n, H, P]
    lses = lse_part.reshape(s * h).index_select(0, hs.reshape(-1)).view(n, h, p)
    lses = lses.masked_fill(~idx.valid[a:b].unsqueeze(1), -math.inf)
    lse = torch.logsumexp(lses, dim=-1)  # [n, H]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(lses - safe.unsqueeze(-1))  # [n, H, P]; -inf partials and padding weigh 0
    g = _buffer(bufs, "g", step * h * p, d, o_part.dtype, o_part.device)[:n * h * p]
    torch.index_select(o_part.reshape(s * h, d), 0, hs.reshape(-1), out=g)
    out = _buffer(bufs, "o", step * h, d, o_part.dtype, o_part.device)[:n * h]
    torch.bmm(w.reshape(n * h, 1, p).to(g.dtype), g.view(n * h, p, d), out=out.view(n * h, 1, d))
    o_out.index_copy_(0, idx.dst[a:b], out.view(n, h, d).to(o_out.dtype))
    lse_out.index_copy_(0, idx.dst[a:b], lse.to(lse_out.dtype))


def reduction_bytes(ins: BlockwiseReduction, block_len: np.ndarray, src: list[torch.Tensor],
                    dst: list[torch.Tensor]) -> int:
    """Bytes a reduction must move at least: every source row read once, every destination
    row written once."""
    lens = np.asarray(block_len[ins.dst_block], np.int64)
    nsrc = np.diff(ins.src_ptr)
    read_rows = int((lens * nsrc).sum())
    write_rows = int(lens.sum())
    return sum(read_rows * _row_elems(s) * s.element_size() for s in src) + \
        sum(write_rows * _row_elems(t) * t.element_size() for t in dst)
