"""A division's dQ, dK and dV added in one Triton launch, against ``index_add_``: on CPU in Triton's
interpreter (``TRITON_INTERPRET=1``, set per test), on CUDA where there is a device; and whole
backward passes exact with it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra installs it on Linux x86-64)")

from torch_dcp.executor import reduce as reduce_mod  # noqa: E402
from torch_dcp.executor import triton_grads  # noqa: E402
from torch_dcp.executor.executor import _Buffer  # noqa: E402
from torch_dcp.executor.reduce import add_gradients  # noqa: E402
from torch_dcp.executor.triton_grads import add_grads_triton  # noqa: E402
from reference import needs_cuda  # noqa: E402

cuda = needs_cuda("needs a CUDA device")


@pytest.fixture
def calls(monkeypatch):
    """The dQ rows of every one-launch addition run."""
    seen = []
    monkeypatch.setattr(triton_grads, "add_grads_triton",
                        lambda *args, real=triton_grads.add_grads_triton: seen.append(args[0].shape[0]) or real(*args))
    return seen


def _case(h, hkv, d, nq, nk, rows, dtype, acc, device="cpu", seed=0):
    """Random gradients and accumulators: dQ in its own buffer, dK then dV side by side in one
    (strided rows, as the executor lays them out)."""
    g = torch.Generator().manual_seed(seed)
    dq, dk, dv = (torch.randn(n, hh, d, generator=g, dtype=torch.float64).to(dtype).to(device)
                  for n, hh in ((nq, h), (nk, hkv), (nk, hkv)))
    q_buf = _Buffer(rows + 1, [("dq", acc, (h, d))], torch.device(device))
    kv_buf = _Buffer(rows + 1, [("dk", acc, (hkv, d)), ("dv", acc, (hkv, d))], torch.device(device))
    for f in (*q_buf.fields.values(), *kv_buf.fields.values()):
        f.copy_(torch.randn(f.shape, generator=g, dtype=torch.float64).to(acc))
    return dq, dk, dv, q_buf, kv_buf


def _want(q_buf, kv_buf, q_rows, kv_rows, dq, dk, dv):
    """index_add_ on copies: repeated rows add up."""
    out = []
    for acc, rows, g in ((q_buf.fields["dq"], q_rows, dq), (kv_buf.fields["dk"], kv_rows, dk),
                         (kv_buf.fields["dv"], kv_rows, dv)):
        t = acc.clone()
        idx = torch.arange(t.shape[0])[rows] if isinstance(rows, slice) else rows
        out.append(t.index_add_(0, idx, g.to(t.dtype)))
    return out


@pytest.mark.parametrize("dtype,acc,tol", [(torch.float64, torch.float64, 1e-12), (torch.bfloat16, torch.float32, 1e-5),
                                           (torch.float32, torch.float32, 1e-5)])
@pytest.mark.parametrize("h,hkv,d", [(4, 2, 8), (3, 3, 5), (8, 1, 16)])
def test_matches_index_add(interpret, dtype, acc, tol, h, hkv, d):
    rows = 13
    g = torch.Generator().manual_seed(1)
    q_idx = torch.randperm(rows, generator=g)[:6]
    kv_idx = torch.randint(0, rows, (9,), generator=g)  # repeats: they add up
    for q_rows, kv_rows in ((q_idx, kv_idx), (slice(2, 8), slice(4, 13)), (slice(0, 6), kv_idx)):
        nq = len(range(rows)[q_rows]) if isinstance(q_rows, slice) else len(q_rows)
        nk = len(range(rows)[kv_rows]) if isinstance(kv_rows, slice) else len(kv_rows)
        dq, dk, dv, qb, kvb = _case(h, hkv, d, nq, nk, rows, dtype, acc)
        want = _want(qb, kvb, q_rows, kv_rows, dq, dk, dv)
        add_grads_triton(dq, dk, dv, qb.fields["dq"], kvb.fields["dk"], kvb.fields["dv"], q_rows, kv_rows)
        for got, w in zip((qb.fields["dq"], kvb.fields["dk"], kvb.fields["dv"]), want):
            assert (got.double() - w.double()).abs().max().item() <= tol


def test_the_torch_path_and_the_launch_agree(interpret, calls):
    dq, dk, dv, qb, kvb = _case(4, 2, 8, 5, 7, 11, torch.float32, torch.float32)
    q_rows, kv_rows = torch.tensor([9, 0, 3, 4, 10]), torch.tensor([1, 1, 5, 8, 2, 0, 6])
    ref_q, ref_kv = _Buffer(12, [("dq", torch.float32, (4, 8))], torch.device("cpu")), \
        _Buffer(12, [("dk", torch.float32, (2, 8)), ("dv", torch.float32, (2, 8))], torch.device("cpu"))
    ref_q.flat.copy_(qb.flat)
    ref_kv.flat.copy_(kvb.flat)
    add_gradients(ref_q.fields["dq"], q_rows, dq, ref_kv, kv_rows, dk, dv)  # CPU: the torch path
    assert not calls
    add_gradients(qb.fields["dq"], q_rows, dq, kvb, kv_rows, dk, dv, use_triton=True)
    assert calls == [5]
    assert torch.allclose(qb.flat, ref_q.flat, atol=1e-6) and torch.allclose(kvb.flat, ref_kv.flat, atol=1e-6)


def test_errors(interpret, monkeypatch):
    dq, dk, dv, qb, kvb = _case(4, 2, 8, 5, 7, 11, torch.float32, torch.float32)
    fields = (qb.fields["dq"], kvb.fields["dk"], kvb.fields["dv"])
    with pytest.raises(ValueError, match="q_rows"):
        add_grads_triton(dq, dk, dv, *fields, slice(0, 4), slice(0, 7))
    with pytest.raises(ValueError, match="kv_rows"):
        add_grads_triton(dq, dk, dv, *fields, slice(0, 5), torch.arange(6))
    with pytest.raises(ValueError, match="expected dq"):
        add_grads_triton(dq, dk, dv[:, :1], *fields, slice(0, 5), slice(0, 7))
    with pytest.raises(ValueError, match="float32 or float64"):
        add_grads_triton(dq, dk, dv, fields[0].bfloat16(), *fields[1:], slice(0, 5), slice(0, 7))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="Triton is not available"):
        add_grads_triton(dq, dk, dv, *fields, slice(0, 5), slice(0, 7))


@pytest.mark.parametrize("mask", ["causal", "lambda"])
def test_backward_passes_exact_with_it(interpret, calls, monkeypatch, mask):
    """Whole forward and backward passes (GQA, a dense masked reference, float64) with every
    division's gradients added by the one launch."""
    import torch_dcp
    from test_exact import _batch, _check

    monkeypatch.setattr(reduce_mod, "_use_triton", lambda t, use: use is not False)
    batch = _batch(mask, "gqa8/2-d32")
    _check(torch_dcp.plan(batch, 3, planner="greedy", block_size=4, divisions=2), batch)
    assert calls


@cuda
def test_cuda_matches_index_add(calls, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows, nq, nk = 4096, 3000, 3500
    dq, dk, dv, qb, kvb = _case(8, 2, 128, nq, nk, rows, torch.bfloat16, torch.float32, device="cuda")
    q_rows = torch.randperm(rows, device="cuda")[:nq]
    kv_rows = torch.randint(0, rows, (nk,), device="cuda")
    want = _want(qb, kvb, q_rows, kv_rows, dq, dk, dv)
    add_gradients(qb.fields["dq"], q_rows, dq, kvb, kv_rows, dk, dv)  # on CUDA: the one launch by default
    assert calls == [nq]
    for got, w in zip((qb.fields["dq"], kvb.fields["dk"], kvb.fields["dv"]), want):
        assert torch.allclose(got, w, atol=1e-4)
