"""The executor of a plan, by the plan's type: one table for every caller (``emulate``, the
context manager, the planning loader)."""

from __future__ import annotations

from typing import Any

from ..plan import Plan
from ..plan.heads import HeadParallelPlan
from ..planners.base import Runtime
from .allgather import AllGatherExecutor
from .executor import RankExecutor
from .heads import HeadParallelExecutor
from .transport import Transport

__all__ = ["EXECUTORS", "RUNTIME_EXECUTORS", "make_executor"]

#: plan type -> executor class (same constructor arguments)
EXECUTORS: dict[type, type] = {Plan: RankExecutor, HeadParallelPlan: HeadParallelExecutor}
#: a static family's runtime -> the executor that runs a :class:`Plan` of it as its authors do
#: (a runtime not listed runs on the plan type's executor)
RUNTIME_EXECUTORS: dict[Runtime, type] = {Runtime.ALLGATHER: AllGatherExecutor,
                                          Runtime.DCP_ALLGATHER: AllGatherExecutor}


def make_executor(plan: "Plan | HeadParallelPlan", rank: int, transport: Transport, **options: Any) -> Any:
    """The executor of ``rank`` for ``plan`` (``options``: the executor's keyword arguments:
    ``kernel``, ``scale``, ``timings``, ``device_plan``).

    Raises:
        TypeError: ``plan`` is no plan.
    """
    try:
        cls = RUNTIME_EXECUTORS.get(plan.placement.runtime) if type(plan) is Plan else None
        cls = cls or EXECUTORS[type(plan)]
    except KeyError:
        raise TypeError(f"no executor for {type(plan).__name__}; expected one of {[c.__name__ for c in EXECUTORS]}") from None
    return cls(plan, rank, transport, **options)
