"""Attention kernels: the division protocol, and the per-group kernels every other kernel can
fall back on.

Every kernel runs a whole ``BlockwiseAttention`` instruction (a *division*) per call, on
*packed* inputs the executor gathers for it: the division's query rows one after another
(``q: [Q_rows, H, D]``) and the distinct key/value rows it reads (``k, v: [K_rows, H_kv, D]``),
as laid out by :class:`~torch_dcp.executor.division.Division`; a kernel may ask for padding
rows at the end (``KernelLayout.q_rows >= div.n_q``). Everything a kernel needs beyond the
inputs is computed on the host when the device plan is built (:meth:`DivisionKernel.prepare`,
NumPy) and turned into device objects once per step when it is uploaded
(:meth:`DivisionKernel.bind`), so the step itself only launches kernels.

The forward computes the division's partial output and its log-sum-exp; the backward the
gradients given the *final* LSE and ``delta = rowsum(dO * O)`` (FlashAttention-2 style
recomputation: Dao, "FlashAttention-2", 2023, Algorithm 2). GQA: query head ``h`` uses
key/value head ``h // (H / H_kv)``. Rows that see no key get output 0 and LSE ``-inf``, and no
gradient.

:class:`GroupKernel` implements the protocol with one call per group of tiles sharing a query
block (:class:`ReferenceKernel`, :class:`~torch_dcp.executor.kernels.sdpa.SDPAKernel`);
:class:`~torch_dcp.executor.kernels.flex.FlexKernel` runs a division in one FlexAttention launch.
The kernels by name are in the registry, :mod:`torch_dcp.executor.kernels`, which no kernel
module imports.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from ..division import Division
from ..reduce import triton_runs_on

__all__ = ["KernelLayout", "kernel_rows", "DivisionKernel", "GroupKernel", "ReferenceKernel", "out_with_delta",
           "output_delta", "flash_backward_inputs"]


class KernelLayout(NamedTuple):
    """What a kernel needs for one division, built on the host.

    Attributes:
        q_rows, k_rows: packed query / key-value rows the kernel is given (``>= div.n_q`` /
            ``div.n_k``; rows past those are padding: the executor repeats a real row there and
            the kernel must ignore them).
        arrays: NumPy arrays to upload with the device plan (any dtype).
        static: plain Python data for :meth:`DivisionKernel.bind`.
        kv_order: ``None``, or the division's key/value rows in the order the kernel reads
            them (int64 indices into ``div.kv_rows``, repeats allowed, ``k_rows`` of them before
            padding): the executor gathers them so, composing it with its own gather (one gather,
            not two), and adds the kernel's dK, dV for those rows back the same way; the kernel's
            ``k``, ``v`` are then already in its order.
        q_order: ``None``, or the division's query rows the kernel computes, in its order
            (distinct int64 indices into ``div.q_rows``; rows left out see none of the
            division's keys): gathered, written and added back the same way; rows left out get
            no partial (the output rows of such a pass start as the null row: output 0, LSE
            ``-inf``) and no gradient.
    """

    q_rows: int
    k_rows: int
    arrays: dict[str, np.ndarray]
    static: Any
    kv_order: np.ndarray | None = None
    q_order: np.ndarray | None = None


def kernel_rows(div: Division, layout: KernelLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's rows of ``div`` composed with its own orders (one gather each):
    ``(q_rows, kv_rows, q_idx, kv_idx)``: the division's query / key-value rows in the kernel's
    order, and the same padded to ``layout.q_rows`` / ``layout.k_rows`` by repeating the first
    (int64)."""
    kv_rows = div.kv_rows if layout.kv_order is None else div.kv_rows[layout.kv_order]
    q_rows = div.q_rows if layout.q_order is None else div.q_rows[layout.q_order]
    q_idx = np.concatenate([q_rows, np.full(layout.q_rows - len(q_rows), q_rows[0] if len(q_rows) else 0)])
    kv_idx = np.concatenate([kv_rows, np.full(layout.k_rows - len(kv_rows), kv_rows[0] if len(kv_rows) else 0)])
    return q_rows, kv_rows, q_idx.astype(np.int64), kv_idx.astype(np.int64)


class DivisionKernel(Protocol):
    """What the executor needs from a kernel; results in ``acc_dtype`` or the inputs' dtype (the
    executor converts them as it writes them into its accumulation-dtype buffers)."""

    name: str

    def prepare(self, div: Division) -> KernelLayout:
        """Host side (NumPy), once per division when the device plan is built."""
        ...

    def bind(self, arrays: dict[str, torch.Tensor], static: Any) -> Any:
        """Device side, once per upload: turn the uploaded arrays into what ``forward`` and
        ``backward`` take as ``meta`` (no host-to-device copies after this)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, scale: float,
                acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(out [n_q, H, D], lse [n_q, H])`` of the division's real query rows."""
        ...

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                 delta: torch.Tensor, meta: Any, scale: float,
                 acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(dq [n_q, H, D], dk [n_k, H_kv, D], dv [n_k, H_kv, D])`` of the global
        attention restricted to the division's pairs, given the final LSE and delta (packed like
        ``q``)."""
        ...


def output_delta(do: torch.Tensor, out: torch.Tensor, acc_dtype: torch.dtype,
                 into: torch.Tensor | None = None) -> torch.Tensor:
    """``delta = rowsum(dO * O)`` per row and head, the backward's input beside the final LSE
    (FlashAttention-2, arXiv:2307.08691, Algorithm 2, line 4), the product in ``acc_dtype``.
    Shapes: ``do, out [N, H, D]``; returns ``[N, H]`` (``into``, written, where given; else
    ``acc_dtype``). On CUDA with Triton: one launch
    (:func:`~torch_dcp.executor.triton_delta.output_delta_triton`)."""
    if into is None:
        into = torch.empty(do.shape[:2], dtype=acc_dtype, device=do.device)
    if triton_runs_on(do):
        from ..triton_delta import output_delta_triton

        return output_delta_triton(do, out, into)
    prod = do * out if do.dtype == acc_dtype else do.to(acc_dtype) * out  # out is promoted in the product
    return torch.sum(prod, -1, out=into)


def out_with_delta(do: torch.Tensor, delta: torch.Tensor, acc_dtype: torch.dtype,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``O' = dO * delta / |dO|^2`` per row and head (0 where ``dO = 0``), in ``out_dtype``
    (default ``acc_dtype``); the norm and the coefficient in ``acc_dtype``.

    Fused attention backwards take the forward output ``O`` only to form
    ``delta = rowsum(dO * O)`` (FlashAttention-2, Algorithm 2, line 4); the executor has
    ``delta`` (the final output never travels), and ``rowsum(dO * O') = delta``. Shapes:
    ``do [N, H, D]``, ``delta [N, H]``. On CUDA with Triton: one launch
    (:func:`~torch_dcp.executor.triton_delta.out_with_delta_triton`, the norm in the
    accumulation precision from ``dO`` itself).
    """
    if triton_runs_on(do):  # one launch (torch_dcp::out_with_delta)
        from ..triton_delta import out_with_delta_triton

        return out_with_delta_triton(do, delta, out_dtype or acc_dtype)
    norm = torch.sum(torch.square(do), -1, dtype=acc_dtype)
    ok = norm > 0
    coef = torch.where(ok, delta.to(acc_dtype) / torch.where(ok, norm, torch.ones_like(norm)), torch.zeros_like(norm))
    return torch.mul(do, coef.unsqueeze(-1)).to(out_dtype or acc_dtype)


