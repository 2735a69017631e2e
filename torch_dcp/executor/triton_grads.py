"""A division's gradients added into the backward's accumulators in one Triton launch.

After a division's attention backward, the executor adds its ``dQ`` rows into the query
gradient accumulator and its ``dK`` / ``dV`` rows into the key/value one: with torch operations
an ``add_`` (or ``index_add_``) for ``dQ``, and for scattered key/value rows ``dK`` and ``dV``
concatenated then one ``index_add_`` (or two ``add_`` into contiguous rows): two or three
launches a division. Here it is one launch, one program per gradient row and block of heads
(``dQ`` rows first, then ``dK`` / ``dV`` rows, a program adding both of its row), reading each
gradient once and adding it, converted to the accumulator's dtype, with an atomic add
(``tl.atomic_add``, relaxed: the kernel's row orders may repeat a key row within a division, and
repeated rows add up as ``index_add_``'s do).

The launch is the ``torch_dcp::add_grads`` operator, made with :func:`torch.library.triton_op` as
``torch_dcp::merge_lse`` is (:mod:`~torch_dcp.executor.triton_merge`: fake under
``FakeTensorMode``, traceable by ``torch.compile``; on CPU tensors only under
``TRITON_INTERPRET=1``, for tests)::

    torch_dcp::add_grads(Tensor dq, Tensor dk, Tensor dv, Tensor(a3!) dq_acc, Tensor(a4!) dk_acc,
                         Tensor(a5!) dv_acc, Tensor? q_idx, Tensor? kv_idx, SymInt q_start,
                         SymInt kv_start) -> ()
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .triton_merge import _plain, _rows, launch, tl, triton, triton_available

__all__ = ["add_grads_triton", "OP_NAME"]

OP_NAME = "torch_dcp::add_grads"
_TILE = 1024  # elements of one program's [heads, head_dim] tile


def _add_grads_kernel(dq, dk, dv, dq_acc, dk_acc, dv_acc, q_idx, kv_idx, nq, q_start, kv_start, HQ, HK,
                      sq_r, sq_h, sq_d, sk_r, sk_h, sk_d, sv_r, sv_h, sv_d,
                      aq_r, aq_h, aq_d, ak_r, ak_h, ak_d, av_r, av_h, av_d,
                      Q_IDX: tl.constexpr, KV_IDX: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    if i < nq:  # a dQ row
        r = tl.load(q_idx + i).to(tl.int64) if Q_IDX else q_start + i
        ok = (hs < HQ)[:, None] & (ds < D)[None, :]
        g = tl.load(dq + i * sq_r + hs[:, None] * sq_h + ds[None, :] * sq_d, mask=ok, other=0.0)
        tl.atomic_add(dq_acc + r * aq_r + hs[:, None] * aq_h + ds[None, :] * aq_d, g.to(dq_acc.dtype.element_ty),
                      mask=ok, sem="relaxed")
    else:  # a dK row and the dV row beside it
        j = i - nq
        r = tl.load(kv_idx + j).to(tl.int64) if KV_IDX else kv_start + j
        ok = (hs < HK)[:, None] & (ds < D)[None, :]
        g = tl.load(dk + j * sk_r + hs[:, None] * sk_h + ds[None, :] * sk_d, mask=ok, other=0.0)
        tl.atomic_add(dk_acc + r * ak_r + hs[:, None] * ak_h + ds[None, :] * ak_d, g.to(dk_acc.dtype.element_ty),
                      mask=ok, sem="relaxed")
        g = tl.load(dv + j * sv_r + hs[:, None] * sv_h + ds[None, :] * sv_d, mask=ok, other=0.0)
        tl.atomic_add(dv_acc + r * av_r + hs[:, None] * av_h + ds[None, :] * av_d, g.to(dv_acc.dtype.element_ty),
                      mask=ok, sem="relaxed")


def _launch(dq, dk, dv, dq_acc, dk_acc, dv_acc, q_idx, kv_idx, q_start, kv_start, wrap: bool) -> None:
    nq, HQ, D = dq.shape
    nk, HK, _ = dk.shape
    block_d = triton.next_power_of_2(int(D))
    block_h = min(triton.next_power_of_2(max(int(HQ), int(HK))), max(1, _TILE // block_d))
    dummy = dq_acc  # pointer argument of an unused index (never loaded)
    args = (dq, dk, dv, dq_acc, dk_acc, dv_acc, dummy if q_idx is None else q_idx, dummy if kv_idx is None else kv_idx,
            nq, q_start, kv_start, HQ, HK, *dq.stride(), *dk.stride(), *dv.stride(), *dq_acc.stride(),
            *dk_acc.stride(), *dv_acc.stride())
    consts = dict(Q_IDX=q_idx is not None, KV_IDX=kv_idx is not None, D=int(D), BLOCK_H=block_h, BLOCK_D=block_d,
                  num_warps=max(1, min(8, block_h * block_d // 256)))
    grid = (nq + nk, triton.cdiv(max(int(HQ), int(HK)), block_h))
    launch(_add_grads_kernel, grid, args, consts, wrap, dq, OP_NAME)


def _add_grads(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dq_acc: torch.Tensor, dk_acc: torch.Tensor,
               dv_acc: torch.Tensor, q_idx: Optional[torch.Tensor], kv_idx: Optional[torch.Tensor], q_start: int,
               kv_start: int) -> None:
    """The body of ``torch_dcp::add_grads`` (arguments checked by :func:`add_grads_triton`), also its
    fake implementation (the launch then only marks the accumulators written)."""
    _launch(dq, dk, dv, dq_acc, dk_acc, dv_acc, q_idx, kv_idx, q_start, kv_start, wrap=True)


if triton is not None:
    torch.library.triton_op(OP_NAME, mutates_args={"dq_acc", "dk_acc", "dv_acc"})(_add_grads)


def add_grads_triton(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dq_acc: torch.Tensor,
                     dk_acc: torch.Tensor, dv_acc: torch.Tensor, q_rows: Any, kv_rows: Any) -> None:
    """``dq_acc[q_rows] += dq``, ``dk_acc[kv_rows] += dk``, ``dv_acc[kv_rows] += dv`` in one launch
    (the ``torch_dcp::add_grads`` operator; module docstring), converted to the accumulators' dtypes;
    repeated rows add up.

    Args:
        dq: ``[nq, H, D]``; dk, dv: ``[nk, Hkv, D]``; any floating dtypes and strides.
        dq_acc: ``[R, H, D]``; dk_acc, dv_acc: ``[R', Hkv, D]``: float32 or float64 (an atomic
            add), any strides (rows may be strided views of a wider row).
        q_rows, kv_rows: the accumulators' rows: a slice or a 1-D int32/int64 index tensor on the
            device, of ``nq`` / ``nk`` rows, each in range (not checked).

    Raises:
        RuntimeError: Triton is not importable, or the tensors are not on CUDA and the
            interpreter is off (:func:`~torch_dcp.executor.triton_merge.triton_available`).
        ValueError: shapes, dtypes, devices or row counts that do not match.
    """
    dev = dq.device
    if not triton_available(dev):
        raise RuntimeError(f"add_grads_triton: Triton is not available for {dev} "
                           "(needs the triton package and a CUDA device, or TRITON_INTERPRET=1)")
    ts = (dq, dk, dv, dq_acc, dk_acc, dv_acc)
    if any(t.dim() != 3 for t in ts) or dk.shape != dv.shape or dq.shape[1:] != dq_acc.shape[1:] \
            or dk.shape[1:] != dk_acc.shape[1:] or dk_acc.shape != dv_acc.shape or dq.shape[2] != dk.shape[2]:
        raise ValueError("add_grads_triton: expected dq [nq, H, D], dk and dv [nk, Hkv, D] and accumulators "
                         f"[rows, H, D], [rows, Hkv, D], got {[list(t.shape) for t in ts]}")
    if any(t.dtype not in (torch.float32, torch.float64) for t in ts[3:]):
        raise ValueError(f"add_grads_triton: accumulators must be float32 or float64, got {[t.dtype for t in ts[3:]]}")
    if any(t.device != dev for t in ts):
        raise ValueError("add_grads_triton: all tensors must be on one device")
    q_start, q_idx = _rows(q_rows, dq.shape[0], dq_acc.shape[0], "q_rows", dev)
    kv_start, kv_idx = _rows(kv_rows, dk.shape[0], dk_acc.shape[0], "kv_rows", dev)
    if dq.shape[0] + dk.shape[0] == 0:
        return
    args = (dq, dk, dv, dq_acc, dk_acc, dv_acc, q_idx, kv_idx, q_start, kv_start)
    if not torch.compiler.is_compiling() and _plain(*ts):
        _launch(*args, wrap=False)  # what the operator runs here, without its Python dispatch
    else:
        torch.ops.torch_dcp.add_grads(*args)
