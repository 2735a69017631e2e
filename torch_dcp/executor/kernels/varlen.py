"""Varlen fast path: a division as a few variable-length (packed) flash-attention calls.

A variable-length attention call (Dao, "FlashAttention-2", 2023, §3; the ``cu_seqlens``
interface of PyTorch's ``aten._flash_attention_forward``) runs many independent *segments*
at once: segment ``s`` has queries ``q[cu_q[s]:cu_q[s+1]]`` and keys ``k[cu_k[s]:cu_k[s+1]]``,
and query ``i`` of a segment sees key ``j`` when ``i + off - wl <= j <= i + off + wr`` with
``off = L_k - L_q`` (bottom-right alignment; ``wl`` / ``wr`` = -1: unbounded; ``wr = 0, wl = -1``
is causal). One call has one ``(wl, wr)``.

:func:`plan_segments` expresses a division's visible pairs exactly as such segments, on the host
when the device plan is built, or says it cannot:

1. *Units*: consecutive groups (query blocks) of one document are merged while their tiles are
   consistent -- no group would see, through the union of the unit's key blocks, a key block
   that is not one of its own tiles (checked against each group's key-range hull). A unit's
   keys are the union of its key blocks in document order, so a long document's query blocks
   share one key span (no key is gathered once per query block).
2. For every query of a unit, its key ranges (``BatchSpec.key_ranges``) become intervals of the
   unit's key list (``searchsorted`` on positions); touching intervals are coalesced.
3. The unit's queries are cut where the number of intervals changes or an interval's edges stop
   moving like a flash window (a right edge that is constant or advances by one key per query;
   a left edge that may also stay put first); each piece and interval slot is fitted to
   ``(k_min, k_max, wl, wr)`` with ``wr`` 0 (causal) or -1 (none), and
   the fit is checked exactly against every query's interval. A failed fit means the division
   is not expressible (e.g. a sliding window across a missing key block): use FlexAttention.
4. Segments are grouped by ``(wl, wr)``: one call each (causal documents: one call; λ: the sink
   rectangles and the windows, two calls). A query row in several calls (λ sink + window) has
   its partial results merged by LSE (:func:`~torch_dcp.executor.reduce.merge_partials`).

:class:`VarlenKernel` runs the calls: on CUDA with fp16/bf16 inputs through
``aten._flash_attention_forward`` / ``aten._flash_attention_backward`` (GQA native, the LSE
returned, no forward recomputation in the backward: the flash backward takes the final LSE and
``O' = dO * delta / |dO|^2``, whose ``rowsum(dO * O')`` is the ``delta`` the executor has); on
other devices or dtypes segment by segment with :class:`~torch_dcp.executor.kernels.base.ReferenceKernel`
under the same window semantics (exact; for tests).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from ...plan import ReduceOp
from ..division import Division
from .base import KernelLayout, ReferenceKernel, flash_backward_inputs
from ..reduce import add_rows, merge_partials, put_rows, take_rows

__all__ = ["Segment", "plan_segments", "VarlenKernel", "flash_varlen_available", "cuda_capability",
           "assume_cuda_capability"]

_BIG = np.iinfo(np.int64).max


class Segment(NamedTuple):
    """One varlen segment: packed query rows ``[q0, q1)`` of the division, packed key rows
    ``keys`` (document order), flash window ``(wl, wr)`` (-1 = unbounded)."""

    q0: int
    q1: int
    keys: np.ndarray
    wl: int
    wr: int


#: the compute capability every CUDA device is taken to have, set by :func:`assume_cuda_capability`
_ASSUMED_CAPABILITY: tuple[int, int] | None = None


@contextlib.contextmanager
def assume_cuda_capability(capability: tuple[int, int]) -> Iterator[None]:
    """Within the block, torch_dcp's kernel choices take every CUDA device to have compute
    ``capability`` (``(major, minor)``, e.g. ``(9, 0)`` for an H100) instead of asking the driver:
    for dry runs under ``FakeTensorMode`` with ``device="cuda"`` tensors where no GPU or driver
    exists (fake tensors have no capability), so that they take the path such a GPU would. It
    sets a process-wide value (not per thread), restored on exit.

    Raises:
        ValueError: ``capability`` is not two non-negative ints.
    """
    global _ASSUMED_CAPABILITY
    cap = tuple(capability)
    if len(cap) != 2 or not all(isinstance(x, int) and x >= 0 for x in cap):
        raise ValueError(f"capability must be (major, minor), two non-negative ints, got {capability!r}")
    old, _ASSUMED_CAPABILITY = _ASSUMED_CAPABILITY, cap
    try:
        yield
    finally:
        _ASSUMED_CAPABILITY = old


def cuda_capability(device: torch.device | str) -> tuple[int, int] | None:
    """Compute capability ``(major, minor)`` of a CUDA ``device``: the assumed one inside
    :func:`assume_cuda_capability`, else the real device's where CUDA is available, else None
    (no driver or GPU: nothing to ask; e.g. fake CUDA tensors on a CPU-only machine)."""
    if _ASSUMED_CAPABILITY is not None:
        return _ASSUMED_CAPABILITY
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(torch.device(device)))


def flash_varlen_available(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``aten._flash_attention_forward`` can run these inputs: CUDA (compute capability
    8.0 or newer, see :func:`cuda_capability`; an unknown capability counts as too old),
    fp16/bf16, ``head_dim`` a multiple of 8 up to 256."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if head_dim % 8 or head_dim > 256:
        return False
    cap = cuda_capability(device)
    return cap is not None and cap[0] >= 8


# ---------------------------------------------------------------------------------------- host side
def _coalesce(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the non-empty intervals ``[lo, hi)`` sorted and with touching ones joined:
    ``(lo, hi, count)``, slots past ``count`` hold ``_BIG``."""
    n, r = lo.shape
    empty = lo >= hi
    order = np.argsort(np.where(empty, _BIG, lo), axis=1, kind="stable")
    lo_s = np.take_along_axis(np.where(empty, _BIG, lo), order, 1)
    hi_s = np.take_along_axis(np.where(empty, _BIG, hi), order, 1)
    out_lo, out_hi = np.full((n, r), _BIG), np.full((n, r), _BIG)
    count = np.zeros(n, np.int64)
    cur_lo, cur_hi = lo_s[:, 0].copy(), hi_s[:, 0].copy()
    every = np.arange(n)
    for s in range(1, r + 1):
        last = s == r
        nl = np.full(n, _BIG) if last else lo_s[:, s]
        nh = np.full(n, _BIG) if last else hi_s[:, s]
        join = (nl <= cur_hi) & (nl != _BIG)
        emit = ~join & (cur_lo != _BIG)
        rows = every[emit]
        out_lo[rows, count[rows]] = cur_lo[rows]
        out_hi[rows, count[rows]] = cur_hi[rows]
        count[rows] += 1
        cur_hi = np.where(join, np.maximum(cur_hi, nh), nh)
        cur_lo = np.where(join, cur_lo, nl)
    return out_lo, out_hi, count


