"""``kernel="auto"``: a fast kernel where a division's mask suits it, a general one elsewhere,
chosen per division when the device plan is built (which kernels :func:`get_kernel
<torch_dcp.executor.kernels.get_kernel>` pairs is the registry's choice)."""

from __future__ import annotations

from typing import Any

import torch

from ..division import Division
from .base import DivisionKernel, KernelLayout

__all__ = ["AutoKernel"]


class AutoKernel:
    """The kernel chosen per division: ``fast`` (the varlen fast path,
    :class:`~torch_dcp.executor.kernels.varlen.VarlenKernel`) where the division's mask is a few flash
    windows, ``general`` elsewhere. Each division's choice is made once, when the device plan
    is built.

    Args:
        general: the kernel for divisions the fast path cannot express (any mask).
        fast: a kernel with ``try_prepare(div, min_rows) -> KernelLayout | None``, or None
            (always ``general``): :class:`~torch_dcp.executor.kernels.varlen.VarlenKernel` or
            :class:`~torch_dcp.executor.kernels.flash_attn.FlashAttnKernel`.
        min_rows: the fast path only where its segments average at least this many query rows.
        name: the kernel's name (``"auto"``; ``"flash_attn"`` for :func:`get_kernel`'s
            ``"flash_attn"``).
    """

    def __init__(self, general: DivisionKernel, fast: Any = None, min_rows: int = 32, name: str = "auto"):
        self.general, self.fast, self.min_rows, self.name = general, fast, int(min_rows), name
        self._by_name = {k.name: k for k in (general, fast) if k is not None}

    def prepare(self, div: Division) -> KernelLayout:
        layout = self.fast.try_prepare(div, self.min_rows) if self.fast is not None else None
        kern = self.fast if layout is not None else self.general
        if layout is None:
            layout = self.general.prepare(div)
        return layout._replace(static=(kern.name, layout.static))

    def bind(self, arrays: dict[str, torch.Tensor], static: Any) -> tuple[DivisionKernel, Any]:
        name, inner = static
        kern = self._by_name[name]
        return kern, kern.bind(arrays, inner)

    def forward(self, q, k, v, meta, scale, acc_dtype):
        kern, inner = meta
        return kern.forward(q, k, v, inner, scale, acc_dtype)

    def backward(self, q, k, v, do, lse, delta, meta, scale, acc_dtype):
        kern, inner = meta
        return kern.backward(q, k, v, do, lse, delta, inner, scale, acc_dtype)
