"""``torch.compile`` of a model whose SDPA runs inside ``torch_dcp.context_parallel`` (CPU, gloo).

The attention must compile without a graph break (``fullgraph=True``, ``aot_eager``), run the
plan's executor when the graph runs (``torch_dcp::attention`` is one opaque op in the graph),
give the eager result, and serve the next step's plan (other token counts per rank, a
head-parallel plan) without a graph per plan.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_dcp
from torch_dcp import BatchSpec, Causal, Topology
from reference import reference_attention
from spawn import run_ranks

H, HKV, D, DIM = 4, 2, 8, 32
#: (documents, planner, head parallelism): each a new plan, with other token counts per rank
STEPS = [([13, 40, 7, 22], "dcp", 1), ([31, 5, 44], "greedy", 1), ([9, 27, 18, 19], "ring", 2)]


class _Model(nn.Module):
    """A linear projection to Q, K, V (GQA), causal SDPA, and a loss against fixed targets."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, (H + 2 * HKV) * D)
        self.is_causal = True

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = self.qkv(x).split([H * D, HKV * D, HKV * D], dim=-1)
        q, k, v = (t.view(1, s, -1, D).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal, enable_gqa=True)
        return (out.transpose(1, 2).reshape(1, s, H * D) * target).sum()


def _step(model, mesh, batch, planner, hp, x, target):
    """The global loss and this rank's parameter gradients of one step inside the context."""
    model.zero_grad()
    plan = torch_dcp.plan(batch, Topology.single_node(mesh.size()), planner=planner, block_size=8,
                          head_parallel=hp)
    xs, ts = x.clone(), target.clone()
    with torch_dcp.context_parallel(mesh, buffers=[xs, ts], buffer_seq_dims=[1, 1], plan=plan):
        loss = model(xs, ts)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    params = getattr(model, "_orig_mod", model).named_parameters()  # (a compiled module's are its original's)
    return float(total), {n: p.grad.clone() for n, p in params}


def _compiled_matches_eager(rank, world, mesh):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Model()
    compiled_counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=compiled_counter, fullgraph=True)
    for i, (lens, planner, hp) in enumerate(STEPS):
        batch = BatchSpec(lens, Causal(), n_heads=H, n_kv_heads=HKV, head_dim=D, dtype="float32")
        g = torch.Generator().manual_seed(i)
        x = torch.randn(1, batch.total_tokens, DIM, generator=g)
        target = torch.randn(1, batch.total_tokens, H * D, generator=g)
        eager_loss, eager_grads = _step(model, mesh, batch, planner, hp, x, target)
        loss, grads = _step(compiled, mesh, batch, planner, hp, x, target)
        assert abs(loss - eager_loss) <= 1e-5 * abs(eager_loss), (i, loss, eager_loss)
        for n, grad in eager_grads.items():
            torch.testing.assert_close(grads[n], grad, rtol=1e-5, atol=1e-5, msg=f"step {i} grad {n}")
        # the global loss is the dense one (no context parallelism)
        with torch.no_grad():
            q, k, v = model.qkv(x[0]).split([H * D, HKV * D, HKV * D], dim=-1)
            ref = reference_attention(batch, q.view(-1, H, D), k.view(-1, HKV, D), v.view(-1, HKV, D))
            ref_loss = float((ref.reshape(-1, H * D) * target[0].double()).sum())
        assert abs(loss - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss)), (i, loss, ref_loss)
    # one graph with static shapes, then one with a dynamic token count: no graph per plan
    assert compiled_counter.frame_count <= 2, compiled_counter.frame_count

    # no graph break: explain traces the same forward inside a context
    batch = BatchSpec(STEPS[0][0], Causal(), n_heads=H, n_kv_heads=HKV, head_dim=D, dtype="float32")
    x, target = torch.randn(1, batch.total_tokens, DIM), torch.randn(1, batch.total_tokens, H * D)
    with torch_dcp.context_parallel(mesh, buffers=[x, target], buffer_seq_dims=[1, 1], batch=batch, block_size=8):
        explained = torch._dynamo.explain(model)(x, target)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        ops = [n.target for gm in explained.graphs for n in gm.graph.nodes if n.op == "call_function"]
        assert torch.ops.torch_dcp.attention.default in ops or torch.ops.torch_dcp.attention in ops, ops

        # a call that contradicts the plan raises the eager wrapper's error, on every rank, also compiled
        model.is_causal = False
        with pytest.raises(ValueError, match="is_causal=False, but the context's mask is causal"):
            compiled(x, target)
        model.is_causal = True
        # one that contradicts any plan is found while tracing: with fullgraph, Dynamo's error names it
        masked = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, attn_mask=q[..., 0] > 0),
                               backend="aot_eager", fullgraph=True)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="SDPA got an explicit attn_mask"):
            masked(torch.zeros(1, H, x.shape[1], D))

    # outside the context the compiled model is PyTorch's SDPA again (the graph is guarded on it)
    x, target = torch.randn(1, 12, DIM), torch.randn(1, 12, H * D)
    torch.testing.assert_close(compiled(x, target), model(x, target))


def test_compiled_sdpa_has_no_graph_break_and_matches_eager(tmp_path):
    """2 ranks, three steps with new plans each (dcp, greedy, ring with head parallelism 2):
    ``fullgraph=True`` compiles, losses and gradients equal eager and the dense reference, at
    most two graphs (static, then a dynamic token count)."""
    run_ranks(_compiled_matches_eager, 2, tmp_path, timeout=240)