def _fit(a: np.ndarray, b: np.ndarray) -> tuple[int, int, int, int] | None:
    """``(k_min, k_max, wl, wr)`` of one segment whose query ``i`` sees exactly keys
    ``[a[i], b[i])`` of the key list, or None when no flash window does."""
    n = len(a)
    kmin, kmax = int(a.min()), int(b.max())
    diag = kmin + (kmax - kmin - n) + np.arange(n)  # the key aligned with query i (bottom right)
    if (b == kmax).all():
        wr = -1
    else:
        wr = 0  # causal: the right edge is the diagonal (see _edge_breaks)
        if (b != np.minimum(kmax, diag + 1)).any():
            return None
    if (a == kmin).all():
        wl = -1
    else:
        w = (diag - a)[a > kmin]
        wl = int(w[0])
        if wl < 0 or (w != wl).any() or (a != np.maximum(kmin, diag - wl)).any():
            return None
    return kmin, kmax, wl, wr


def _edge_breaks(x: np.ndarray, left: bool) -> np.ndarray:
    """bool ``[n - 1]``: cut before query ``i + 1`` where ``x`` stops moving like a window edge.

    A left edge may stay put and then advance one key per query (a window clamped at the start
    of the key list: steps 0 then 1); a right edge either advances one key per query or stays
    put, never both in one segment (so every right edge is causal or unbounded: ``wr`` is 0 or
    -1; a right window reaching past the diagonal is cut instead)."""
    d = np.diff(x)
    bad = (d != 0) & (d != 1)
    if left:
        bad[1:] |= (d[1:] == 0) & (d[:-1] == 1)
    else:
        bad[1:] |= d[1:] != d[:-1]
    return bad


