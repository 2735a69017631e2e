"""The executor of a plan, by the plan's type: one table for every caller (``emulate``, the
context manager, the planning loader)."""

from __future__ import annotations

from typing import Any

from ..plan import Plan
from ..plan.heads import HeadParallelPlan
from .executor import RankExecutor
from .heads import HeadParallelExecutor
from .runtime import RUNTIME_EXECUTORS, plan_executor
from .transport import Transport

__all__ = ["EXECUTORS", "RUNTIME_EXECUTORS", "make_executor"]

#: plan type -> executor class (same constructor arguments)
EXECUTORS: dict[type, type] = {Plan: RankExecutor, HeadParallelPlan: HeadParallelExecutor}


def make_executor(plan: "Plan | HeadParallelPlan", rank: int, transport: Transport, **options: Any) -> Any:
    """The executor of ``rank`` for ``plan`` (``options``: the executor's keyword arguments:
    ``kernel``, ``scale``, ``timings``, ``device_plan``).

    Raises:
        TypeError: ``plan`` is no plan.
    """
    try:
        cls = plan_executor(plan) if type(plan) is Plan else EXECUTORS[type(plan)]
    except KeyError:
        raise TypeError(f"no executor for {type(plan).__name__}; expected one of {[c.__name__ for c in EXECUTORS]}") from None
    return cls(plan, rank, transport, **options)
