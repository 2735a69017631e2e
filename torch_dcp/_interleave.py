"""Round-robin driver for per-rank generators that yield while blocked on communication.

Used wherever all ranks of a plan run in one process: the in-process executor and the
plan validator's symbolic run.
"""

from __future__ import annotations

from typing import Callable, Generator, Sequence

__all__ = ["interleave"]


def interleave(gens: Sequence[Generator], progress: Callable[[], int]) -> list:
    """Run generators round-robin until all return; returns their return values.

    A generator yields when it cannot go on (waiting for messages). ``progress()`` returns
    a counter that grows whenever any generator posts something others may wait for.

    Raises:
        RuntimeError: a full round in which no generator finished and ``progress()`` did not
            change (a deadlock: some rank waits for a message nobody sends).
    """
    results: list = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        before = progress()
        still = []
        finished = False
        for i in live:
            try:
                next(gens[i])
                still.append(i)
            except StopIteration as stop:
                results[i] = stop.value
                finished = True
        if still and not finished and progress() == before:
            raise RuntimeError(f"deadlock: ranks {still} wait for messages that no rank sends")
        live = still
    return results