def _unit_segments(div: Division, qr: np.ndarray, keys: np.ndarray) -> list[Segment] | None:
    kpos = div.k_pos[keys]
    lo = np.searchsorted(kpos, div.key_starts[qr], "left")
    hi = np.searchsorted(kpos, div.key_ends[qr], "left")
    lo, hi, cnt = _coalesce(lo, hi)
    n = len(qr)
    cut = np.zeros(n, bool)
    cut[0] = True
    cut[1:] |= (cnt[1:] != cnt[:-1]) | (qr[1:] != qr[:-1] + 1)
    for s in range(lo.shape[1]):
        both = (cnt[1:] > s) & (cnt[:-1] > s)
        cut[1:] |= both & (_edge_breaks(lo[:, s], True) | _edge_breaks(hi[:, s], False))
    starts = np.flatnonzero(cut)
    segs = []
    for p0, p1 in zip(starts.tolist(), np.append(starts[1:], n).tolist()):
        for s in range(int(cnt[p0])):
            fit = _fit(lo[p0:p1, s], hi[p0:p1, s])
            if fit is None:
                return None
            kmin, kmax, wl, wr = fit
            segs.append(Segment(int(qr[p0]), int(qr[p0]) + p1 - p0, keys[kmin:kmax], wl, wr))
    return segs


def plan_segments(div: Division) -> list[Segment] | None:
    """The division's visible pairs as varlen segments (module docstring), or None when some
    pair pattern is not a flash window. Each pair is covered once."""
    present, _ = div.tile_matrix()
    reach = div.reachable()  # the hull of each group's key ranges
    order = np.argsort(div.k_pos[div.k_ptr[:-1]], kind="stable")  # key blocks in document order (within a document)
    segs: list[Segment] = []
    unit: list[int] = []
    union = forbidden = None

    def flush() -> bool:
        if not unit:
            return True
        qr = np.concatenate([np.arange(div.q_ptr[g], div.q_ptr[g + 1]) for g in unit])
        blocks = order[union[order]]
        keys = np.concatenate([np.arange(div.k_ptr[j], div.k_ptr[j + 1]) for j in blocks.tolist()])
        got = _unit_segments(div, qr, keys)
        if got is None:
            return False
        segs.extend(got)
        return True

    for g in range(div.n_groups):
        rows = slice(int(div.q_ptr[g]), int(div.q_ptr[g + 1]))
        needed = reach[g]
        tiles = present[g]
        if unit and div.q_doc[rows.start] == div.q_doc[div.q_ptr[unit[0]]] and not (tiles & forbidden).any() \
                and not (needed & (union | tiles) & ~tiles).any():
            unit.append(g)
            union |= tiles
            forbidden |= needed & ~tiles
            continue
        if not flush():
            return None
        unit, union, forbidden = [g], tiles.copy(), needed & ~tiles
    return segs if flush() else None


class _Call(NamedTuple):
    """One varlen call of a division (host side)."""

    wl: int
    wr: int
    q_rows: np.ndarray  # packed query rows of its segments, in order
    keys: np.ndarray  # packed key rows of its segments, in order
    cu_q: np.ndarray
    cu_k: np.ndarray


