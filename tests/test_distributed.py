"""Real multi-process runs on the gloo backend: float32 results against the float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_dcp
from torch_dcp import BatchSpec, Lambda, SharedQuestion
from torch_dcp.executor import RankExecutor, TorchDistributedTransport
from reference import random_qkv, reference_with_grads
from spawn import run_ranks

CASES = {
    "causal-greedy": (None, "greedy"),
    "lambda-ring": (Lambda(sink=3, window=9), "ring"),
    "sq-greedy": (SharedQuestion(0.25, 3), "greedy"),
}


def _plans(world: int):
    """``(name, batch, plan)``: each case on one node; on 4 ranks also dcp on 2 nodes x 2 ranks
    on both node-once routings (gateways, reducers and relays of returns passing blocks on)."""
    import dataclasses

    from torch_dcp.api import divide
    from torch_dcp.planners import Routing

    for name, (mask, planner) in CASES.items():
        batch = BatchSpec([1, 19, 50, 6, 33], mask, n_heads=8, n_kv_heads=2, head_dim=32, dtype="float32")
        yield name, batch, torch_dcp.plan(batch, world, planner=planner, block_size=8, divisions=3)
    if world == 4:
        topo = torch_dcp.Topology(n_nodes=2, ranks_per_node=2)
        # a window-masked document split over the nodes: NODE relays a return on the home's node,
        # RAILS fetches a block through a gateway that does not need it
        batch = BatchSpec([240], Lambda(sink=2, window=24), n_heads=8, n_kv_heads=2, head_dim=32, dtype="float32")
        pl = torch_dcp.plan(batch, topo, planner="dcp", block_size=8, divisions=3, head_parallel=1).placement
        for routing in (Routing.NODE, Routing.RAILS):
            yield f"lambda-dcp-{routing.value}", batch, divide(dataclasses.replace(pl, routing=routing), topo, 3)


def _worker(rank: int, world: int, mesh) -> None:
    torch.manual_seed(0)
    for name, batch, plan in _plans(world):
        digests = [None] * world
        dist.all_gather_object(digests, plan.digest())
        assert len(set(digests)) == 1, f"{name}: ranks planned differently"
        q, k, v, go = random_qkv(batch, torch.float32, seed=1)
        idx = torch.from_numpy(plan.token_indices(rank))
        ql, kl, vl = (t[idx].clone().requires_grad_(True) for t in (q, k, v))
        ex = RankExecutor(plan, rank, TorchDistributedTransport(None))
        out = ex.attention(ql, kl, vl)
        out.backward(go[idx])
        ref = reference_with_grads(batch, q, k, v, go)
        for what, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), ref):
            err = (got.double() - want[idx]).abs().max().item()
            assert err <= 1e-5, f"{name} rank {rank} {what}: error {err:.2e}"
        assert ex.bytes_sent > 0 or world == 1


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_multiprocess_exact(world, tmp_path):
    run_ranks(_worker, world, tmp_path)


def test_refusal_channel_tells_peers_only_what_concerns_them():
    """A refusal concerns a peer that has begun that call and did not refuse it too (ranks that
    all refuse the same call stay in step); a poll before any refusal reads nothing else."""
    import torch.distributed as dist

    from torch_dcp.executor import RefusalChannel

    store = dist.HashStore()
    a, b, c = (RefusalChannel(store, "entry", r) for r in range(3))
    for ch in (a, b, c):
        ch.begin_call()
    assert a.poll() is None
    b.post("rank 1 has float64 queries")
    assert a.poll() == (1, "rank 1 has float64 queries") and b.poll() is None
    a.post("the same call refused here too")  # refused by rank 0 as well: rank 0 and 1 agree on call 1
    assert a.poll() is None and b.poll() is None
    assert c.poll() in ((0, "the same call refused here too"), (1, "rank 1 has float64 queries"))
    d, e = RefusalChannel(store, "next", 0), RefusalChannel(store, "next", 1)
    d.begin_call()
    e.post("dropout", upcoming=True)  # rank 1 refuses its call 1 before making it; rank 0 is in call 1
    assert d.poll() == (1, "dropout")
    f, g = RefusalChannel(store, "later", 0), RefusalChannel(store, "later", 1)
    for _ in range(2):
        g.begin_call()
    g.post("a call rank 0 has not reached")
    assert f.poll() is None  # rank 0 may refuse call 2 too when it gets there
    f.begin_call()
    f.begin_call()
    assert f.poll() == (1, "a call rank 0 has not reached")


def _refused_then_gone(rank: int, world: int, mesh) -> None:
    """docs/failures.md's refusal with its race forced: rank 1 refuses its SDPA call (an
    ``attn_mask``) and ends its process before rank 0 posts its transfers. Rank 0's transfers
    then fail on a closed connection, and it still raises the refusal (rank 1, its reason)."""
    import os
    import time

    import torch.nn.functional as F

    import spawn
    from torch_dcp.executor import PeerRefusedError

    gone = os.path.join(spawn.run_dir, "rank1-gone")
    batch = BatchSpec([256], None, n_heads=2, n_kv_heads=2, head_dim=8, dtype="float32")
    with torch_dcp.context_parallel(mesh, batch=batch, planner="ring", block_size=32, timeout=30) as ctx:
        q = torch.randn(1, 2, ctx.plan.local_tokens(rank), 8)
        if rank == 1:
            with pytest.raises(ValueError, match="attn_mask"):
                F.scaled_dot_product_attention(q, q, q, is_causal=True, attn_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool))
            open(gone, "w").close()
            os._exit(0)  # its connections close with the process
        deadline = time.monotonic() + 30
        while not os.path.exists(gone):
            assert time.monotonic() < deadline, "rank 1 never refused"
            time.sleep(0.02)
        time.sleep(0.5)  # rank 1's process has ended
        with pytest.raises(PeerRefusedError) as err:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert err.value.peers == [1] and "attn_mask" in err.value.reason, err.value


def test_a_peer_that_refused_and_left_is_reported_as_a_refusal(tmp_path):
    run_ranks(_refused_then_gone, 2, tmp_path, timeout=90, dies=(1,), barrier=False)


def test_autocast_casts_sdpa_inputs_as_autocast_does():
    """The SDPA interception's cast inside torch.autocast gives SDPA's inputs the dtypes autocast
    gives them (fp32 and bf16 mixed in, float64 left alone): the same output bit for bit."""
    import torch.nn.functional as F

    from torch_dcp.context import _autocast

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 33, 16, generator=g), torch.randn(1, 2, 33, 16, generator=g)
    v = torch.randn(1, 2, 33, 16, generator=g).bfloat16()
    assert _autocast(q, k, v) == (q, k, v)  # outside autocast: as is
    with torch.autocast("cpu", torch.bfloat16):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        cq, ck, cv = _autocast(q, k, v)
        w64 = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
        assert [t.dtype for t in _autocast(q.double(), torch.arange(3))] == [torch.float64, torch.int64]
    assert want.dtype == cq.dtype == ck.dtype == cv.dtype == torch.bfloat16 and w64.dtype == torch.float64
    assert torch.equal(F.scaled_dot_product_attention(cq, ck, cv, is_causal=True, enable_gqa=True), want)
