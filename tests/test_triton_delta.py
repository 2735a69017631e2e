"""The one-launch ``O' = dO * delta / |dO|^2`` (torch_dcp::out_with_delta) against the float64
formula and the torch version: on CPU in Triton's interpreter. The kernel reduces with
``tl.sum``, a ``triton.jit`` function of Triton's standard library, which Triton 3.9's
interpreter runs only when ``TRITON_INTERPRET=1`` was set before Triton was imported: the checks
run in a process started with it (:func:`test_in_the_interpreter`)."""

from __future__ import annotations

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
    assert "10 passed" in res.stdout, res.stdout[-500:]


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
