"""``kernel="sdpa"``: PyTorch's fused CPU flash attention, one call per group of tiles sharing a
query block (:class:`~torch_dcp.executor.kernels.base.GroupKernel`)."""

from __future__ import annotations

import math

import torch

from .base import GroupKernel, ReferenceKernel, out_with_delta

__all__ = ["SDPAKernel"]


class SDPAKernel(GroupKernel):
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

    def forward_group(self, q, k, v, mask, scale, acc_dtype):
        if q.device.type != "cpu":
            return self._fallback.forward_group(q, k, v, mask, scale, acc_dtype)
        return self._call(q, k, v, mask, scale, acc_dtype)

    def forward_causal(self, q, k, v, scale, acc_dtype):
        if q.device.type != "cpu":
            return super().forward_causal(q, k, v, scale, acc_dtype)
        return self._call(q, k, v, None, scale, acc_dtype, causal=True)

    def backward_group(self, q, k, v, do, lse, delta, mask, scale, acc_dtype):
        if q.device.type != "cpu":
            return self._fallback.backward_group(q, k, v, do, lse, delta, mask, scale, acc_dtype)
        return self._call_backward(q, k, v, do, lse, delta, mask, scale, acc_dtype)

    def backward_causal(self, q, k, v, do, lse, delta, scale, acc_dtype):
        if q.device.type != "cpu":
            return super().backward_causal(q, k, v, do, lse, delta, scale, acc_dtype)
        return self._call_backward(q, k, v, do, lse, delta, None, scale, acc_dtype, causal=True)

    def _call(self, q, k, v, mask, scale, acc_dtype, causal=False):
        """The fused forward: under ``mask`` (bool ``[n_q, n_k]`` or None), or causal (query
        ``i`` sees keys ``0..i``: the kernel skips the blocks above the diagonal)."""
        g = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            self._heads_first(q, acc_dtype), self._heads_first(k, acc_dtype, g), self._heads_first(v, acc_dtype, g),
            0.0, causal, attn_mask=self._additive(mask, acc_dtype), scale=scale)
        out = out[0].transpose(0, 1)
        lse = lse[0].transpose(0, 1).to(acc_dtype)
        if mask is not None:
            empty = ~mask.any(dim=1)
            if bool(empty.any()):
                lse = lse.masked_fill(empty[:, None], -math.inf)
                out = out.masked_fill(empty[:, None, None], 0.0)
        return out, lse

    def _call_backward(self, q, k, v, do, lse, delta, mask, scale, acc_dtype, causal=False):
        nk, hkv, d = k.shape
        g = q.shape[1] // hkv
        do_acc = do.to(acc_dtype)
        out_like = out_with_delta(do_acc, delta, acc_dtype)
        lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(acc_dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            self._heads_first(do_acc, acc_dtype), self._heads_first(q, acc_dtype), self._heads_first(k, acc_dtype, g),
            self._heads_first(v, acc_dtype, g), self._heads_first(out_like, acc_dtype),
            lse_safe.transpose(0, 1).unsqueeze(0).contiguous(), 0.0, causal,
            attn_mask=self._additive(mask, acc_dtype), scale=scale)
        dq = dq[0].transpose(0, 1)
        dk = dk[0].transpose(0, 1).reshape(nk, hkv, g, d).sum(2)
        dv = dv[0].transpose(0, 1).reshape(nk, hkv, g, d).sum(2)
        return dq, dk, dv
