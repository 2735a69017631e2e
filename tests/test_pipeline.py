"""Pipeline parallelism beside DCP: padded rows, microbatch plans, bound stage chunk calls (gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_dcp
from torch_dcp import BatchSpec, Causal, Lambda, SharedQuestion
from torch_dcp.executor.padding import PaddedRows
from torch_dcp.pipeline import MicrobatchPlans
from reference import random_qkv, reference_with_grads
from spawn import run_ranks

LENS = [[23, 5, 40], [7, 61], [30, 30, 8]]  # three microbatches' documents (68 tokens each)
CAPACITY = 48  # every rank's tokens padded to this (> 68 / 2)


def _padded(t: torch.Tensor, idx: torch.Tensor, capacity: int) -> torch.Tensor:
    """``t [T, heads, D]`` at ``idx``, zero rows up to ``capacity``, as ``[1, heads, capacity, D]``."""
    out = t.new_zeros((capacity, *t.shape[1:]))
    out[: len(idx)] = t[idx]
    return out.transpose(0, 1).unsqueeze(0).contiguous()


def _microbatches_exact(rank, world, mesh):
    """Each microbatch's plan in its own context of padded calls, run out of order (a pipeline
    schedule's forwards and backwards interleave): real rows equal the float64 reference,
    forward and backward; padding rows give zero outputs and zero gradients."""
    masks = (Causal(), Lambda(sink=3, window=9), SharedQuestion(0.25, 3))
    plans = MicrobatchPlans(mesh, CAPACITY)
    batches = [BatchSpec(lens, m, n_heads=4, n_kv_heads=2, head_dim=8, dtype="float64") for lens, m in zip(LENS, masks)]
    for b in batches:
        assert plans.add(torch_dcp.plan(b, world, planner="greedy", block_size=8)) == batches.index(b)
    saved = {}
    for i in (1, 0, 2):  # forwards out of order
        q, k, v, go = random_qkv(batches[i], torch.float64, seed=i)
        with plans.microbatch(i) as ctx:
            assert ctx.rows == CAPACITY
            idx = torch.from_numpy(ctx.plan.token_indices(rank))
            ql, kl, vl = (_padded(t, idx, CAPACITY).requires_grad_(True) for t in (q, k, v))
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
        assert out.shape == ql.shape
        saved[i] = (idx, (q, k, v, go), (ql, kl, vl), out)
    for i in (2, 0, 1):  # backwards in another order, each in its microbatch's context
        idx, (q, k, v, go), (ql, kl, vl), out = saved[i]
        with plans.microbatch(i):
            out.backward(_padded(go, idx, CAPACITY))
        ref = reference_with_grads(batches[i], q, k, v, go)
        n = len(idx)
        for what, got, want in (("out", out, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]),
                                ("dv", vl.grad, ref[3])):
            rows = got.detach()[0].transpose(0, 1)
            err = (rows[:n] - want[idx]).abs().max().item()
            assert err <= 1e-10, f"microbatch {i} {what}: error {err:.2e}"
            assert torch.count_nonzero(rows[n:]) == 0, f"microbatch {i} {what}: padding rows not zero"
    assert plans.contexts == 6
    with pytest.raises(IndexError, match="microbatch 3 has no plan"):
        with plans.microbatch(3):
            pass
    # a call that does not carry the capacity is refused before any communication
    with plans.microbatch(0) as ctx:
        n = ctx.plan.local_tokens(rank)
        q = torch.zeros(1, 4, n, 8, dtype=torch.float64)
        with pytest.raises(ValueError, match=f"sequence length {n}"):
            F.scaled_dot_product_attention(q, q[:, :2], q[:, :2], is_causal=True, enable_gqa=True)


def test_microbatch_plans_exact_with_padding_on_2_ranks(tmp_path):
    run_ranks(_microbatches_exact, 2, tmp_path)


def _refusals(rank, world, mesh):
    batch = BatchSpec([70, 10], Causal(), n_heads=2, n_kv_heads=2, head_dim=8, dtype="float64")
    plan = torch_dcp.plan(batch, world, planner="greedy", block_size=8)
    most = max(plan.local_tokens(r) for r in range(world))
    with pytest.raises(ValueError, match=f"plan puts up to {most} tokens on a rank"):
        with torch_dcp.context_parallel(mesh, plan=plan, padded_tokens=most - 1):
            pass
    with pytest.raises(ValueError, match="give no buffers"):
        with torch_dcp.context_parallel(mesh, plan=plan, padded_tokens=most,
                                        buffers=[torch.zeros(1, 80)], buffer_seq_dims=[1]):
            pass
    plans = MicrobatchPlans(mesh, most - 1)
    with pytest.raises(ValueError, match=f"microbatch 0: .*={most - 1}, but the plan puts up to {most} tokens on a rank"):
        plans.add(plan)
    assert len(plans) == 0


def test_capacity_refusals_on_2_ranks(tmp_path):
    run_ranks(_refusals, 2, tmp_path)


def test_pad_and_bad_capacity():
    plans = MicrobatchPlans(None, 5)
    assert plans.pad(torch.tensor([[1, 2, 3]]), -100).tolist() == [[1, 2, 3, -100, -100]]
    with pytest.raises(ValueError, match="6 tokens, more than the capacity of 5"):
        plans.pad(torch.arange(6), 0)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="capacity must be a positive integer"):
            MicrobatchPlans(None, bad)


def test_padded_rows_refuse_a_capacity_below_the_tokens_and_calls_of_other_lengths():
    with pytest.raises(ValueError, match="puts 9 tokens on this rank, more than the 8 rows"):
        PaddedRows(object(), 9, 8)

    class Echo:
        def forward(self, q, k, v, scale=None):
            return q * 2, q[..., 0]

    rows = PaddedRows(Echo(), 3, 5)
    q = torch.ones(5, 2, 4)
    out, lse = rows.forward(q, q, q)
    assert out.shape == (5, 2, 4) and out[:3].eq(2).all() and out[3:].eq(0).all() and lse.shape == (5, 2)
    with pytest.raises(ValueError, match="have 4 rows, every call of this context carries 5"):
        rows.forward(q[:4], q[:4], q[:4])


class _Stage:
    """The two chunk calls of a pipeline stage, recording the plan bound when each runs."""

    def __init__(self):
        self.seen = []

    def forward_one_chunk(self, chunk, args, kwargs=None, save_forward_output=True):
        self.seen.append(("F", chunk, torch_dcp.context.active_context().plan.digest()))

    def backward_one_chunk(self, chunk, loss=None, full_backward=True, last_backward=False):
        self.seen.append(("B", chunk, torch_dcp.context.active_context().plan.digest()))


def _bind(rank, world, mesh):
    plans = MicrobatchPlans(mesh, 64)
    digests = []
    for lens in LENS:
        p = torch_dcp.plan(BatchSpec(lens, Causal(), n_heads=2, n_kv_heads=2, head_dim=8), world, block_size=8)
        plans.add(p)
        digests.append(p.digest())
    stage = _Stage()
    plans.bind(stage)
    for kind, chunk in (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)):  # 1F1B's order
        if kind == "F":
            stage.forward_one_chunk(chunk, ())
        else:
            stage.backward_one_chunk(chunk, last_backward=chunk == 2)
        assert torch_dcp.context.active_context() is None
    assert stage.seen == [(k, c, digests[c]) for k, c in (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2))]
    with pytest.raises(ValueError, match="already bound"):
        plans.bind(stage)


def test_bound_stage_runs_each_chunk_in_its_microbatch_context(tmp_path):
    run_ranks(_bind, 2, tmp_path)
