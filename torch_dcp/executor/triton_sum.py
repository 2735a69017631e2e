"""The sum of gradient partials in one Triton kernel: gathered, added and written at once.

A backward ends (and a node's reducer sends on) by summing, for each of ``n`` destination rows,
its ``p`` partial dQ (or dK and dV) rows spread over the accumulator buffer. With torch that
is a gather of the ``n x p`` rows, a sum over ``p`` and, for scattered destinations, a scatter:
two or three launches and a gathered copy of every partial. Here it is one launch, one program
per destination row and block of columns, reading each partial once and writing the sum cast to
the destination's dtype (a bfloat16 gradient straight from float32 partials). Accumulation is in
float32 (float64 for float64 sources).

The launch is the ``torch_dcp::sum_rows`` operator (defined at import where Triton is
importable), made with :func:`torch.library.triton_op` as ``torch_dcp::merge_lse`` is
(:mod:`~torch_dcp.executor.triton_merge`: fake under ``FakeTensorMode``, traceable by
``torch.compile``; on CPU tensors only under ``TRITON_INTERPRET=1``, for tests)::

    torch_dcp::sum_rows(Tensor src, Tensor(a1!) dst, Tensor? src_idx, Tensor? dst_idx,
                        SymInt src_start, SymInt dst_start, SymInt n, SymInt p,
                        Tensor? wire=None, SymInt wire_start=0) -> ()

and, where a row's columns go to two tensors (a backward's dK and dV, which leave the
attention operator as separate results), ``torch_dcp::sum_rows_split``: the same with a second
destination ``Tensor(a2!) dst2`` after ``dst``, the row's first ``dst.shape[1]`` columns written
to ``dst`` and the rest to ``dst2``, still one launch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .triton_merge import _plain, launch, partial_rows, tl, triton, triton_available

__all__ = ["sum_rows_triton", "summable", "OP_NAME", "SPLIT_OP_NAME"]

OP_NAME = "torch_dcp::sum_rows"
SPLIT_OP_NAME = "torch_dcp::sum_rows_split"
_BLOCK = 1024  # columns of one program


def _sum_rows_kernel(src, dst, dst2, src_idx, dst_idx, wire, p, src_start, dst_start, wire_start, wire_stop, F, F1,
                     s_r, d_r, d2_r, w_r, SRC_IDX: tl.constexpr, DST_IDX: tl.constexpr, WIRE: tl.constexpr,
                     SPLIT: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    acc = tl.full([BLOCK], 0.0, ACC)
    first = i * p
    j = 0
    while j < p:  # a while loop: one compiled kernel for every p (as the LSE merge's)
        r = tl.load(src_idx + first + j).to(tl.int64) if SRC_IDX else src_start + first + j
        if WIRE:  # rows [wire_start, wire_stop) are read from the wire buffer, in its dtype
            if (r >= wire_start) & (r < wire_stop):
                acc += tl.load(wire + (r - wire_start) * w_r + cols, mask=ok, other=0.0).to(ACC)
            else:
                acc += tl.load(src + r * s_r + cols, mask=ok, other=0.0).to(ACC)
        else:
            acc += tl.load(src + r * s_r + cols, mask=ok, other=0.0).to(ACC)
        j += 1
    d = tl.load(dst_idx + i).to(tl.int64) if DST_IDX else dst_start + i
    if SPLIT:  # columns [0, F1) to dst, [F1, F) to dst2
        tl.store(dst + d * d_r + cols, acc.to(dst.dtype.element_ty), mask=ok & (cols < F1))
        tl.store(dst2 + d * d2_r + (cols - F1), acc.to(dst2.dtype.element_ty), mask=ok & (cols >= F1))
    else:
        tl.store(dst + d * d_r + cols, acc.to(dst.dtype.element_ty), mask=ok)


def _launch(src, dst, src_idx, dst_idx, src_start, dst_start, n, p, wrap: bool, wire=None, wire_start=0,
            dst2=None) -> None:
    F = src.shape[1]
    block = min(_BLOCK, triton.next_power_of_2(int(F)))
    dummy = src  # pointer argument of an unused index (never loaded)
    args = (src, dst, dummy if dst2 is None else dst2, dummy if src_idx is None else src_idx,
            dummy if dst_idx is None else dst_idx, dummy if wire is None else wire, p, src_start, dst_start,
            wire_start, wire_start + (0 if wire is None else wire.shape[0]), F, F if dst2 is None else dst.shape[1],
            src.stride(0), dst.stride(0), 0 if dst2 is None else dst2.stride(0), 0 if wire is None else wire.stride(0))
    consts = dict(SRC_IDX=src_idx is not None, DST_IDX=dst_idx is not None, WIRE=wire is not None,
                  SPLIT=dst2 is not None, ACC=tl.float64 if src.dtype == torch.float64 else tl.float32, BLOCK=block,
                  num_warps=max(1, min(8, block // 256)))
    launch(_sum_rows_kernel, (n, triton.cdiv(F, block)), args, consts, wrap, src,
           OP_NAME if dst2 is None else SPLIT_OP_NAME)


def _sum_rows(src: torch.Tensor, dst: torch.Tensor, src_idx: Optional[torch.Tensor], dst_idx: Optional[torch.Tensor],
              src_start: int, dst_start: int, n: int, p: int, wire: Optional[torch.Tensor] = None,
              wire_start: int = 0) -> None:
    """The body of ``torch_dcp::sum_rows`` (see :func:`sum_rows_triton`), also its fake
    implementation (the launch goes through :func:`torch.library.wrap_triton`)."""
    _launch(src, dst, src_idx, dst_idx, src_start, dst_start, n, p, True, wire, wire_start)


def _sum_rows_split(src: torch.Tensor, dst: torch.Tensor, dst2: torch.Tensor, src_idx: Optional[torch.Tensor],
                    dst_idx: Optional[torch.Tensor], src_start: int, dst_start: int, n: int, p: int,
                    wire: Optional[torch.Tensor] = None, wire_start: int = 0) -> None:
    """The body of ``torch_dcp::sum_rows_split`` (``torch_dcp::sum_rows`` with the row's columns
    split between ``dst`` and ``dst2``; see :func:`sum_rows_triton`)."""
    _launch(src, dst, src_idx, dst_idx, src_start, dst_start, n, p, True, wire, wire_start, dst2)


if triton is not None:
    torch.library.triton_op(OP_NAME, mutates_args={"dst"})(_sum_rows)
    torch.library.triton_op(SPLIT_OP_NAME, mutates_args={"dst", "dst2"})(_sum_rows_split)


def summable(t: torch.Tensor) -> bool:
    """Whether :func:`sum_rows_triton` takes ``t`` (``[rows, F]``, unit column stride, floating)."""
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1) and t.is_floating_point()


def sum_rows_triton(src: torch.Tensor, dst: torch.Tensor, src_rows: Any, dst_rows: Any, n: int, p: int,
                    wire: torch.Tensor | None = None, wire_start: int = 0, dst2: torch.Tensor | None = None) -> None:
    """``dst[dst_rows[i]] = sum_j src[src_rows[i * p + j]]`` for ``i < n``, in one launch, cast
    to ``dst``'s dtype (``p = 1``: a gather that converts). With ``wire``, the source rows
    ``wire_start .. wire_start + len(wire) - 1`` are read from ``wire`` instead, in its own dtype
    (partials received in the K/V dtype, :mod:`~torch_dcp.executor.wire`). With ``dst2``, each
    sum's first ``F1 = dst.shape[1]`` columns go to ``dst`` and the rest to ``dst2`` (two
    results from one row: dK and dV), still one launch.

    Args:
        src: partials ``[R, F]``, dst: ``[R', F]`` (:func:`summable`; any row strides, one device),
            or ``[R', F1]`` with ``dst2`` ``[R', F - F1]`` (same rows, its own dtype and row stride).
        src_rows: the ``n * p`` source rows, row-major (a slice or a 1-D int32/int64 tensor on
            the device, each in ``[0, R)``, not checked); dst_rows: the ``n`` destination rows.
        n, p: destination rows and partials per row (``p >= 1``).
        wire: ``[m, F]`` (:func:`summable`, on ``src``'s device), the rows from ``wire_start``
            on; ``wire_start + m <= R``.

    Raises:
        RuntimeError: Triton is not available for ``src``'s device.
        ValueError: shapes, devices, row counts or ``p`` that do not fit.
    """
    dev = src.device
    if not triton_available(dev):
        raise RuntimeError(f"sum_rows_triton: Triton is not available for {dev}")
    widths = dst.shape[1] + (0 if dst2 is None else dst2.shape[1])
    if not (summable(src) and summable(dst) and src.shape[1] == widths and dst.device == dev):
        raise ValueError(f"sum_rows_triton: expected src [R, F] and dst [R', F] with unit column strides on one "
                         f"device, got {list(src.shape)} {src.stride()} and {list(dst.shape)} {dst.stride()}"
                         + ("" if dst2 is None else f" (and dst2 {list(dst2.shape)})"))
    if dst2 is not None and not (summable(dst2) and dst2.device == dev and dst2.shape[0] == dst.shape[0]
                                 and dst.shape[1] > 0 and dst2.shape[1] > 0):
        raise ValueError(f"sum_rows_triton: expected dst2 [{dst.shape[0]}, F - {dst.shape[1]}] with unit column "
                         f"stride on {dev}, got {list(dst2.shape)} {dst2.stride()} on {dst2.device}")
    if wire is not None and not (summable(wire) and wire.shape[1] == src.shape[1] and wire.device == dev
                                 and 0 <= wire_start and wire_start + wire.shape[0] <= src.shape[0]):
        raise ValueError(f"sum_rows_triton: expected wire [m, {src.shape[1]}] on {dev} for rows inside src's "
                         f"{src.shape[0]}, got {list(wire.shape)} on {wire.device} from row {wire_start}")
    if n == 0:
        return
    src_start, src_idx, dst_start, dst_idx = partial_rows("sum_rows_triton", src_rows, dst_rows, n, p, src.shape[0],
                                                          dst.shape[0], dev)
    tensors = [t for t in (src_idx, dst_idx, wire, dst2) if t is not None]
    if not torch.compiler.is_compiling() and _plain(src, dst, *tensors):
        _launch(src, dst, src_idx, dst_idx, src_start, dst_start, n, p, False, wire, int(wire_start), dst2)
    elif dst2 is not None:
        torch.ops.torch_dcp.sum_rows_split(src, dst, dst2, src_idx, dst_idx, src_start, dst_start, n, p, wire,
                                           int(wire_start))
    else:
        torch.ops.torch_dcp.sum_rows(src, dst, src_idx, dst_idx, src_start, dst_start, n, p, wire, int(wire_start))
