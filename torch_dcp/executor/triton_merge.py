"""The LSE merge of partial attention outputs in one Triton kernel (one read of every partial).

One program per destination row and block of heads: it reads the ``p`` partial LSEs and keeps a
running maximum and a running sum of exponentials rescaled to it (the online normalizer of
Milakov & Gimelshein, "Online normalizer calculation for softmax", arXiv:1805.02867, 2018; the
same rescaling FlashAttention-2 applies between key blocks, Dao, arXiv:2307.08691, 2023), then
reads each partial output vector once and accumulates it weighted by ``exp(lse_i - lse)``::

    lse = log sum_i exp(lse_i)          o = sum_i exp(lse_i - lse) o_i

Partials with LSE ``-inf`` weigh nothing (their outputs are not read); a row whose partials all
have LSE ``-inf`` gets output 0 and LSE ``-inf``. Accumulation is in float32 (float64 for
float64 sources). On CPU tensors the kernel runs only under ``TRITON_INTERPRET=1`` (slow; for
tests).

The launch is the ``torch_dcp::merge_lse`` operator, defined at import where Triton is
importable (nothing is registered where it is not), with :func:`torch.library.triton_op` and
:func:`torch.library.wrap_triton`::

    torch_dcp::merge_lse(Tensor src_o, Tensor src_lse, Tensor(a2!) dst_o, Tensor(a3!) dst_lse,
                         Tensor? src_idx, Tensor? dst_idx, SymInt src_start, SymInt dst_start,
                         SymInt n, SymInt p) -> ()

so that it is an operator PyTorch sees: under ``FakeTensorMode`` (CUDA tensors without a GPU or
driver) it runs its fake implementation -- the same Python body, whose launch is then a
``triton_kernel_wrapper_mutation`` call that only marks ``dst_o`` and ``dst_lse`` written --
and ``torch.compile`` traces into it (the kernel appears in the graph as a user-defined Triton
kernel). :func:`merge_lse_triton` validates the arguments and calls it -- or, on plain tensors
with no dispatch mode active and outside ``torch.compile``, where nothing can see the operator,
launches the kernel as the operator's implementation would, without its Python dispatch (about
60 us a call on an H100 host, as much as a small merge takes).
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = tl = None

__all__ = ["triton_available", "merge_lse_triton", "OP_NAME"]

#: the operator's name (``torch.ops.torch_dcp.merge_lse``), registered where Triton is importable
OP_NAME = "torch_dcp::merge_lse"
_TILE = 1024  # elements of one program's [heads, head_dim] tile: 4 KiB of float32 per partial


@torch.compiler.assume_constant_result
def _interpret() -> bool:
    """Whether Triton runs kernels in its interpreter (read at each call, as ``triton.jit`` does;
    a constant for ``torch.compile``, which cannot trace Triton's reading of the environment)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # pragma: no cover - Triton < 3.4


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether :func:`merge_lse_triton` can run on ``device``: Triton is importable and the
    device is CUDA, or Triton's interpreter is on (``TRITON_INTERPRET=1``). ``device`` None:
    whether a CUDA device is available. A CUDA device given is taken as is (not queried): under
    ``FakeTensorMode`` a fake CUDA tensor's device counts without a GPU."""
    if triton is None:
        return False
    if _interpret():
        return True
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def _merge_lse_kernel(src_o, src_lse, dst_o, dst_lse, src_idx, dst_idx, p, src_start, dst_start, H,
                      so_r, so_h, so_d, sl_r, sl_h, do_r, do_h, do_d, dl_r, dl_h,
                      SRC_IDX: tl.constexpr, DST_IDX: tl.constexpr, SA: tl.constexpr, DA: tl.constexpr,
                      ACC: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # D a constant: the mask of a head_dim that is no power of two (72) keeps vectorized accesses
    i = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    h_ok = hs < H
    hd_ok = h_ok[:, None] & (ds < D)[None, :]
    first = i * p
    # the p LSEs: running maximum m and sum s of exp(lse_j - m), rescaled when m grows
    m = tl.full([BLOCK_H], float("-inf"), ACC)
    s = tl.full([BLOCK_H], 0.0, ACC)
    # while loops, not range(p): one compiled kernel for every p, and Triton 3.6's interpreter
    # cannot take range() of a runtime scalar under NumPy 2
    j = 0
    while j < p:
        r = tl.load(src_idx + first + j).to(tl.int64) if SRC_IDX else src_start + first + j
        lj = tl.load(src_lse + r * sl_r + hs * sl_h, mask=h_ok, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, lj)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf - 0) = 0
        s = s * tl.exp(m - base) + tl.exp(lj - base)
        m = m_new
        j += 1
    lse = m + tl.log(tl.where(s > 0, s, 1.0))  # s = 0 only where every partial is -inf: lse = m = -inf
    base = tl.where(lse == float("-inf"), 0.0, lse)
    # the p output vectors, each read once (not at all where its weight is 0)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, ACC)
    j = 0
    while j < p:
        r = tl.load(src_idx + first + j).to(tl.int64) if SRC_IDX else src_start + first + j
        w = tl.exp(tl.load(src_lse + r * sl_r + hs * sl_h, mask=h_ok, other=float("-inf")).to(ACC) - base)
        row = tl.multiple_of(r * so_r, SA)
        oj = tl.load(src_o + row + tl.multiple_of(hs * so_h, SA)[:, None] + ds[None, :] * so_d,
                     mask=hd_ok & (w > 0)[:, None], other=0.0)
        acc += w[:, None] * oj.to(ACC)
        j += 1
    d = tl.load(dst_idx + i).to(tl.int64) if DST_IDX else dst_start + i
    row = tl.multiple_of(d * do_r, DA)
    tl.store(dst_o + row + tl.multiple_of(hs * do_h, DA)[:, None] + ds[None, :] * do_d,
             acc.to(dst_o.dtype.element_ty), mask=hd_ok)
    tl.store(dst_lse + d * dl_r + hs * dl_h, lse.to(dst_lse.dtype.element_ty), mask=h_ok)


_JITTED: dict[tuple[Any, bool], Any] = {}


def jitted(fn: Any) -> Any:
    """``fn`` jitted (or wrapped for the interpreter) at first use in each mode."""
    key = (fn, _interpret())
    if key not in _JITTED:
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key]


