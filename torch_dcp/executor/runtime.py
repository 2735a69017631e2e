"""Which executor runs a :class:`~torch_dcp.plan.Plan`, by its placement's runtime
(:class:`~torch_dcp.planners.base.Runtime`): one table for a plan's own executor
(:func:`~torch_dcp.executor.make.make_executor`) and a head-parallel plan's outer one
(:class:`~torch_dcp.executor.heads.HeadParallelExecutor`)."""

from __future__ import annotations

from ..plan import Plan
from ..planners.base import Runtime
from .allgather import AllGatherExecutor
from .allgather_node import NodeAllGatherExecutor
from .executor import RankExecutor
from .ring import RingExecutor

__all__ = ["RUNTIME_EXECUTORS", "plan_executor"]

#: a static family's runtime -> the executor that runs a :class:`Plan` of it as its authors do
#: (a runtime not listed runs on torch_dcp's executor)
RUNTIME_EXECUTORS: dict[Runtime, type] = {Runtime.ALLGATHER: AllGatherExecutor,
                                          Runtime.DCP_ALLGATHER: AllGatherExecutor,
                                          Runtime.DCP_NODE_ALLGATHER: NodeAllGatherExecutor,
                                          Runtime.TE_RING: RingExecutor,
                                          Runtime.DCP_RING: RingExecutor}


def plan_executor(plan: Plan) -> type:
    """The executor class of ``plan`` (same constructor arguments as
    :class:`~torch_dcp.executor.executor.RankExecutor`)."""
    return RUNTIME_EXECUTORS.get(plan.placement.runtime, RankExecutor)
