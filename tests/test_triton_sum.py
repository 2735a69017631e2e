"""The one-launch sum of gradient partials (``torch_dcp::sum_rows``) against torch's gather and
sum: on CPU in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra installs it on Linux x86-64)")

from torch_dcp.executor.executor import _Buffer, _Outputs  # noqa: E402
from torch_dcp.executor.reduce import merge_partials  # noqa: E402
from torch_dcp.executor.triton_sum import sum_rows_triton  # noqa: E402
from torch_dcp.plan import ReduceOp  # noqa: E402


# bfloat16: within one step (the interpreter truncates where a GPU rounds)
@pytest.mark.parametrize("dtype,out,tol", [(torch.float64, torch.float64, 1e-12), (torch.float32, torch.float32, 1e-5),
                                           (torch.float32, torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("p", [1, 3])
def test_matches_torch(interpret, dtype, out, tol, p):
    """Buffers whose row is dK then dV (one flat view) and a dQ field, sources and destinations
    as slices or indices, written in the destination's dtype."""
    g = torch.Generator().manual_seed(p)
    n, h, d = 5, 3, 20
    src = _Buffer(n * p + 3, [("dk", dtype, (h, d)), ("dv", dtype, (h, d))], torch.device("cpu"))
    src.flat.copy_(torch.randn(src.flat.shape, generator=g, dtype=torch.float64))
    perm = torch.randperm(n * p + 3, generator=g)[:n * p]
    for s_rows in (slice(1, 1 + n * p), perm):
        for d_rows in (slice(0, n), torch.tensor([4, 0, 6, 2, 1])):
            idx = torch.arange(n * p + 3)[s_rows]
            want = src.flat[idx].reshape(n, p, -1).sum(1)
            dst = _Buffer(8, [("dk", out, (h, d)), ("dv", out, (h, d))], torch.device("cpu"))
            dst.words.fill_(0)
            merge_partials(ReduceOp.SUM, src, dst, s_rows, d_rows, n, p, use_triton=True)
            rows = torch.arange(8)[d_rows]
            assert torch.allclose(dst.flat[rows].double(), want.double(), rtol=tol, atol=tol)
            untouched = torch.ones(8, dtype=torch.bool)
            untouched[rows] = False
            assert (dst.flat[untouched] == 0).all()
    # a typed field (dQ [rows, H, D]) into a separate output
    dq = torch.randn(n * p, h, d, generator=g).to(dtype)
    res = _Outputs(dq=torch.empty(n, h, d, dtype=out))
    merge_partials(ReduceOp.SUM, _Outputs(dq=dq), res, slice(0, n * p), slice(0, n), n, p, use_triton=True)
    assert torch.allclose(res.fields["dq"].double(), dq.reshape(n, p, h, d).sum(1).double(), rtol=tol, atol=tol)


def test_errors(interpret, monkeypatch):
    src, dst = torch.zeros(6, 4), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="src_rows"):
        sum_rows_triton(src, dst, slice(0, 5), slice(0, 3), 3, 2)
    with pytest.raises(ValueError, match="p must be"):
        sum_rows_triton(src, dst, slice(0, 0), slice(0, 3), 3, 0)
    with pytest.raises(ValueError, match="unit column strides"):
        sum_rows_triton(src, torch.zeros(3, 5), slice(0, 6), slice(0, 3), 3, 2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="Triton is not available"):
        sum_rows_triton(src, dst, slice(0, 6), slice(0, 3), 3, 2)