def flash_backward_inputs(do: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor, acc_dtype: torch.dtype,
                          out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What a fused (flash) attention backward takes besides Q, K, V, dO: ``O'``
    (:func:`out_with_delta`, ``out_dtype``) and the final LSE heads-first, ``[H, N]`` float32
    contiguous. On CUDA with Triton both come from one launch
    (``torch_dcp::out_with_delta_lse``)."""
    if triton_runs_on(do):
        from ..triton_delta import out_with_delta_triton

        return out_with_delta_triton(do, delta, out_dtype, lse=lse)
    return out_with_delta(do, delta, acc_dtype, out_dtype), lse.to(torch.float32).t().contiguous()


class _Group(NamedTuple):
    q0: int
    q1: int
    keys: Any  # slice of the packed keys, or an int64 index tensor into them
    partial: bool  # some pair of the group is masked: build its mask
    runs: tuple = ()  # [a, b) columns of the group's keys in partial tiles (the mask is evaluated there only)
    tail: int = -1  # >= 0: keys [tail:] are the queries' own block under a causal mask, the rest all visible


class _GroupMeta(NamedTuple):
    groups: list[_Group]
    n_q: int
    n_k: int
    k_pos: torch.Tensor  # [n_k] document-local positions of the packed keys
    starts: torch.Tensor  # [n_q, R] key ranges [start, end) of the packed queries
    ends: torch.Tensor


def _causal_tail(div: Division, g: int, rows: np.ndarray, runs: tuple) -> int:
    """Where group ``g``'s keys end in its own query block under a causal mask (query ``i`` of the
    block sees key ``i`` of the block and those before it, every earlier key visible): the first
    column of that block among the group's keys, else -1."""
    if len(runs) != 1 or runs[0][1] != len(rows):
        return -1
    a, b = runs[0]
    q0, q1 = int(div.q_ptr[g]), int(div.q_ptr[g + 1])
    if b - a != q1 - q0:
        return -1
    kp, kd = div.k_pos[rows[a:b]], div.k_doc[rows[a:b]]
    qp, qd = div.q_pos[q0:q1], div.q_doc[q0:q1]
    if not (np.array_equal(kp, qp) and np.array_equal(kd, qd)):
        return -1
    st, en = div.key_starts[q0:q1], div.key_ends[q0:q1]
    if len(kp) > 1 and np.all(np.diff(kp) > 0):  # ascending positions: each range is a run of keys
        return a if _sees_its_prefix(kp, st, en) else -1
    vis = ((kp[None, :, None] >= st[:, None, :]) & (kp[None, :, None] < en[:, None, :])).any(-1)
    return a if np.array_equal(vis, np.tri(b - a, dtype=bool)) else -1


