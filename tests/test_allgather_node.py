"""All-gather CP whose collectives cross each node once (``torch_dcp.executor.allgather_node``):
exact against the dense float64 reference in one process and on gloo, its bytes into each node
counted against the formula, priced as it runs and offered among dcp's candidates."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import torch_dcp
from torch_dcp import BatchSpec, Causal, Lambda, Topology
from torch_dcp.api import divide
from torch_dcp.executor import InProcessTransport, Mailbox, make_executor
from torch_dcp.executor.allgather import collective_groups
from torch_dcp.executor.allgather_node import NODE_PHASES, NodeAllGatherExecutor, node_layout
from torch_dcp.plan.heads import HeadLayout, HeadParallelPlan
from torch_dcp.plan.memory import attention_memory
from torch_dcp.planners import Runtime, plan_allgather
from torch_dcp.sim.simulate import simulate
from reference import assert_replay_matches_eager, context_step_errors, random_qkv, reference_with_grads
from spawn import run_ranks
from test_exact import HEADS, MASKS, _batch, _check

#: (nodes, ranks per node, CP size): one group of 2 and of 3 nodes (this rank's node first, in
#: the middle, last), two groups of 2 nodes, nodes of one and of three ranks
LAYOUTS = [(2, 2, None), (3, 2, None), (4, 2, 4), (3, 1, None), (2, 3, None)]


def _node_plan(batch, nodes, rpn, cp, divisions=1):
    topo = Topology(n_nodes=nodes, ranks_per_node=rpn)
    placement = dataclasses.replace(plan_allgather(batch, topo, cp_size=cp), runtime=Runtime.DCP_NODE_ALLGATHER)
    return divide(placement, topo, divisions)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("nodes,rpn,cp", LAYOUTS)
def test_exact_every_mask_and_layout(mask, nodes, rpn, cp):
    heads = list(HEADS)[LAYOUTS.index((nodes, rpn, cp)) % len(HEADS)]  # GQA and MHA over the layouts
    batch = _batch(mask, heads)
    plan = _node_plan(batch, nodes, rpn, cp)
    assert isinstance(make_executor(plan, 0, InProcessTransport(Mailbox(), 0)), NodeAllGatherExecutor)
    _check(plan, batch)


@pytest.mark.parametrize("mask", ["causal", "lambda"])
def test_exact_with_the_varlen_kernel(mask):
    # the varlen kernel reads some key rows several times (its segments): their dK/dV add up
    from torch_dcp.executor import AutoKernel, ReferenceKernel, VarlenKernel

    batch = _batch(mask, "gqa8/2-d32")
    for nodes, rpn, cp in ((2, 2, None), (3, 2, None)):
        _check(_node_plan(batch, nodes, rpn, cp), batch, kernel=AutoKernel(ReferenceKernel(), VarlenKernel(),
                                                                            min_rows=1))


def test_exact_as_the_outer_plan_of_head_parallelism_and_with_empty_groups():
    batch = _batch("causal", "gqa8/2-d32")
    topo = Topology(n_nodes=2, ranks_per_node=4)
    lay = HeadLayout.of(batch, 2)
    ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
    outer = dataclasses.replace(plan_allgather(ob, ot), runtime=Runtime.DCP_NODE_ALLGATHER)
    plan = HeadParallelPlan(divide(outer, ot, 1), batch, topo, 2, "allgather/cp4/node/hp2")
    assert isinstance(make_executor(plan, 0, InProcessTransport(Mailbox(), 0)).outer, NodeAllGatherExecutor)
    _check(plan, batch)
    # one document on 8 ranks in groups of 4: the second group holds nothing; 3 tokens over 4
    # ranks: ranks without tokens in a group that has some
    for lens, nodes, cp in (([40], 4, 4), ([3], 2, None)):
        small = BatchSpec(lens, Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float64")
        plan = _node_plan(small, nodes, 2, cp)
        assert min(plan.local_tokens(r) for r in range(plan.world_size)) == 0
        _check(plan, small)


def test_layout_and_errors():
    batch = _batch("causal", "gqa8/2-d32")
    plan = _node_plan(batch, 3, 2, None)
    lay = node_layout(plan, 3)
    assert (lay.node, lay.rail, lay.j, lay.l, lay.n, lay.r) == ((2, 3), (1, 3, 5), 1, 1, 3, 2)
    one_node = divide(dataclasses.replace(plan_allgather(batch, Topology(n_nodes=2, ranks_per_node=2), cp_size=2),
                                          runtime=Runtime.DCP_NODE_ALLGATHER), Topology(n_nodes=2, ranks_per_node=2), 1)
    with pytest.raises(ValueError, match="two or more whole nodes"):
        make_executor(one_node, 0, InProcessTransport(Mailbox(), 0))
    plain = divide(plan_allgather(batch, Topology(n_nodes=2, ranks_per_node=2)), Topology(n_nodes=2, ranks_per_node=2),
                   1)
    with pytest.raises(ValueError, match="runs plans of runtime 'dcp-node-allgather'"):
        NodeAllGatherExecutor(plain, 0, InProcessTransport(Mailbox(), 0))


class _Counting(Mailbox):
    """A mailbox that records every message: ``(phase, src, dst, bytes)``."""

    def __init__(self):
        super().__init__()
        self.log = []

    def post(self, key, message):
        self.log.append((key[0], key[2], key[3], message.numel() * message.element_size()))
        super().post(key, message)


def test_each_shard_crosses_into_each_node_once(monkeypatch):
    """Bytes between nodes per stage, counted on the in-process transport, against the formula:
    in each pass's rail gather every remote member's shard (``R`` rows of K and V) enters each
    node of the group once; the backward's rail sum sends each node's partial sums (dK and dV of
    ``R`` rows) of each remote member's shard once; the near and far collectives stay inside
    the node. The plan's transfers (NCCL's rings on each group) move the same bytes between
    nodes, each remote shard once, a third of the ring all-gather's on three nodes."""
    batch = BatchSpec([70, 13, 41, 90, 5], Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype="float32")
    nodes, rpn = 3, 2
    plan = _node_plan(batch, nodes, rpn, None)
    boxes = []
    monkeypatch.setattr(importlib.import_module("torch_dcp.executor.emulate"), "Mailbox",
                        lambda: boxes.append(_Counting()) or boxes[-1])
    q, k, v, go = random_qkv(batch, torch.float32, 0)
    torch_dcp.emulate(plan, q, k, v, go)
    (box,) = boxes
    topo = plan.topology
    shard = int(plan.placement.rank_tokens().max()) * 2 * batch.n_kv_heads * batch.head_dim * 4  # K and V, fp32
    into = {}
    for phase, src, dst, nbytes in box.log:
        if topo.node_of(src) != topo.node_of(dst):
            key = (phase, int(topo.node_of(dst)))
            into[key] = into.get(key, 0) + nbytes
    want = (nodes - 1) * rpn * shard  # every remote member's shard, once
    rails = {NODE_PHASES["forward rail"], NODE_PHASES["backward rail"], NODE_PHASES["backward rail sum"]}
    assert set(p for p, _ in into) == rails
    for phase in rails:  # K and V of R rows, or dK and dV of R rows: the same bytes
        for node in range(nodes):
            assert into[(phase, node)] == want
    src, dst, nbytes, _ = plan.transfers()
    cross = topo.node_of(src) != topo.node_of(dst)
    ring = divide(plan_allgather(batch, topo), topo, 1)
    rs, rd, rb, _ = ring.transfers()
    assert nbytes[cross].sum() == pytest.approx(3 * nodes * want)  # three collectives, each shard into each node once
    assert nbytes[cross].sum() < rb[topo.node_of(rs) != topo.node_of(rd)].sum()


