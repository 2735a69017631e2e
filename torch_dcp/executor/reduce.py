"""``BlockwiseReduction``: the LSE merge of partial outputs and the sum of gradient partials.

* :func:`merge_partials` -- what the executor runs: for ``n`` destination rows with up to
  ``p`` partials each (source rows given row-major as ``n * p`` indices into the partial
  buffer; missing partials point at a null row that weighs nothing), a gather of the partials'
  LSEs and their softmax over ``p`` as weights, one gather of the partial outputs, their
  weighted sum written straight into the destination, and the merged LSE: a fixed handful of
  launches per reduction, whatever its number of blocks (one gather and one write when every
  row has one partial). On CUDA with Triton installed, the LSE merge is instead one launch
  that reads every partial once (one partial per row too: it gathers, converts and writes O
  and the LSE at once; :func:`~torch_dcp.executor.triton_merge.merge_lse_triton`, the
  ``torch_dcp::merge_lse`` operator: under ``FakeTensorMode`` -- fake CUDA tensors, no GPU
  needed -- it runs its fake implementation, and ``torch.compile`` traces into it).
* :func:`add_gradients` -- a division's dQ, dK and dV added into the backward's accumulators
  (on CUDA with Triton one launch, :mod:`~torch_dcp.executor.triton_grads`).
* :func:`reduce_loop` -- one step per destination block; the reference.

LSE merge (``op=LSE_MERGE``): ``lse = log sum_i exp(lse_i)``, ``o = sum_i exp(lse_i - lse) o_i``;
partials with LSE ``-inf`` weigh nothing, rows with none give output 0 and LSE ``-inf``. Sum
(``op=SUM``): ``sum_i x_i``. Destinations are written (not accumulated).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..plan import BlockwiseReduction, ReduceOp

__all__ = ["merge_partials", "add_gradients", "reduce_loop", "dense_rows"]


def take_rows(t: torch.Tensor, rows: Any) -> torch.Tensor:
    """Rows of ``t``: a view for a slice, one gather for an index tensor."""
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def put_rows(t: torch.Tensor, rows: Any, value: torch.Tensor) -> None:
    """``t[rows] = value`` (``rows``: a slice or an int64 index tensor), converted to ``t``'s
    dtype in the same pass where the rows are a slice."""
    if isinstance(rows, slice):
        t[rows].copy_(value)
    else:
        t.index_copy_(0, rows, value.to(t.dtype))


def add_rows(t: torch.Tensor, rows: Any, value: torch.Tensor) -> None:
    """``t[rows] += value`` (``rows``: a slice or an int64 index tensor; repeated indices add
    up), converted to ``t``'s dtype."""
    if isinstance(rows, slice):
        t[rows].add_(value)
    else:
        t.index_add_(0, rows, value.to(t.dtype))


