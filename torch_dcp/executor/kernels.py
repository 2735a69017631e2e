"""Attention kernels for groups of tiles that share a query block.

A kernel computes, for queries ``q: [n_q, H, D]`` against the concatenated keys and values
of several key/value blocks ``k, v: [n_k, H_kv, D]`` under a boolean mask ``[n_q, n_k]``
(``None`` = all visible), the partial output and its log-sum-exp (forward), or the
gradients given the final LSE and ``delta = rowsum(dO * O)`` (backward, FlashAttention-2
style recomputation: Dao, "FlashAttention-2", 2023, Algorithm 2). GQA: query head ``h``
uses key/value head ``h // (H / H_kv)``.

Rows that see no key get output 0 and LSE ``-inf``, and no gradient.

A kernel may also implement the *division* protocol (``forward_division`` /
``backward_division``, see :class:`DivisionKernel`): the executor then hands it every group
of a ``BlockwiseAttention`` instruction at once (one launch, or a few, per division) instead of
calling it group by group. :class:`~torch_dcp.executor.flex.FlexKernel` does.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

__all__ = ["AttentionKernel", "DivisionKernel", "ReferenceKernel", "SDPAKernel", "get_kernel"]


class AttentionKernel(Protocol):
    """What the executor needs from a kernel; all results in ``acc_dtype``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float, acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(out [n_q, H, D], lse [n_q, H])``."""
        ...

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                 delta: torch.Tensor, mask: torch.Tensor | None, scale: float,
                 acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(dq [n_q, H, D], dk [n_k, H_kv, D], dv [n_k, H_kv, D])``."""
        ...