def test_priced_below_the_ring_all_gather_and_chosen_where_faster():
    """On 2 x 8 H100s, a corpus-like causal batch of 116K tokens: the node-once all-gather moves
    fewer bytes between the nodes than NCCL's ring on the same group; as the outer plan of 2-way
    head parallelism (CP groups of 8 head groups on 2 nodes of 4) it is faster on the simulator
    (the near keys' attention hides part of the rail's gather, which pays for its second call and
    merge), without head parallelism (nodes of 8) not. dcp's candidates offer it
    (``dcp:allgather/cp16/node``, ``dcp:allgather/cp8/node/hp2``), never slower than the plan
    kept; its process groups (the node's and the rail's) are created at context entry."""
    batch = BatchSpec([24000, 20000, 16000] + [2800] * 20, Causal(), n_heads=8, n_kv_heads=2, head_dim=128,
                      dtype="bfloat16")
    topo = Topology.preset("h100", n_nodes=2)
    cm = torch_dcp.CostModel.load("h100-executor")
    times = {}
    for n in (1, 2):
        lay = HeadLayout.of(batch, n)
        ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
        for rt in (Runtime.DCP_ALLGATHER, Runtime.DCP_NODE_ALLGATHER):
            p = divide(dataclasses.replace(plan_allgather(ob, ot), runtime=rt), ot, 1)
            if n == 1:
                times[rt, "bytes"] = p.stats()["inter_node_bytes"]
                times[rt, "memory"] = attention_memory(p).max()
            times[rt, n] = simulate(p if n == 1 else HeadParallelPlan(p, batch, topo, n, "x"), cm).makespan_s
    ring, node = Runtime.DCP_ALLGATHER, Runtime.DCP_NODE_ALLGATHER
    assert times[node, "bytes"] < 0.6 * times[ring, "bytes"]  # 8 shards into a node against the ring's 15
    assert times[node, "memory"] <= times[ring, "memory"]  # the near buffer freed before the far one
    assert times[node, 2] < 0.95 * times[ring, 2] and times[node, 1] > times[ring, 1]
    plan = torch_dcp.plan(batch, topo, cost_model=cm)
    labels = [label for label, _ in plan.candidates]
    assert {"dcp:allgather/cp16/node", "dcp:allgather/cp8/node/hp2"} <= set(labels)
    assert simulate(plan, cm).makespan_s <= times[node, 2] * (1 + 1e-9)
    node16 = divide(dataclasses.replace(plan_allgather(batch, topo), runtime=node), topo, 1)
    assert collective_groups(node16, 3)[:2] == [tuple(range(8)), (3, 11)]


# ---------------------------------------------------------------------- gloo
def _gloo_worker(rank: int, world: int, mesh) -> None:
    # 2 nodes of 2 ranks: the rail groups {0, 2} and {1, 3}, the node groups {0, 1} and {2, 3}
    for mask in (Causal(), Lambda(sink=3, window=9)):
        batch = BatchSpec([1, 19, 50, 6, 33, 2], mask, n_heads=8, n_kv_heads=2, head_dim=16, dtype="float32")
        plan = _node_plan(batch, 2, 2, None)
        q, k, v, go = random_qkv(batch, torch.float32, seed=2)
        ref = reference_with_grads(batch, q.double(), k.double(), v.double(), go.double())
        errs = context_step_errors(mesh, batch, rank, q, k, v, go, ref, plan=plan)
        assert max(errs.values()) <= 1e-5, f"rank {rank} {type(mask).__name__}: {errs}"
    # layer replay records the runtime like any plan
    batch = BatchSpec([70, 13, 41, 90], Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype="float32")
    assert_replay_matches_eager(mesh, rank, _node_plan(batch, 2, 2, None), batch)


def test_gloo_context_parallel_exact(tmp_path):
    run_ranks(_gloo_worker, 4, tmp_path)