def _calls(segs: list[Segment]) -> list[_Call]:
    by_window: dict[tuple[int, int], list[Segment]] = {}
    for s in segs:
        by_window.setdefault((s.wl, s.wr), []).append(s)
    full = by_window.get((-1, -1), [])
    others = [w for w in sorted(by_window) if w != (-1, -1)]
    if full and others:  # a one-query full segment fits any window that reaches back far enough: one call fewer
        keep = []
        for s in full:
            w = next((w for w in others if s.q1 - s.q0 == 1 and w[1] >= 0 and (w[0] < 0 or w[0] >= len(s.keys) - 1)), None)
            (by_window[w] if w is not None else keep).append(s)
        if keep:
            by_window[(-1, -1)] = keep
        else:
            del by_window[(-1, -1)]
    calls = []
    for (wl, wr), ss in sorted(by_window.items()):
        ss = sorted(ss, key=lambda s: s.q0)
        ql = np.array([s.q1 - s.q0 for s in ss], np.int64)
        kl = np.array([len(s.keys) for s in ss], np.int64)
        q_rows = np.concatenate([np.arange(s.q0, s.q1) for s in ss])
        calls.append(_Call(wl, wr, q_rows, np.concatenate([s.keys for s in ss]),
                           np.concatenate(([0], np.cumsum(ql))), np.concatenate(([0], np.cumsum(kl)))))
    return calls


def _rows_spec(idx: np.ndarray) -> tuple:
    """``("slice", a, b)`` when ``idx`` is ``arange(a, b)``, else ``("index",)``."""
    if len(idx) and (np.diff(idx) == 1).all():
        return ("slice", int(idx[0]), int(idx[-1]) + 1)
    if len(idx) == 0:
        return ("slice", 0, 0)
    return ("index",)


# ---------------------------------------------------------------------------------------- device side
class _BoundCall(NamedTuple):
    wl: int
    wr: int
    q: Any  # slice or int64 index tensor into the division's packed queries
    k: Any
    cu_q: torch.Tensor  # int32 [S + 1]
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    segments: tuple  # ((q0, q1, k0, k1), ...) within the call's gathered rows (reference path)


class _VarlenMeta(NamedTuple):
    calls: tuple[_BoundCall, ...]
    n_q: int
    n_k: int
    mode: str  # "single": one call covers every row once, in order; "direct": rows at most once; "merge"
    merge_idx: torch.Tensor | None  # int64 [n_q * P] rows of the concatenated call outputs (null = last)
    parts: int
    rng: torch.Tensor  # placeholder philox state for the flash backward (no dropout)


def flash_window(wl: int, wr: int, max_k: int) -> tuple[int, int]:
    """The window a FlashAttention-2 call really applies for ``window_size_left/right`` =
    ``(wl, wr)`` (-1: unbounded) and ``max_seqlen_k = max_k``: flash rewrites them (FA2's
    ``mha_varlen_fwd``/``_bwd`` and ``set_params_fprop``, as in PyTorch's aten copy): a side at or
    beyond ``max_k`` becomes unbounded, then an unbounded side facing a bounded one becomes
    ``max_k``. So ``(wl >= 0, -1)`` reaches only ``max_k`` keys right of the diagonal: a segment
    with more queries than ``max_k + 1`` loses keys unless ``max_k`` is raised (see
    :func:`_seqlen_bounds`)."""
    if wl >= max_k:
        wl = -1
    if wr >= max_k:
        wr = -1
    if wl < 0 and wr >= 0:
        wl = max_k
    if wl >= 0 and wr < 0:
        wr = max_k
    return wl, wr


