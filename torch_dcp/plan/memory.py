"""Peak attention memory per rank of a plan: the tokens a rank holds plus the keys and values of
other ranks' tokens it holds at once, as the plan's runtime runs it.

This is the memory context parallelism trades against time (a static CP group that gathers
all its K/V runs one attention call but holds the group's keys and values on every rank), and
what ``python -m torch_dcp.benchmarks compare`` reports beside the times. It counts the
attention's inputs only: activations outside attention, weights and optimizer state are the
same for every plan of a batch.

Per rank ``r``, in bytes:

* held: its tokens' Q, K, V and O (:meth:`~torch_dcp.workload.Workload.block_bytes`);
* K/V of other ranks, by runtime (:class:`~torch_dcp.planners.base.Runtime`):

  - all-gather CP (``ALLGATHER``, ``DCP_ALLGATHER``): the gathered buffer of its CP group,
    ``G`` shards of the group's largest rank (NCCL needs equal shards), less its own tokens;
    crossing each node once (``DCP_NODE_ALLGATHER``, ``n`` nodes of ``r`` ranks per group): the
    larger of its node's ``r`` shards and the rail's ``n`` (while the near keys' attention runs)
    and the rail's ``n`` and the other nodes' ``r (n - 1)`` (the near buffer freed), less its
    own tokens;
  - ring attention (``TE_RING``, ``DCP_RING``): two K/V shards of its group's largest rank, the
    step's and the next step's receive buffer (``AttnFuncWithCPAndKVP2P`` double-buffers);
    none on a ring of one rank;
  - torch_dcp's executor (``EXECUTOR``): the K/V blocks it fetches (its route table's rows), all
    held in its K/V buffer during a pass (:meth:`~torch_dcp.plan.Plan.buffer_sizes`);

* a head-parallel plan (Ulysses, HCP, dcp's ``/hpN`` plans): the rank's own tokens (before the
  all-to-all, still held for the backward) plus its outer rank's memory at ``H / N`` heads
  (after the all-to-all).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..planners.base import Runtime
from ..workload import Buf, resident_token_bytes
from .heads import HeadParallelPlan

__all__ = ["attention_memory"]


def _gathered(plan: Any) -> np.ndarray:
    """Rows of other ranks' K/V in each rank's all-gather buffer."""
    pl = plan.placement
    tokens = pl.rank_tokens()
    size = pl.cp_size or plan.world_size
    shard = tokens.reshape(-1, size).max(axis=1)  # the largest rank of every CP group
    return np.repeat(shard, size) * size - tokens


def _ring(plan: Any) -> np.ndarray:
    """Rows of the two K/V shards in flight on each rank of a ring (none on a ring of one rank)."""
    pl = plan.placement
    size = pl.cp_size or plan.world_size
    if size == 1:
        return np.zeros(plan.world_size, np.int64)
    return np.repeat(pl.rank_tokens().reshape(-1, size).max(axis=1), size) * 2


def _executor(plan: Any) -> np.ndarray:
    """Rows of the K/V blocks each rank fetches: its K/V buffer holds every one of a pass beside
    its own rows (:meth:`~torch_dcp.plan.Plan.buffer_sizes`), relays included."""
    t, blen = plan.tables, plan.workload.block_len
    kv = t["fetch_kind"] == 1
    return np.bincount(t["fetch_rank"][kv], weights=blen[t["fetch_block"][kv]], minlength=plan.world_size)


def _node_gathered(plan: Any) -> np.ndarray:
    """Rows of other ranks' K/V in the node-once all-gather's buffers at their peak."""
    pl = plan.placement
    tokens = pl.rank_tokens()
    size, r = pl.cp_size or plan.world_size, plan.topology.ranks_per_node
    n = size // r
    shard = tokens.reshape(-1, size).max(axis=1)
    return np.repeat(shard, size) * (n + max(r, r * (n - 1))) - tokens


#: rows of other ranks' K/V a rank holds at once, per runtime
_OTHER_KV_ROWS: dict[Runtime, Callable[[Any], np.ndarray]] = {
    Runtime.ALLGATHER: _gathered,
    Runtime.DCP_ALLGATHER: _gathered,
    Runtime.DCP_NODE_ALLGATHER: _node_gathered,
    Runtime.TE_RING: _ring,
    Runtime.DCP_RING: _ring,
    Runtime.EXECUTOR: _executor,
}


def attention_memory(plan: Any) -> np.ndarray:
    """Peak bytes of the attention's inputs on every rank (module docstring): float64 ``[W]``.

    Args:
        plan: a :class:`~torch_dcp.plan.Plan` or a
            :class:`~torch_dcp.plan.heads.HeadParallelPlan`.
    """
    if isinstance(plan, HeadParallelPlan):  # own tokens (all heads), then the outer rank's at H / N heads
        own = plan.rank_tokens.astype(np.float64) * resident_token_bytes(plan.batch)
        return own + np.repeat(attention_memory(plan.outer), plan.layout.size)
    pl, wl = plan.placement, plan.workload
    held = np.bincount(pl.block_rank, weights=wl.block_bytes(), minlength=plan.world_size)
    kv_row = float(pl.token_bytes()[(False, Buf.KV)])
    return held + _OTHER_KV_ROWS[pl.runtime](plan) * kv_row