def _sees_its_prefix(kp: np.ndarray, st: np.ndarray, en: np.ndarray) -> bool:
    """Whether query ``i`` sees exactly keys ``0..i`` (key ``j`` is seen where ``st[i, r] <=
    kp[j] < en[i, r]`` for some range ``r``), in ``O(n R)``: ``kp`` ascending, so range ``r`` of
    query ``i`` is the run of keys ``[lo, hi)`` found by binary search, and the runs must cover
    ``[0, i + 1)`` without a gap."""
    n = len(kp)
    lo, hi = np.searchsorted(kp, st, "left"), np.searchsorted(kp, en, "left")
    empty = hi <= lo
    lo, hi = np.where(empty, n + 1, lo), np.where(empty, -1, hi)  # empty runs last, reaching nothing
    order = np.argsort(lo, axis=1, kind="stable")
    lo, hi = np.take_along_axis(lo, order, 1), np.take_along_axis(hi, order, 1)
    ok, reach = lo[:, 0] == 0, hi[:, 0]
    for r in range(1, lo.shape[1]):
        ok &= (lo[:, r] <= reach) | (lo[:, r] == n + 1)
        reach = np.maximum(reach, hi[:, r])
    return bool(ok.all()) and np.array_equal(reach, np.arange(1, n + 1))


