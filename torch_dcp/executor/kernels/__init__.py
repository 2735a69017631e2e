"""The kernel registry: every kernel by name (:func:`get_kernel`, :data:`KERNEL_NAMES`) and the
automatic choice per device, dtype and head size.

The kernels live one per module beside it -- :mod:`.base` (the division protocol,
:class:`KernelLayout`, the per-group :class:`ReferenceKernel`), :mod:`.sdpa`, :mod:`.flex`,
:mod:`.varlen`, :mod:`.flash_attn` (built on varlen's segments) and :mod:`.auto` (a kernel per
division) -- and import the registry nowhere: it imports them.
"""

from __future__ import annotations

import torch

from .auto import AutoKernel
from .base import DivisionKernel, GroupKernel, KernelLayout, ReferenceKernel, out_with_delta
from .flash_attn import FlashAttnKernel, FlashAttnUnavailable, flash_attn_backend
from .sdpa import SDPAKernel
from .varlen import VarlenKernel, flash_varlen_available

__all__ = ["KernelLayout", "DivisionKernel", "GroupKernel", "ReferenceKernel", "SDPAKernel", "FlexKernel",
           "VarlenKernel", "FlashAttnKernel", "FlashAttnUnavailable", "AutoKernel", "get_kernel", "KERNEL_NAMES",
           "out_with_delta"]


#: varlen calls a division may take on the automatic kernels' fast path: one launch per division
#: (a division whose mask needs two flash windows, λ's sink and band, runs one FlexAttention
#: launch instead); ``kernel="varlen"`` alone keeps up to 4
AUTO_VARLEN_CALLS = 1


def __getattr__(name: str):
    """:class:`~torch_dcp.executor.kernels.flex.FlexKernel` and ``flex_available``, imported at
    first use: FlexAttention imports ``torch._dynamo`` (over a second of ``import torch_dcp``),
    which a planning worker or a CLI never needs."""
    if name in ("FlexKernel", "flex_available"):
        from . import flex

        return getattr(flex, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _flex_kernel() -> DivisionKernel:
    from .flex import FlexKernel

    return FlexKernel()


def _general_kernel() -> DivisionKernel:
    from .flex import FlexKernel, flex_available

    return FlexKernel() if flex_available() else ReferenceKernel()


def _flash_attn_kernel() -> AutoKernel:
    """flash-attn's varlen calls per division, FlexAttention where a division's mask is not a few
    flash windows (raises :class:`~torch_dcp.executor.kernels.flash_attn.FlashAttnUnavailable` without
    the package)."""
    return AutoKernel(_general_kernel(), FlashAttnKernel(max_calls=AUTO_VARLEN_CALLS), name="flash_attn")


_KERNELS = {"reference": ReferenceKernel, "sdpa": SDPAKernel, "flex": _flex_kernel, "varlen": VarlenKernel,
            "flash_attn": _flash_attn_kernel}

#: Every kernel name :func:`get_kernel` accepts.
KERNEL_NAMES: tuple[str, ...] = ("auto", *sorted(_KERNELS))


def get_kernel(kernel: "str | DivisionKernel | None", device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, head_dim: int | None = None) -> DivisionKernel:
    """A kernel by name, an instance as is, or the automatic choice.

    Names: ``"reference"`` (:class:`ReferenceKernel`), ``"sdpa"``
    (:class:`~torch_dcp.executor.kernels.sdpa.SDPAKernel`), ``"flex"``
    (:class:`~torch_dcp.executor.kernels.flex.FlexKernel`), ``"varlen"``
    (:class:`~torch_dcp.executor.kernels.varlen.VarlenKernel`; raises at plan time on masks it
    cannot express), ``"flash_attn"`` (an :class:`AutoKernel` named ``flash_attn``: one varlen call
    through the flash-attn package, :class:`~torch_dcp.executor.kernels.flash_attn.FlashAttnKernel`,
    FlexAttention for divisions one call cannot express), ``"auto"`` (same as None): on a CUDA
    ``device``, an :class:`AutoKernel` choosing per division between one varlen flash call (when
    ``dtype``/``head_dim`` suit a flash kernel: fp16/bf16, ``head_dim`` a multiple of 8 up to
    256; through flash-attn where it is installed and suits the GPU, else aten's) and
    FlexAttention (when this torch has it; else the reference kernel); on CPU, or with no
    device given, the fused SDPA kernel.

    Raises:
        ValueError: unknown kernel name.
        RuntimeError: ``"flex"`` on a torch without FlexAttention;
            :class:`~torch_dcp.executor.kernels.flash_attn.FlashAttnUnavailable` (a ``RuntimeError``):
            ``"flash_attn"`` without the flash-attn package.
    """
    if kernel is None or kernel == "auto":
        if device is None or torch.device(device).type != "cuda":
            return SDPAKernel()
        fast = None
        if dtype is not None and head_dim is not None:
            if flash_attn_backend(device, dtype, head_dim) is not None:
                fast = FlashAttnKernel(max_calls=AUTO_VARLEN_CALLS)
            elif flash_varlen_available(device, dtype, head_dim):
                fast = VarlenKernel(max_calls=AUTO_VARLEN_CALLS)
        return AutoKernel(_general_kernel(), fast)
    if isinstance(kernel, str):
        try:
            factory = _KERNELS[kernel]
        except KeyError:
            raise ValueError(f"unknown kernel {kernel!r}; available: {sorted(_KERNELS) + ['auto']}") from None
        return factory()
    return kernel
