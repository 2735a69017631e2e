"""What the runtimes of the static families share (torch_dcp's all-gather and ring runtimes,
:mod:`torch_dcp.executor.allgather`, :mod:`torch_dcp.executor.ring`): the public API of an
executor over their pass generators."""

from __future__ import annotations

import torch

from .executor import InstructionTime, RowChecks, _Clock, _drain, dcp_attention

__all__ = ["StaticRuntime"]


class StaticRuntime(RowChecks):
    """The public API of a static family's runtime (torch_dcp's all-gather and ring runtimes)
    over its generators ``forward_steps(q, k, v, scale, keep)`` and ``backward_steps(q, k, v,
    out, lse, dout, scale, state)``, which yield while a transfer is not complete; the same calls
    as :class:`~torch_dcp.executor.executor.RankExecutor`. Its forward keeps no state (the backward moves K and V again)."""

    _clock: "_Clock"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward attention of this rank's tokens (as :meth:`~torch_dcp.executor.executor.RankExecutor.forward`): ``(out
        [S_local, H, D], lse [S_local, H])``.

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