def _partial_runs(lengths: np.ndarray, full: np.ndarray) -> tuple[tuple[int, int], ...]:
    """``[a, b)`` column runs of the partial tiles among a group's tiles (key rows ``lengths``
    each, in order), adjacent ones merged."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    runs: list[list[int]] = []
    for a, b, f in zip(starts.tolist(), ends.tolist(), full.tolist()):
        if f:
            continue
        if runs and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    return tuple((a, b) for a, b in runs)


class GroupKernel:
    """The division protocol as one call per group of tiles sharing a query block.

    A group's keys are exactly its tiles' key blocks; its mask, where some tile is partial, is
    the batch's key ranges evaluated on the device from the document positions in the device
    plan. Subclasses give :meth:`forward_group` / :meth:`backward_group` (``mask``: bool
    ``[n_q, n_k]`` or None = all visible).
    """

    name = "group"

    def prepare(self, div: Division) -> KernelLayout:
        present, full = div.tile_matrix()
        static, idx, off = [], [], 0
        for g in range(div.n_groups):
            js = np.nonzero(present[g])[0]
            lo, hi = div.k_ptr[js], div.k_ptr[js + 1]
            rows = np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())]) if len(js) else \
                np.zeros(0, np.int64)
            partial = not bool(full[g, js].all())
            runs = _partial_runs(hi - lo, full[g, js]) if partial else ()
            tail = _causal_tail(div, g, rows, runs)
            if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
                keys = ("slice", int(rows[0]), int(rows[-1]) + 1)
            else:
                keys = ("index", off, off + len(rows))
                idx.append(rows)
                off += len(rows)
            static.append((int(div.q_ptr[g]), int(div.q_ptr[g + 1]), keys, partial, runs, tail))
        arrays = {"kidx": np.concatenate(idx).astype(np.int64) if idx else np.zeros(0, np.int64),
                  "k_pos": div.k_pos.astype(np.int64), "starts": div.key_starts.astype(np.int64),
                  "ends": div.key_ends.astype(np.int64)}
        return KernelLayout(div.n_q, div.n_k, arrays, (static, div.n_q, div.n_k))

    def bind(self, arrays: dict[str, torch.Tensor], static: Any) -> _GroupMeta:
        groups_static, n_q, n_k = static
        groups = []
        for q0, q1, (how, a, b), partial, runs, tail in groups_static:
            keys = slice(a, b) if how == "slice" else arrays["kidx"][a:b]
            groups.append(_Group(q0, q1, keys, partial, runs, tail))
        return _GroupMeta(groups, n_q, n_k, arrays["k_pos"], arrays["starts"], arrays["ends"])

    @staticmethod
    def _keys(t: torch.Tensor, keys: Any) -> torch.Tensor:
        return t[keys] if isinstance(keys, slice) else t.index_select(0, keys)

    @staticmethod
    def _mask(meta: _GroupMeta, g: _Group) -> torch.Tensor | None:
        """bool ``[n_q, n_k]`` of a partial group: the batch's key ranges evaluated in its partial
        tiles' columns only (every pair of a full tile is visible)."""
        if not g.partial:
            return None
        kp = GroupKernel._keys(meta.k_pos, g.keys)
        st, en = meta.starts[g.q0:g.q1, None, :], meta.ends[g.q0:g.q1, None, :]
        mask = torch.ones(g.q1 - g.q0, len(kp), dtype=torch.bool, device=kp.device)
        for a, b in g.runs:
            k = kp[a:b][None, :, None]
            mask[:, a:b] = ((k >= st) & (k < en)).any(-1)
        return mask

    def forward(self, q, k, v, meta: _GroupMeta, scale, acc_dtype):
        h, d = q.shape[1], q.shape[2]
        out = torch.zeros(meta.n_q, h, d, dtype=acc_dtype, device=q.device)
        lse = torch.full((meta.n_q, h), -math.inf, dtype=acc_dtype, device=q.device)
        for g in meta.groups:
            gq, gk, gv = q[g.q0:g.q1], self._keys(k, g.keys), self._keys(v, g.keys)
            if g.tail < 0:
                o, l = self.forward_group(gq, gk, gv, self._mask(meta, g), scale, acc_dtype)
            else:  # the visible keys in one call, the causal diagonal block in another, merged by LSE
                a = g.tail
                o, l = self.forward_causal(gq, gk[a:], gv[a:], scale, acc_dtype)
                if a > 0:
                    o1, l1 = self.forward_group(gq, gk[:a], gv[:a], None, scale, acc_dtype)
                    m = torch.logaddexp(l, l1)
                    o = o * torch.exp(l - m).unsqueeze(-1) + o1 * torch.exp(l1 - m).unsqueeze(-1)
                    l = m
            out[g.q0:g.q1] = o
            lse[g.q0:g.q1] = l
        return out, lse

    def backward(self, q, k, v, do, lse, delta, meta: _GroupMeta, scale, acc_dtype):
        dq = torch.zeros(meta.n_q, *q.shape[1:], dtype=acc_dtype, device=q.device)
        dk = torch.zeros(meta.n_k, *k.shape[1:], dtype=acc_dtype, device=q.device)
        dv = torch.zeros(meta.n_k, *v.shape[1:], dtype=acc_dtype, device=q.device)
        for g in meta.groups:
            s = slice(g.q0, g.q1)
            kk, vv = self._keys(k, g.keys), self._keys(v, g.keys)
            if g.tail < 0:
                gq, gk, gv = self.backward_group(q[s], kk, vv, do[s], lse[s], delta[s], self._mask(meta, g), scale,
                                                 acc_dtype)
            else:  # the gradients of the two calls add up (they are taken with the final LSE)
                a = g.tail
                gq, gk, gv = self.backward_causal(q[s], kk[a:], vv[a:], do[s], lse[s], delta[s], scale, acc_dtype)
                if a > 0:
                    gq1, gk1, gv1 = self.backward_group(q[s], kk[:a], vv[:a], do[s], lse[s], delta[s], None, scale,
                                                        acc_dtype)
                    gq, gk, gv = gq + gq1, torch.cat((gk1, gk)), torch.cat((gv1, gv))
            dq[s] = gq
            if isinstance(g.keys, slice):
                dk[g.keys] += gk
                dv[g.keys] += gv
            else:
                dk.index_add_(0, g.keys, gk)
                dv.index_add_(0, g.keys, gv)
        return dq, dk, dv

    def forward_group(self, q, k, v, mask, scale, acc_dtype):  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def _tril(n: int, device: torch.device) -> torch.Tensor:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()

    def forward_causal(self, q, k, v, scale, acc_dtype):
        """:meth:`forward_group` of a query block against its own keys under a causal mask (query
        ``i`` sees keys ``0..i``); subclasses with a causal kernel skip the hidden half."""
        return self.forward_group(q, k, v, self._tril(q.shape[0], q.device), scale, acc_dtype)

    def backward_causal(self, q, k, v, do, lse, delta, scale, acc_dtype):
        """:meth:`backward_group` of :meth:`forward_causal`'s pairs."""
        return self.backward_group(q, k, v, do, lse, delta, self._tril(q.shape[0], q.device), scale, acc_dtype)

    def backward_group(self, q, k, v, do, lse, delta, mask, scale, acc_dtype):  # pragma: no cover - abstract
        raise NotImplementedError


