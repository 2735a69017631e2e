"""torch_dcp: dynamic context parallelism for PyTorch training.

Each step, the documents of the global batch are cut into token blocks, only the attention
tiles the mask needs are kept, a planner places blocks and tiles on ranks, and an executor
runs every rank's part of the attention, forward and backward, exactly.

    >>> import torch_dcp
    >>> batch = torch_dcp.BatchSpec([4096, 512, 300], torch_dcp.masks.Causal(), n_heads=8, n_kv_heads=2, head_dim=128)
    >>> plan = torch_dcp.plan(batch, torch_dcp.Topology(n_nodes=1, ranks_per_node=4), planner="greedy", block_size=512)
    >>> plan.stats()["comm_bytes"]  # doctest: +SKIP
"""

from . import masks
from .api import plan
from .batch import BatchSpec
from .context import DCPContext, context_parallel, context_parallel_unshard, unshard
from .cost import CostModel
from .executor import RankExecutor, dcp_attention, emulate
from .masks import BlockwiseCausal, Causal, Full, Lambda, Ranges, SharedQuestion
from .plan import Plan, PlanError
from .sim.simulate import SimResult, simulate
from .teardown import shutdown
from .planners import Placement
from .topology import Topology
from .workload import Workload

__version__ = "0.1.0"

__all__ = [
    "masks",
    "plan",
    "simulate",
    "shutdown",
    "SimResult",
    "CostModel",
    "context_parallel",
    "context_parallel_unshard",
    "unshard",
    "DCPContext",
    "BatchSpec",
    "Topology",
    "Workload",
    "Placement",
    "Plan",
    "PlanError",
    "RankExecutor",
    "dcp_attention",
    "emulate",
    "Causal",
    "Full",
    "Lambda",
    "BlockwiseCausal",
    "SharedQuestion",
    "Ranges",
]
