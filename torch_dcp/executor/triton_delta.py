"""``O' = dO * delta / |dO|^2`` in one Triton kernel: the stand-in output a fused attention
backward is given.

Fused attention backwards take the forward output ``O`` only to form ``delta = rowsum(dO * O)``
(FlashAttention-2, Dao, arXiv:2307.08691, Algorithm 2, line 4). The executor has ``delta`` (the
final output never travels), and any ``O'`` with ``rowsum(dO * O') = delta`` serves: per row and
head, ``O' = dO * delta / |dO|^2`` (0 where ``dO = 0``, where ``delta`` is 0 too).
:func:`~torch_dcp.executor.kernels.base.out_with_delta` computes it with a handful of torch
operations (norm, guard, quotient, product, cast); here it is one launch, one program per row
and block of heads, reading ``dO`` once, the norm and the quotient in float32 (float64 for
float64 inputs).

The launch is the ``torch_dcp::out_with_delta`` operator (defined at import where Triton is
importable), made with :func:`torch.library.triton_op` as ``torch_dcp::merge_lse`` is
(:mod:`~torch_dcp.executor.triton_merge`: fake under ``FakeTensorMode``, traceable by
``torch.compile``; on CPU tensors only under ``TRITON_INTERPRET=1``, for tests)::

    torch_dcp::out_with_delta(Tensor do, Tensor delta, Tensor(a2!) out) -> ()
"""

from __future__ import annotations

import torch

from .triton_merge import _plain, launch, tl, triton, triton_available

__all__ = ["out_with_delta_triton", "OP_NAME"]

OP_NAME = "torch_dcp::out_with_delta"
_TILE = 1024  # elements of one program's [heads, head_dim] tile


def _out_with_delta_kernel(do, delta, out, H, sd_r, sd_h, sd_d, sl_r, sl_h, so_r, so_h, so_d,
                           ACC: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    h_ok = hs < H
    hd_ok = h_ok[:, None] & (ds < D)[None, :]
    g = tl.load(do + i * sd_r + hs[:, None] * sd_h + ds[None, :] * sd_d, mask=hd_ok, other=0.0).to(ACC)
    norm = tl.sum(g * g, axis=1)
    dl = tl.load(delta + i * sl_r + hs * sl_h, mask=h_ok, other=0.0).to(ACC)
    coef = tl.where(norm > 0, dl / tl.where(norm > 0, norm, 1.0), 0.0)
    tl.store(out + i * so_r + hs[:, None] * so_h + ds[None, :] * so_d, (g * coef[:, None]).to(out.dtype.element_ty),
             mask=hd_ok)


def _launch(do: torch.Tensor, delta: torch.Tensor, out: torch.Tensor, wrap: bool) -> None:
    n, H, D = do.shape
    if n == 0:
        return
    block_d = triton.next_power_of_2(int(D))
    block_h = min(triton.next_power_of_2(int(H)), max(1, _TILE // block_d))
    args = (do, delta, out, H, *do.stride(), *delta.stride(), *out.stride())
    consts = dict(ACC=tl.float64 if do.dtype == torch.float64 else tl.float32, D=int(D), BLOCK_H=block_h,
                  BLOCK_D=block_d, num_warps=max(1, min(8, block_h * block_d // 256)))
    grid = (n, triton.cdiv(H, block_h))
    launch(_out_with_delta_kernel, grid, args, consts, wrap, do, OP_NAME)


def _out_with_delta(do: torch.Tensor, delta: torch.Tensor, out: torch.Tensor) -> None:
    """The body of ``torch_dcp::out_with_delta`` (arguments checked by
    :func:`out_with_delta_triton`), also its fake implementation (the launch goes through
    :func:`torch.library.wrap_triton`, as ``torch_dcp::merge_lse``'s does)."""
    _launch(do, delta, out, wrap=True)


if triton is not None:
    torch.library.triton_op(OP_NAME, mutates_args={"out"})(_out_with_delta)


def out_with_delta_triton(do: torch.Tensor, delta: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``O' = dO * delta / |dO|^2`` per row and head (0 where ``dO = 0``) in one launch.

    Args:
        do: ``[N, H, D]`` floating, any strides. delta: ``[N, H]`` floating.
        out_dtype: the dtype of ``O'``.

    Returns:
        ``O'``: ``[N, H, D]`` contiguous, ``out_dtype``.

    Raises:
        RuntimeError: Triton is not available for ``do``'s device (see
            :func:`~torch_dcp.executor.triton_merge.triton_available`).
        ValueError: shapes or devices that do not match.
    """
    if not triton_available(do.device):
        raise RuntimeError(f"out_with_delta_triton: Triton is not available for {do.device} "
                           "(needs the triton package and a CUDA device, or TRITON_INTERPRET=1)")
    if do.dim() != 3 or tuple(delta.shape) != tuple(do.shape[:2]) or delta.device != do.device:
        raise ValueError(f"out_with_delta_triton: expected do [N, H, D] and delta [N, H] on one device, got "
                         f"{list(do.shape)} on {do.device} and {list(delta.shape)} on {delta.device}")
    out = torch.empty(do.shape, dtype=out_dtype, device=do.device)
    if not torch.compiler.is_compiling() and _plain(do, delta, out):
        _launch(do, delta, out, wrap=False)
    else:
        torch.ops.torch_dcp.out_with_delta(do, delta, out)
    return out
