"""The one-pass Triton LSE merge against the per-block loop and the torch merge: on CPU in
Triton's interpreter (``TRITON_INTERPRET=1``, set per test: Triton reads it at each launch), on
CUDA where there is a device."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra installs it on Linux x86-64)")

from torch_dcp.executor import reduce as reduce_mod  # noqa: E402
from torch_dcp.executor import triton_merge  # noqa: E402
from torch_dcp.executor.executor import _Buffer, _Outputs  # noqa: E402
from torch_dcp.executor.reduce import merge_partials, reduce_loop  # noqa: E402
from torch_dcp.executor.triton_merge import merge_lse_triton, triton_available  # noqa: E402
from torch_dcp.plan import ReduceOp  # noqa: E402
from reference import needs_cuda  # noqa: E402
from test_executor import _merge_index, _random_reduction  # noqa: E402

LSE = ReduceOp.LSE_MERGE
cuda = needs_cuda("needs a CUDA device")


@pytest.fixture
def calls(monkeypatch):
    """Counts the Triton merges run."""
    seen = []
    real = triton_merge.merge_lse_triton

    def spy(*args):
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(triton_merge, "merge_lse_triton", spy)
    return seen


def _ns(o, lse):
    return types.SimpleNamespace(fields={"o": o, "lse": lse}, flat=None)


def _partials(rows, h, d, dtype, device="cpu", seed=0, missing=0.25):
    """A source ``_Buffer`` (o and LSE side by side: strided rows) of ``rows`` random partials,
    some with LSE -inf (their outputs NaN: never to be read), plus the null row (the last)."""
    g = torch.Generator().manual_seed(seed)
    src = _Buffer(rows + 1, [("o", dtype, (h, d)), ("lse", dtype, (h,))], torch.device(device))
    lse = torch.randn(rows + 1, h, generator=g, dtype=torch.float64) * 3
    lse[torch.rand(rows + 1, h, generator=g) < missing] = -math.inf
    lse[rows] = -math.inf
    o = torch.randn(rows + 1, h, d, generator=g, dtype=torch.float64)
    o[rows] = 0
    src.fields["lse"].copy_(lse)
    src.fields["o"].copy_(o)
    return src


def _torch_merge(src, src_rows, dst_rows, n, p, h, d, dtype, size=None):
    """The torch path's result in ``size`` (default ``n``) zeroed rows, the -inf partials'
    outputs zeroed (it reads them)."""
    o, lse = src.fields["o"], src.fields["lse"]
    clean = _ns(torch.where(torch.isinf(lse)[..., None], 0.0, o), lse)
    size = size or n
    out = _ns(torch.zeros(size, h, d, dtype=dtype, device=o.device), torch.zeros(size, h, dtype=dtype, device=o.device))
    merge_partials(LSE, clean, out, src_rows, dst_rows, n, p, use_triton=False)
    return out.fields["o"], out.fields["lse"]


def _close(got, want, tol):
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not got.isnan().any()
    fin = torch.isfinite(want)
    assert not fin.any() or (got[fin].double() - want[fin].double()).abs().max().item() <= tol


# ---------------------------------------------------------------------- CPU, in the interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_matches_the_loop(interpret, dtype, tol):
    """Blocks of rows with 0..p partials (rows with none: the null row), odd head_dim."""
    rng = np.random.default_rng(1)
    h, d = 3, 72
    for trial, max_p in enumerate([2, 5]):
        ins, lens, rows = _random_reduction(LSE, rng, n_dst=5, max_p=max_p, block=3, heads=h, dim=d)
        g = torch.Generator().manual_seed(trial)
        n = int(lens.sum())
        lse = torch.randn(rows + 1, h, generator=g, dtype=torch.float64) * 3
        lse[torch.rand(rows + 1, h, generator=g) < 0.2] = -math.inf
        lse[rows] = -math.inf
        o = torch.randn(rows + 1, h, d, generator=g, dtype=torch.float64)
        o = torch.where(torch.isinf(lse)[..., None], 0.0, o).to(dtype)
        lse = lse.to(dtype)
        want = [torch.full((n, h, d), 7.0, dtype=dtype), torch.full((n, h), 7.0, dtype=dtype)]
        reduce_loop(ins, lens, [o, lse], want)
        s_idx, d_idx, p = _merge_index(ins, lens, rows)
        assert p >= 2
        order = torch.argsort(d_idx)
        for s_rows, d_rows in ((s_idx, d_idx), (s_idx.reshape(n, p)[order].reshape(-1), slice(0, n))):
            got = _ns(torch.full_like(want[0], 7.0), torch.full_like(want[1], 7.0))
            merge_partials(LSE, _ns(o, lse), got, s_rows, d_rows, n, p, use_triton=True)
            _close(got.fields["o"], want[0], tol)
            _close(got.fields["lse"], want[1], tol)


@pytest.mark.parametrize("h,d", [(3, 72), (8, 16), (5, 1)])
def test_strided_rows_slices_and_indices(interpret, h, d):
    """Executor buffers (o and LSE in one row), sources and destinations as slices or indices,
    -inf partials whose outputs are NaN (never read), and rows without any partial."""
    n, p = 6, 3
    src = _partials(n * p + 4, h, d, torch.float64, seed=h + d)
    null = n * p + 4
    perm = torch.randperm(n * p + 4, generator=torch.Generator().manual_seed(0))[:n * p]
    perm[p:2 * p] = null  # row 1: every partial missing
    perm[2 * p + 1] = null
    src.fields["o"][torch.isinf(src.fields["lse"])] = math.nan  # partials that weigh nothing, garbage
    src.fields["o"][null] = 0
    cases = [(slice(2, 2 + n * p), slice(0, n)), (perm, slice(0, n)), (perm, torch.tensor([5, 0, 3, 1, 4, 2])),
             (slice(2, 2 + n * p), torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32)), (perm.int(), slice(2, 2 + n))]
    for s_rows, d_rows in cases:
        want_o, want_l = _torch_merge(src, *(r if isinstance(r, slice) else r.long() for r in (s_rows, d_rows)),
                                      n, p, h, d, torch.float64, size=8)  # the torch path takes int64 only
        dst = _Buffer(8, [("o", torch.float64, (h, d)), ("lse", torch.float64, (h,))], torch.device("cpu"))
        dst.words.fill_(0)
        merge_partials(LSE, src, dst, s_rows, d_rows, n, p, use_triton=True)
        _close(dst.fields["o"], want_o, 1e-12)  # rows not written: 0 in both
        _close(dst.fields["lse"], want_l, 1e-12)
    # the all-missing row: output 0, LSE -inf
    dst = _Outputs(o=torch.full((n, h, d), 7.0, dtype=torch.float64), lse=torch.full((n, h), 7.0, dtype=torch.float64))
    merge_partials(LSE, src, dst, perm, slice(0, n), n, p, use_triton=True)
    assert (dst.fields["o"][1] == 0).all() and (dst.fields["lse"][1] == -math.inf).all()


def test_one_partial_per_row_is_gathered_and_converted(interpret):
    """``p = 1`` in one launch: each row's partial gathered (a slice or indices), written in the
    destination's dtype; a partial with LSE -inf gives output 0 (its O is garbage, not read)."""
    n, h, d = 7, 3, 24
    src = _partials(n + 3, h, d, torch.float32, seed=5, missing=0.3)
    perm = torch.randperm(n + 3, generator=torch.Generator().manual_seed(1))[:n]
    for s_rows in (slice(2, 2 + n), perm):
        want_o, want_l = _torch_merge(src, s_rows, slice(0, n), n, 1, h, d, torch.float32)
        src.fields["o"][torch.isinf(src.fields["lse"])] = math.nan
        dst = _ns(torch.full((n, h, d), 7.0, dtype=torch.float64), torch.full((n, h), 7.0, dtype=torch.float64))
        merge_partials(LSE, src, dst, s_rows, slice(0, n), n, 1, use_triton=True)
        _close(dst.fields["o"], want_o.double(), 1e-6)
        _close(dst.fields["lse"], want_l.double(), 1e-6)