class ReferenceKernel(GroupKernel):
    """Exact attention in plain torch ops, on any device (one call per group).

    Computes in ``acc_dtype`` (float32, or float64 for float64 inputs); the scores of a group
    are materialised (``[H, n_q, n_k]``), so it is meant for correctness and CPU runs.
    """

    name = "reference"

    @staticmethod
    def _scores(q, k, mask, scale, acc):
        nq, h, d = q.shape
        nk, hkv, _ = k.shape
        g = h // hkv
        qg = q.to(acc).reshape(nq, hkv, g, d)
        s = torch.einsum("qhgd,khd->hgqk", qg, k.to(acc)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
        return qg, s

    def forward_group(self, q, k, v, mask, scale, acc_dtype):
        nq, h, d = q.shape
        _, s = self._scores(q, k, mask, scale, acc_dtype)
        lse = torch.logsumexp(s, dim=-1)  # [hkv, g, nq]
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - safe.unsqueeze(-1))
        out = torch.einsum("hgqk,khd->qhgd", p, v.to(acc_dtype)).reshape(nq, h, d)
        return out, lse.reshape(h, nq).transpose(0, 1)

    def backward_group(self, q, k, v, do, lse, delta, mask, scale, acc_dtype):
        nq, h, d = q.shape
        nk, hkv, _ = k.shape
        g = h // hkv
        qg, s = self._scores(q, k, mask, scale, acc_dtype)
        lse_g = lse.to(acc_dtype).transpose(0, 1).reshape(hkv, g, nq, 1)
        safe = torch.where(torch.isinf(lse_g), torch.zeros_like(lse_g), lse_g)
        p = torch.exp(s - safe)
        if mask is not None:
            p = p.masked_fill(~mask, 0.0)
        dog = do.to(acc_dtype).reshape(nq, hkv, g, d)
        vv = v.to(acc_dtype)
        dv = torch.einsum("hgqk,qhgd->khd", p, dog)
        dp = torch.einsum("qhgd,khd->hgqk", dog, vv)
        delta_g = delta.to(acc_dtype).transpose(0, 1).reshape(hkv, g, nq, 1)
        ds = p * (dp - delta_g)
        dq = torch.einsum("hgqk,khd->qhgd", ds, k.to(acc_dtype)).reshape(nq, h, d) * scale
        dk = torch.einsum("hgqk,qhgd->khd", ds, qg) * scale
        return dq, dk, dv
