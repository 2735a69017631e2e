"""What the runtimes of the static families share (torch_dcp's all-gather and ring runtimes,
:mod:`torch_dcp.executor.allgather`, :mod:`torch_dcp.executor.ring`): their kernel choice, one
attention call of a rank's tiles built and uploaded once, its timing, and the public API of an
executor over their pass generators."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from ..plan import BlockwiseAttention
from .device_plan import host_to_device, rows_on
from .division import build_division
from .executor import RowChecks, _drain, dcp_attention
from .timing import InstructionTime, _Clock
from .kernels import DivisionKernel, get_kernel
from .kernels.base import kernel_rows

__all__ = ["StaticRuntime", "KernelCall"]


class KernelCall(NamedTuple):
    """One attention call on a device: the kernel's packed query and key/value rows (slices or
    index tensors), the rows of its results, the same rows on the host, and its bound metadata."""

    q: Any  # packed query rows of the local tensors (kernel order, padding included)
    kv: Any  # packed key/value rows of the key/value buffer (kernel order, padding included)
    out: Any  # local rows of the kernel's query results
    q_rows: np.ndarray  # the same, on the host
    kv_rows: np.ndarray  # key/value buffer rows of the kernel's dK/dV results, on the host
    meta: Any


class StaticRuntime(RowChecks):
    """The public API of a static family's runtime (torch_dcp's all-gather and ring runtimes)
    over its generators ``forward_steps(q, k, v, scale, keep)`` and ``backward_steps(q, k, v,
    out, lse, dout, scale, state)``, which yield while a transfer is not complete; the same calls
    as :class:`~torch_dcp.executor.executor.RankExecutor`. Its forward keeps no state (the
    backward moves K and V again)."""

    _clock: "_Clock"
    row: np.ndarray  # every block's first row in the runtime's key/value layout
    kernel: "DivisionKernel | None"

    def _init_runtime(self, kernel: "str | DivisionKernel | None", timings: bool) -> None:
        """The kernel (chosen per device at :meth:`_choose_kernel` when ``None`` or ``"auto"``)
        and the timing clock."""
        self._kernel_spec = kernel
        self.kernel = None if kernel is None or kernel == "auto" else get_kernel(kernel)
        self.device_plan = None
        self.record_timings = bool(timings)
        self._clock = _Clock()
        self._device: torch.device | None = None

    def _choose_kernel(self, device: torch.device) -> None:
        """The automatic kernel for ``device`` (again only when the device type changes)."""
        if self._kernel_spec in (None, "auto") and (self._device is None or self._device.type != device.type):
            self.kernel = get_kernel(self._kernel_spec, device=device, dtype=self.dtype,
                                     head_dim=self.plan.batch.head_dim)

    def _instruction(self, tiles: np.ndarray, q_offset: int, kv_offset: int,
                     kv_row: np.ndarray | None = None) -> BlockwiseAttention | None:
        """``tiles`` (on this rank) as one attention call: query rows ``row - q_offset`` of the
        local tensors, key/value rows ``kv_row - kv_offset`` of the key/value buffer (``kv_row``:
        every block's first row there; default :attr:`row`) (None: no tiles)."""
        if tiles.size == 0:
            return None
        wl = self.plan.workload
        tiles = tiles[np.lexsort((wl.tile_kv[tiles], wl.tile_q[tiles]))]
        q_block, counts = np.unique(wl.tile_q[tiles], return_counts=True)
        local = self.row[q_block] - q_offset
        kv_block = wl.tile_kv[tiles]
        kv_row = self.row if kv_row is None else kv_row
        return BlockwiseAttention(0, q_block, local, local, np.concatenate(([0], np.cumsum(counts))).astype(np.int64),
                                  kv_block, kv_row[kv_block] - kv_offset, tiles)

    def _kernel_call(self, ins: BlockwiseAttention, device: torch.device) -> KernelCall:
        """``ins`` laid out by the kernel, its rows and metadata built on the host and uploaded
        once."""
        div = build_division(ins, self.plan.workload)
        lay = self.kernel.prepare(div)
        q_rows, kv_rows, q_idx, kv_idx = kernel_rows(div, lay)
        arrays = {k: host_to_device(torch.from_numpy(np.ascontiguousarray(a)), device) for k, a in lay.arrays.items()}
        return KernelCall(rows_on(q_idx, device), rows_on(kv_idx, device), rows_on(q_rows, device), q_rows, kv_rows,
                          self.kernel.bind(arrays, lay.static))

    def _timed(self, division: int, backward: bool, fn: Any) -> Any:
        """``fn()``, its attention time recorded as ``division``'s where timings are asked for."""
        if not self.record_timings:
            return fn()
        t0 = self._clock.start(self._device)
        out = fn()
        self._clock.stop(self._device, t0, division, "attention", backward)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward attention of this rank's tokens (as
        :meth:`~torch_dcp.executor.executor.RankExecutor.forward`): ``(out [S_local, H, D],
        lse [S_local, H])``.

        Raises:
            ValueError: inputs that do not match the plan and this rank (the message names what).
            TransferError: a transfer or collective failed or timed out (:class:`TransferTimeoutError`).
        """
        return _drain(self.forward_steps(q, k, v, scale))

    def forward_keeping(self, q, k, v, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` plus an empty state."""
        return _drain(self.forward_steps(q, k, v, scale, keep=True))

    def state_nbytes(self, kv_heads: int, every_rank: bool = False) -> int:
        """Bytes of :meth:`forward_keeping`'s state: 0."""
        return 0

    def backward(self, q, k, v, out, lse, dout, scale: float | None = None,
                 state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Complete gradients of this rank's Q, K, V (``(dq, dk, dv)`` in the input dtype).

        Raises:
            ValueError: as :meth:`forward`, for ``q, k, v, out, dout``, or a bad ``lse``.
            TransferError: a transfer or collective failed or timed out.
        """
        return _drain(self.backward_steps(q, k, v, out, lse, dout, scale, state))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Differentiable forward (:func:`~torch_dcp.executor.executor.dcp_attention`)."""
        return dcp_attention(q, k, v, self)

    @property
    def timings(self) -> list[InstructionTime]:
        """The attention calls' times recorded with ``timings=True``."""
        return self._clock.results()

    def reset_timings(self) -> None:
        """Forget the recorded timings."""
        self._clock.clear()