def _write(dst: torch.Tensor, rows: Any, compute) -> None:
    """``dst[rows] = compute(out)``, computing straight into ``dst`` where ``rows`` is a slice
    (converted to ``dst``'s dtype as it is written)."""
    if isinstance(rows, slice):
        compute(dst[rows])
    else:
        dst.index_copy_(0, rows, compute(None).to(dst.dtype))


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether the executor's Triton launches run on ``t``'s device: CUDA (a fake CUDA tensor
    counts: the device is taken as is, not queried) with Triton importable. Triton's modules are
    imported at the first CUDA call: with the ``torch.compile`` hint they register, they cost a
    CPU-only ``import torch_dcp`` over a second."""
    if not t.is_cuda:
        return False
    from .triton_merge import triton_available

    return triton_available(t.device)


def _use_triton(t: torch.Tensor, use_triton: bool | None) -> bool:
    """``use_triton`` if given, else :func:`triton_runs_on`."""
    return triton_runs_on(t) if use_triton is None else use_triton


def add_gradients(dq_acc: torch.Tensor, q_rows: Any, dq: torch.Tensor, dkv: Any, kv_rows: Any, dk: torch.Tensor,
                  dv: torch.Tensor, use_triton: bool | None = None) -> None:
    """A division's gradients added into the backward's accumulators: ``dq_acc[q_rows] += dq`` and
    ``dkv``'s ``dk`` / ``dv`` fields at ``kv_rows`` ``+= dk`` / ``dv`` (repeated rows add up),
    converted to the accumulators' dtypes. On CUDA with Triton, one launch
    (:func:`~torch_dcp.executor.triton_grads.add_grads_triton`); else one ``add_`` or
    ``index_add_`` for ``dQ`` and, for scattered key/value rows of a buffer whose row is ``dK``
    then ``dV`` (``dkv.flat``), both concatenated into one ``index_add_``.

    Args:
        dq_acc: ``[R, H, D]``; dq: ``[nq, H, D]``; dk, dv: ``[nk, Hkv, D]``.
        dkv: the key/value gradient buffer (``fields["dk"]``, ``fields["dv"]`` ``[R', Hkv, D]``,
            ``flat`` the rows' words or None).
        q_rows, kv_rows: slices or int64 index tensors.
        use_triton: the one launch; None (default): :func:`triton_runs_on`.
    """
    if _use_triton(dq, use_triton):
        from .triton_grads import add_grads_triton

        add_grads_triton(dq, dk, dv, dq_acc, dkv.fields["dk"], dkv.fields["dv"], q_rows, kv_rows)
        return
    add_rows(dq_acc, q_rows, dq)
    if isinstance(kv_rows, slice) or dkv.flat is None:
        add_rows(dkv.fields["dk"], kv_rows, dk)
        add_rows(dkv.fields["dv"], kv_rows, dv)
    else:  # scattered rows: dK and dV side by side, converted as they are concatenated, one index_add_
        flat = dkv.flat.unflatten(1, (2 * dk.shape[1], dk.shape[2]))
        both = torch.empty(dk.shape[0], *flat.shape[1:], dtype=flat.dtype, device=dk.device)
        add_rows(flat, kv_rows, torch.cat((dk, dv), 1, out=both))


def _sum_in_one_launch(s: torch.Tensor, d: torch.Tensor, src_rows: Any, dst_rows: Any, n: int, p: int,
                       wire: tuple[torch.Tensor, int] | None = None, d2: torch.Tensor | None = None) -> bool:
    """``d[dst_rows] = sum of s[src_rows]`` (``p`` per row) in one Triton launch
    (:func:`~torch_dcp.executor.triton_sum.sum_rows_triton`; ``wire``: the rows kept in the
    K/V dtype and their first row; ``d2``: the row's columns past ``d``'s go there), where all
    are rows it takes as ``[rows, F]`` views; whether it ran."""
    from .triton_sum import sum_rows_triton, summable

    dsts = [d] + ([] if d2 is None else [d2])
    if not (dense_rows(s) and all(dense_rows(t) for t in dsts) and (wire is None or dense_rows(wire[0]))):
        return False
    s2, w2 = s.flatten(1), None if wire is None else wire[0].flatten(1)  # views: the rows are dense
    flat = [t.flatten(1) for t in dsts]
    if not (summable(s2) and all(summable(t) for t in flat) and (w2 is None or summable(w2))):
        return False
    sum_rows_triton(s2, flat[0], src_rows, dst_rows, n, p, wire=w2, wire_start=0 if wire is None else wire[1],
                    dst2=flat[1] if d2 is not None else None)
    return True


def _split_sum(src: Any, dst: Any, src_rows: Any, dst_rows: Any, n: int, p: int, use_triton: bool | None) -> bool:
    """A sum whose whole source row (``src.flat``) goes to the two separate results of ``dst``
    (dK and dV), its fields in the source's order, in one launch (the kept K/V-dtype rows read
    there): whether it ran (on CUDA with Triton)."""
    if p == 0 or src.flat is None or dst.flat is not None or len(dst.fields) != 2 or len(src.fields) != 2:
        return False
    if not _use_triton(src.flat, use_triton):
        return False
    (a, da), (b, db) = zip(src.fields.values(), dst.fields.values())
    if da.shape[1:] != a.shape[1:] or db.shape[1:] != b.shape[1:]:
        return False
    kept = getattr(src, "wire", None)
    wire = None if kept is None or kept[0].flat is None else (kept[0].flat, kept[1])
    if kept is not None and wire is None:
        return False
    return _sum_in_one_launch(src.flat, da, src_rows, dst_rows, n, p, wire, d2=db)


def dense_rows(t: torch.Tensor) -> bool:
    """Whether each row of ``t`` is dense (its dimensions past the first contiguous), so that
    ``t.flatten(1)`` is a view."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return t.dim() >= 1


def merge_partials(op: ReduceOp, src: Any, dst: Any, src_rows: Any, dst_rows: Any, n: int, p: int,
                   use_triton: bool | None = None) -> None:
    """Reduce ``p`` partials per destination row.

    Args:
        op: :class:`~torch_dcp.plan.ReduceOp`.
        src, dst: buffers with typed ``fields`` (``o [rows, H, D]`` and ``lse [rows, H]`` for
            the LSE merge; any fields, paired in order, for sums) and ``flat``: a typed
            ``[rows, F]`` view of whole rows, or None (sums use it to reduce all fields at once).
            A source with ``words`` (``[rows, W]``, its rows as raw words) and ``view_rows``
            (typed fields of gathered words) is gathered whole rows at a time.
        src_rows: the ``n * p`` source rows, row-major (a slice or an int64 index tensor).
        dst_rows: the ``n`` destination rows (a slice or an index tensor).
        n, p: destination rows and partials per row.
        use_triton: the LSE merge (``p >= 1``) with the Triton kernel; None (default):
            on CUDA when Triton is importable.

    Raises:
        RuntimeError: ``use_triton=True`` where Triton cannot run (see
            :func:`~torch_dcp.executor.triton_merge.triton_available`).
    """
    if n == 0:
        return
    if op is ReduceOp.SUM:
        # one typed view of the whole row where the layout has one (into two results where they
        # are apart: dK and dV), else field by field; rows kept in the K/V dtype (a buffer's
        # ``wire``) are read there, by the one launch
        if _split_sum(src, dst, src_rows, dst_rows, n, p, use_triton):
            return
        kept = getattr(src, "wire", None)
        whole = src.flat is not None and dst.flat is not None
        pairs = [(src.flat, dst.flat)] if whole else list(zip(src.fields.values(), dst.fields.values()))
        wires = [None] * len(pairs) if kept is None else \
            [(w, kept[1]) for w in ([kept[0].flat] if whole else kept[0].fields.values())]
        for (s, d), w in zip(pairs, wires):
            if p == 0:
                _write(d, dst_rows, lambda out: out.zero_() if out is not None else d.new_zeros(n, *d.shape[1:]))
                continue
            if w is not None:
                if not _sum_in_one_launch(s, d, src_rows, dst_rows, n, p, w):
                    raise RuntimeError("merge_partials: rows kept in the K/V dtype need the one-launch sum, which "
                                       f"does not take {list(s.shape)} {s.stride()} into {list(d.shape)} {d.stride()}")
                continue
            if _use_triton(s, use_triton) and _sum_in_one_launch(s, d, src_rows, dst_rows, n, p):
                continue
            g = take_rows(s, src_rows)
            if p == 1:
                _write(d, dst_rows, lambda out: out.copy_(g) if out is not None else g)
                continue
            g = g.reshape(n, p, *s.shape[1:])
            _write(d, dst_rows, lambda out: torch.sum(g, 1, out=out) if out is not None else g.sum(1))
        return
    o, lse = src.fields["o"], src.fields["lse"]
    do, dl = dst.fields["o"], dst.fields["lse"]
    if p == 0:
        _write(do, dst_rows, lambda out: out.zero_() if out is not None else do.new_zeros(n, *do.shape[1:]))
        _write(dl, dst_rows, lambda out: out.fill_(-math.inf) if out is not None else dl.new_full((n, dl.shape[1]), -math.inf))
        return
    if _use_triton(o, use_triton):  # one launch, every partial read once, in place
        from .triton_merge import merge_lse_triton

        merge_lse_triton(o, lse, do, dl, src_rows, dst_rows, n, p)
        return
    if hasattr(src, "words"):  # whole rows (O and LSE side by side) in one 2-D gather
        f = src.view_rows(take_rows(src.words, src_rows))
        og, lg = f["o"], f["lse"]
    else:  # 2-D gathers take the fast row-copy path
        og = take_rows(o.reshape(o.shape[0], -1), src_rows).view(-1, *o.shape[1:])
        lg = take_rows(lse, src_rows)
    if p == 1:
        _write(do, dst_rows, lambda out: out.copy_(og) if out is not None else og.contiguous())
        _write(dl, dst_rows, lambda out: out.copy_(lg) if out is not None else lg.contiguous())
        return
    lg = lg.unflatten(0, (n, p))
    w = torch.softmax(lg, 1).nan_to_num_(0.0)  # rows whose partials all have LSE -inf: weights 0
    og = og.unflatten(0, (n, p))
    prod = og * w.unsqueeze(-1) if isinstance(src_rows, slice) else og.mul_(w.unsqueeze(-1))  # gathered: a copy
    _write(do, dst_rows, lambda out: torch.sum(prod, 1, out=out) if out is not None else prod.sum(1))
    _write(dl, dst_rows, lambda out: torch.logsumexp(lg, 1, out=out) if out is not None else torch.logsumexp(lg, 1))


def reduce_loop(ins: BlockwiseReduction, block_len: np.ndarray, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    """Reference implementation, destination block by destination block.

    Raises:
        RuntimeError: unknown ``ins.op``.
    """
    for i in range(len(ins.dst_row)):
        n = int(block_len[ins.dst_block[i]])
        d0 = int(ins.dst_row[i])
        srows = ins.src_row[ins.src_ptr[i]:ins.src_ptr[i + 1]].tolist()
        if ins.op is ReduceOp.SUM:
            for s, t in zip(src, dst):
                acc = torch.zeros_like(t[d0:d0 + n])
                for r in srows:
                    acc += s[r:r + n]
                t[d0:d0 + n] = acc
        elif ins.op is ReduceOp.LSE_MERGE:
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
