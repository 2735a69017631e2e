"""Padded rows: an executor whose calls carry a fixed number of rows, this rank's tokens first.

Pipeline parallelism (``torch.distributed.pipelining``) fixes the shape of the activations a
stage sends to the next at its first step, but a DCP plan gives a rank a different number of
tokens in every microbatch. :class:`PaddedRows` lets every SDPA call carry a fixed ``rows``
(the run's token capacity per rank): the first ``n`` rows are this rank's tokens of the plan
(``plan.local_tokens(rank)``) and go to the wrapped executor; the rest are padding, whose
outputs and gradients are zero (so a padding row never reaches a real row, and with its label
ignored it adds nothing to the loss or to any gradient).

A rank that a plan gives no tokens may run its model on :data:`PLACEHOLDER_ROWS` placeholder
token instead of none (:class:`PlaceholderRows`): a model whose layers cannot run an empty
sequence (``view(b, 0, -1, head_dim)``) then runs as on every other rank, the placeholder's
attention output and gradients are zero, and the rank still takes part in every transfer.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PaddedRows", "PlaceholderRows", "check_capacity", "PLACEHOLDER_ROWS"]

#: rows a rank holding no tokens of the plan may feed its model in their place (:class:`PlaceholderRows`)
PLACEHOLDER_ROWS = 1


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t [n, ...]`` followed by zero rows up to ``[rows, ...]``."""
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def check_capacity(plan: Any, capacity: Any, what: str) -> None:
    """Raise ``ValueError`` (naming ``what``) unless ``capacity`` is an integer holding every
    rank's tokens of ``plan`` (the same answer on every rank: they hold the same plan)."""
    most = max(plan.local_tokens(r) for r in range(plan.world_size))
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < most:
        raise ValueError(f"{what}={capacity!r}, but the plan puts up to {most} tokens on a rank (raise the token "
                         "capacity)")


class PaddedRows:
    """The executor interface (``forward``, ``forward_keeping``, ``backward``) over calls of
    ``rows`` rows whose first ``executor``'s local tokens are real (see the module).

    Args:
        executor: a rank executor (or a :class:`~torch_dcp.executor.replay.LayerReplay`) whose
            calls take ``tokens`` rows.
        tokens: this rank's tokens in the plan.
        rows: rows of every call (``>= tokens``).

    Raises:
        ValueError: ``rows < tokens``; in a call, inputs without ``rows`` rows.
    """

    def __init__(self, executor: Any, tokens: int, rows: int):
        if rows < tokens:
            raise ValueError(f"padded rows: the plan puts {tokens} tokens on this rank, more than the {rows} rows "
                             "every call carries (raise the token capacity)")
        self.executor, self.tokens, self.rows = executor, int(tokens), int(rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["executor"], name)

    def _real(self, *tensors: torch.Tensor | None) -> tuple:
        for t in tensors:
            if t is not None and t.shape[0] != self.rows:
                raise ValueError(f"torch_dcp: attention inputs have {t.shape[0]} rows, every call of this context "
                                 f"carries {self.rows} (this rank's {self.tokens} tokens, then padding)")
        return tuple(None if t is None else t[: self.tokens] for t in tensors)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
        """``(out [rows, H, D], lse [rows, H])``, zero on the padding rows."""
        out, lse = self.executor.forward(*self._real(q, k, v), scale)
        return _pad(out, self.rows), _pad(lse, self.rows)

    def forward_keeping(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
        """``(out, lse, state)``: :meth:`forward` and the wrapped executor's state."""
        out, lse, state = self.executor.forward_keeping(*self._real(q, k, v), scale)
        return _pad(out, self.rows), _pad(lse, self.rows), state

    def backward(self, q, k, v, out, lse, dout, scale: float | None = None, state: torch.Tensor | None = None):
        """``(dq, dk, dv)`` over ``rows`` rows, zero on the padding rows."""
        dq, dk, dv = self.executor.backward(*self._real(q, k, v, out, lse, dout), scale, state)
        return _pad(dq, self.rows), _pad(dk, self.rows), _pad(dv, self.rows)


class PlaceholderRows:
    """The executor interface of a rank that holds no tokens of the plan: a call of no rows runs
    the wrapped executor as it is; a call of :data:`PLACEHOLDER_ROWS` rows (a placeholder token the
    model runs because it cannot run an empty sequence) runs it on no rows, the placeholder's
    output and gradients zero (:class:`PaddedRows`). Either way the rank's transfers run.

    Args:
        executor: a rank executor (or a :class:`~torch_dcp.executor.replay.LayerReplay`) whose
            rank holds no tokens.
    """

    def __init__(self, executor: Any):
        self.executor, self.padded = executor, PaddedRows(executor, 0, PLACEHOLDER_ROWS)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["executor"], name)

    def _runner(self, q: torch.Tensor) -> Any:
        return self.executor if q.shape[0] == 0 else self.padded

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
        """``(out, lse)`` with ``q``'s rows (zero for a placeholder)."""
        return self._runner(q).forward(q, k, v, scale)

    def forward_keeping(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
        """``(out, lse, state)``: :meth:`forward` and the wrapped executor's state."""
        return self._runner(q).forward_keeping(q, k, v, scale)

    def backward(self, q, k, v, out, lse, dout, scale: float | None = None, state: torch.Tensor | None = None):
        """``(dq, dk, dv)`` with ``q``'s rows (zero for a placeholder)."""
        return self._runner(q).backward(q, k, v, out, lse, dout, scale, state)
