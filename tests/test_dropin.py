"""torch_dcp.context_parallel as a drop-in for PyTorch's context_parallel: code written for
PyTorch's (buffers of B rows, no batch=, context_parallel_unshard) with only the import changed,
on gloo ranks, against one process's attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_dcp
from torch_dcp import BatchSpec, Causal, Full, Lambda, context_parallel, context_parallel_unshard
from spawn import run_ranks


def _sdpa_rows(rank, world, mesh):
    """PyTorch's own test pattern: q, k, v ``[8, 8, 64 W, 32]`` are the buffers (seq dim 2),
    made to require grad inside; causal and bidirectional, forward only and forward + backward,
    eager and compiled (``aot_eager``, fullgraph); out and gradients gathered back with
    ``context_parallel_unshard``, against SDPA on the whole rows (float32: 2e-6, upstream's
    tolerance for its exact kernel; bfloat16: upstream's ``1e-3 W`` and ``8e-3 W``)."""
    for dtype, causal, forward_only, compiled, named in [
        (torch.float32, True, False, False, False), (torch.float32, False, False, False, False),
        (torch.float32, False, False, False, True), (torch.float32, True, True, False, False),
        (torch.float32, True, False, True, False), (torch.bfloat16, True, False, False, False),
    ]:
        label = f"{dtype} causal={causal} forward_only={forward_only} compiled={compiled} mask named={named}"
        torch.manual_seed(10)
        q, k, v = (torch.rand(8, 8, 64 * world, 32, dtype=dtype, requires_grad=True) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if not forward_only:
            out.sum().backward()
        exact = _float32_reference(q, k, v, causal) if dtype == torch.bfloat16 else None
        cq, ck, cv = (t.detach().clone() for t in (q, k, v))
        mask = {"mask": Causal() if causal else Full()} if named else {}  # unnamed: as the first call says
        with context_parallel(mesh, buffers=(cq, ck, cv), buffer_seq_dims=(2, 2, 2), **mask) as ctx:
            assert cq.shape[0] == 1 and cq.shape[2] == ctx.plan.local_tokens(rank), label
            assert ctx.plan.planner.startswith("dcp"), ctx.plan.planner
            for t in (cq, ck, cv):
                t.requires_grad = True
            fn = F.scaled_dot_product_attention
            if compiled:
                fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
            if forward_only:
                with torch.no_grad():
                    cp_out = fn(cq, ck, cv, is_causal=causal)
            else:
                cp_out = fn(cq, ck, cv, is_causal=causal)
                cp_out.sum().backward()
            (full,) = context_parallel_unshard(mesh, [cp_out], [2])
            assert full.shape == out.shape, label
            got = [full] + ([] if forward_only else context_parallel_unshard(mesh, [cq.grad, ck.grad, cv.grad], [2] * 3))
            want = [out] + ([] if forward_only else [q.grad, k.grad, v.grad])
            for name, g, w, x, atol in zip(("out", "dq", "dk", "dv"), got, want, exact or want,
                                           (2e-6, 2e-6, 2e-6, 2e-6) if dtype == torch.float32 else
                                           (1e-3 * world, *[8e-3 * world] * 3)):
                # within upstream's tolerance, or (bfloat16) closer to float32 than upstream's bf16 reference
                err = (g.float() - w.float()).abs().max().item()
                closer = (g.float() - x).abs().max().item() <= (w.float() - x).abs().max().item()
                assert err <= atol or (dtype == torch.bfloat16 and closer), f"{label}: {name} {err:.2e}"
            for t in (cq, ck, cv):
                t.requires_grad = False
        assert cq.shape == q.shape and torch.equal(cq, q.detach()), f"{label}: the buffer was not restored"


def _float32_reference(q, k, v, causal):
    """Out, dq, dk, dv of SDPA on ``q, k, v`` in float32 (``out.sum()`` backward)."""
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
    out.sum().backward()
    return [out.detach(), q32.grad, k32.grad, v32.grad]


def _rope(x, freqs):
    """Rotary embedding: ``x: [B, S, H, D]``, ``freqs: [S, D/2]`` (complex)."""
    xc = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(-2).to(x.dtype)


class _Attention(torch.nn.Module):
    """A model's attention as PyTorch context-parallel users write it: ``bsz, seqlen`` from its
    input, RoPE from a per-position table, GQA through ``enable_gqa``."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.emb = torch.nn.Embedding(64, dim, dtype=torch.float64)
        self.wq = torch.nn.Linear(dim, dim, dtype=torch.float64)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, dtype=torch.float64)

    def forward(self, tokens, freqs):
        bsz, seqlen = tokens.shape
        x = self.emb(tokens)
        q = self.wq(x).view(bsz, seqlen, self.heads, self.head_dim)
        k, v = self.wkv(x).view(bsz, seqlen, 2, self.kv_heads, self.head_dim).unbind(2)
        q, k = _rope(q, freqs), _rope(k, freqs)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=True)
        return out.transpose(1, 2).reshape(bsz, seqlen, -1)


def _model_code(rank, world, mesh):
    """Model code written for PyTorch's context_parallel: ``[B, S]`` token ids and labels, a RoPE
    table ``[S, D/2]`` (seq dim 0), ``view(bsz, seqlen, ...)``; the attention's heads are learnt
    at the first SDPA call. Loss (a sum over this rank's tokens) and the gradients summed over
    the ranks match one process (float64)."""
    torch.manual_seed(0)
    model = _Attention()
    rows, seq = 3, 10 * world + 1
    tokens = torch.randint(0, 64, (rows, seq))
    labels = torch.randn(rows, seq, 32, dtype=torch.float64)
    inv_freq = 10.0 ** -torch.arange(4, dtype=torch.float64)  # head_dim 8: 4 rotary pairs
    freqs = torch.polar(torch.ones(seq, 4, dtype=torch.float64), torch.arange(seq)[:, None] * inv_freq)
    want = ((model(tokens, freqs) - labels) ** 2).sum()
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    with context_parallel(mesh, buffers=[tokens, labels, freqs], buffer_seq_dims=[1, 1, 0]) as ctx:
        assert ctx.plan.batch.n_heads == 8  # nominal until the first SDPA call
        assert tokens.shape == (1, ctx.plan.local_tokens(rank)) and freqs.shape[0] == tokens.shape[1]
        loss = ((model(tokens, freqs) - labels) ** 2).sum()
        spec = ctx.plan.batch
        assert (spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.dtype) == (4, 2, 8, "float64"), spec
        grads = torch.autograd.grad(loss, list(model.parameters()))
    assert tokens.shape == (rows, seq) and freqs.shape == (seq, 4)
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert abs(total.item() - want.item()) <= 1e-10 * abs(want.item()), (total.item(), want.item())
    for g, w in zip(grads, want_grads):
        g = g.clone()
        dist.all_reduce(g)
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-10), (g - w).abs().max()


def _rows_in_calls(rank, world, mesh):
    """SDPA calls of ``[B, H, S_local / B, D]`` split this rank's tokens row after row, with and
    without ``batch=``; a λ mask named with ``mask=``; ``torch_dcp.plan`` defaults to dcp."""
    batch = BatchSpec([8, 12, 4, 8], Causal(), n_heads=2, n_kv_heads=2, head_dim=4, dtype="float64")
    assert torch_dcp.plan(batch, world, block_size=4).planner.startswith("dcp")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 32, 4, dtype=torch.float64, generator=g) for _ in range(3))
    from reference import reference_attention

    for kind in ("batch", "rows"):
        if kind == "batch":  # the documents described
            cm = context_parallel(mesh, batch=batch, block_size=4)
        else:  # four rows of 8 tokens under a λ mask, the heads learnt at the first call
            cm = context_parallel(mesh, buffers=[torch.zeros(4, 8)], buffer_seq_dims=[1], mask=Lambda(sink=1, window=3))
        with cm as ctx:
            idx = torch.from_numpy(ctx.plan.token_indices(rank))
            n = len(idx)
            ql, kl, vl = (t[:, :, idx].clone().requires_grad_(True) for t in (q, k, v))
            b = 2 if n % 2 == 0 and n else 1
            out = F.scaled_dot_product_attention(*(t[0].unflatten(1, (b, n // b)).transpose(0, 1) for t in (ql, kl, vl)),
                                                 is_causal=True)
            assert out.shape == (b, 2, n // b, 4)
            out.square().sum().backward()
            spec = ctx.plan.batch
        assert spec.n_heads == 2 and spec.head_dim == 4 and spec.dtype == "float64", spec
        qg, kg, vg = (t[0].transpose(0, 1).clone().requires_grad_(True) for t in (q, k, v))
        ref = reference_attention(spec, qg, kg, vg)
        ref.square().sum().backward()
        got = out.detach().transpose(0, 1).flatten(1, 2).transpose(0, 1)  # [n, H, D]
        assert torch.allclose(got, ref.detach()[idx], atol=1e-10), kind
        assert torch.allclose(ql.grad[0].transpose(0, 1), qg.grad[idx], atol=1e-10), kind


def _refusals(rank, world, mesh):
    """Every inconsistent combination refused by name, on every rank, before any transfer."""
    q = torch.zeros(2, 2, 8, 4)
    with pytest.raises(ValueError, match="no torch_dcp.context_parallel context has run on this mesh"):
        context_parallel_unshard(mesh, [q], [2])
    cases = [
        (dict(buffers=[q], buffer_seq_dims=[2], batch=BatchSpec([16], Causal(), n_heads=2, n_kv_heads=2, head_dim=4,
                                                                dtype="float32"), mask=Full()), "mask= is for"),
        (dict(buffers=[q], buffer_seq_dims=[2], head_parallel=2), "head_parallel needs batch="),
        (dict(buffers=[q, torch.zeros(2, 9)], buffer_seq_dims=[2, 1]), "different sequence lengths"),
        (dict(buffers=[q, torch.zeros(3, 8)], buffer_seq_dims=[2, 1]), "different batch sizes"),
        (dict(buffers=[q], buffer_seq_dims=[2], batch=BatchSpec([12], Causal(), n_heads=2, n_kv_heads=2, head_dim=4,
                                                                dtype="float32")), "2 rows of 8 tokens"),
        (dict(), "give batch=, plan= or buffers="),
        (dict(buffers=[q], buffer_seq_dims=[2], mask="causal"), "mask must be a torch_dcp mask spec"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            with context_parallel(mesh, **kwargs):
                pass
    with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2], mask=Causal()):
        with pytest.raises(ValueError, match=r"mask=torch_dcp.Full\(\)"):
            F.scaled_dot_product_attention(q, q, q)
    with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):  # the first call sets the mask
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with pytest.raises(ValueError, match=r"set by the context's first SDPA call"):
            F.scaled_dot_product_attention(q, q, q)
        x = torch.zeros(2, 2, 4, 4)
        with pytest.raises(ValueError, match="batch sizes 1/2/2"):
            F.scaled_dot_product_attention(x[:1], x, x, is_causal=True)
    with pytest.raises(ValueError, match="load_balancer must be None"):
        context_parallel_unshard(mesh, [q], [2], load_balancer=object())


@pytest.mark.parametrize("world", [2, 3])
def test_pytorch_cp_test_pattern_with_the_import_swapped(world, tmp_path):
    run_ranks(_sdpa_rows, world, tmp_path)


def test_model_code_written_for_pytorch_cp(tmp_path):
    run_ranks(_model_code, 3, tmp_path)


def test_rows_in_sdpa_calls_and_named_masks(tmp_path):
    run_ranks(_rows_in_calls, 2, tmp_path)


def test_inconsistent_combinations_are_refused(tmp_path):
    run_ranks(_refusals, 2, tmp_path)
