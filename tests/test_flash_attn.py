"""``kernel="flash_attn"``: the flash-attn package family (FlashAttention-4's ``flash_attn.cute``
first on Hopper/Blackwell, FlashAttention-2's varlen ops otherwise) running a division's varlen
calls, FlexAttention per division where the mask is not a few flash windows.

Without the package (every CPU machine of CI): the named kernel raises an error naming the
package, the automatic kernel is unchanged, the arguments are checked. With it: exact against the
float64 reference on CUDA (``cuda`` marker), and dry runs on fake CUDA tensors where the package
registers fake implementations (FlashAttention-2's custom ops)."""

from __future__ import annotations

import pytest
import torch

import torch_dcp
from torch_dcp.executor import AutoKernel, FlashAttnKernel, SDPAKernel, VarlenKernel, get_kernel
from torch_dcp.executor.kernels.flash_attn import (FlashAttnUnavailable, flash_attn_backend, flash_attn_backends,
                                           flash_attn_versions)
from torch_dcp.executor.kernels import KERNEL_NAMES
from torch_dcp.executor.kernels.varlen import assume_cuda_capability
from reference import needs_cuda
from test_exact import BLOCK, _batch
from test_varlen import _check

HAVE = bool(flash_attn_backends())
absent = pytest.mark.skipif(HAVE, reason="checks the behaviour without flash-attn (it is installed here)")
present = pytest.mark.skipif(not HAVE, reason="flash-attn is not installed (pip install 'torch-dcp[flash]')")
BF16 = torch.bfloat16


@absent
def test_without_the_package_the_named_kernel_says_what_to_install():
    with pytest.raises(FlashAttnUnavailable, match=r"kernel='flash_attn' needs the flash-attn package: "
                                                   r"pip install 'torch-dcp\[flash\]'.*No module named 'flash_attn'"):
        get_kernel("flash_attn", device="cuda", dtype=BF16, head_dim=64)
    with pytest.raises(RuntimeError, match=r"flash-attn-4 \(flash_attn.cute.interface\)"):
        FlashAttnKernel(backend="fa4")
    batch = _batch("causal", "gqa8/2-d64")
    plan = torch_dcp.plan(batch, 1, planner="greedy", block_size=BLOCK, divisions=1)
    with pytest.raises(FlashAttnUnavailable, match="flash-attn"):
        torch_dcp.emulate(plan, *(torch.zeros(batch.total_tokens, h, 64) for h in (8, 2, 2)), kernel="flash_attn")
    assert flash_attn_backends() == () and flash_attn_versions() == {}


@absent
def test_without_the_package_the_automatic_kernel_is_unchanged():
    with assume_cuda_capability((9, 0)):
        kern = get_kernel("auto", device="cuda", dtype=BF16, head_dim=64)
        assert flash_attn_backend("cuda", BF16, 64) is None
    assert type(kern) is AutoKernel and type(kern.fast) is VarlenKernel and kern.name == "auto"
    with assume_cuda_capability((7, 5)):  # no flash at all: FlexAttention (or the reference) for every division
        assert get_kernel("auto", device="cuda", dtype=BF16, head_dim=64).fast is None
    assert isinstance(get_kernel("auto", device="cpu"), SDPAKernel)


