"""Timing a rank's instructions (``timings=True`` on an executor): CUDA events on CUDA, the wall
clock around a synchronised region elsewhere."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

__all__ = ["InstructionTime"]


class InstructionTime(NamedTuple):
    """Measured compute time of one instruction of a rank's program.

    Attributes:
        division: the division it belongs to (that of the latest ``BlockwiseAttention``; copies
            before the first one count for the first division).
        kind: ``"copy"`` (BlockwiseCopy), ``"pack"`` (gathering a CommLaunch's messages),
            ``"attention"``, ``"unpack"`` (scattering a CommWait's messages, the wait itself not
            counted) or ``"reduction"``.
        seconds: elapsed device time (CUDA events on CUDA, ``time.perf_counter`` around a
            synchronised region elsewhere).
        backward: whether it is in the backward program.
    """

    division: int
    kind: str
    seconds: float
    backward: bool


class _Clock:
    """Times regions of device work: CUDA events on CUDA (resolved lazily), wall clock with a
    device synchronisation elsewhere."""

    def __init__(self):
        self._items: list[tuple[int, str, Any, Any, bool]] = []

    @staticmethod
    def _sync(device: torch.device) -> None:
        mod = getattr(torch, device.type, None)
        if device.type != "cpu" and mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()

    def start(self, device: torch.device) -> Any:
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        self._sync(device)
        return time.perf_counter()

    def stop(self, device: torch.device, token: Any, division: int, kind: str, backward: bool) -> None:
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._items.append((division, kind, token, ev, backward))
        else:
            self._sync(device)
            self._items.append((division, kind, token, time.perf_counter(), backward))

    def results(self) -> list[InstructionTime]:
        out = []
        for division, kind, a, b, backward in self._items:
            if isinstance(a, float):
                sec = b - a
            else:
                b.synchronize()
                sec = a.elapsed_time(b) / 1e3
            out.append(InstructionTime(division, kind, float(sec), backward))
        return out

    def clear(self) -> None:
        self._items.clear()