def test_float32_partials_to_bfloat16_output(interpret):
    """A destination of another dtype (a final output in bf16) is written cast to it."""
    n, p, h, d = 5, 4, 2, 40
    src = _partials(n * p, h, d, torch.float32, seed=3, missing=0.1)
    want_o, want_l = _torch_merge(src, slice(0, n * p), slice(0, n), n, p, h, d, torch.float32)
    dst = _ns(torch.empty(n, h, d, dtype=torch.bfloat16), torch.empty(n, h, dtype=torch.float32))
    merge_lse_triton(src.fields["o"], src.fields["lse"], dst.fields["o"], dst.fields["lse"], slice(0, n * p),
                     slice(0, n), n, p)
    _close(dst.fields["lse"], want_l, 1e-5)
    # within one bf16 step (the interpreter casts by truncation, a GPU rounds to nearest)
    assert torch.allclose(dst.fields["o"].float(), want_o, rtol=2 ** -7, atol=1e-6)


def test_one_partial_writes_a_kernels_output_into_a_mixed_row(interpret):
    """How the executor writes a division's output into its partial rows (O in the inputs' dtype,
    the LSE in float32, one row) on a GPU: the merge of one partial per row, one launch, which
    writes a bfloat16 O and its LSE unchanged (weight exp(0) = 1; the LSE taken as the kernel
    gave it, here a transposed view); a row with LSE -inf gets output 0; a float32 O is cast."""
    n, h, d = 6, 3, 16
    g = torch.Generator().manual_seed(4)
    lse = (torch.randn(h, n, generator=g) * 3).t()  # [n, h], strided as the varlen kernel returns it
    lse[2] = -math.inf
    o = torch.randn(n, h, d, generator=g).bfloat16()
    o[2] = 0
    for d_rows in (slice(3, 3 + n), torch.tensor([9, 0, 4, 1, 7, 2])):
        row = _Buffer(10, [("o", torch.bfloat16, (h, d)), ("lse", torch.float32, (h,))], torch.device("cpu"))
        assert row.flat is None  # two dtypes: no typed view of the whole row
        row.words.fill_(0)
        merge_partials(LSE, _Outputs(o=o, lse=lse), row, slice(0, n), d_rows, n, 1, use_triton=True)
        assert torch.equal(row.fields["o"][d_rows], o) and torch.equal(row.fields["lse"][d_rows], lse)
    row.words.fill_(0)
    merge_partials(LSE, _Outputs(o=o.float() / 3, lse=lse), row, slice(0, n), slice(0, n), n, 1, use_triton=True)
    assert torch.allclose(row.fields["o"][:n].float(), o.float() / 3, rtol=2 ** -7, atol=0)


