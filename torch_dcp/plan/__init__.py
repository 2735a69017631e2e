"""The plan: per-rank programs of one DCP attention step.

* :mod:`.ir` -- the five instructions, :class:`Program`, the instruction table;
* :mod:`.plan` -- :class:`Plan` (placement + divisions, statistics);
* :mod:`.compiler` -- placement and divisions to programs;
* :mod:`.validator` -- the symbolic check of every rank's programs;
* :mod:`.serialize` -- bytes and digests.
"""

from ..workload import Buf, item_token_bytes
from .ir import (
    HANDLERS,
    BlockwiseAttention,
    BlockwiseCopy,
    BlockwiseReduction,
    CommLaunch,
    CommWait,
    Instruction,
    PlanError,
    Program,
    ReduceOp,
    Transfer,
    dispatch,
)
from .plan import Plan
from .heads import HeadParallelPlan, load_plan

__all__ = [
    "Plan",
    "HeadParallelPlan",
    "load_plan",
    "Program",
    "Transfer",
    "BlockwiseCopy",
    "CommLaunch",
    "CommWait",
    "BlockwiseAttention",
    "BlockwiseReduction",
    "Instruction",
    "ReduceOp",
    "Buf",
    "HANDLERS",
    "dispatch",
    "PlanError",
    "item_token_bytes",
]
