"""FlexAttention kernel: one launch per division, any mask.

:class:`FlexKernel` runs a whole ``BlockwiseAttention`` instruction (all its groups) as one
``torch.nn.attention.flex_attention.flex_attention`` call (He et al., "FlexAttention",
arXiv 2412.05496):

* queries: the division's query blocks packed one after another, ``[1, H, N_q, D]``;
  keys/values: the distinct key/value blocks it reads, ``[1, H_kv, N_k, D]`` (GQA through
  ``enable_gqa``). Both are padded to a multiple of the flex block size (default 128 rows);
  padding rows see nothing and are seen by nothing.
* a ``BlockMask`` built directly from the division's tile list (no dense mask evaluation):
  a flex tile is *present* if any of the division's tiles overlaps it and *full* if every
  pair in it belongs to a full tile of the division;
* a ``mask_mod`` evaluated in partial flex tiles through index tensors: per packed query its
  group (query block), document-local position's key ranges ``[start, end)`` (``R`` ranges,
  ``BatchSpec.key_ranges``); per packed key its distinct key block and document-local
  position; plus the division's ``[G, J]`` tile matrix, so a pair counts only where the plan
  runs its tile here. Every mask spec (Causal, Full, Lambda, BlockwiseCausal, SharedQuestion,
  Ranges) goes through the same code.

The forward returns the partial output and its natural-log LSE (``-inf`` and output 0 for rows
that see no key).

Backward (exact gradients of the *global* attention): the partial forward is recomputed with
autograd and back-propagated with ``grad_out = c * dO`` and ``grad_lse = c * (rowsum(dO * O_p)
- delta)``, ``c = exp(LSE_p - LSE)``, where ``LSE`` is the final LSE and ``delta = rowsum(dO * O)``
of the final output (``rowsum(grad_out * O_p) - c * delta`` in practice, with ``grad_out`` as
rounded to the input dtype). Then ``dS = P_p * c * (dO V^T - delta)``: the FlashAttention-2
backward (Dao, 2023, Algorithm 2) with the global softmax ``P = c * P_p``.

Devices:

* CUDA: ``torch.compile(flex_attention)`` (compiled once per process, dynamic shapes after the
  first recompile), inputs in their own dtype (bf16 stays bf16; partials are cast to the
  accumulation dtype for the merge). Backward through flex's own (compiled) backward with
  the LSE gradient.
* CPU: eager ``flex_attention`` for the forward (PyTorch's unfused implementation: it
  materialises the ``[H, N_q, N_k]`` scores); inputs are cast to the accumulation dtype.
  FlexAttention has no backward on CPU (``NotImplementedError`` as of torch 2.13), and the
  compiled CPU kernel returns no LSE, so the CPU backward recomputes the partial forward with
  a dense differentiable stand-in that applies exactly the same block mask (full / partial
  tiles) and ``mask_mod``, then uses the same exact backward. It is meant for tests; use the
  ``"sdpa"`` kernel for CPU runs.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Callable

import numpy as np
import torch

from .division import Division

__all__ = ["FlexKernel", "flex_available"]

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None
    flex_attention = None

try:  # torch >= 2.9: return_aux=AuxRequest(lse=True); older: return_lse=True
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

_USE_AUX = (flex_attention is not None and AuxRequest is not None
            and "return_aux" in inspect.signature(flex_attention).parameters)
_COMPILED: dict[str, Callable] = {}


def flex_available() -> bool:
    """Whether this torch has FlexAttention."""
    return flex_attention is not None


def _compiled_flex() -> Callable:
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention)
    return _COMPILED["flex"]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class _State:
    """Device-side pieces of one division (or one group) for a given flex block size."""

    def __init__(self, n_q: int, n_k: int, bs: int, device: torch.device, q_index: torch.Tensor | None,
                 kv_index: torch.Tensor | None, mask_mod: Callable, full: np.ndarray, partial: np.ndarray):
        self.n_q, self.n_k = n_q, n_k
        self.nq_pad, self.nk_pad = _round_up(n_q, bs), _round_up(n_k, bs)
        self.bs = bs
        self.q_index, self.kv_index = q_index, kv_index
        self.mask_mod = mask_mod
        self.full, self.partial = full, partial  # bool [n_q_tiles, n_k_tiles]
        self.block_mask = _block_mask(full, partial, bs, self.nq_pad, self.nk_pad, mask_mod, device)
        self._dense: torch.Tensor | None = None

    def dense_visible(self, device: torch.device) -> torch.Tensor:
        """bool ``[N_q_pad, N_k_pad]``: what flex sees (full tiles, or partial tiles where
        ``mask_mod`` holds)."""
        if self._dense is None:
            bs = self.bs
            full = torch.from_numpy(self.full).to(device)
            part = torch.from_numpy(self.partial).to(device)
            full = full.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
            part = part.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
            qi = torch.arange(self.nq_pad, device=device)[:, None]
            ki = torch.arange(self.nk_pad, device=device)[None, :]
            zero = torch.zeros((), dtype=torch.long, device=device)
            self._dense = full | (part & self.mask_mod(zero, zero, qi, ki))
        return self._dense


def _kv_blocks(m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    num = m.sum(axis=1).astype(np.int32)
    idx = np.argsort(~m, axis=1, kind="stable").astype(np.int32)
    return torch.from_numpy(num)[None, None], torch.from_numpy(np.ascontiguousarray(idx))[None, None]


def _block_mask(full: np.ndarray, partial: np.ndarray, bs: int, nq_pad: int, nk_pad: int, mask_mod: Callable,
                device: torch.device) -> Any:
    kv_num, kv_idx = _kv_blocks(partial)
    full_num, full_idx = _kv_blocks(full)
    return BlockMask.from_kv_blocks(kv_num.to(device), kv_idx.to(device), full_num.to(device), full_idx.to(device),
                                    BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(nq_pad, nk_pad))


def _prefix2d(a: np.ndarray) -> np.ndarray:
    s = np.zeros((a.shape[0] + 1, a.shape[1] + 1), np.int64)
    s[1:, 1:] = a.astype(np.int64).cumsum(0).cumsum(1)
    return s


def division_tiles(div: Division, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """Flex tiles of a division's packed layout: ``(full, partial)``, bool
    ``[ceil(N_q / bs), ceil(N_k / bs)]``, from the tile list (vectorised, no dense mask)."""
    nqt, nkt = -(-div.n_q // bs), -(-div.n_k // bs)
    g_lo, g_hi = div.q_ptr[:-1] // bs, (div.q_ptr[1:] - 1) // bs
    j_lo, j_hi = div.k_ptr[:-1] // bs, (div.k_ptr[1:] - 1) // bs
    tg, tj = div.tile_group, div.tile_key
    diff = np.zeros((nqt + 1, nkt + 1), np.int64)
    np.add.at(diff, (g_lo[tg], j_lo[tj]), 1)
    np.add.at(diff, (g_lo[tg], j_hi[tj] + 1), -1)
    np.add.at(diff, (g_hi[tg] + 1, j_lo[tj]), -1)
    np.add.at(diff, (g_hi[tg] + 1, j_hi[tj] + 1), 1)
    present = diff.cumsum(0).cumsum(1)[:nqt, :nkt] > 0
    # full: the flex tile lies inside real rows and keys, and every (group, key block) pair it
    # spans is a full tile of the division
    _, full_t = div.tile_matrix()
    s = _prefix2d(full_t)
    a = np.arange(nqt)
    b = np.arange(nkt)
    ga0 = div.q_group[np.minimum(a * bs, div.n_q - 1)]
    ga1 = div.q_group[np.minimum((a + 1) * bs, div.n_q) - 1]
    jb0 = div.k_block[np.minimum(b * bs, div.n_k - 1)]
    jb1 = div.k_block[np.minimum((b + 1) * bs, div.n_k) - 1]
    cnt = (s[ga1[:, None] + 1, jb1[None, :] + 1] - s[ga0[:, None], jb1[None, :] + 1]
           - s[ga1[:, None] + 1, jb0[None, :]] + s[ga0[:, None], jb0[None, :]])
    area = (ga1 - ga0 + 1)[:, None] * (jb1 - jb0 + 1)[None, :]
    inside = ((a + 1) * bs <= div.n_q)[:, None] & ((b + 1) * bs <= div.n_k)[None, :]
    full = inside & (cnt == area) & present
    return full, present & ~full


def _division_mask_mod(div: Division, nq_pad: int, nk_pad: int, device: torch.device) -> Callable:
    G, J = div.n_groups, div.n_key_blocks
    present, _ = div.tile_matrix()
    tm = np.zeros((G + 1, J + 1), bool)  # row G / column J: padding, sees nothing
    tm[:G, :J] = present
    R = div.key_starts.shape[1]

    def pad(a: np.ndarray, n: int, fill: int) -> torch.Tensor:
        out = np.full((n,) + a.shape[1:], fill, np.int64)
        out[:len(a)] = a
        return torch.from_numpy(out).to(device)

    tiles = torch.from_numpy(tm.reshape(-1)).to(device)
    qg = pad(div.q_group * (J + 1), nq_pad, G * (J + 1))
    kb = pad(div.k_block, nk_pad, J)
    kpos = pad(div.k_pos, nk_pad, 0)
    starts = pad(div.key_starts, nq_pad, 0)
    ends = pad(div.key_ends, nq_pad, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        kp = kpos[kv_idx]
        seen = (kp >= starts[q_idx, 0]) & (kp < ends[q_idx, 0])
        for r in range(1, R):
            seen = seen | ((kp >= starts[q_idx, r]) & (kp < ends[q_idx, r]))
        return seen & tiles[qg[q_idx] + kb[kv_idx]]

    return mask_mod


def _dense_mask_mod(mask: torch.Tensor, nq_pad: int, nk_pad: int) -> Callable:
    padded = torch.zeros(nq_pad, nk_pad, dtype=torch.bool, device=mask.device)
    padded[:mask.shape[0], :mask.shape[1]] = mask
    flat = padded.reshape(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        return flat[q_idx * nk_pad + kv_idx]

    return mask_mod


class FlexKernel:
    """FlexAttention over whole divisions (see the module docstring).

    Args:
        block_size: flex tile size in rows (``BLOCK_SIZE`` of the ``BlockMask``; default 128).
        compile: use ``torch.compile(flex_attention)``; default: on CUDA only (the compiled CPU
            kernel returns no LSE).

    Division protocol (used by the executor):

    * ``forward_division(q_ws, k_ws, v_ws, div, scale, acc_dtype) -> (out [n_q, H, D], lse [n_q, H])``
    * ``backward_division(q_ws, k_ws, v_ws, do_ws, lse_ws, delta_ws, div, scale, acc_dtype)
      -> (dq [n_q, H, D], dk [n_k, H_kv, D], dv [n_k, H_kv, D])``

    where the ``*_ws`` are the rank's work buffers (``qws`` rows for Q, dO, LSE, delta;
    ``kvws`` rows for K, V) and ``div`` the :class:`~torch_dcp.executor.division.Division`;
    results are in packed order (``div.out_rows`` / ``div.kv_rows``) and ``acc_dtype``. The
    per-group protocol of :class:`~torch_dcp.executor.kernels.ReferenceKernel` (dense mask)
    is implemented too.

    Raises:
        RuntimeError: this torch has no FlexAttention.
        ValueError: ``block_size`` not positive.
    """

    name = "flex"

    def __init__(self, block_size: int = 128, compile: bool | None = None):
        if flex_attention is None:
            raise RuntimeError("FlexKernel needs torch.nn.attention.flex_attention (torch >= 2.5)")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = int(block_size)
        self.compile = compile

    # ------------------------------------------------------------------ helpers
    def _compiled(self, device: torch.device) -> bool:
        return self.compile if self.compile is not None else device.type == "cuda"

    def _in_dtype(self, t: torch.Tensor, acc: torch.dtype) -> torch.dtype:
        return t.dtype if t.device.type == "cuda" else acc

    def _state(self, div: Division, device: torch.device) -> _State:
        key = ("flex", self.block_size, str(device))
        st = div.cache.get(key)
        if st is None:
            bs = self.block_size
            full, partial = division_tiles(div, bs)
            nq_pad, nk_pad = _round_up(div.n_q, bs), _round_up(div.n_k, bs)
            qi = np.concatenate([div.q_rows, np.full(nq_pad - div.n_q, div.q_rows[0])])
            ki = np.concatenate([div.kv_rows, np.full(nk_pad - div.n_k, div.kv_rows[0])])
            st = _State(div.n_q, div.n_k, bs, device, torch.from_numpy(qi).to(device), torch.from_numpy(ki).to(device),
                        _division_mask_mod(div, nq_pad, nk_pad, device), full, partial)
            div.cache[key] = st
        return st

    def _group_state(self, n_q: int, n_k: int, mask: torch.Tensor | None, device: torch.device) -> _State:
        bs = self.block_size
        nq_pad, nk_pad = _round_up(n_q, bs), _round_up(n_k, bs)
        m = mask if mask is not None else torch.ones(n_q, n_k, dtype=torch.bool, device=device)
        padded = torch.zeros(nq_pad, nk_pad, dtype=torch.bool)
        padded[:n_q, :n_k] = m.cpu()
        tiles = padded.reshape(nq_pad // bs, bs, nk_pad // bs, bs).permute(0, 2, 1, 3).reshape(nq_pad // bs, nk_pad // bs, -1)
        full = tiles.all(-1).numpy()
        present = tiles.any(-1).numpy()
        return _State(n_q, n_k, bs, device, None, None, _dense_mask_mod(m, nq_pad, nk_pad), full, present & ~full)

    def _flex(self, q4, k4, v4, st: _State, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """flex_attention with the LSE (natural log), either API spelling."""
        fn = _compiled_flex() if self._compiled(q4.device) else flex_attention
        kw = dict(block_mask=st.block_mask, scale=scale, enable_gqa=q4.shape[1] != k4.shape[1])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")
            if _USE_AUX:
                out, aux = fn(q4, k4, v4, return_aux=AuxRequest(lse=True), **kw)
                return out, aux.lse
            out, lse = fn(q4, k4, v4, return_lse=True, **kw)
            return out, lse

    @staticmethod
    def _dense(q4, k4, v4, st: _State, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable stand-in for flex on devices where flex has no backward: the same
        visible pairs (block mask + mask_mod), dense math."""
        g = q4.shape[1] // k4.shape[1]
        k4, v4 = k4.repeat_interleave(g, 1), v4.repeat_interleave(g, 1)
        vis = st.dense_visible(q4.device)
        empty = ~vis.any(-1)  # [N_q]
        s = torch.einsum("bhqd,bhkd->bhqk", q4, k4) * scale
        s = s.masked_fill(~vis, -math.inf).masked_fill(empty[:, None], 0.0)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bhqk,bhkd->bhqd", p, v4)
        out = torch.where(empty[:, None], torch.zeros_like(out), out)
        lse = torch.where(empty, torch.full_like(lse, -math.inf), lse)
        return out, lse

    @staticmethod
    def _heads_first(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).transpose(0, 1).unsqueeze(0)

    def _gather(self, t: torch.Tensor, index: torch.Tensor | None, n_pad: int, dtype: torch.dtype) -> torch.Tensor:
        if index is not None:
            return self._heads_first(t.index_select(0, index), dtype)
        pad = t.new_zeros((n_pad - t.shape[0],) + tuple(t.shape[1:]))
        return self._heads_first(torch.cat([t, pad]), dtype)

    # ------------------------------------------------------------------ core
    def _forward(self, q, k, v, st: _State, scale, acc) -> tuple[torch.Tensor, torch.Tensor]:
        dt = self._in_dtype(q, acc)
        q4 = self._gather(q, st.q_index, st.nq_pad, dt)
        k4 = self._gather(k, st.kv_index, st.nk_pad, dt)
        v4 = self._gather(v, st.kv_index, st.nk_pad, dt)
        with torch.no_grad():
            out, lse = self._flex(q4, k4, v4, st, scale)
        return out[0, :, :st.n_q].transpose(0, 1).to(acc), lse[0, :, :st.n_q].transpose(0, 1).to(acc)

    def _backward(self, q, k, v, do, lse, delta, st: _State, scale, acc):
        dt = self._in_dtype(q, acc)
        q4 = self._gather(q, st.q_index, st.nq_pad, dt)
        k4 = self._gather(k, st.kv_index, st.nk_pad, dt)
        v4 = self._gather(v, st.kv_index, st.nk_pad, dt)
        do4 = self._gather(do, st.q_index, st.nq_pad, acc)
        lse_f = self._gather(lse.unsqueeze(-1), st.q_index, st.nq_pad, acc)[..., 0]  # [1, H, N_q_pad]
        delta4 = self._gather(delta.unsqueeze(-1), st.q_index, st.nq_pad, acc)[..., 0]
        if st.q_index is None:  # padding rows of the per-group path: -inf, no gradient
            lse_f[:, :, st.n_q:] = -math.inf
        flex_bwd = q4.device.type not in ("cpu", "mps")  # FlexAttention has no backward there
        with torch.enable_grad():
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q4, k4, v4))
            if flex_bwd:
                out_p, lse_p = self._flex(qg, kg, vg, st, scale)
            else:
                out_p, lse_p = self._dense(qg, kg, vg, st, scale)
            lp = lse_p.detach().to(acc)
            c = torch.where(torch.isfinite(lp), torch.exp(lp - torch.where(torch.isfinite(lse_f), lse_f, lp)),
                            torch.zeros_like(lp))
            grad_out = (c.unsqueeze(-1) * do4).to(out_p.dtype)
            # with the rounded grad_out, so that flex's own rowsum(grad_out * O_p) cancels exactly
            grad_lse = (grad_out.to(acc) * out_p.detach().to(acc)).sum(-1) - c * delta4
            torch.autograd.backward((out_p, lse_p), (grad_out, grad_lse.to(lse_p.dtype)))
        dq = qg.grad[0, :, :st.n_q].transpose(0, 1).to(acc)
        dk = kg.grad[0, :, :st.n_k].transpose(0, 1).to(acc)
        dv = vg.grad[0, :, :st.n_k].transpose(0, 1).to(acc)
        return dq, dk, dv

    # ------------------------------------------------------------------ division protocol
    def forward_division(self, q_ws: torch.Tensor, k_ws: torch.Tensor, v_ws: torch.Tensor, div: Division,
                         scale: float, acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial output ``[n_q, H, D]`` and LSE ``[n_q, H]`` of every packed query of ``div``."""
        return self._forward(q_ws, k_ws, v_ws, self._state(div, q_ws.device), scale, acc_dtype)

    def backward_division(self, q_ws, k_ws, v_ws, do_ws, lse_ws, delta_ws, div: Division, scale: float,
                          acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq [n_q, H, D], dk [n_k, H_kv, D], dv [n_k, H_kv, D])`` of ``div``'s pairs, given the
        final LSE and ``delta = rowsum(dO * O)`` in ``lse_ws``/``delta_ws`` (``qws`` rows)."""
        st = self._state(div, q_ws.device)
        return self._backward(q_ws, k_ws, v_ws, do_ws, lse_ws, delta_ws, st, scale, acc_dtype)

    # ------------------------------------------------------------------ per-group protocol
    def forward(self, q, k, v, mask, scale, acc_dtype):
        """One group: ``q [n_q, H, D]`` against ``k, v [n_k, H_kv, D]`` under ``mask [n_q, n_k]``."""
        return self._forward(q, k, v, self._group_state(q.shape[0], k.shape[0], mask, q.device), scale, acc_dtype)

    def backward(self, q, k, v, do, lse, delta, mask, scale, acc_dtype):
        """One group's ``(dq, dk, dv)`` given the final LSE and delta (see ``ReferenceKernel``)."""
        st = self._group_state(q.shape[0], k.shape[0], mask, q.device)
        return self._backward(q, k, v, do, lse, delta, st, scale, acc_dtype)
