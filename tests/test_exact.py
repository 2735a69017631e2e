"""Exactness of the executor against the dense masked float64 reference, in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_dcp
from torch_dcp import BatchSpec, BlockwiseCausal, Causal, Full, Lambda, Ranges, SharedQuestion
from reference import random_qkv, reference_with_grads

# documents of length 1, lengths not a multiple of B=4, and one longer than W*B for W=8 (41 > 32)
DOC_LENS = [1, 7, 30, 5, 41, 3]
BLOCK = 4


def _ranges_masks(lens, seed=0):
    rng = np.random.default_rng(seed)
    masks = []
    for n in lens:
        rows = []
        for i in range(n):
            k = int(rng.integers(0, 4))
            starts = rng.integers(0, n, k)
            rows.append([(int(s), int(min(n, s + rng.integers(0, 6)))) for s in starts])
        masks.append(Ranges(rows))
    return masks


MASKS = {
    "causal": Causal(),
    "full": Full(),
    "lambda": Lambda(sink=3, window=5),
    "blockwise": BlockwiseCausal(block=4, window_blocks=2, sink_blocks=1),
    "shared_question": SharedQuestion(question_frac=0.2, n_answers=4),
    "ranges": "ranges",
}
HEADS = {"gqa8/2-d32": (8, 2, 32), "mha4-d64": (4, 4, 64), "gqa8/2-d64": (8, 2, 64), "mha4-d32": (4, 4, 32)}


def _batch(mask_name, heads, dtype="float64"):
    h, hkv, d = HEADS[heads]
    mask = _ranges_masks(DOC_LENS) if mask_name == "ranges" else MASKS[mask_name]
    return BatchSpec(DOC_LENS, mask, n_heads=h, n_kv_heads=hkv, head_dim=d, dtype=dtype)


def _check(plan, batch, tol=1e-10, seed=0, kernel=None):
    q, k, v, go = random_qkv(batch, torch.float64, seed)
    out, dq, dk, dv = torch_dcp.emulate(plan, q, k, v, go, kernel=kernel)
    ref = reference_with_grads(batch, q, k, v, go)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        err = (got - want).abs().max().item()
        assert err <= tol, f"{name}: max abs error {err:.3e} > {tol}"


#: (heads, world size) pairs run with every planner and mask: every world size once, GQA and MHA
#: each over several world sizes, and every pair of (GQA or MHA, head size) (the head size is a
#: trailing dimension no planner or route sees; tests/test_exact.py's head-parallel cases cross
#: GQA with world sizes again)
CROSS = [("gqa8/2-d32", w) for w in (1, 3, 8)] + [("mha4-d64", w) for w in (2, 4)] + [
    ("gqa8/2-d64", 2), ("mha4-d32", 3)]


@pytest.mark.parametrize("planner", ["ring", "greedy", "dcp", "megatron", "fcp"])
@pytest.mark.parametrize("heads,world_size", CROSS)
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_exact_forward_backward(planner, world_size, mask_name, heads):
    batch = _batch(mask_name, heads)
    divisions = 1 + (world_size + len(mask_name)) % 4
    plan = torch_dcp.plan(batch, world_size, planner=planner, block_size=BLOCK, divisions=divisions)
    plan.validate()
    _check(plan, batch)


@pytest.mark.parametrize("world_size", [2, 3, 8])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_exact_allgather(world_size, mask_name):
    """allgather shares ring's layout and the direct routes every other planner uses: one
    head configuration is enough on top of theirs."""
    batch = _batch(mask_name, "gqa8/2-d32")
    plan = torch_dcp.plan(batch, world_size, planner="allgather", block_size=BLOCK, divisions=3)
    plan.validate()
    _check(plan, batch)


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
@pytest.mark.parametrize("world_size", [1, 3, 8])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_exact_each_kernel(kernel, world_size, mask_name):
    batch = _batch(mask_name, "gqa8/2-d32")
    plan = torch_dcp.plan(batch, world_size, planner="greedy", block_size=BLOCK, divisions=3)
    _check(plan, batch, kernel=kernel)


@pytest.mark.parametrize("world_size", [2, 4])
def test_exact_multi_node_topology(world_size):
    batch = _batch("causal", "gqa8/2-d32")
    topo = torch_dcp.Topology(n_nodes=2, ranks_per_node=world_size // 2)
    for planner in ("ring", "allgather", "greedy", "dcp", "megatron", "fcp"):
        plan = torch_dcp.plan(batch, topo, planner=planner, block_size=BLOCK, divisions=4)
        plan.validate()
        _check(plan, batch)


def test_fully_masked_rows_give_zero_output_and_gradient():
    # query 0 of each document sees nothing; a whole block of document 1 sees nothing
    n0, n1 = 6, 9
    r0 = Ranges([[]] + [[(0, i)] for i in range(1, n0)])
    r1 = Ranges([[] for _ in range(4)] + [[(0, i + 1)] for i in range(4, n1)])
    batch = BatchSpec([n0, n1], [r0, r1], n_heads=2, n_kv_heads=1, head_dim=8, dtype="float64")
    for w in (1, 2, 3):
        plan = torch_dcp.plan(batch, w, planner="greedy", block_size=4, divisions=2)
        plan.validate()
        _check(plan, batch)


def test_float32_and_bfloat16_match_reference_loosely():
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 3e-2)):
        batch = _batch("lambda", "gqa8/2-d32", dtype=dtype)
        plan = torch_dcp.plan(batch, 3, planner="greedy", block_size=BLOCK)
        tdt = getattr(torch, dtype)
        q, k, v, go = random_qkv(batch, tdt)
        out, dq, dk, dv = torch_dcp.emulate(plan, q, k, v, go)
        ref = reference_with_grads(batch, q, k, v, go)
        for got, want in zip((out, dq, dk, dv), ref):
            assert got.dtype == tdt
            assert (got.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def test_emulate_rejects_bad_inputs():
    batch = _batch("causal", "gqa8/2-d32")
    plan = torch_dcp.plan(batch, 2, block_size=BLOCK)
    q, k, v, go = random_qkv(batch)
    with pytest.raises(ValueError, match="q must be"):
        torch_dcp.emulate(plan, q[:-1], k, v)
    with pytest.raises(ValueError, match="k must be"):
        torch_dcp.emulate(plan, q, k.repeat_interleave(4, 1), v)
    with pytest.raises(ValueError, match="dtype"):
        torch_dcp.emulate(plan, q.float(), k.float(), v.float())
    assert torch.equal(torch_dcp.emulate(plan, q, k, v), torch_dcp.emulate(plan, q, k, v, go)[0])


def _relays(plan):
    """(fetches passed on by a gateway, partials reduced on the way home) of ``plan``."""
    t, br = plan.tables, plan.placement.block_rank
    fetch = int((br[t["fetch_block"]] != t["fetch_src"]).sum())
    ret = sum(int((br[t[f"ret_{s}_block"]] != t[f"ret_{s}_dst"]).sum()) for s in ("q", "kv"))
    return fetch, ret


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (2, 4), (3, 2)])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_exact_node_routes(nodes, rpn, mask_name):
    """Routing.NODE and RAILS: fetches relayed by a node's gateway (also in the opening phase
    before division 0; on RAILS also by gateways that need no block of their own) and partials
    reduced on a node's reducer (also in the closing phase after the last division) and passed
    home by relays give the dense reference's outputs and gradients."""
    import dataclasses

    from torch_dcp.api import divide
    from torch_dcp.planners import Routing

    batch = _batch(mask_name, "gqa8/2-d32")
    topo = torch_dcp.Topology(n_nodes=nodes, ranks_per_node=rpn)
    dcp = torch_dcp.plan(batch, topo, planner="dcp", block_size=BLOCK, divisions=3, rivals=(), head_parallel=1)
    assert dcp.placement.routing in (Routing.NODE, Routing.RAILS)
    # the greedy layout spreads documents over nodes: many relays of both kinds; with one
    # division every gateway fetches in the opening phase and reducers send in the closing one
    greedy = torch_dcp.plan(batch, topo, planner="greedy", block_size=BLOCK).placement
    spread = {(r, d): divide(dataclasses.replace(greedy, routing=r), topo, d)
              for r in (Routing.NODE, Routing.RAILS) for d in (3, 1)}
    for plan in (dcp, *spread.values()):
        plan.validate()
        _check(plan, batch)
    if mask_name in ("causal", "full"):
        fetch, ret = _relays(spread[(Routing.NODE, 3)])
        assert fetch > 0 and ret > 0
    if mask_name == "full":
        t = spread[(Routing.NODE, 1)].tables
        assert (t["fetch_div"] == -1).any() and any((t[f"ret_{s}_div"] == 1).any() for s in ("q", "kv"))


