"""DCP beside tensor parallelism: the head split (TensorParallelHeads), its exactness against the
float64 dense reference, the DCP group's topology of a multi-dimensional mesh, and
context_parallel over the DCP sub-mesh of a (dp, tp) mesh on gloo ranks."""

from __future__ import annotations

import socket

import pytest
import torch

import torch_dcp
from torch_dcp import BatchSpec, Topology
from torch_dcp.tensor_parallel import TensorParallelHeads
from reference import context_step_errors, random_qkv, reference_with_grads
from spawn import run_ranks

MASKS = {
    "causal": torch_dcp.Causal(),
    "lambda": torch_dcp.Lambda(sink=3, window=17),
    "blockwise": torch_dcp.BlockwiseCausal(block=8, window_blocks=2, sink_blocks=1),
    "shared_question": torch_dcp.SharedQuestion(0.2, 3),
    "full": torch_dcp.Full(),
}


def test_head_ranges_shard_or_replicate_the_kv_heads():
    s = TensorParallelHeads(8, 4, 2)  # H_kv >= TP: KV heads sharded
    assert (s.local_heads, s.local_kv_heads) == (4, 2)
    assert [list(s.query_heads(t)) for t in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(s.kv_heads(t)) for t in range(2)] == [[0, 1], [2, 3]]
    r = TensorParallelHeads(8, 2, 4)  # H_kv < TP: each KV head on TP / H_kv = 2 ranks
    assert (r.local_heads, r.local_kv_heads) == (2, 1)
    assert [list(r.kv_heads(t)) for t in range(4)] == [[0], [0], [1], [1]]
    one = TensorParallelHeads(8, 8, 8)
    assert [list(one.kv_heads(t)) for t in range(8)] == [[t] for t in range(8)]
    # every query head reads a KV head its rank holds
    for split in (s, r, one, TensorParallelHeads(16, 4, 8), TensorParallelHeads(32, 8, 4)):
        g = split.n_heads // split.n_kv_heads
        for t in range(split.degree):
            assert {h // g for h in split.query_heads(t)} <= set(split.kv_heads(t))


@pytest.mark.parametrize("h,hkv,tp,what", [(8, 2, 3, "must divide the 8 query heads"),
                                            (12, 6, 4, "must divide the 6 key/value"),
                                            (8, 2, 8, None), (12, 4, 6, "must divide the tensor-parallel degree 6"),
                                            (8, 3, 2, "must divide n_heads"), (8, 2, 0, "positive integer"),
                                            (8, 2, True, "positive integer")])
def test_bad_splits_name_the_counts(h, hkv, tp, what):
    if what is None:
        assert TensorParallelHeads(h, hkv, tp).local_heads == 1
        return
    with pytest.raises(ValueError, match=what):
        TensorParallelHeads(h, hkv, tp)


def test_local_batch_keeps_documents_and_checks_heads():
    b = BatchSpec([40, 7, 300], torch_dcp.Lambda(sink=4, window=32), n_heads=8, n_kv_heads=2, head_dim=16,
                  dtype="float32")
    local = TensorParallelHeads.of(b, 4).local_batch(b)
    assert (local.n_heads, local.n_kv_heads, local.head_dim, local.dtype) == (2, 1, 16, "float32")
    assert local.doc_lens.tolist() == [40, 7, 300] and local.masks == b.masks
    with pytest.raises(ValueError, match="this split is of 8/4"):
        TensorParallelHeads(8, 4, 2).local_batch(b)
    with pytest.raises(ValueError, match=r"TP index must be an integer in \[0, 4\)"):
        TensorParallelHeads(8, 2, 4).query_heads(4)


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("h,hkv,tp", [(8, 2, 4), (8, 4, 2), (4, 4, 2)], ids=["kv<tp", "kv>=tp", "mha"])
def test_head_split_is_exact(mask, h, hkv, tp):
    """Every TP rank runs the one plan of the TP-local batch on its own heads (emulated over 3
    DCP ranks, odd lengths); the ranks' outputs and dq side by side, and dk, dv summed over the
    ranks that hold a replicated KV head (the gradient all-reduce of a replicated projection),
    equal the float64 dense reference of the whole layer."""
    batch = BatchSpec([37, 5, 61, 18], MASKS[mask], n_heads=h, n_kv_heads=hkv, head_dim=8, dtype="float64")
    split = TensorParallelHeads.of(batch, tp)
    local = split.local_batch(batch)
    plan = torch_dcp.plan(local, Topology.single_node(3), planner="dcp", block_size=8)
    assert plan.batch.n_heads == h // tp
    q, k, v, go = random_qkv(batch, torch.float64, seed=1)
    want = reference_with_grads(batch, q, k, v, go)
    out, dq, dk, dv = (torch.zeros_like(t) for t in want)
    for t in range(tp):
        qh, kh = list(split.query_heads(t)), list(split.kv_heads(t))
        o, gq, gk, gv = torch_dcp.emulate(plan, q[:, qh], k[:, kh], v[:, kh], go[:, qh], kernel="reference")
        out[:, qh], dq[:, qh] = o, gq
        dk[:, kh] += gk
        dv[:, kh] += gv
    for name, g, w in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
        assert (g - w).abs().max().item() < 1e-10, name


# ---------------------------------------------------------------------- gloo ranks
def _from_mesh_ranks(rank, world, mesh):
    from torch.distributed.device_mesh import init_device_mesh

    socket.gethostname = lambda: f"node{rank // 2}"  # two processes per host, as torchrun lays them out
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for kwargs in ({}, {"ranks_per_node": 2}):  # TP fills a node: every DCP rank on a node of its own
        t = Topology.from_mesh(dp_tp, dims="dp", **kwargs)
        assert (t.n_nodes, t.ranks_per_node) == (2, 1), (kwargs, t)
        assert Topology.from_mesh(dp_tp["dp"], **kwargs) == t
    t = Topology.from_mesh(dp_tp, dims="tp", ranks_per_node=2)  # the TP group: one node
    assert (t.n_nodes, t.ranks_per_node) == (1, 2)
    assert Topology.from_mesh(dp_tp, dims="dp", ranks_per_node=4) == Topology(n_nodes=1, ranks_per_node=2)
    # several DCP dimensions (HSDP beside TP), flattened in the order named
    three = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    for kwargs in ({}, {"ranks_per_node": 2}):
        t = Topology.from_mesh(three, dims=("dp_replicate", "dp_shard"), **kwargs)
        assert (t.n_nodes, t.ranks_per_node) == (2, 1), (kwargs, t)
    # TP across nodes, DCP inside one: (tp, dp) with 2 processes per node
    tp_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    assert Topology.from_mesh(tp_dp, dims="dp") == Topology(n_nodes=1, ranks_per_node=2)
    for bad, what in (({}, "needs dims="), ({"dims": "cp"}, "unknown mesh dimension"),
                      ({"dims": "dp", "ranks_per_node": 0}, "positive integer")):
        with pytest.raises(ValueError, match=what):
            Topology.from_mesh(dp_tp, **bad)
    # flattened tp-major, the group runs node 0, node 1, node 0, node 1
    with pytest.raises(ValueError, match="not consecutive"):
        Topology.from_mesh(dp_tp, dims=("tp", "dp"), ranks_per_node=2)


def test_topology_from_a_two_dimensional_mesh(tmp_path):
    run_ranks(_from_mesh_ranks, 4, tmp_path, timeout=240)


def _tp_context_ranks(rank, world, mesh):
    """2 DCP x 2 TP: each TP rank runs the plan of its local heads over its DCP sub-group."""
    from torch.distributed.device_mesh import init_device_mesh

    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = dp_tp["tp"].get_local_rank()
    for mask, (h, hkv) in (("causal", (4, 1)), ("lambda", (4, 2))):
        batch = BatchSpec([29, 70, 6, 33], MASKS[mask], n_heads=h, n_kv_heads=hkv, head_dim=8, dtype="float64")
        split = TensorParallelHeads.of(batch, 2)
        q, k, v, go = random_qkv(batch, torch.float64, seed=3)
        ref = reference_with_grads(batch, q, k, v, go)
        qh, kh = list(split.query_heads(tp)), list(split.kv_heads(tp))
        # the reference's dk, dv of this rank's KV heads from its own query heads only (the TP
        # all-reduce of a replicated head is the model's): recompute with the other heads' upstream zeroed
        go_mine = torch.zeros_like(go)
        go_mine[:, qh] = go[:, qh]
        ref_mine = reference_with_grads(batch, q, k, v, go_mine)
        want = (ref[0][:, qh], ref[1][:, qh], ref_mine[2][:, kh], ref_mine[3][:, kh])
        topo = Topology.from_mesh(dp_tp, dims="dp")
        errs = context_step_errors(dp_tp["dp"], split.local_batch(batch), dp_tp["dp"].get_local_rank(), q[:, qh],
                                   k[:, kh], v[:, kh], go[:, qh], want, planner="dcp", block_size=16, topology=topo)
        assert max(errs.values()) < 1e-10, (mask, tp, errs)


def test_context_parallel_over_the_dcp_sub_mesh_of_a_tp_mesh(tmp_path):
    run_ranks(_tp_context_ranks, 4, tmp_path, timeout=240)
