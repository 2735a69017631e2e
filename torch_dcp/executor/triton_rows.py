"""Rows into and out of the work buffers in one Triton launch: a pass's local inputs, and a
division's query and key/value rows.

A pass opens by copying the rank's own rows into the rows ``[0, S)`` of its work buffers, each
field of a buffer row from its own tensor: Q into the query buffer and K, V into the key/value
buffer in the forward; Q, dO and the LSE into the query buffer (beside ``delta``, written by
the backward's ``delta`` launch) and K, V in the backward. With torch these are one copy per
field (K and V share one ``cat``): two launches forward, four backward. Here they are one
launch, one program per row and tensor, each copying the tensor's row into its field of the
buffer row as raw 16-bit words (every floating dtype the executor takes is a whole number of
them, and every field starts at a multiple of its element size), so dtypes pass unchanged.

A division's attention reads its query rows and its key/value rows out of the buffers, in
the order its kernel call takes them: with torch one ``index_select`` per buffer. Here both
are one launch (:func:`gather_rows_triton`), one program per row, buffer and block of words.

The launches are the ``torch_dcp::copy_rows`` and ``torch_dcp::gather_rows`` operators (defined
at import where Triton is importable), made with :func:`torch.library.triton_op` as
``torch_dcp::merge_lse`` is (:mod:`~torch_dcp.executor.triton_merge`: fake under
``FakeTensorMode``, traceable by ``torch.compile``; on CPU tensors only under
``TRITON_INTERPRET=1``, for tests)::

    torch_dcp::copy_rows(Tensor[] srcs, Tensor(a1!) dst0, Tensor(a2!) dst1, int[] dst_of,
                         int[] offsets, SymInt n) -> ()
    torch_dcp::gather_rows(Tensor src0, Tensor src1, Tensor rows0, Tensor rows1,
                           Tensor(a4!) out0, Tensor(a5!) out1) -> ()
"""

from __future__ import annotations

from typing import Sequence

import torch

from .reduce import dense_rows
from .triton_merge import _plain, launch, tl, triton, triton_available

__all__ = ["copy_rows_triton", "gather_rows_triton", "row_copyable", "OP_NAME", "GATHER_OP_NAME", "MAX_SOURCES"]

OP_NAME = "torch_dcp::copy_rows"
GATHER_OP_NAME = "torch_dcp::gather_rows"
_WORDS = 1024  # int64 words of one gathering program
#: the most tensors one launch copies (Q, dO, the LSE, K, V)
MAX_SOURCES = 5


def _copy_rows_kernel(s0, s1, s2, s3, s4, d0, d1, d2, d3, d4, ss0, ss1, ss2, ss3, ss4, ds0, ds1, ds2, ds3, ds4,
                      o0, o1, o2, o3, o4, n0, n1, n2, n3, n4, BLOCK: tl.constexpr):
    # one program per (row, tensor): the branches, not a table of pointers, so that the launch
    # needs nothing on the device but the tensors themselves; every pointer read as 16-bit
    # words, strides and offsets in them
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = tl.arange(0, BLOCK)
    w = tl.pointer_type(tl.int16)
    if j == 0:
        m = c < n0
        tl.store(d0.to(w) + i * ds0 + o0 + c, tl.load(s0.to(w) + i * ss0 + c, mask=m), mask=m)
    elif j == 1:
        m = c < n1
        tl.store(d1.to(w) + i * ds1 + o1 + c, tl.load(s1.to(w) + i * ss1 + c, mask=m), mask=m)
    elif j == 2:
        m = c < n2
        tl.store(d2.to(w) + i * ds2 + o2 + c, tl.load(s2.to(w) + i * ss2 + c, mask=m), mask=m)
    elif j == 3:
        m = c < n3
        tl.store(d3.to(w) + i * ds3 + o3 + c, tl.load(s3.to(w) + i * ss3 + c, mask=m), mask=m)
    else:
        m = c < n4
        tl.store(d4.to(w) + i * ds4 + o4 + c, tl.load(s4.to(w) + i * ss4 + c, mask=m), mask=m)


