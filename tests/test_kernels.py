"""Kernels against each other and against a dense float64 computation, group by group."""

from __future__ import annotations

import math

import pytest
import torch

from torch_dcp.executor.kernels import ReferenceKernel, SDPAKernel, get_kernel


def _dense(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return torch.einsum("hqk,khd->qhd", p, vv), lse.transpose(0, 1)


@pytest.mark.parametrize("kernel", [ReferenceKernel(), SDPAKernel()], ids=["reference", "sdpa"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_kernel_forward_backward(kernel, dtype, tol, masked, heads):
    g = torch.Generator().manual_seed(1)
    h, hkv = heads
    nq, nk, d = 13, 29, 16
    q = torch.randn(nq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(nk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(nk, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(nq, h, d, generator=g, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.rand(nq, nk, generator=g) > 0.4
        mask[:2] = False  # rows that see nothing
    scale = 0.3
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out, lse = kernel.forward_group(q.to(dtype), k.to(dtype), v.to(dtype), mask, scale, acc)
    ref_out, ref_lse = _dense(q.to(dtype), k.to(dtype), v.to(dtype), mask, scale)
    assert out.dtype == acc and lse.dtype == acc
    assert (out.double() - ref_out).abs().max() <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() <= tol * 10
    # backward against autograd of the dense computation (the group is the whole attention here)
    qa, ka, va = (t.to(dtype).double().requires_grad_(True) for t in (q, k, v))
    o, _ = _dense(qa, ka, va, mask, scale)
    o.backward(do.to(dtype).double())
    delta = (do.to(dtype).to(acc) * out).sum(-1)
    dq, dk, dv = kernel.backward_group(q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype), lse, delta, mask, scale, acc)
    for got, want in ((dq, qa.grad), (dk, ka.grad), (dv, va.grad)):
        assert got.dtype == acc
        assert (got.double() - want).abs().max() <= tol * 10


def test_get_kernel():
    assert isinstance(get_kernel(None), SDPAKernel)
    assert isinstance(get_kernel("reference"), ReferenceKernel)
    k = ReferenceKernel()
    assert get_kernel(k) is k
    with pytest.raises(ValueError, match="unknown kernel"):
        get_kernel("flash3")


def test_the_causal_tail_check_matches_the_dense_one():
    """A group's causal tail (its own block under a causal mask) is found in O(n R) where the
    block's key positions ascend: the same answer as the dense [n, n, R] comparison, on random
    ranges (causal ones, several per query, empty ones, gaps)."""
    import numpy as np

    from torch_dcp.executor.kernels.base import _sees_its_prefix

    rng = np.random.default_rng(0)
    agree = {True: 0, False: 0}
    for _ in range(5000):
        n, r = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        kp = np.sort(rng.choice(20, n, replace=False))
        if rng.random() < 0.5:  # causal: [document start, own position + 1), maybe a second range
            st, en = np.zeros((n, r), np.int64), np.zeros((n, r), np.int64)
            st[:, 0], en[:, 0] = rng.integers(0, 3), kp + 1
            if r > 1 and rng.random() < 0.5:
                st[:, 1] = rng.integers(0, 20, n)
                en[:, 1] = st[:, 1] + rng.integers(0, 4, n)
        else:
            st = rng.integers(0, 20, (n, r))
            en = st + rng.integers(0, 8, (n, r))
        vis = ((kp[None, :, None] >= st[:, None, :]) & (kp[None, :, None] < en[:, None, :])).any(-1)
        want = bool(np.array_equal(vis, np.tri(n, dtype=bool)))
        assert _sees_its_prefix(kp, st, en) == want, (kp, st, en)
        agree[want] += 1
    assert min(agree.values()) > 100  # both answers were exercised