def launch(fn: Any, grid: tuple, args: tuple, consts: dict, wrap: bool, probe: torch.Tensor, op: str) -> None:
    """Launch the Triton kernel ``fn`` (jitted by :func:`jitted`): through
    :func:`torch.library.wrap_triton` where ``wrap`` (an operator's body: fake and traceable),
    else straight. In Triton's interpreter (CPU tests) it runs on real tensors only: a fake
    ``probe`` (an argument of the launch) launches nothing (the operator only marks its outputs
    written), a traced one raises ``RuntimeError`` naming ``op``."""
    kernel = jitted(fn)
    if not _interpret():
        (torch.library.wrap_triton(kernel) if wrap else kernel)[grid](*args, **consts)
    elif _is_fake(probe):
        return  # the interpreter needs data; a fake launch only marks the outputs written
    elif type(probe) is not torch.Tensor:
        raise RuntimeError(f"{op} cannot be traced while Triton's interpreter is on (TRITON_INTERPRET=1): the "
                           "interpreter runs on real tensors only")
    else:
        kernel[grid](*args, **consts)


def _rows(rows: Any, count: int, total: int, name: str, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """``(start, None)`` for a unit-step slice, ``(0, int64 indices)`` otherwise; checks counts."""
    if isinstance(rows, slice):
        r = range(total)[rows]  # as slice.indices(total), which torch.compile cannot trace
        if r.step == 1 and len(r) == count:
            return r.start, None
        rows = torch.arange(r.start, r.stop, r.step, device=device)
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.numel() != count:
        got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else rows
        raise ValueError(f"{name}: expected a slice or a 1-D index tensor of {count} rows, got {got}")
    if rows.dtype not in (torch.int32, torch.int64) or rows.device != device:
        raise ValueError(f"{name}: indices must be int32/int64 on {device}, got {rows.dtype} on {rows.device}")
    return 0, rows.contiguous()


def partial_rows(name: str, src_rows: Any, dst_rows: Any, n: int, p: int, src_total: int, dst_total: int,
                 device: torch.device) -> tuple[int, torch.Tensor | None, int, torch.Tensor | None]:
    """``(src_start, src_idx, dst_start, dst_idx)`` (see :func:`_rows`) of a reduction of ``p``
    partials into each of ``n`` rows, for the kernel ``name``.

    Raises:
        ValueError: ``p < 1``, or rows that do not count ``n * p`` and ``n``.
    """
    if p < 1:
        raise ValueError(f"{name}: p must be >= 1, got {p}")
    src_start, src_idx = _rows(src_rows, n * p, src_total, "src_rows", device)
    dst_start, dst_idx = _rows(dst_rows, n, dst_total, "dst_rows", device)
    return src_start, src_idx, dst_start, dst_idx


def _align(t: torch.Tensor) -> int:
    """A power of two (up to 16 bytes' worth of elements) dividing ``t``'s row and head strides:
    every ``D``-vector starts that many elements past an aligned base (vectorized accesses)."""
    return math.gcd(max(1, 16 // t.element_size()), int(t.stride(0)), int(t.stride(1)))


def _is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (``FakeTensorMode``: metadata only, no storage)."""
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def _plain(*tensors: torch.Tensor) -> bool:
    """Whether the merge may launch without the operator: plain tensors (no fake or other
    subclass) and no dispatch mode active (no fake mode, tracer, profiler mode to see the op)."""
    return all(type(t) is torch.Tensor for t in tensors) and torch._C._len_torch_dispatch_stack() == 0


def _merge_lse(src_o: torch.Tensor, src_lse: torch.Tensor, dst_o: torch.Tensor, dst_lse: torch.Tensor,
               src_idx: Optional[torch.Tensor], dst_idx: Optional[torch.Tensor],
               src_start: int, dst_start: int, n: int, p: int) -> None:
    """The body of ``torch_dcp::merge_lse`` (arguments checked by :func:`merge_lse_triton`): one
    launch of ``n x ceil(H / BLOCK_H)`` programs, writing ``dst_o`` and ``dst_lse`` in place.

    Args:
        src_o ``[R, H, D]``, src_lse ``[R, H]``, dst_o ``[R', H, D]``, dst_lse ``[R', H]``: as in
            :func:`merge_lse_triton`.
        src_idx: the ``n * p`` source rows (int32/int64, contiguous), or None: rows
            ``src_start .. src_start + n * p``. dst_idx: the ``n`` destination rows, or None:
            rows ``dst_start .. dst_start + n``.
        n, p: destination rows (``n >= 1``) and partials per row (``p >= 1``).

    Also the operator's fake implementation (``triton_op`` registers the body as such): under
    ``FakeTensorMode`` or while traced the launch goes through :func:`torch.library.wrap_triton`
    and computes nothing. Triton's interpreter (``TRITON_INTERPRET=1``, CPU tests) has no such
    wrapper: there the kernel runs directly on real tensors and is skipped on fake ones.

    Raises:
        RuntimeError: traced (``torch.compile``, ``make_fx``) while Triton's interpreter is on.
    """
    _launch(src_o, src_lse, dst_o, dst_lse, src_idx, dst_idx, src_start, dst_start, n, p, wrap=True)


def _launch(src_o, src_lse, dst_o, dst_lse, src_idx, dst_idx, src_start, dst_start, n, p, wrap: bool) -> None:
    """The launch (arguments as :func:`_merge_lse`'s), through :func:`torch.library.wrap_triton`
    where ``wrap`` (the operator's body: traceable) or straight to the kernel."""
    _, H, D = src_o.shape
    block_d = triton.next_power_of_2(int(D))
    block_h = min(triton.next_power_of_2(int(H)), max(1, _TILE // block_d))
    dummy = src_lse  # pointer argument of an unused index (never loaded)
    args = (src_o, src_lse, dst_o, dst_lse, dummy if src_idx is None else src_idx,
            dummy if dst_idx is None else dst_idx, p, src_start, dst_start, H,
            *src_o.stride(), *src_lse.stride(), *dst_o.stride(), *dst_lse.stride())
    consts = dict(SRC_IDX=src_idx is not None, DST_IDX=dst_idx is not None, SA=_align(src_o), DA=_align(dst_o),
                  ACC=tl.float64 if src_o.dtype == torch.float64 else tl.float32, D=int(D),
                  BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(1, min(8, block_h * block_d // 256)))
    grid = (n, triton.cdiv(H, block_h))
    launch(_merge_lse_kernel, grid, args, consts, wrap, src_o, OP_NAME)


if triton is not None:
    torch.library.triton_op(OP_NAME, mutates_args={"dst_o", "dst_lse"})(_merge_lse)


def merge_lse_triton(src_o: torch.Tensor, src_lse: torch.Tensor, dst_o: torch.Tensor, dst_lse: torch.Tensor,
                     src_rows: Any, dst_rows: Any, n: int, p: int) -> None:
    """Merge ``p`` partials into each of ``n`` destination rows in one launch (the
    ``torch_dcp::merge_lse`` operator; fake and traceable, see the module docstring).

    Args:
        src_o: partial outputs ``[R, H, D]``, float32 or float64 (float16/bfloat16 accepted,
            accumulated in float32); any strides (rows may be strided views of a wider row).
        src_lse: partial LSEs ``[R, H]``, floating; ``-inf`` for partials that weigh nothing.
        dst_o: ``[R', H, D]``, any floating dtype (written cast to it); dst_lse: ``[R', H]``.
        src_rows: the ``n * p`` source rows, row-major (destination row ``i``'s partials are
            ``src_rows[i * p:(i + 1) * p]``): a slice or a 1-D int32/int64 tensor on the
            device, each index in ``[0, R)`` (not checked).
        dst_rows: the ``n`` destination rows: a slice or an index tensor, in ``[0, R')``.
        n, p: destination rows and partials per row.

    Raises:
        RuntimeError: Triton is not importable, or the tensors are not on CUDA and the
            interpreter is off (see :func:`triton_available`).
        ValueError: shapes, devices or row counts that do not match.
    """
    dev = src_o.device
    if not triton_available(dev):
        raise RuntimeError(f"merge_lse_triton: Triton is not available for {dev} "
                           "(needs the triton package and a CUDA device, or TRITON_INTERPRET=1)")
    if src_o.dim() != 3 or dst_o.dim() != 3 or src_lse.dim() != 2 or dst_lse.dim() != 2:
        raise ValueError("merge_lse_triton: expected o [rows, H, D] and lse [rows, H], got "
                         f"{list(src_o.shape)}, {list(src_lse.shape)}, {list(dst_o.shape)}, {list(dst_lse.shape)}")
    _, H, D = src_o.shape
    if tuple(dst_o.shape[1:]) != (H, D) or src_lse.shape != (src_o.shape[0], H) or dst_lse.shape != (dst_o.shape[0], H):
        raise ValueError(f"merge_lse_triton: mismatched shapes {list(src_o.shape)}, {list(src_lse.shape)}, "
                         f"{list(dst_o.shape)}, {list(dst_lse.shape)}")
    if any(t.device != dev for t in (src_lse, dst_o, dst_lse)):
        raise ValueError("merge_lse_triton: all tensors must be on one device")
    if n == 0:
        return
    src_start, src_idx, dst_start, dst_idx = partial_rows("merge_lse_triton", src_rows, dst_rows, n, p,
                                                          src_o.shape[0], dst_o.shape[0], dev)
    args = (src_o, src_lse, dst_o, dst_lse, src_idx, dst_idx, src_start, dst_start, n, p)
    if not torch.compiler.is_compiling() and _plain(src_o, src_lse, dst_o, dst_lse):
        _launch(*args, wrap=False)  # what the operator runs here, without its Python dispatch (~60 us)
    else:
        torch.ops.torch_dcp.merge_lse(*args)
