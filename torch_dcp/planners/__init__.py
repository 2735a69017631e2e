"""Planners: every one maps a batch to a :class:`Placement` of blocks and tiles on ranks.

Planners never import ``torch.distributed``: they are pure functions of the batch and the
topology.
"""

from __future__ import annotations

from typing import Callable

from .allgather import plan_allgather
from .base import Placement, Routing, Runtime
from .dcp import dcp_candidates, plan_dcp
from .fcp import plan_fcp
from .greedy import plan_greedy
from .megatron import plan_megatron
from .ring import plan_ring

__all__ = ["Placement", "Routing", "Runtime", "PLANNERS", "CANDIDATES", "HEAD_PLANNERS", "get_planner", "dcp_candidates", "plan_allgather", "plan_dcp", "plan_fcp", "plan_greedy", "plan_megatron", "plan_ring"]

#: name -> ``fn(batch, topology, block_size, **options) -> Placement``
PLANNERS: dict[str, Callable[..., Placement]] = {
    "allgather": plan_allgather,
    "dcp": plan_dcp,
    "fcp": plan_fcp,
    "greedy": plan_greedy,
    "megatron": plan_megatron,
    "ring": plan_ring,
}

#: planners that offer several placements, best first: ``fn(batch, topology, block_size,
#: **options) -> list[Placement]``; :func:`torch_dcp.plan` times them with the simulator and
#: keeps the fastest
CANDIDATES: dict[str, Callable[..., list[Placement]]] = {
    "dcp": dcp_candidates,
}


#: head-parallel baselines: name -> ``(outer planner, N of the topology)``; the plan is the
#: outer planner's over the ``W / N`` head groups (:mod:`torch_dcp.plan.heads`):
#:
#: * ``ulysses``: DeepSpeed-Ulysses / TransformerEngine ``a2a`` (Jacobs et al., 2023, §3):
#:   all-to-all over all ``W`` ranks, one attention over every document per rank for ``H / W``
#:   heads (``W`` must divide ``H``);
#: * ``hcp``: Megatron-Core / TransformerEngine ``a2a+p2p`` hierarchical CP: all-to-all over the
#:   ranks of a node, the zig-zag ring (:func:`plan_ring`) over the nodes for ``H / icp`` heads.
HEAD_PLANNERS: dict[str, tuple[str, Callable[..., int]]] = {
    "ulysses": ("ring", lambda topology: topology.world_size),
    "hcp": ("ring", lambda topology: topology.ranks_per_node),
}


def get_planner(name: str) -> Callable[..., Placement]:
    """The planner called ``name``.

    Raises:
        ValueError: unknown planner name.
    """
    try:
        return PLANNERS[name]
    except KeyError:
        raise ValueError(f"unknown planner {name!r}; available: {sorted(PLANNERS)}") from None