def test_arguments_and_backend_choice():
    assert "flash_attn" in KERNEL_NAMES
    with pytest.raises(ValueError, match="backend must be 'auto', 'fa4' or 'fa2', got 'fa3'"):
        FlashAttnKernel(backend="fa3")
    both = ("fa4", "fa2")
    with assume_cuda_capability((9, 0)):  # Hopper: FA4 first
        assert flash_attn_backend("cuda", BF16, 128, both) == "fa4"
        assert flash_attn_backend("cuda", torch.float16, 256, both) == "fa4"
        assert flash_attn_backend("cuda", BF16, 128, ("fa2",)) == "fa2"
        for dev, dt, hd in (("cuda", torch.float32, 128), ("cuda", BF16, 260), ("cuda", BF16, 100), ("cpu", BF16, 128)):
            assert flash_attn_backend(dev, dt, hd, both) is None, (dev, dt, hd)
    with assume_cuda_capability((10, 0)):  # Blackwell: FA4 up to head_dim 128
        assert flash_attn_backend("cuda", BF16, 128, both) == "fa4"
        assert flash_attn_backend("cuda", BF16, 256, both) == "fa2"
    with assume_cuda_capability((8, 0)):  # Ampere: FA2 only
        assert flash_attn_backend("cuda", BF16, 64, both) == "fa2"
        assert flash_attn_backend("cuda", BF16, 64, ("fa4",)) is None
    with assume_cuda_capability((7, 5)):
        assert flash_attn_backend("cuda", BF16, 64, both) is None


@present
@needs_cuda("needs CUDA (flash-attn kernels, bf16)")
@pytest.mark.parametrize("mask_name", ["causal", "lambda", "full", "shared_question"])
def test_flash_attn_exact_on_cuda(mask_name):
    batch = _batch(mask_name, "gqa8/2-d64", dtype="bfloat16")
    auto = get_kernel("auto", "cuda", BF16, 64)
    assert isinstance(auto.fast, FlashAttnKernel), "the automatic kernel prefers flash-attn where it runs"
    kernels = [get_kernel("flash_attn")]
    kernels += [AutoKernel(get_kernel("flex"), FlashAttnKernel(backend=b), name="flash_attn")
                for b in flash_attn_backends() if flash_attn_backend("cuda", BF16, 64, (b,))]
    for kern in kernels:
        for w, planner in ((1, "dcp"), (4, "dcp"), (3, "greedy")):
            plan = torch_dcp.plan(batch, w, planner=planner, block_size=BLOCK, divisions=2)
            _check(plan, batch, kern, tol=2e-2, dtype=BF16, device="cuda")
    assert kernels[0].fast.backend_for(torch.empty(1, 8, 64, device="cuda", dtype=BF16)) in ("fa4", "fa2")


@present
@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of PyTorch (no GPU needed)")
@pytest.mark.skipif("fa2" not in flash_attn_backends(), reason="FlashAttention-2's ops (fake implementations) absent")
def test_flash_attn_fa2_on_fake_cuda():
    from test_fake_cuda import _dry_run, _plan

    kern = AutoKernel(get_kernel("flex"), FlashAttnKernel(backend="fa2"), name="flash_attn")
    for mask in ("causal", "lambda"):
        _, seen = _dry_run(_plan(mask, "bfloat16", 4), kern, BF16)
        assert seen["flash_attn._flash_attn_varlen_forward.default"]
        assert seen["flash_attn._flash_attn_varlen_backward.default"]
        assert not seen["aten._flash_attention_forward.default"]


def test_an_old_flash_attention_4_is_refused_with_the_reason():
    """A ``flash_attn.cute`` whose forward returns no LSE and whose backward has no varlen
    arguments (mid-2025 versions) counts as absent, saying to upgrade."""
    from types import SimpleNamespace

    from torch_dcp.executor.kernels.flash_attn import _check_fa4

    def fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale=None, causal=False, window_size_left=None,
            window_size_right=None):
        raise AssertionError("not called")

    def bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
            window_size_right=None):
        raise AssertionError("not called")

    with pytest.raises(ImportError, match=r"_flash_attn_fwd lacks \['return_lse'\]: this flash-attn-4 is too old"):
        _check_fa4(SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd))
    with pytest.raises(ImportError, match=r"_flash_attn_bwd lacks \['cu_seqlens_k', 'cu_seqlens_q'\]"):
        _check_fa4(SimpleNamespace(_flash_attn_fwd=lambda q, k, v, return_lse=False, cu_seqlens_q=None,
                                   cu_seqlens_k=None, softmax_scale=None, causal=False, window_size_left=None,
                                   window_size_right=None: None, _flash_attn_bwd=bwd))
