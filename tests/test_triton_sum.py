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


@pytest.mark.parametrize("p", [1, 3])
def test_wire_rows_are_read_from_the_wire_buffer(interpret, p):
    """Rows ``wire_start ..`` of the source read from a second buffer in its own dtype (partials
    received in the K/V dtype), the rows around them from the source: the sum of the rows as if
    the wire's were in the source; ``p = 1`` a gather that converts (a phase's sends)."""
    g = torch.Generator().manual_seed(p)
    n, f = 4, 20
    src = torch.randn(n * p + 6, f, generator=g)
    wire = torch.randn(5, f, generator=g).bfloat16()
    whole = src.clone()
    whole[3:8] = wire.float()
    src[3:8] = float("nan")  # never read
    for rows in (slice(0, n * p), torch.randperm(n * p + 6, generator=g)[:n * p]):
        idx = torch.arange(n * p + 6)[rows]
        dst = torch.zeros(n, f)
        sum_rows_triton(src, dst, rows, slice(0, n), n, p, wire=wire, wire_start=3)
        assert torch.allclose(dst, whole[idx].reshape(n, p, f).sum(1), atol=1e-6)
    m = n * p + 6
    sent = torch.empty(m, f, dtype=torch.bfloat16)
    sum_rows_triton(src, sent, slice(0, m), slice(0, m), m, 1, wire=wire, wire_start=3)
    assert torch.equal(sent[3:8], wire)  # passed on as received
    assert torch.allclose(sent.float(), whole.bfloat16().float(), atol=2 ** -6, rtol=2 ** -7)
    with pytest.raises(ValueError, match="wire"):
        sum_rows_triton(src, dst, slice(0, n * p), slice(0, n), n, p, wire=wire, wire_start=n * p + 2)
    with pytest.raises(ValueError, match="wire"):
        sum_rows_triton(src, dst, slice(0, n * p), slice(0, n), n, p, wire=torch.zeros(2, f + 1), wire_start=0)


@pytest.mark.parametrize("p", [1, 2])
def test_a_row_split_between_two_results(interpret, p):
    """The backward's last sum: each row's dK then dV (one float32 row, some rows kept in bf16)
    summed into two separate bf16 results in one launch, as the two per field would give; a
    second destination whose width or rows do not fit is refused."""
    g = torch.Generator().manual_seed(p)
    n, h, d, rows = 4, 2, 8, 4 * p + 5
    src = _Buffer(rows, [("dk", torch.float32, (h, d)), ("dv", torch.float32, (h, d))], torch.device("cpu"))
    src.flat.copy_(torch.randn(src.flat.shape, generator=g))
    kept = _Buffer(3, [("dk", torch.bfloat16, (h, d)), ("dv", torch.bfloat16, (h, d))], torch.device("cpu"))
    kept.flat.copy_(torch.randn(kept.flat.shape, generator=g))
    src.wire = (kept, 2)
    whole = src.flat.clone()
    whole[2:5] = kept.flat.float()
    src.flat[2:5] = float("nan")  # read from the kept rows
    for s_rows in (slice(1, 1 + n * p), torch.randperm(rows, generator=g)[:n * p]):
        want = whole[torch.arange(rows)[s_rows]].reshape(n, p, 2, h, d).sum(1)
        got = _Outputs(dk=torch.zeros(n + 1, h, d, dtype=torch.bfloat16), dv=torch.zeros(n + 1, h, d, dtype=torch.bfloat16))
        merge_partials(ReduceOp.SUM, src, got, s_rows, torch.tensor([3, 0, 4, 1]), n, p, use_triton=True)
        for i, name in enumerate(("dk", "dv")):
            assert torch.allclose(got.fields[name][[3, 0, 4, 1]].float(), want[:, i], atol=2 ** -5, rtol=2 ** -7)
            assert (got.fields[name][2] == 0).all()  # a row not written
    with pytest.raises(ValueError, match="dst2"):
        sum_rows_triton(torch.zeros(6, 8), torch.zeros(3, 4), slice(0, 6), slice(0, 3), 3, 2, dst2=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="unit column strides"):
        sum_rows_triton(torch.zeros(6, 8), torch.zeros(3, 4), slice(0, 6), slice(0, 3), 3, 2, dst2=torch.zeros(3, 5))


@pytest.mark.parametrize("wire,split", [(False, False), (True, False), (True, True)])
def test_compiles_for_a_gpu(wire, split):
    """The kernel through Triton's whole compiler for an H100 (sm_90) without one: the
    interpreter runs Python, so only this catches what the compiler refuses (with and without
    the wire rows, into one result or two)."""
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    from torch_dcp.executor.triton_merge import jitted
    from torch_dcp.executor.triton_sum import _sum_rows_kernel

    try:
        from triton.backends.compiler import GPUTarget
    except ImportError:  # pragma: no cover - an older Triton
        pytest.skip("this Triton has no GPUTarget")
    sig = {"src": "*fp32", "dst": "*bf16", "dst2": "*bf16", "src_idx": "*i64", "dst_idx": "*i64", "wire": "*bf16",
           "p": "i32", "src_start": "i32", "dst_start": "i32", "wire_start": "i32", "wire_stop": "i32", "F": "i32",
           "F1": "i32", "s_r": "i32", "d_r": "i32", "d2_r": "i32", "w_r": "i32",
           **dict.fromkeys(("SRC_IDX", "DST_IDX", "WIRE", "SPLIT", "ACC", "BLOCK"), "constexpr")}
    src = ASTSource(fn=jitted(_sum_rows_kernel), signature=sig,
                    constexprs={"SRC_IDX": True, "DST_IDX": False, "WIRE": wire, "SPLIT": split, "ACC": tl.float32,
                                "BLOCK": 512})
    assert "ptx" in triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm
