"""dK/dV partials on the wire in the K/V dtype.

The executor adds dK and dV up in the accumulation dtype (float32 for bfloat16 or float16
inputs), but a partial that leaves the rank travels in the K/V dtype, as TransformerEngine's
context parallelism sends its ``dkv`` buffers (and as torch_dcp's all-gather and ring runtimes
do): half the bytes of the returns that end the backward. With torch alone (the CPU), a phase's
dK/dV sends are cast in one operation (their rows taken in message order, sliced where they follow one another, else
gathered: :class:`~torch_dcp.executor.device_plan.LaunchStep` ``narrow``); a receive lands in a
buffer of the K/V dtype and is cast into its accumulator rows once its phase completes (one
operation per run of contiguous rows: a phase's receives, which the compiler lays out side by
side). The receiver adds the partials in the accumulation dtype, so each partial is rounded once,
to the inputs' own precision.

On CUDA with Triton the received partials are not cast at all: a pass's receives fill one run of
rows (the compiler lays them side by side), kept in a buffer of the K/V dtype (:func:`keeps_wire`),
and what reads those rows reads them there, in one launch that converts as it reads
(:func:`~torch_dcp.executor.triton_sum.sum_rows_triton` with its ``wire`` rows): the sums of
partials (a reducer's, the home's) and the sends (:func:`wire_send`: a phase's dK/dV sends
gathered and cast in one launch, a relay's received partial passed on as it came). Where the
inputs are in the accumulation dtype (float32, float64) nothing is cast: the bytes on the wire
are the accumulator's own.

:func:`~torch_dcp.workload.item_token_bytes` counts these bytes; the simulator and the planner
see them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..workload import Buf
from .reduce import take_rows, triton_runs_on

__all__ = ["NARROWED", "narrowed", "narrow_send", "narrow_receives", "keeps_wire", "wire_send", "wire_sends",
           "wire_receives"]

#: the transfer kind that travels in the K/V dtype rather than in the accumulation dtype
NARROWED = frozenset({Buf.DKV})


def narrowed(kind: Buf, acc: torch.dtype, wire: torch.dtype) -> bool:
    """Whether messages of ``kind`` are cast from the accumulation dtype ``acc`` to ``wire``."""
    return kind in NARROWED and wire != acc


def narrow_send(words: torch.Tensor, acc: torch.dtype, wire: torch.dtype) -> torch.Tensor:
    """Accumulator rows ``words`` (int64 ``[rows, W]``, every row's fields in ``acc`` filling
    it) cast to the ``wire`` dtype, ``[rows, F]``: the dK/dV sends of a phase in one operation
    (each message a run of its rows, ``.reshape(-1).view(torch.uint8)``)."""
    return words.view(acc).to(wire)


def narrow_receives(rows: Sequence[slice], flat: torch.Tensor, wire: torch.dtype
                    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Buffers for receives into contiguous ``rows`` of ``flat`` (the accumulator, typed
    ``[rows, F]``), in the ``wire`` dtype: one uint8 message buffer per receive, and the casts
    that put them in place once they have arrived, ``(destination, source)`` (``destination.copy_``
    each; one per run of receives whose rows follow one another)."""
    messages, casts = [], []
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and rows[j].start == rows[j - 1].stop:
            j += 1
        start, stop = rows[i].start, rows[j - 1].stop
        staging = torch.empty(stop - start, flat.shape[1], dtype=wire, device=flat.device)
        messages += [staging[r.start - start:r.stop - start].reshape(-1).view(torch.uint8) for r in rows[i:j]]
        casts.append((flat[start:stop], staging))
        i = j
    return messages, casts


def keeps_wire(t: torch.Tensor) -> bool:
    """Whether the dK/dV partials received into ``t``'s buffer stay in the K/V dtype where they
    land, read as such by the sums and sends (one Triton launch each), rather than cast into
    their accumulator rows: on CUDA with Triton (:func:`~torch_dcp.executor.reduce.triton_runs_on`)."""
    return triton_runs_on(t)


def wire_send(flat: torch.Tensor, rows: slice | torch.Tensor, wire: torch.Tensor, wire_start: int) -> torch.Tensor:
    """The rows ``rows`` of the accumulator ``flat`` (``[R, F]``) in ``wire``'s dtype, ``[n, F]``,
    in one launch: rows ``wire_start .. wire_start + len(wire) - 1`` are read from ``wire``
    (received partials kept in the K/V dtype, passed on unchanged), the others cast.

    Raises:
        RuntimeError: Triton is not available for ``flat``'s device.
    """
    from .triton_sum import sum_rows_triton

    n = len(range(flat.shape[0])[rows]) if isinstance(rows, slice) else int(rows.numel())
    out = torch.empty(n, flat.shape[1], dtype=wire.dtype, device=flat.device)
    sum_rows_triton(flat, out, rows, slice(0, n), n, 1, wire=wire, wire_start=wire_start)
    return out


def wire_sends(buf: Any, rows: slice | torch.Tensor, acc: torch.dtype, wire: torch.dtype) -> torch.Tensor:
    """A phase's dK/dV sends, ``[n, F]`` in ``wire``: the rows ``rows`` of the executor's dK/dV
    buffer ``buf`` (``words``, ``flat``, and ``wire``: its received rows kept in the K/V dtype and
    their first row, or None), in one launch where rows are kept (:func:`wire_send`), else
    gathered and cast (:func:`narrow_send`)."""
    if buf.wire is None:
        return narrow_send(take_rows(buf.words, rows), acc, wire)
    kept, start = buf.wire
    return wire_send(buf.flat, rows, kept.flat, start)


def wire_receives(buf: Any, rows: Sequence[slice], wire: torch.dtype
                  ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Message buffers (uint8) for receives in the K/V dtype into contiguous ``rows`` of the
    executor's dK/dV buffer ``buf``, and the casts that put them in its accumulator rows once
    they have arrived: none where its received rows are kept in the K/V dtype (``buf.wire``),
    else :func:`narrow_receives`'s."""
    if buf.wire is None:
        return narrow_receives(rows, buf.flat, wire)
    kept, start = buf.wire
    return [kept.message(slice(r.start - start, r.stop - start)) for r in rows], []
