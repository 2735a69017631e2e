"""The one-launch ``O' = dO * delta / |dO|^2`` (torch_dcp::out_with_delta) against the float64
formula and the torch version: on CPU in Triton's interpreter. The kernel reduces with
``tl.sum``, a ``triton.jit`` function of Triton's standard library, which Triton 3.9's
interpreter runs only when ``TRITON_INTERPRET=1`` was set before Triton was imported: the checks
run in a process started with it (:func:`test_in_the_interpreter`)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra installs it on Linux x86-64)")

from torch_dcp.executor.kernels.base import out_with_delta  # noqa: E402
from torch_dcp.executor.triton_delta import out_with_delta_triton  # noqa: E402


@pytest.fixture
def interpret():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in test_in_the_interpreter's process (TRITON_INTERPRET=1 before Triton is imported)")


def test_in_the_interpreter():
    """This file's other tests, in a process whose Triton runs its interpreter."""
    here = Path(__file__).resolve()
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(here.parents[1]), str(here.parent), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here), "-k",
                          "not test_in_the_interpreter"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "20 passed" in res.stdout, res.stdout[-500:]


def _case(n: int, h: int, d: int, dtype: torch.dtype, wide: bool = False):
    g = torch.Generator().manual_seed(n * 31 + h * 7 + d)
    do = torch.randn(n, h, d + (5 if wide else 0), generator=g, dtype=torch.float64)
    do[1] = 0.0  # a row whose upstream gradient is 0: O' = 0
    delta = torch.randn(n, h, generator=g, dtype=torch.float64)
    delta[1] = 0.0
    do = do.to(dtype)[..., :d]  # wide: a strided view (a field of a wider row)
    return do, delta


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("h,d,wide", [(8, 128, False), (3, 72, True), (1, 8, False)])
def test_matches_the_formula_and_keeps_delta(interpret, dtype, tol, h, d, wide):
    do, delta = _case(6, h, d, dtype, wide)
    out = out_with_delta_triton(do, delta, dtype)
    assert out.dtype == dtype and out.shape == do.shape and out.is_contiguous()
    d64 = do.double()
    norm = (d64 * d64).sum(-1)
    want = torch.where(norm[..., None] > 0, d64 * (delta / torch.where(norm > 0, norm, 1))[..., None], 0)
    assert (out.double() - want).abs().max().item() <= tol * want.abs().max().item()
    assert torch.count_nonzero(out[1]) == 0
    # what a fused backward forms from it: rowsum(dO * O') = delta
    assert ((d64 * out.double()).sum(-1) - delta).abs().max().item() <= 4 * tol * delta.abs().max().item()
    # the torch version (CPU) agrees
    ref = out_with_delta(do, delta, torch.float64 if dtype == torch.float64 else torch.float32, dtype)
    assert (out.double() - ref.double()).abs().max().item() <= tol * want.abs().max().item()


def test_refuses_without_a_device_or_interpreter(interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    do, delta = _case(3, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match="Triton is not available for cpu"):
        out_with_delta_triton(do, delta, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"expected do \[N, H, D\] and delta \[N, H\]"):
        out_with_delta_triton(do, delta[:, :1], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_same_launch_writes_the_lse_heads_first(interpret, dtype):
    """``lse=``: ``(O', lse.t())`` from one launch (torch_dcp::out_with_delta_lse), the LSE float32
    and contiguous heads-first whatever its strides (a field of a gathered row here), -inf kept."""
    do, delta = _case(7, 3, 16, dtype)
    g = torch.Generator().manual_seed(5)
    row = torch.randn(7, 3 + 4, generator=g, dtype=torch.float64)
    lse = row[:, 2:5]  # strided
    lse[2, 1] = -float("inf")
    out, lse_t = out_with_delta_triton(do, delta, dtype, lse=lse)
    assert torch.equal(out, out_with_delta_triton(do, delta, dtype))
    assert lse_t.dtype == torch.float32 and lse_t.shape == (3, 7) and lse_t.is_contiguous()
    assert torch.equal(lse_t, lse.t().float())
    from torch_dcp.executor.kernels.base import flash_backward_inputs

    o2, l2 = flash_backward_inputs(do, delta, lse, torch.float64 if dtype == torch.float64 else torch.float32, dtype)
    assert torch.equal(l2, lse_t) and (o2.double() - out.double()).abs().max().item() <= 1e-2
    with pytest.raises(ValueError, match=r"expected lse \[7, 3\]"):
        out_with_delta_triton(do, delta, dtype, lse=lse[:, :2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_backward_inputs_match_the_torch_formulas(interpret, dtype):
    """torch_dcp::flex_backward_inputs: O' as out_with_delta's, the LSE in base 2 heads-first with
    non-finite rows at 0, and (rowsum(dO * O') - delta) * ln 2 from the rounded O'."""
    import math

    from torch_dcp.executor.triton_delta import flex_backward_inputs_triton

    do, delta = _case(9, 4, 32, dtype)
    delta = delta.float()
    lse = torch.randn(9, 4, generator=torch.Generator().manual_seed(2))
    lse[3, 2], lse[4, 0] = -math.inf, math.nan
    out, lse2, glse = flex_backward_inputs_triton(do, delta, lse, dtype)
    assert torch.equal(out, out_with_delta_triton(do, delta, dtype))
    want_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).t() / math.log(2)
    assert lse2.shape == (4, 9) and lse2.is_contiguous() and (lse2 - want_lse).abs().max().item() <= 1e-6
    want_g = ((do.float() * out.float()).sum(-1) - delta).t() * math.log(2)
    assert glse.shape == (4, 9) and (glse - want_g).abs().max().item() <= 1e-5 * max(1.0, want_g.abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("wide", [False, True])
def test_output_delta_is_the_rowsum_in_the_accumulation_dtype(interpret, dtype, tol, wide):
    """torch_dcp::output_delta: rowsum(dO * O) per row and head, written into a strided field,
    the bf16 products summed in float32 (exact products: the float64 sum to float32's rounding),
    as the torch version on CPU computes it."""
    from torch_dcp.executor.kernels.base import output_delta
    from torch_dcp.executor.triton_delta import output_delta_triton

    do, _ = _case(6, 3, 72, dtype, wide)
    o = torch.randn(6, 3, 80, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(dtype)[..., 4:76]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    row = torch.full((6, 5), math.nan, dtype=acc)
    into = row[:, 1:4]  # a field of a wider row
    got = output_delta_triton(do, o, into)
    want = (do.double() * o.double()).sum(-1)
    assert got is into and torch.isnan(row[:, 0]).all() and torch.isnan(row[:, 4]).all()
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item()
    assert (output_delta(do, o, acc).double() - want).abs().max().item() <= tol * want.abs().max().item()
    with pytest.raises(ValueError, match=r"expected do and o \[N, H, D\], delta \[N, H\]"):
        output_delta_triton(do, o[:, :2], into)
