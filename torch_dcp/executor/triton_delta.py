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
    torch_dcp::out_with_delta_lse(Tensor do, Tensor delta, Tensor lse, Tensor(a3!) out, Tensor(a4!) lse_t) -> ()

    torch_dcp::flex_backward_inputs(Tensor do, Tensor delta, Tensor lse, Tensor(a3!) out, Tensor(a4!) lse_t,
                                    Tensor(a5!) glse) -> ()

The second also writes the LSE heads-first (``lse.t()``, float32, contiguous), the layout fused
attention backwards read, saving the transposing copy a division would otherwise make; the third
writes what FlexAttention's backward op takes (:func:`flex_backward_inputs_triton`).
"""

from __future__ import annotations

import torch

from .triton_merge import _plain, launch, tl, triton, triton_available

__all__ = ["out_with_delta_triton", "flex_backward_inputs_triton", "output_delta_triton", "OP_NAME", "LSE_OP_NAME",
           "FLEX_OP_NAME", "DELTA_OP_NAME"]

OP_NAME = "torch_dcp::out_with_delta"
LSE_OP_NAME = "torch_dcp::out_with_delta_lse"
FLEX_OP_NAME = "torch_dcp::flex_backward_inputs"
DELTA_OP_NAME = "torch_dcp::output_delta"
_TILE = 1024  # elements of one program's [heads, head_dim] tile


def _out_with_delta_kernel(do, delta, out, lse, lse_t, glse, N, H, sd_r, sd_h, sd_d, sl_r, sl_h, so_r, so_h, so_d,
                           se_r, se_h, ACC: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr, WITH_LSE: tl.constexpr, FLEX: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    h_ok = hs < H
    hd_ok = h_ok[:, None] & (ds < D)[None, :]
    g = tl.load(do + i * sd_r + hs[:, None] * sd_h + ds[None, :] * sd_d, mask=hd_ok, other=0.0).to(ACC)
    norm = tl.sum(g * g, axis=1)
    dl = tl.load(delta + i * sl_r + hs * sl_h, mask=h_ok, other=0.0).to(ACC)
    coef = tl.where(norm > 0, dl / tl.where(norm > 0, norm, 1.0), 0.0)
    o = (g * coef[:, None]).to(out.dtype.element_ty)
    tl.store(out + i * so_r + hs[:, None] * so_h + ds[None, :] * so_d, o, mask=hd_ok)
    if WITH_LSE:  # the LSE heads-first, contiguous: [H, N] float32, as fused backwards read it
        e = tl.load(lse + i * se_r + hs * se_h, mask=h_ok, other=0.0).to(tl.float32)
        at = hs.to(tl.int64) * N + i
        if FLEX:  # base 2, rows that see nothing at 0; and the LSE gradient that removes O' rounding
            e = tl.where((e == e) & (tl.abs(e) < float("inf")), e, 0.0) * 1.4426950408889634
            gl = (tl.sum(g * o.to(ACC), axis=1) - dl) * 0.6931471805599453
            tl.store(glse + at, gl.to(tl.float32), mask=h_ok)
        tl.store(lse_t + at, e, mask=h_ok)


def _output_delta_kernel(do, o, delta, H, sd_r, sd_h, sd_d, so_r, so_h, so_d, sl_r, sl_h, ACC: tl.constexpr,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    h_ok = hs < H
    hd_ok = h_ok[:, None] & (ds < D)[None, :]
    g = tl.load(do + i * sd_r + hs[:, None] * sd_h + ds[None, :] * sd_d, mask=hd_ok, other=0.0).to(ACC)
    x = tl.load(o + i * so_r + hs[:, None] * so_h + ds[None, :] * so_d, mask=hd_ok, other=0.0).to(ACC)
    tl.store(delta + i * sl_r + hs * sl_h, tl.sum(g * x, axis=1).to(delta.dtype.element_ty), mask=h_ok)


def _launch_delta(do: torch.Tensor, o: torch.Tensor, delta: torch.Tensor, wrap: bool) -> None:
    n, H, D = do.shape
    if n == 0:
        return
    block_d = triton.next_power_of_2(int(D))
    block_h = min(triton.next_power_of_2(int(H)), max(1, _TILE // block_d))
    acc = tl.float64 if torch.float64 in (do.dtype, o.dtype, delta.dtype) else tl.float32
    consts = dict(ACC=acc, D=int(D), BLOCK_H=block_h, BLOCK_D=block_d,
                  num_warps=max(1, min(8, block_h * block_d // 256)))
    launch(_output_delta_kernel, (n, triton.cdiv(H, block_h)), (do, o, delta, H, *do.stride(), *o.stride(),
                                                               *delta.stride()), consts, wrap, do, DELTA_OP_NAME)


def _output_delta(do: torch.Tensor, o: torch.Tensor, delta: torch.Tensor) -> None:
    """The body of ``torch_dcp::output_delta`` (see :func:`output_delta_triton`)."""
    _launch_delta(do, o, delta, wrap=True)


def _launch(do: torch.Tensor, delta: torch.Tensor, out: torch.Tensor, wrap: bool, lse: torch.Tensor | None = None,
            lse_t: torch.Tensor | None = None, glse: torch.Tensor | None = None) -> None:
    n, H, D = do.shape
    if n == 0:
        return
    block_d = triton.next_power_of_2(int(D))
    block_h = min(triton.next_power_of_2(int(H)), max(1, _TILE // block_d))
    with_lse, flex = lse is not None, glse is not None
    args = (do, delta, out, lse if with_lse else delta, lse_t if with_lse else delta, glse if flex else delta, n, H,
            *do.stride(), *delta.stride(), *out.stride(), *(lse.stride() if with_lse else (0, 0)))
    consts = dict(ACC=tl.float64 if do.dtype == torch.float64 else tl.float32, D=int(D), BLOCK_H=block_h,
                  BLOCK_D=block_d, WITH_LSE=with_lse, FLEX=flex, num_warps=max(1, min(8, block_h * block_d // 256)))
    grid = (n, triton.cdiv(H, block_h))
    launch(_out_with_delta_kernel, grid, args, consts, wrap, do,
           FLEX_OP_NAME if flex else LSE_OP_NAME if with_lse else OP_NAME)


def _out_with_delta(do: torch.Tensor, delta: torch.Tensor, out: torch.Tensor) -> None:
    """The body of ``torch_dcp::out_with_delta`` (arguments checked by
    :func:`out_with_delta_triton`), also its fake implementation (the launch goes through
    :func:`torch.library.wrap_triton`, as ``torch_dcp::merge_lse``'s does)."""
    _launch(do, delta, out, wrap=True)


def _out_with_delta_lse(do: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                        lse_t: torch.Tensor) -> None:
    """The body of ``torch_dcp::out_with_delta_lse``: :func:`_out_with_delta` that also writes
    ``lse_t = lse.t()`` (float32, contiguous)."""
    _launch(do, delta, out, True, lse, lse_t)


def _flex_backward_inputs(do: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                          lse_t: torch.Tensor, glse: torch.Tensor) -> None:
    """The body of ``torch_dcp::flex_backward_inputs`` (see :func:`flex_backward_inputs_triton`)."""
    _launch(do, delta, out, True, lse, lse_t, glse)


if triton is not None:
    torch.library.triton_op(OP_NAME, mutates_args={"out"})(_out_with_delta)
    torch.library.triton_op(LSE_OP_NAME, mutates_args={"out", "lse_t"})(_out_with_delta_lse)
    torch.library.triton_op(FLEX_OP_NAME, mutates_args={"out", "lse_t", "glse"})(_flex_backward_inputs)
    torch.library.triton_op(DELTA_OP_NAME, mutates_args={"delta"})(_output_delta)


def output_delta_triton(do: torch.Tensor, o: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dO * O)`` per row and head (FlashAttention-2, arXiv:2307.08691,
    Algorithm 2, line 4) in one launch, the product and the sum in float32 (float64 where a
    tensor is), written into ``delta``.

    Args:
        do, o: ``[N, H, D]`` floating, any strides, one device. delta: ``[N, H]`` floating, any
            strides (a field of a wider row), written.

    Returns:
        ``delta``.

    Raises:
        RuntimeError: Triton is not available for ``do``'s device.
        ValueError: shapes or devices that do not match.
    """
    if not triton_available(do.device):
        raise RuntimeError(f"output_delta_triton: Triton is not available for {do.device}")
    if (do.dim() != 3 or tuple(o.shape) != tuple(do.shape) or tuple(delta.shape) != tuple(do.shape[:2])
            or o.device != do.device or delta.device != do.device):
        raise ValueError(f"output_delta_triton: expected do and o [N, H, D], delta [N, H] on one device, got "
                         f"{list(do.shape)}, {list(o.shape)}, {list(delta.shape)}")
    if not torch.compiler.is_compiling() and _plain(do, o, delta):
        _launch_delta(do, o, delta, wrap=False)
    else:
        torch.ops.torch_dcp.output_delta(do, o, delta)
    return delta


def flex_backward_inputs_triton(do: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor,
                                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What FlexAttention's backward op takes beyond Q, K, V, dO, in one launch: ``O'``
    (:func:`out_with_delta_triton`), the final LSE in base 2, heads-first, rows that see nothing
    at 0 (``[H, N]`` float32), and the LSE gradient ``(rowsum(dO * O') - delta) * ln 2``
    (``[H, N]`` float32: the op forms delta from the rounded ``O'``; this removes the difference).

    Raises:
        RuntimeError: Triton is not available for ``do``'s device.
        ValueError: shapes or devices that do not match.
    """
    if not triton_available(do.device):
        raise RuntimeError(f"flex_backward_inputs_triton: Triton is not available for {do.device}")
    if (do.dim() != 3 or tuple(delta.shape) != tuple(do.shape[:2]) or tuple(lse.shape) != tuple(delta.shape)
            or delta.device != do.device or lse.device != do.device):
        raise ValueError(f"flex_backward_inputs_triton: expected do [N, H, D], delta and lse [N, H] on one device, "
                         f"got {list(do.shape)}, {list(delta.shape)}, {list(lse.shape)}")
    out = torch.empty(do.shape, dtype=out_dtype, device=do.device)
    lse_t = torch.empty(lse.shape[::-1], dtype=torch.float32, device=do.device)
    glse = torch.empty(lse.shape[::-1], dtype=torch.float32, device=do.device)
    if not torch.compiler.is_compiling() and _plain(do, delta, lse, out, lse_t, glse):
        _launch(do, delta, out, False, lse, lse_t, glse)
    else:
        torch.ops.torch_dcp.flex_backward_inputs(do, delta, lse, out, lse_t, glse)
    return out, lse_t, glse


def out_with_delta_triton(do: torch.Tensor, delta: torch.Tensor, out_dtype: torch.dtype,
                          lse: torch.Tensor | None = None) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """``O' = dO * delta / |dO|^2`` per row and head (0 where ``dO = 0``) in one launch.

    Args:
        do: ``[N, H, D]`` floating, any strides. delta: ``[N, H]`` floating.
        out_dtype: the dtype of ``O'``.
        lse: ``[N, H]`` floating, any strides, or None: the same launch also writes it
            heads-first (``torch_dcp::out_with_delta_lse``), as fused attention backwards read it.

    Returns:
        ``O'``: ``[N, H, D]`` contiguous, ``out_dtype``; with ``lse``: ``(O', lse_t)``,
        ``lse_t = lse.t()`` ``[H, N]`` float32 contiguous.

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
    if lse is not None:
        if tuple(lse.shape) != tuple(delta.shape) or lse.device != do.device:
            raise ValueError(f"out_with_delta_triton: expected lse {list(delta.shape)} on {do.device}, got "
                             f"{list(lse.shape)} on {lse.device}")
        lse_t = torch.empty(lse.shape[::-1], dtype=torch.float32, device=do.device)
        if not torch.compiler.is_compiling() and _plain(do, delta, out, lse, lse_t):
            _launch(do, delta, out, False, lse, lse_t)
        else:
            torch.ops.torch_dcp.out_with_delta_lse(do, delta, lse, out, lse_t)
        return out, lse_t
    if not torch.compiler.is_compiling() and _plain(do, delta, out):
        _launch(do, delta, out, wrap=False)
    else:
        torch.ops.torch_dcp.out_with_delta(do, delta, out)
    return out