def _seqlen_bounds(call: "_Call") -> tuple[int, int]:
    """``(max_seqlen_q, max_seqlen_k)`` to pass flash for ``call``. ``max_q >= 2``: flash
    reshapes calls whose segments all have one query (GQA groups swapped into the sequence).
    ``max_k >= max_q`` for a window bounded on the left only, so that flash's rewrite
    (:func:`flash_window`) leaves its right side unbounded for every query (it needs
    ``max_k >= L_q - 1``). Larger bounds than the segments' lengths are harmless: they size the
    launch grid, and each segment's rows and keys come from ``cu_seqlens``."""
    max_q = max(2, int(np.diff(call.cu_q).max()))
    max_k = int(np.diff(call.cu_k).max())
    if call.wl >= 0 and call.wr < 0:
        max_k = max(max_k, max_q)
    return max_q, max_k


def _window_mask(lq: int, lk: int, wl: int, wr: int, max_k: int, device) -> torch.Tensor | None:
    """bool ``[lq, lk]`` of what a flash call with window ``(wl, wr)`` and ``max_seqlen_k =
    max_k`` shows query ``i`` of a segment of ``lq`` queries and ``lk`` keys (None: all
    visible): :func:`flash_window`'s rewrite, then bottom-right alignment."""
    wl, wr = flash_window(wl, wr, max_k)
    if wl < 0 and wr < 0:
        return None
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    m = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if wr >= 0:
        m &= j <= i + wr
    if wl >= 0:
        m &= j >= i - wl
    return m


