"""Dense masked attention reference (float64 on CPU) and helpers shared by the tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_dcp import BatchSpec


def dense_batch_mask(batch: BatchSpec) -> np.ndarray:
    """bool [T, T]: the batch's masks inside each document, nothing across documents."""
    T = batch.total_tokens
    m = np.zeros((T, T), bool)
    cu = batch.cu_seqlens
    for d in range(batch.n_docs):
        a, b = cu[d], cu[d + 1]
        m[a:b, a:b] = batch.mask_of(d).dense(b - a)
    return m


def reference_attention(batch: BatchSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense attention over the whole packed batch. q: [T, H, D], k, v: [T, H_kv, D].

    Computed in float64; rows that see no key give 0. Differentiable.
    """
    mask = torch.from_numpy(dense_batch_mask(batch))
    g = batch.n_heads // batch.n_kv_heads
    q64, k64, v64 = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q64, k64) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, -float("inf"))
    p = torch.softmax(s, -1)
    p = torch.where(mask, p, torch.zeros_like(p))  # fully masked rows: NaN -> 0
    return torch.einsum("hqk,khd->qhd", p, v64)


def random_qkv(batch: BatchSpec, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T, H, Hkv, D = batch.total_tokens, batch.n_heads, batch.n_kv_heads, batch.head_dim
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(T, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(T, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    go = torch.randn(T, H, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, go


def reference_with_grads(batch: BatchSpec, q, k, v, go):
    """(out, dq, dk, dv) of the dense reference, float64."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out = reference_attention(batch, q, k, v)
    out.backward(go.double())
    return out.detach(), q.grad, k.grad, v.grad


def assert_emulation_exact(plan, batch: BatchSpec, tol: float = 1e-10, seed: int = 0) -> None:
    """``plan`` emulated in one process with the reference kernel, forward and backward, within
    ``tol`` of the float64 dense reference (out, dq, dk, dv) on random float64 inputs."""
    import torch_dcp

    q, k, v, go = random_qkv(batch, torch.float64, seed)
    want = reference_with_grads(batch, q, k, v, go)
    got = torch_dcp.emulate(plan, q, k, v, go, kernel="reference")
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert (g - w).abs().max().item() < tol, name


def needs_cuda(reason: str = "needs a CUDA device"):
    """Decorator of a GPU test: marked ``cuda`` (``pytest -m cuda`` selects the suite's CUDA
    tests, as ``benchmarks gpu-report`` does) and skipped where no CUDA device is available."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)

    def mark(fn):
        return pytest.mark.cuda(skip(fn))

    return mark


def context_step_errors(mesh, batch: BatchSpec, rank: int, q, k, v, go, ref, **context_args) -> dict[str, float]:
    """One SDPA forward + backward of the global ``q, k, v: [T, H(_kv), D]`` (upstream gradient
    ``go``) inside ``torch_dcp.context_parallel(mesh, ..., batch=batch, **context_args)`` (a
    ``plan`` in ``context_args`` instead of ``batch``) on
    this rank: the max abs error of its out, dq, dk, dv against ``ref`` (from
    :func:`reference_with_grads`) on the tokens it holds (0.0 for a rank without tokens)."""
    import torch.nn.functional as F

    import torch_dcp

    qb, kb, vb, gb = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, go))
    if "plan" not in context_args:  # a plan given is the batch's
        context_args = {**context_args, "batch": batch}
    with torch_dcp.context_parallel(mesh, buffers=[qb, kb, vb, gb], buffer_seq_dims=[2, 2, 2, 2],
                                    **context_args) as ctx:
        ql, kl, vl = (t.clone().requires_grad_(True) for t in (qb, kb, vb))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
        out.backward(gb)
        idx = torch.from_numpy(ctx.plan.token_indices(rank))
        return {what: (got.detach()[0].transpose(0, 1).double() - want[idx]).abs().max().item() if len(idx) else 0.0
                for what, got, want in (("out", out, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]),
                                        ("dv", vl.grad, ref[3]))}


def assert_replay_matches_eager(mesh, rank: int, plan, batch: BatchSpec, layers: int = 3) -> None:
    """Layer replay records ``plan``'s runtime like any plan: ``layers`` causal SDPA layers inside
    ``torch_dcp.context_parallel(mesh, plan=plan)`` with an eager recorder (every layer after
    the first of each pass replayed) give, bit for bit, the outputs and gradients without replay."""
    import torch_dcp
    from torch_dcp.executor.replay import EagerRecorder

    q, k, v, go = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in random_qkv(batch, torch.float32, seed=5))
    runs = []
    for replay in (EagerRecorder(), False):
        with torch_dcp.context_parallel(mesh, buffers=[q.clone(), k.clone(), v.clone(), go.clone()],
                                        buffer_seq_dims=[2, 2, 2, 2], plan=plan, replay=replay) as ctx:
            idx = torch.from_numpy(ctx.plan.token_indices(rank))
            ql, kl, vl = (t[:, :, idx].clone().requires_grad_(True) for t in (q, k, v))
            outs = [torch.nn.functional.scaled_dot_product_attention(ql * (i + 1), kl, vl, is_causal=True,
                                                                     enable_gqa=True) for i in range(layers)]
            torch.stack(outs).sum(0).backward(go[:, :, idx])
            runs.append([o.detach() for o in outs] + [ql.grad, kl.grad, vl.grad])
            if replay:
                assert replay.records == 2 and ctx.replay.replays == 2 * layers
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def assert_stalled_peer_times_out(executor_cls, plan, rank: int, match: str, timeout: float = 3.0) -> None:
    """Rank 1 never takes part; every other rank's forward of ``plan`` on ``executor_cls`` over
    the default group raises ``TransferTimeoutError`` (its message matching ``match``) within
    the transport's ``timeout`` (plus slack), instead of hanging."""
    import datetime
    import time

    from torch_dcp.executor import TorchDistributedTransport, TransferTimeoutError

    transport = TorchDistributedTransport(None, timeout=datetime.timedelta(seconds=timeout))
    ex = executor_cls(plan, rank, transport)
    b, n = plan.batch, plan.local_tokens(rank)
    q, k, v = (torch.randn(n, h, b.head_dim) for h in (b.n_heads, b.n_kv_heads, b.n_kv_heads))
    if rank == 1:  # never joins
        time.sleep(2 * timeout)
        return
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=match):
        ex.forward(q, k, v)
    assert time.monotonic() - t0 < timeout + 5


def assert_bf16_close(plan, batch: BatchSpec, rel: float = 0.05, seed: int = 3) -> None:
    """``plan`` emulated in bfloat16 stays within ``rel`` (max abs error over the reference's max
    magnitude) of the float64 reference, out and every gradient: partials summed in bfloat16
    on the way (a static runtime's dK/dV in the K/V dtype) lose no more than that."""
    import torch_dcp

    q, k, v, go = random_qkv(batch, torch.float64, seed)
    got = torch_dcp.emulate(plan, *(t.bfloat16() for t in (q, k, v, go)))
    ref = reference_with_grads(batch, q, k, v, go)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        err = (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
        assert err < rel, f"{name}: relative error {err:.3f}"
