"""Peak attention memory per rank (torch_dcp.plan.memory): each runtime's formula on hand-counted
plans, and the comparison's memory columns."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import torch_dcp
from torch_dcp import BatchSpec, Causal, CostModel, Topology
from torch_dcp.api import divide
from torch_dcp.planners import Runtime, plan_allgather
from torch_dcp.plan.memory import attention_memory

LENS = [3000, 1000, 700, 300]  # 5,000 tokens
TOKEN = (2 * 8 + 2 * 2) * 128 * 2  # Q, K, V, O bytes per token (bf16, GQA 8/2, head_dim 128)
KV = 2 * 2 * 128 * 2  # K and V bytes per token


def _batch(lens=LENS):
    return BatchSpec(lens, Causal(), n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")


@pytest.mark.parametrize("cp_size", [None, 2, 1])
def test_all_gather_holds_its_groups_padded_shards(cp_size):
    topo = Topology(n_nodes=1, ranks_per_node=4)
    placement = plan_allgather(_batch(), topo, cp_size=cp_size)
    plan = divide(placement, topo, 1)
    tokens = placement.rank_tokens()
    size = cp_size or 4
    shard = tokens.reshape(-1, size).max(axis=1).repeat(size)
    want = tokens * TOKEN + (shard * size - tokens) * KV
    assert np.allclose(attention_memory(plan), want)
    same = divide(dataclasses.replace(placement, runtime=Runtime.DCP_ALLGATHER), topo, 1)
    assert np.allclose(attention_memory(same), want)  # both all-gather runtimes hold the same buffer
    if size == 1:
        assert np.allclose(attention_memory(plan), tokens * TOKEN)  # alone: nothing of another rank


def test_ring_holds_two_shards_and_the_executor_its_fetched_rows():
    topo = Topology(n_nodes=1, ranks_per_node=4)
    ring = torch_dcp.plan(_batch(), topo, planner="ring")
    assert ring.placement.runtime is Runtime.TE_RING
    tokens = ring.placement.rank_tokens()
    assert np.allclose(attention_memory(ring), tokens * TOKEN + 2 * tokens.max() * KV)
    dcp = torch_dcp.plan(_batch(), topo, planner="dcp", cost_model=CostModel.load("h100"), head_parallel=1,
                         rivals=("ring", "megatron", "allgather", "documents"))
    assert dcp.placement.runtime is Runtime.EXECUTOR
    held = dcp.placement.rank_tokens() * TOKEN
    extra = []
    for r in range(4):
        s = dcp.buffer_sizes(r)
        extra.append(max(s.get("fwd_kv", 0), s.get("bwd_kv", 0)) - s["local"])
    assert min(extra) >= 0 and max(extra) > 0  # causal on 4 ranks: someone fetches keys
    assert np.allclose(attention_memory(dcp), held + np.array(extra) * KV)


def test_head_parallel_adds_the_outer_ranks_memory_at_fewer_heads():
    topo = Topology(n_nodes=1, ranks_per_node=4)
    uly = torch_dcp.plan(_batch(), topo, planner="ulysses")
    n = uly.layout.size
    assert n == 4
    own = uly.rank_tokens * TOKEN
    outer = attention_memory(uly.outer)
    assert np.allclose(attention_memory(uly), own + np.repeat(outer, n))
    # the outer rank holds every token at H / N heads (and the key/value heads the layout gives it)
    assert outer.max() >= 5000 * (2 * 2 + 2 * uly.layout.kv_heads) * 128 * 2 * 0.999


def test_compare_reports_the_peaks():
    from torch_dcp.benchmarks.compare import compare_batch, summarize

    topo = Topology(n_nodes=2, ranks_per_node=2)
    row = compare_batch(_batch([6000, 500, 3000, 2500, 200]), topo, CostModel.load("h100"), [1024])
    assert row["dcp_peak_mib"] > 0 and row["best_baseline_peak_mib"] > 0
    for family in ("ring", "allgather"):
        assert row[f"{family}_peak_mib"] == row[f"{family}_peak_by_cp_mib"][str(row[f"{family}_cp"])]
    # all-gather over the whole world holds every token's K/V on each rank
    assert row["allgather_peak_by_cp_mib"]["4"] * (1 << 20) >= 12200 * KV
    s = summarize([dict(row, scale=1.0, batch="b", mask="causal")])
    ratio = row["best_baseline_peak_mib"] / row["dcp_peak_mib"]
    assert s["best_peak_over_dcp"] == [ratio] * 3
    assert len(s["more_memory"]) == (ratio > 1.1)
    assert s["tuned"]["peak_over_dcp"] is not None