class DivisionKernel(Protocol):
    """Optional protocol: all groups of one ``BlockwiseAttention`` instruction per call.

    ``q_ws [S_q, H, D]``, ``k_ws, v_ws [S_kv, H_kv, D]`` are the rank's work buffers; ``div``
    (:class:`~torch_dcp.executor.division.Division`) says which rows the division reads
    (``div.q_rows``, ``div.kv_rows``), which (query block, key block) tiles it runs and every
    packed row's document position and key ranges. Results are in packed order and
    ``acc_dtype``; the executor writes them to ``div.out_rows`` / adds them at ``div.kv_rows``.
    """

    def forward_division(self, q_ws: torch.Tensor, k_ws: torch.Tensor, v_ws: torch.Tensor, div,
                         scale: float, acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(out [n_q, H, D], lse [n_q, H])``, partial over the division's tiles."""
        ...

    def backward_division(self, q_ws: torch.Tensor, k_ws: torch.Tensor, v_ws: torch.Tensor, do_ws: torch.Tensor,
                          lse_ws: torch.Tensor, delta_ws: torch.Tensor, div, scale: float,
                          acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(dq [n_q, H, D], dk [n_k, H_kv, D], dv [n_k, H_kv, D])`` of the global
        attention restricted to the division's tiles, given the final LSE and
        ``delta = rowsum(dO * O)`` (``qws`` rows, like ``do_ws``)."""
        ...


class ReferenceKernel:
    """Exact attention in plain torch ops, on any device.

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

    def forward(self, q, k, v, mask, scale, acc_dtype):
        nq, h, d = q.shape
        _, s = self._scores(q, k, mask, scale, acc_dtype)
        lse = torch.logsumexp(s, dim=-1)  # [hkv, g, nq]
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - safe.unsqueeze(-1))
        out = torch.einsum("hgqk,khd->qhgd", p, v.to(acc_dtype)).reshape(nq, h, d)
        return out, lse.reshape(h, nq).transpose(0, 1)

    def backward(self, q, k, v, do, lse, delta, mask, scale, acc_dtype):
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


class SDPAKernel:
    """PyTorch's fused CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``
    and its backward), which returns the LSE and takes an additive mask; other devices use
    :class:`ReferenceKernel` for now.

    Inputs are cast to ``acc_dtype`` so partial outputs keep full precision for the LSE merge.
    GQA key/value heads are expanded for the call and their gradients summed back.

    The fused backward recomputes ``delta = rowsum(dO * O)`` from the output it is given; the
    executor has ``delta`` (the final output never travels), so the kernel passes
    ``O' = dO * delta / |dO|^2`` (``0`` where ``dO = 0``), whose ``rowsum(dO * O')`` is ``delta``.
    """

    name = "sdpa"

    def __init__(self):
        self._fallback = ReferenceKernel()

    @staticmethod
    def _heads_first(t, acc, groups=1):
        if groups > 1:
            t = t.repeat_interleave(groups, dim=1)
        return t.to(acc).transpose(0, 1).unsqueeze(0)

    @staticmethod
    def _additive(mask, acc):
        if mask is None:
            return None
        return torch.zeros(mask.shape, dtype=acc, device=mask.device).masked_fill(~mask, -math.inf)

    def forward(self, q, k, v, mask, scale, acc_dtype):
        if q.device.type != "cpu":
            return self._fallback.forward(q, k, v, mask, scale, acc_dtype)
        g = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            self._heads_first(q, acc_dtype), self._heads_first(k, acc_dtype, g), self._heads_first(v, acc_dtype, g),
            0.0, False, attn_mask=self._additive(mask, acc_dtype), scale=scale)
        out = out[0].transpose(0, 1)
        lse = lse[0].transpose(0, 1).to(acc_dtype)
        if mask is not None:
            empty = ~mask.any(dim=1)
            if bool(empty.any()):
                lse = lse.masked_fill(empty[:, None], -math.inf)
                out = out.masked_fill(empty[:, None, None], 0.0)
        return out, lse

    def backward(self, q, k, v, do, lse, delta, mask, scale, acc_dtype):
        if q.device.type != "cpu":
            return self._fallback.backward(q, k, v, do, lse, delta, mask, scale, acc_dtype)
        nk, hkv, d = k.shape
        g = q.shape[1] // hkv
        do_acc = do.to(acc_dtype)
        norm = (do_acc * do_acc).sum(-1)
        coef = torch.where(norm > 0, delta.to(acc_dtype) / torch.where(norm > 0, norm, torch.ones_like(norm)),
                           torch.zeros_like(norm))
        out_like = do_acc * coef.unsqueeze(-1)
        lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(acc_dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            self._heads_first(do_acc, acc_dtype), self._heads_first(q, acc_dtype), self._heads_first(k, acc_dtype, g),
            self._heads_first(v, acc_dtype, g), self._heads_first(out_like, acc_dtype),
            lse_safe.transpose(0, 1).unsqueeze(0).contiguous(), 0.0, False,
            attn_mask=self._additive(mask, acc_dtype), scale=scale)
        dq = dq[0].transpose(0, 1)
        dk = dk[0].transpose(0, 1).reshape(nk, hkv, g, d).sum(2)
        dv = dv[0].transpose(0, 1).reshape(nk, hkv, g, d).sum(2)
        return dq, dk, dv


def _flex_kernel():
    from .flex import FlexKernel

    return FlexKernel()


_KERNELS = {"reference": ReferenceKernel, "sdpa": SDPAKernel, "flex": _flex_kernel}


def get_kernel(kernel: str | AttentionKernel | None, device: torch.device | str | None = None) -> AttentionKernel:
    """A kernel by name, an instance as is, or the automatic choice.

    Names: ``"reference"`` (:class:`ReferenceKernel`), ``"sdpa"`` (:class:`SDPAKernel`),
    ``"flex"`` (:class:`~torch_dcp.executor.flex.FlexKernel`), ``"auto"`` (same as None):
    on a CUDA ``device`` FlexAttention over whole divisions when this torch has it, else (CPU,
    or no device given) the fused SDPA kernel. ``flash_attn`` varlen is not used: its masks
    (causal, sliding window) cannot express a division's tile list.

    Raises:
        ValueError: unknown kernel name.
        RuntimeError: ``"flex"`` on a torch without FlexAttention.
    """
    if kernel is None or kernel == "auto":
        if device is not None and torch.device(device).type == "cuda":
            from .flex import flex_available

            if flex_available():
                return _flex_kernel()
        return SDPAKernel()
    if isinstance(kernel, str):
        try:
            factory = _KERNELS[kernel]
        except KeyError:
            raise ValueError(f"unknown kernel {kernel!r}; available: {sorted(_KERNELS) + ['auto']}") from None
        return factory()
    return kernel