def test_executor_end_to_end(interpret, calls, monkeypatch):
    """A whole forward and backward with every LSE merge in Triton."""
    import torch_dcp
    from test_exact import _batch, _check

    monkeypatch.setattr(reduce_mod, "_use_triton", lambda t, use: use is not False)
    batch = _batch("causal", "mha4-d32")
    plan = torch_dcp.plan(batch, 3, planner="greedy", block_size=4, divisions=2)
    _check(plan, batch)
    assert calls and max(calls) >= 2


def test_dispatch_and_errors(interpret, calls, monkeypatch):
    src = _partials(8, 2, 4, torch.float32)
    dst = _ns(torch.empty(4, 2, 4), torch.empty(4, 2))
    merge_partials(LSE, src, dst, slice(0, 8), slice(0, 4), 4, 2)  # CPU: the torch path
    assert not calls
    merge_partials(LSE, src, dst, slice(0, 4), slice(0, 4), 4, 1, use_triton=True)  # one partial: one launch too
    assert calls == [1]
    assert triton_available("cpu") and triton_available()
    o, lse = src.fields["o"], src.fields["lse"]
    with pytest.raises(ValueError, match="src_rows"):
        merge_lse_triton(o, lse, dst.fields["o"], dst.fields["lse"], slice(0, 7), slice(0, 4), 4, 2)
    with pytest.raises(ValueError, match="dst_rows"):
        merge_lse_triton(o, lse, dst.fields["o"], dst.fields["lse"], slice(0, 8), torch.arange(3), 4, 2)
    with pytest.raises(ValueError, match="shapes"):
        merge_lse_triton(o, lse, torch.empty(4, 2, 5), dst.fields["lse"], slice(0, 8), slice(0, 4), 4, 2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available("cpu") and triton_available("cuda")
    with pytest.raises(RuntimeError, match="Triton is not available"):
        merge_partials(LSE, src, dst, slice(0, 8), slice(0, 4), 4, 2, use_triton=True)


# ---------------------------------------------------------------------- CUDA
@cuda
@pytest.mark.parametrize("h,d", [(8, 128), (3, 72)])
def test_cuda_matches_torch(calls, monkeypatch, h, d):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    n, p = 4096, 8
    src = _partials(n * p, h, d, torch.float32, device="cuda", missing=0.1)
    perm = torch.randperm(n * p + 1, device="cuda")[:n * p]
    src.fields["o"][torch.isinf(src.fields["lse"])] = 0
    for s_rows in (perm, slice(0, n * p)):
        want_o, want_l = _torch_merge(src, s_rows, slice(0, n), n, p, h, d, torch.float32)
        dst = _Outputs(o=torch.full((n, h, d), math.nan, device="cuda"),
                       lse=torch.full((n, h), math.nan, device="cuda"))
        merge_partials(LSE, src, dst, s_rows, slice(0, n), n, p)  # on CUDA: Triton by default
        _close(dst.fields["o"], want_o, 1e-5)
        _close(dst.fields["lse"], want_l, 1e-5)
    assert calls == [p, p]
    src64 = _partials(64 * 3, h, d, torch.float64, device="cuda")
    want_o, want_l = _torch_merge(src64, slice(0, 192), slice(0, 64), 64, 3, h, d, torch.float64)
    dst = _ns(torch.empty(64, h, d, dtype=torch.float64, device="cuda"),
              torch.empty(64, h, dtype=torch.float64, device="cuda"))
    merge_partials(LSE, src64, dst, slice(0, 192), slice(0, 64), 64, 3)
    _close(dst.fields["o"], want_o, 1e-12)
    _close(dst.fields["lse"], want_l, 1e-12)


@pytest.mark.parametrize("dst_idx", [False, True])
def test_compiles_for_a_gpu_with_bfloat16_partials(dst_idx):
    """The merge kernel through Triton's whole compiler for an H100 (sm_90) without one, as the
    executor launches it on partial rows whose O is bfloat16 (a division's output written into
    them, and their merges): the interpreter runs Python, so only this catches what the compiler
    refuses for that dtype."""
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    from torch_dcp.executor.triton_merge import _merge_lse_kernel, jitted

    try:
        from triton.backends.compiler import GPUTarget
    except ImportError:  # pragma: no cover - an older Triton
        pytest.skip("this Triton has no GPUTarget")
    sig = {"src_o": "*bf16", "src_lse": "*fp32", "dst_o": "*bf16", "dst_lse": "*fp32", "src_idx": "*i64",
           "dst_idx": "*i64", "p": "i32", "src_start": "i32", "dst_start": "i32", "H": "i32",
           **dict.fromkeys(("so_r", "so_h", "so_d", "sl_r", "sl_h", "do_r", "do_h", "do_d", "dl_r", "dl_h"), "i32"),
           **dict.fromkeys(("SRC_IDX", "DST_IDX", "SA", "DA", "ACC", "D", "BLOCK_H", "BLOCK_D"), "constexpr")}
    src = ASTSource(fn=jitted(_merge_lse_kernel), signature=sig,
                    constexprs={"SRC_IDX": False, "DST_IDX": dst_idx, "SA": 8, "DA": 8, "ACC": tl.float32, "D": 128,
                                "BLOCK_H": 8, "BLOCK_D": 128})
    assert "ptx" in triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm
