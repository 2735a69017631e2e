"""``kernel="flash_attn"``: a division's varlen calls through the ``flash-attn`` package family.

The division is cut into flash-window segments exactly as for :class:`~torch_dcp.executor.kernels.varlen.VarlenKernel`
(:func:`~torch_dcp.executor.kernels.varlen.plan_segments`: ``cu_seqlens``, causal, sliding windows,
GQA native); each call then runs through whichever of these is importable and suits the inputs:

* **FlashAttention-4** (``pip install flash-attn-4``, module ``flash_attn.cute``), first, on
  compute capability 9.x-11.x (Hopper, Blackwell): ``_flash_attn_fwd`` with ``cu_seqlens_q/k``,
  ``window_size_left/right`` and ``return_lse=True``, ``_flash_attn_bwd`` given the output and
  the LSE;
* **FlashAttention-2** (``pip install flash-attn``, 2.7 or newer), on 8.0 or newer:
  ``torch.ops.flash_attn._flash_attn_varlen_forward`` / ``_backward`` (the package's own
  custom ops, which register fake implementations, so they trace under ``FakeTensorMode``);
* neither (another device or dtype, or the package absent for this call): the inherited path,
  aten's varlen flash or the reference math.

Both take what aten's flash takes: ``q [total_q, H, D]``, ``k, v [total_k, H_kv, D]`` (fp16 or
bf16), int32 ``cu_seqlens`` ``[S + 1]``, the LSE as ``[H, total_q]`` float32. The backward is
given the executor's *final* LSE and ``O' = dO * delta / |dO|^2`` in place of the output, whose
``rowsum(dO * O')`` is the ``delta`` the flash backward forms (no forward recomputation), as for
aten's varlen flash. Divisions whose mask is not a few flash windows fall back per division to
FlexAttention through :class:`~torch_dcp.executor.kernels.auto.AutoKernel`
(``get_kernel("flash_attn")``), which ``get_kernel("auto")`` prefers on CUDA whenever
:func:`flash_attn_backend` names a backend for the inputs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from importlib import metadata
from typing import Any

import torch

from .base import flash_backward_inputs
from .varlen import VarlenKernel, cuda_capability

__all__ = ["FlashAttnKernel", "flash_attn_backends", "flash_attn_backend", "flash_attn_versions",
           "FlashAttnUnavailable", "BACKENDS"]

#: the backends this kernel knows, in order of preference
BACKENDS: tuple[str, ...] = ("fa4", "fa2")
_MODULES = {"fa4": "flash_attn.cute.interface", "fa2": "flash_attn.flash_attn_interface"}
_PACKAGES = {"fa4": "flash-attn-4", "fa2": "flash-attn"}
_imported: dict[str, Any] = {}  # backend -> module, or the exception its import raised


class FlashAttnUnavailable(RuntimeError):
    """``kernel="flash_attn"`` (or a backend of it) was asked for where it cannot be imported."""


def flash_attn_versions() -> dict[str, str]:
    """Installed distributions of the family, ``{distribution: version}`` (read from the package
    metadata; nothing is imported; ``{}`` when none is installed)."""
    out = {}
    for dist in ("flash-attn", "flash-attn-4", "fa4"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def _module(backend: str) -> Any:
    """The backend's interface module, or the exception importing it raised (cached)."""
    if backend not in _imported:
        name = _MODULES[backend]
        try:
            if importlib.util.find_spec("flash_attn") is None:
                raise ModuleNotFoundError(f"No module named 'flash_attn' (pip install {_PACKAGES[backend]})")
            mod = importlib.import_module(name)
            if backend == "fa2" and not hasattr(getattr(torch.ops, "flash_attn", None), "_flash_attn_varlen_forward"):
                raise ImportError("flash_attn has no torch.ops.flash_attn._flash_attn_varlen_forward "
                                  "(flash-attn 2.7 or newer registers it)")
            if backend == "fa4":
                _check_fa4(mod)
            _imported[backend] = mod
        except Exception as e:  # ImportError, or an extension built for another torch/CUDA (OSError, ...)
            _imported[backend] = e
    return _imported[backend]


#: keyword arguments this kernel gives FlashAttention-4's forward and backward (varlen, windows, LSE)
_FA4_NEEDS = {"_flash_attn_fwd": {"cu_seqlens_q", "cu_seqlens_k", "window_size_left", "window_size_right",
                                  "return_lse", "softmax_scale", "causal"},
              "_flash_attn_bwd": {"cu_seqlens_q", "cu_seqlens_k", "window_size_left", "window_size_right"}}


def _check_fa4(mod: Any) -> None:
    """Raises ImportError when ``flash_attn.cute``'s forward or backward lacks an argument the
    kernel passes (versions before varlen backward and returned LSE)."""
    for fn, needs in _FA4_NEEDS.items():
        missing = needs - (_params(getattr(mod, fn)) if hasattr(mod, fn) else frozenset())
        if missing:
            raise ImportError(f"flash_attn.cute.interface.{fn} lacks {sorted(missing)}: this flash-attn-4 is too old "
                              "(upgrade: pip install -U flash-attn-4)")


@functools.lru_cache(maxsize=None)
def _params(fn: Any) -> frozenset:
    import inspect

    return frozenset(inspect.signature(fn).parameters)


def _fa4_seqlens(fn: Any, c: Any) -> dict[str, int]:
    """``max_seqlen_q/k`` where the installed FA4 takes them (newer versions do)."""
    return {k: v for k, v in (("max_seqlen_q", c.max_q), ("max_seqlen_k", c.max_k)) if k in _params(fn)}


def flash_attn_backends() -> tuple[str, ...]:
    """The backends that import here, in order of preference (``()`` without flash-attn)."""
    return tuple(b for b in BACKENDS if not isinstance(_module(b), Exception))


def _suits(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return False
    cap = cuda_capability(device)
    if cap is None:
        return False
    if backend == "fa4":
        return cap[0] == 9 or (cap[0] in (10, 11) and head_dim <= 128)
    return cap[0] >= 8


def flash_attn_backend(device: torch.device | str, dtype: torch.dtype, head_dim: int,
                       backends: tuple[str, ...] | None = None) -> str | None:
    """The backend that runs these inputs (``"fa4"`` or ``"fa2"``), or None: CUDA (the
    capability from :func:`~torch_dcp.executor.kernels.varlen.cuda_capability`: FA4 on 9.x, and on
    10.x/11.x for ``head_dim <= 128``; FA2 on 8.0 or newer), fp16/bf16, ``head_dim`` a multiple
    of 8 up to 256, among ``backends`` (default: :func:`flash_attn_backends`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    for b in flash_attn_backends() if backends is None else backends:
        if _suits(b, device, dtype, int(head_dim)):
            return b
    return None


class FlashAttnKernel(VarlenKernel):
    """The varlen fast path's calls through flash-attn (module docstring); the division
    protocol of :class:`~torch_dcp.executor.kernels.base.DivisionKernel`, ``try_prepare`` as
    :class:`~torch_dcp.executor.kernels.varlen.VarlenKernel`'s.

    Args:
        backend: ``"auto"`` (FA4 where it suits the inputs, else FA2), ``"fa4"`` or ``"fa2"``.
        max_calls: most varlen calls per division (as :class:`VarlenKernel`).

    Raises:
        ValueError: an unknown ``backend``.
        FlashAttnUnavailable: no backend (or not the one asked for) imports; the message names
            the package to install and the import error.
    """

    name = "flash_attn"

    def __init__(self, backend: str = "auto", max_calls: int = 4):
        if backend not in ("auto", *BACKENDS):
            raise ValueError(f"backend must be 'auto', 'fa4' or 'fa2', got {backend!r}")
        super().__init__(max_calls)
        wanted = BACKENDS if backend == "auto" else (backend,)
        self.backends = tuple(b for b in wanted if not isinstance(_module(b), Exception))
        if not self.backends:
            why = "; ".join(f"{_PACKAGES[b]} ({_MODULES[b]}): {_module(b)}" for b in wanted)
            raise FlashAttnUnavailable(
                f"kernel='flash_attn' needs the flash-attn package: pip install 'torch-dcp[flash]' (flash-attn>=2.7; "
                f"on Hopper/Blackwell also flash-attn-4). Not importable here: {why}")
        self._choice: dict[tuple, str | None] = {}

    def backend_for(self, q: torch.Tensor) -> str | None:
        """The backend that runs ``q``'s calls (cached per device, dtype and head_dim), or None
        (the inherited aten/reference path)."""
        key = (q.device, q.dtype, q.shape[-1])
        if key not in self._choice:
            self._choice[key] = flash_attn_backend(q.device, q.dtype, q.shape[-1], self.backends)
        return self._choice[key]

    def _flash(self, q: torch.Tensor) -> bool:
        return self.backend_for(q) is not None or super()._flash(q)

    def _call_forward(self, c, q, k, v, scale, acc):
        backend = self.backend_for(q)
        if backend is None:
            return super()._call_forward(c, q, k, v, scale, acc)
        q, k, v = self._dense(q), self._dense(k), self._dense(v)
        causal = c.wl < 0 and c.wr == 0
        if backend == "fa4":
            fwd = _module("fa4")._flash_attn_fwd
            res = fwd(q, k, v, cu_seqlens_q=c.cu_q, cu_seqlens_k=c.cu_k, softmax_scale=scale, causal=causal,
                      window_size_left=c.wl if c.wl >= 0 else None,
                      window_size_right=c.wr if c.wr >= 0 and not causal else None, return_lse=True,
                      **_fa4_seqlens(fwd, c))
            out, lse = res[0], res[1]
        else:
            out, lse, *_ = torch.ops.flash_attn._flash_attn_varlen_forward(
                q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0, scale, causal, c.wl, c.wr)
        return out, lse.t()  # [H, total_q] -> [total_q, H]

    def _call_backward(self, c, q, k, v, do, lse, delta, rng, scale, acc):
        backend = self.backend_for(q)
        if backend is None:
            return super()._call_backward(c, q, k, v, do, lse, delta, rng, scale, acc)
        q, k, v = self._dense(q), self._dense(k), self._dense(v)
        do = self._dense(do).to(q.dtype)
        out_like, lse_hq = flash_backward_inputs(do, delta, lse, acc, q.dtype)  # lse_hq: [H, total_q], the final LSE
        causal = c.wl < 0 and c.wr == 0
        if backend == "fa4":
            bwd = _module("fa4")._flash_attn_bwd
            dq, dk, dv = bwd(q, k, v, out_like, do, lse_hq, scale, causal,
                             window_size_left=c.wl if c.wl >= 0 else None,
                             window_size_right=c.wr if c.wr >= 0 and not causal else None, cu_seqlens_q=c.cu_q,
                             cu_seqlens_k=c.cu_k, **_fa4_seqlens(bwd, c))[:3]
            return dq, dk, dv
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flash_attn._flash_attn_varlen_backward(
            do, q, k, v, out_like, lse_hq, dq, dk, dv, c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0, scale, causal, c.wl,
            c.wr, 0.0, None, False, None)
        return dq, dk, dv