def _launch(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], dst_of: Sequence[int],
            offsets: Sequence[int], n: int, wrap: bool) -> None:
    """The launch: the tensors as they are (no views: the operator's arguments themselves),
    row strides, offsets (16-bit words) and words per row of each source."""
    if n == 0 or not srcs:
        return
    units = [s[0].numel() * s.element_size() // 2 for s in srcs]
    pad = MAX_SOURCES - len(srcs)
    ptrs = [*srcs, *[srcs[0]] * pad, *[dsts[d] for d in dst_of], *[dsts[0]] * pad]  # unused: not launched
    strides = [s.stride(0) * s.element_size() // 2 for s in srcs] + [0] * pad + \
        [dsts[d].stride(0) * 4 for d in dst_of] + [0] * pad
    block = triton.next_power_of_2(max(units))
    consts = dict(BLOCK=block, num_warps=max(1, min(8, block // 512)))
    args = (*ptrs, *strides, *offsets, *[0] * pad, *units, *[0] * pad)
    launch(_copy_rows_kernel, (n, len(srcs)), args, consts, wrap, srcs[0], OP_NAME)


def _copy_rows(srcs: list[torch.Tensor], dst0: torch.Tensor, dst1: torch.Tensor, dst_of: list[int],
               offsets: list[int], n: int) -> None:
    """The body of ``torch_dcp::copy_rows`` (see :func:`copy_rows_triton`), also its fake
    implementation (the launch goes through :func:`torch.library.wrap_triton`)."""
    _launch(srcs, (dst0, dst1), dst_of, offsets, n, wrap=True)


def _gather_rows_kernel(s0, s1, r0, r1, o0, o1, ss0, ss1, n0, n1, w0, w1, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    if j == 0:
        if i < n0:
            r = tl.load(r0 + i).to(tl.int64)
            m = c < w0
            tl.store(o0 + i * w0 + c, tl.load(s0 + r * ss0 + c, mask=m), mask=m)
    else:
        if i < n1:
            r = tl.load(r1 + i).to(tl.int64)
            m = c < w1
            tl.store(o1 + i * w1 + c, tl.load(s1 + r * ss1 + c, mask=m), mask=m)


def _gather(src0: torch.Tensor, src1: torch.Tensor, rows0: torch.Tensor, rows1: torch.Tensor, out0: torch.Tensor,
            out1: torch.Tensor, wrap: bool) -> None:
    n = max(rows0.numel(), rows1.numel())
    if n == 0:
        return
    w = max(src0.shape[1], src1.shape[1])
    block = min(_WORDS, triton.next_power_of_2(int(w)))
    args = (src0, src1, rows0, rows1, out0, out1, src0.stride(0), src1.stride(0), rows0.numel(), rows1.numel(),
            src0.shape[1], src1.shape[1])
    launch(_gather_rows_kernel, (n, 2, triton.cdiv(w, block)), args,
           dict(BLOCK=block, num_warps=max(1, min(8, block // 128))), wrap, src0, GATHER_OP_NAME)


def _gather_rows(src0: torch.Tensor, src1: torch.Tensor, rows0: torch.Tensor, rows1: torch.Tensor,
                 out0: torch.Tensor, out1: torch.Tensor) -> None:
    """The body of ``torch_dcp::gather_rows`` (see :func:`gather_rows_triton`)."""
    _gather(src0, src1, rows0, rows1, out0, out1, wrap=True)


if triton is not None:
    torch.library.triton_op(OP_NAME, mutates_args={"dst0", "dst1"})(_copy_rows)
    torch.library.triton_op(GATHER_OP_NAME, mutates_args={"out0", "out1"})(_gather_rows)


def row_copyable(t: torch.Tensor) -> bool:
    """Whether :func:`copy_rows_triton` takes ``t`` as a source: rows dense inside (any row
    stride, :func:`~torch_dcp.executor.reduce.dense_rows`) of a dtype of whole 16-bit words."""
    return dense_rows(t) and t.element_size() % 2 == 0


def copy_rows_triton(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], dst_of: Sequence[int],
                     offsets: Sequence[int], n: int) -> None:
    """Rows ``[0, n)`` of each ``srcs[j]`` into rows ``[0, n)`` of ``dsts[dst_of[j]]``, at byte
    offset ``offsets[j]`` in each row, bit for bit, in one launch.

    Args:
        srcs: up to :data:`MAX_SOURCES` tensors ``[>= n, ...]`` (:func:`row_copyable`), one device.
        dsts: one or two row buffers, int64 ``[>= n, W]`` with unit column stride (a buffer's
            ``words``), on the sources' device.
        dst_of: each source's buffer (an index into ``dsts``); offsets: each source's byte
            offset in the row (a multiple of 2, its row fitting in the buffer's row).
        n: rows.

    Raises:
        RuntimeError: Triton is not available for the sources' device.
        ValueError: sources, buffers or offsets that do not fit.
    """
    if not srcs:
        return
    dev = srcs[0].device
    if not triton_available(dev):
        raise RuntimeError(f"copy_rows_triton: Triton is not available for {dev}")
    if not 1 <= len(dsts) <= 2 or len(srcs) > MAX_SOURCES or not len(srcs) == len(dst_of) == len(offsets):
        raise ValueError(f"copy_rows_triton: expected up to {MAX_SOURCES} sources with a buffer and an offset each "
                         f"and 1-2 buffers, got {len(srcs)} sources, {len(dsts)} buffers, {len(dst_of)} buffer "
                         f"indices, {len(offsets)} offsets")
    for s, d, o in zip(srcs, dst_of, offsets):
        if not 0 <= d < len(dsts):
            raise ValueError(f"copy_rows_triton: buffer index {d} out of range for {len(dsts)} buffers")
        b = dsts[d]
        row = s[0].numel() * s.element_size() if s.dim() and s.shape[0] else 0
        if (s.device != dev or b.device != dev or b.dtype != torch.int64 or b.dim() != 2 or b.stride(1) != 1
                or not row_copyable(s) or s.shape[0] < n or b.shape[0] < n or o % 2 or o < 0
                or o + row > 8 * b.shape[1]):
            raise ValueError(f"copy_rows_triton: source {list(s.shape)} {s.dtype} on {s.device} does not fit buffer "
                             f"{list(b.shape)} {b.dtype} on {b.device} at byte offset {o} for {n} rows")
    pair = [dsts[0], dsts[-1]]
    if not torch.compiler.is_compiling() and _plain(*srcs, *pair):
        _launch(srcs, pair, dst_of, [o // 2 for o in offsets], n, wrap=False)
    else:
        torch.ops.torch_dcp.copy_rows(list(srcs), pair[0], pair[1], list(dst_of), [o // 2 for o in offsets], n)


def gather_rows_triton(src0: torch.Tensor, rows0: torch.Tensor, src1: torch.Tensor,
                       rows1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src0[rows0], src1[rows1])`` in one launch, as ``index_select(0, rows)`` gives them.

    Args:
        src0, src1: int64 row buffers ``[R, W]`` with unit column stride (a buffer's
            ``words``), one device.
        rows0, rows1: 1-D int64 indices on that device, each in ``[0, R)`` (not checked).

    Returns:
        Two new contiguous tensors ``[len(rows), W]``.

    Raises:
        RuntimeError: Triton is not available for the buffers' device.
        ValueError: buffers or indices that do not fit.
    """
    dev = src0.device
    if not triton_available(dev):
        raise RuntimeError(f"gather_rows_triton: Triton is not available for {dev}")
    for s, r in ((src0, rows0), (src1, rows1)):
        if (s.dtype != torch.int64 or s.dim() != 2 or s.stride(1) != 1 or s.device != dev or r.dim() != 1
                or r.dtype != torch.int64 or r.device != dev):
            raise ValueError(f"gather_rows_triton: expected int64 buffers [R, W] and int64 indices on {dev}, got "
                             f"{list(s.shape)} {s.dtype} on {s.device} and {list(r.shape)} {r.dtype} on {r.device}")
    out0 = torch.empty(rows0.numel(), src0.shape[1], dtype=src0.dtype, device=dev)
    out1 = torch.empty(rows1.numel(), src1.shape[1], dtype=src1.dtype, device=dev)
    if not torch.compiler.is_compiling() and _plain(src0, src1, rows0, rows1, out0, out1):
        _gather(src0, src1, rows0, rows1, out0, out1, wrap=False)
    else:
        torch.ops.torch_dcp.gather_rows(src0, src1, rows0, rows1, out0, out1)
    return out0, out1
