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


def _worker(rank: int, world: int, mesh) -> None:
    torch.manual_seed(0)
    for name, (mask, planner) in CASES.items():
        batch = BatchSpec([1, 19, 50, 6, 33], mask, n_heads=8, n_kv_heads=2, head_dim=32, dtype="float32")
        plan = torch_dcp.plan(batch, world, planner=planner, block_size=8, divisions=3)
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