@pytest.mark.parametrize("layout", ["2x2/hp2", "2x4/hp4", "1x4/hp4", "2x4/hp2"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("heads", ["gqa8/2-d32", "mha4-d32"])
def test_exact_head_parallel(layout, mask_name, heads):
    """Head-parallel plans (all-to-all inside groups of N, the outer plan across them): GQA with
    replicated key/value heads (8/2 with N = 4) and without, 1 x 4 is pure Ulysses."""
    shape, n = layout.split("/hp")
    nodes, rpn = map(int, shape.split("x"))
    batch = _batch(mask_name, heads)
    topo = torch_dcp.Topology(n_nodes=nodes, ranks_per_node=rpn)
    planner = "ring" if nodes == 1 else "dcp"
    plan = torch_dcp.plan(batch, topo, planner=planner, block_size=BLOCK, head_parallel=int(n), divisions=2)
    assert plan.head_parallel == int(n)
    plan.validate()
    _check(plan, batch)


def test_exact_head_parallel_with_a_rank_without_tokens_and_repeated_kv_heads():
    batch = BatchSpec([3], Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float64")
    plan = torch_dcp.plan(batch, torch_dcp.Topology(n_nodes=1, ranks_per_node=4), planner="ring", head_parallel=4)
    assert [plan.local_tokens(r) for r in range(4)] == [1, 1, 1, 0]
    _check(plan, batch)
    # keys and values with their heads repeated to the query heads, as some models pass them
    q, k, v, go = random_qkv(batch, torch.float64, 1)
    rep = batch.n_heads // batch.n_kv_heads
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mailbox = torch_dcp.executor.Mailbox()
    from torch_dcp.executor import InProcessTransport, make_executor
    from torch_dcp._interleave import interleave
    execs = [make_executor(plan, r, InProcessTransport(mailbox, r)) for r in range(4)]
    idx = [torch.from_numpy(plan.token_indices(r)) for r in range(4)]
    ref = reference_with_grads(batch, q, k, v, go)
    for keep in (False, True):  # and with the head-sharded tensors kept for the backward (only dO travels)
        fwd = interleave([e.forward_steps(q[i], kr[i], vr[i], keep=keep) for e, i in zip(execs, idx)],
                         lambda: mailbox.events)
        bwd = interleave([e.backward_steps(q[i], kr[i], vr[i], f[0], f[1], go[i], state=f[2] if keep else None)
                          for e, i, f in zip(execs, idx, fwd)], lambda: mailbox.events)
        out = torch.cat([f[0] for f in fwd])[torch.argsort(torch.cat(idx))]
        assert (out - ref[0]).abs().max().item() < 1e-10
        dk = torch.cat([g[1] for g in bwd])[torch.argsort(torch.cat(idx))]
        assert (dk.view(3, 2, rep, 16).sum(2) - ref[2]).abs().max().item() < 1e-10