class VarlenKernel:
    """A division as a few varlen flash-attention calls (module docstring); the division
    protocol of :class:`~torch_dcp.executor.kernels.base.DivisionKernel`.

    Args:
        max_calls: most varlen calls (distinct windows) per division; a division needing more
            is not expressible.

    Raises (``prepare``):
        ValueError: the division's mask is not expressible as flash windows (use ``"auto"``,
            which falls back to FlexAttention, or ``"flex"``).
    """

    name = "varlen"

    def __init__(self, max_calls: int = 4):
        if max_calls < 1:
            raise ValueError(f"max_calls must be at least 1, got {max_calls}")
        self.max_calls = int(max_calls)
        self._reference = ReferenceKernel()

    # ------------------------------------------------------------------ host side
    def try_prepare(self, div: Division, min_rows: int = 1) -> KernelLayout | None:
        """The layout of ``div``, or None when it is not expressible or its segments average
        fewer than ``min_rows`` query rows (flash works on 128-row tiles: many tiny segments
        waste them)."""
        segs = plan_segments(div)
        if segs is None or (segs and sum(s.q1 - s.q0 for s in segs) < min_rows * len(segs)):
            return None
        calls = _calls(segs)
        if len(calls) > self.max_calls:
            return None
        arrays: dict[str, np.ndarray] = {}
        static_calls = []
        for c, call in enumerate(calls):
            qs, ks = _rows_spec(call.q_rows), _rows_spec(call.keys)
            if qs[0] == "index":
                arrays[f"q{c}"] = call.q_rows
            if ks[0] == "index":
                arrays[f"k{c}"] = call.keys
            arrays[f"cuq{c}"] = call.cu_q.astype(np.int32)
            arrays[f"cuk{c}"] = call.cu_k.astype(np.int32)
            segments = tuple(zip(call.cu_q[:-1].tolist(), call.cu_q[1:].tolist(), call.cu_k[:-1].tolist(),
                                 call.cu_k[1:].tolist()))
            static_calls.append((call.wl, call.wr, qs, ks, *_seqlen_bounds(call), segments))
        all_rows = np.concatenate([c.q_rows for c in calls]) if calls else np.zeros(0, np.int64)
        times = np.bincount(all_rows, minlength=div.n_q)
        if len(calls) == 1 and times.max(initial=0) <= 1:
            # one call: the executor gathers its query rows and keys in the call's order (rows
            # the call leaves out see none of the division's keys) and writes its results back
            call, (wl, wr, qs, ks, *rest) = calls[0], static_calls[0]
            full_q, full_k = qs == ("slice", 0, div.n_q), ks == ("slice", 0, div.n_k)
            n_q, n_k = len(call.q_rows), len(call.keys)
            arrays.pop("q0", None)  # the call's rows are the executor's gathers now
            arrays.pop("k0", None)
            static = ((wl, wr, ("slice", 0, n_q), ("slice", 0, n_k), *rest),)
            return KernelLayout(n_q, n_k, arrays, (static, n_q, n_k, "single", 1),
                                kv_order=None if full_k else call.keys, q_order=None if full_q else call.q_rows)
        if times.max(initial=0) <= 1:
            mode, parts = "direct", 1
        else:  # [n_q, P] positions in the concatenated outputs; missing partials: the null row
            parts = int(times.max())
            order = np.argsort(all_rows, kind="stable")
            first = np.concatenate(([0], np.cumsum(times)))[:-1]
            slot = np.arange(len(all_rows)) - np.repeat(first, times)
            idx = np.full((div.n_q, parts), len(all_rows), np.int64)
            idx[all_rows[order], slot] = order
            arrays["merge"] = idx.reshape(-1)
            mode = "merge"
        return KernelLayout(div.n_q, div.n_k, arrays, (tuple(static_calls), div.n_q, div.n_k, mode, parts))

    def prepare(self, div: Division) -> KernelLayout:
        layout = self.try_prepare(div)
        if layout is None:
            raise ValueError(f"division {div.division}: its mask is not expressible as at most {self.max_calls} "
                             "varlen flash calls; use kernel='auto' (falls back to FlexAttention) or 'flex'")
        return layout

    def bind(self, arrays: dict[str, torch.Tensor], static: tuple) -> _VarlenMeta:
        static_calls, n_q, n_k, mode, parts = static
        calls = []
        for c, (wl, wr, qs, ks, max_q, max_k, segments) in enumerate(static_calls):
            q = slice(qs[1], qs[2]) if qs[0] == "slice" else arrays[f"q{c}"]
            k = slice(ks[1], ks[2]) if ks[0] == "slice" else arrays[f"k{c}"]
            calls.append(_BoundCall(wl, wr, q, k, arrays[f"cuq{c}"], arrays[f"cuk{c}"], max_q, max_k, segments))
        device = next(iter(arrays.values())).device
        return _VarlenMeta(tuple(calls), n_q, n_k, mode, arrays.get("merge"), parts,
                           torch.zeros(2, dtype=torch.int64, device=device))

    # ------------------------------------------------------------------ device side
    @staticmethod
    def _flash(q: torch.Tensor) -> bool:
        return flash_varlen_available(q.device, q.dtype, q.shape[-1])

    @staticmethod
    def _dense(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    def _call_forward(self, c: _BoundCall, q, k, v, scale, acc):
        if self._flash(q):
            out, lse, *_ = torch.ops.aten._flash_attention_forward(
                self._dense(q), self._dense(k), self._dense(v), c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0,
                c.wl < 0 and c.wr == 0, False, scale=scale, window_size_left=c.wl if c.wl >= 0 else None,
                window_size_right=c.wr if c.wr >= 0 else None)
            return out, lse.t()
        outs, lses = [], []
        for q0, q1, k0, k1 in c.segments:
            mask = _window_mask(q1 - q0, k1 - k0, c.wl, c.wr, c.max_k, q.device)
            o, l = self._reference.forward_group(q[q0:q1], k[k0:k1], v[k0:k1], mask, scale, acc)
            outs.append(o)
            lses.append(l)
        return torch.cat(outs), torch.cat(lses)

    def _call_backward(self, c: _BoundCall, q, k, v, do, lse, delta, rng, scale, acc):
        if self._flash(q):
            do = self._dense(do).to(q.dtype)
            out_like, lse_hq = flash_backward_inputs(do, delta, lse, acc, q.dtype)
            return torch.ops.aten._flash_attention_backward(
                do, self._dense(q), self._dense(k), self._dense(v), out_like, lse_hq, c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0,
                c.wl < 0 and c.wr == 0, rng, rng, scale=scale, window_size_left=c.wl if c.wl >= 0 else None,
                window_size_right=c.wr if c.wr >= 0 else None)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for q0, q1, k0, k1 in c.segments:
            mask = _window_mask(q1 - q0, k1 - k0, c.wl, c.wr, c.max_k, q.device)
            gq, gk, gv = self._reference.backward_group(q[q0:q1], k[k0:k1], v[k0:k1], do[q0:q1], lse[q0:q1],
                                                        delta[q0:q1], mask, scale, acc)
            dq[q0:q1] = gq
            dk[k0:k1] += gk
            dv[k0:k1] += gv
        return dq, dk, dv

    def forward(self, q, k, v, meta: _VarlenMeta, scale, acc_dtype):
        """Partial output ``[n_q, H, D]`` and LSE ``[n_q, H]`` of the division's queries."""
        results = [self._call_forward(c, take_rows(q, c.q), take_rows(k, c.k), take_rows(v, c.k), scale, acc_dtype)
                   for c in meta.calls]
        if meta.mode == "single":  # the executor converts to its partial rows' dtypes as it writes
            return results[0]
        h, d = q.shape[1], q.shape[2]
        if meta.mode == "direct":
            out = torch.zeros(meta.n_q, h, d, dtype=acc_dtype, device=q.device)
            lse = torch.full((meta.n_q, h), -math.inf, dtype=acc_dtype, device=q.device)
            for c, (o, l) in zip(meta.calls, results):
                put_rows(out, c.q, o)
                put_rows(lse, c.q, l)
            return out, lse
        o_all = torch.cat([o.to(acc_dtype) for o, _ in results] + [q.new_zeros(1, h, d, dtype=acc_dtype)])
        l_all = torch.cat([l.to(acc_dtype) for _, l in results] + [q.new_full((1, h), -math.inf, dtype=acc_dtype)])
        out = torch.empty(meta.n_q, h, d, dtype=acc_dtype, device=q.device)
        lse = torch.empty(meta.n_q, h, dtype=acc_dtype, device=q.device)
        merge_partials(ReduceOp.LSE_MERGE, _Fields(o=o_all, lse=l_all), _Fields(o=out, lse=lse), meta.merge_idx,
                       slice(0, meta.n_q), meta.n_q, meta.parts)
        return out, lse

    def backward(self, q, k, v, do, lse, delta, meta: _VarlenMeta, scale, acc_dtype):
        """``(dq [n_q, H, D], dk [n_k, H_kv, D], dv [n_k, H_kv, D])`` of the division's pairs,
        given the final LSE and ``delta = rowsum(dO * O)`` (packed like ``q``)."""
        if meta.mode == "single":  # one call over every (gathered) row in order: its grads are the division's
            return self._call_backward(meta.calls[0], q, k, v, do, lse, delta, meta.rng, scale, acc_dtype)
        dq = torch.zeros(meta.n_q, *q.shape[1:], dtype=acc_dtype, device=q.device)
        dk = torch.zeros(meta.n_k, *k.shape[1:], dtype=acc_dtype, device=q.device)
        dv = torch.zeros(meta.n_k, *v.shape[1:], dtype=acc_dtype, device=q.device)
        for c in meta.calls:
            gq, gk, gv = self._call_backward(c, take_rows(q, c.q), take_rows(k, c.k), take_rows(v, c.k),
                                             take_rows(do, c.q), take_rows(lse, c.q), take_rows(delta, c.q),
                                             meta.rng, scale, acc_dtype)
            add_rows(dq, c.q, gq)
            add_rows(dk, c.k, gk)
            add_rows(dv, c.k, gv)
        return dq, dk, dv


class _Fields(SimpleNamespace):
    """Typed fields for :func:`merge_partials` (no whole-row views)."""

    def __init__(self, **fields: torch.Tensor):
        super().__init__(fields=fields, flat=None)

