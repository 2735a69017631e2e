"""torch_dcp.context_parallel on real gloo process groups."""

from __future__ import annotations

import contextlib
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_dcp
from torch_dcp import BatchSpec, BlockwiseCausal, Causal, Full, Lambda, Ranges, SharedQuestion, Topology
from torch_dcp.attention_op import use_executor
from torch_dcp.executor import InProcessTransport, Mailbox, RankExecutor
from reference import context_step_errors, random_qkv, reference_with_grads
from spawn import run_ranks

LENS = [1, 19, 45, 6, 33]


def _masks():
    fwd_ranges = [Ranges([[(0, min(n, i + 3))] for i in range(n)]) for n in LENS]  # sees 2 keys ahead
    return {
        "causal": (Causal(), True),
        "full": (Full(), False),
        "lambda": (Lambda(sink=3, window=9), True),
        "blockwise": (BlockwiseCausal(block=4, window_blocks=2, sink_blocks=1), True),
        "shared_question": (SharedQuestion(0.25, 3), True),
        "ranges_forward": (fwd_ranges, False),
    }


def _spawn(fn, world, tmp_path):
    run_ranks(fn, world, tmp_path)


TOLS = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _check_attention(ctx, rank, q, k, v, go, ref, causal, gqa, label):
    """SDPA on this rank's tokens of the global ``q, k, v, go: [T, H(_kv), D]`` inside ``ctx``,
    forward and backward; out, dq, dk, dv compared with the float64 reference ``ref``
    (tolerance by dtype, relative to the magnitude of the reference when that is above 1)."""
    idx = torch.from_numpy(ctx.plan.token_indices(rank))
    h, hkv = q.shape[1], k.shape[1]
    ql, kl, vl = (t[idx].transpose(0, 1).unsqueeze(0).clone().requires_grad_(True) for t in (q, k, v))
    kk, vv = (kl, vl) if gqa else (t.repeat_interleave(h // hkv, 1) for t in (kl, vl))
    out = F.scaled_dot_product_attention(ql, kk, vv, is_causal=causal, enable_gqa=gqa)
    assert type(out) is torch.Tensor and out.shape == ql.shape and out.dtype == q.dtype
    out.backward(go[idx].transpose(0, 1).unsqueeze(0))
    tol = TOLS[q.dtype]
    for what, got, want in (("out", out, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]),
                            ("dv", vl.grad, ref[3])):
        assert got.dtype == q.dtype, f"{label} {what}: dtype {got.dtype}"
        want = want[idx]
        err = (got.detach()[0].transpose(0, 1).double() - want).abs().max().item()
        bound = tol * max(1.0, want.abs().max().item())
        assert err <= bound, f"{label} {what}: error {err:.2e} > {bound:.2e}"


def _sdpa_matches_reference(rank, world, mesh):
    sdpa, handlers = F.scaled_dot_product_attention, dict(DTensor._op_dispatcher._custom_op_handlers)
    for name, (mask, causal) in _masks().items():
        for heads, gqa in (((8, 2), True), ((4, 4), False), ((8, 2), False)):
            h, hkv = heads
            batch = BatchSpec(LENS, mask, n_heads=h, n_kv_heads=hkv, head_dim=16, dtype="float32")
            q, k, v, go = random_qkv(batch, torch.float32, seed=3)
            ref = reference_with_grads(batch, q, k, v, go)
            # global [1, H, T, D] inputs, sharded by the context as buffers along dim 2
            qb, kb, vb, gb = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, go))
            repeat = not gqa and hkv != h
            with torch_dcp.context_parallel(mesh, buffers=[qb, kb, vb, gb], buffer_seq_dims=[2, 2, 2, 2],
                                            no_restore_buffers={gb}, batch=batch, block_size=8) as ctx:
                ql, kl, vl = (t.clone().requires_grad_(True) for t in (qb, kb, vb))
                kk, vv = (t.repeat_interleave(h // hkv, 1) for t in (kl, vl)) if repeat else (kl, vl)
                out = F.scaled_dot_product_attention(ql, kk, vv, is_causal=causal, enable_gqa=gqa)
                assert type(out) is torch.Tensor and out.shape == ql.shape
                out.backward(gb)
                idx = torch.from_numpy(ctx.plan.token_indices(rank))
                for what, got, want in (("out", out, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]),
                                        ("dv", vl.grad, ref[3])):
                    got = got[0].transpose(0, 1).double()
                    err = (got - want[idx]).abs().max().item()
                    assert err <= 1e-5, f"{name} heads={heads} gqa={gqa} {what}: error {err:.2e}"
                full_out = ctx.unshard(out.detach()[0].transpose(0, 1))
                assert (full_out.double() - ref[0]).abs().max().item() <= 1e-5
            # restored after exit (gb was not to be restored)
            assert torch.equal(qb, q.transpose(0, 1).unsqueeze(0))
            assert gb.shape[2] == ctx.plan.local_tokens(rank)
            assert F.scaled_dot_product_attention is sdpa
            assert DTensor._op_dispatcher._custom_op_handlers == handlers


def _head_parallel_matches_reference(rank, world, mesh):
    """Head-parallel plans on 4 gloo ranks: 2 x 2 with N = 2 (dcp outside) and 1 x 4 with N = 4
    (Ulysses), every mask, GQA with replicated key/value heads (8/2 over 4) and without."""
    for topo, n, planner in ((Topology(n_nodes=2, ranks_per_node=2), 2, "dcp"),
                             (Topology(n_nodes=1, ranks_per_node=4), 4, "ring")):
        for name, (mask, causal) in _masks().items():
            for h, hkv in ((8, 2), (4, 4)):
                batch = BatchSpec(LENS, mask, n_heads=h, n_kv_heads=hkv, head_dim=16, dtype="float64")
                q, k, v, go = random_qkv(batch, torch.float64, seed=5)
                ref = reference_with_grads(batch, q, k, v, go)
                plan = torch_dcp.plan(batch, topo, planner=planner, block_size=8, head_parallel=n)
                assert plan.head_parallel == n
                with torch_dcp.context_parallel(mesh, plan=plan) as ctx:
                    _check_attention(ctx, rank, q, k, v, go, ref, causal, True, f"{name} hp{n} {h}/{hkv}")


def _errors_and_restore(rank, world, mesh):
    sdpa, handlers = F.scaled_dot_product_attention, dict(DTensor._op_dispatcher._custom_op_handlers)
    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float32")
    q, k, v, go = random_qkv(batch, torch.float32)
    ref = reference_with_grads(batch, q, k, v, go)
    tokens = torch.arange(batch.total_tokens).unsqueeze(0)
    before = tokens.clone()

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with torch_dcp.context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1], batch=batch, block_size=8) as ctx:
            assert torch.equal(tokens[0], torch.from_numpy(ctx.plan.token_indices(rank)))
            raise Boom()
    assert torch.equal(tokens, before)
    assert F.scaled_dot_product_attention is sdpa and DTensor._op_dispatcher._custom_op_handlers == handlers

    # every call the plan cannot honour raises on every rank before any communication, so the
    # ranks stay in step: the same context, and the next one, still compute exactly
    with torch_dcp.context_parallel(mesh, batch=batch, block_size=8) as ctx:
        n = ctx.plan.local_tokens(rank)
        ql = q[:n].transpose(0, 1).unsqueeze(0)
        kl = k[:n].transpose(0, 1).unsqueeze(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            qa, ka = ql @ torch.eye(16), kl @ torch.eye(16)  # autocast runs matmuls in bfloat16
        qd = DTensor.from_local(ql, mesh, [Shard(2)], run_check=False)
        cases = [
            ((ql, kl, kl), dict(attn_mask=torch.ones(n, n, dtype=torch.bool), is_causal=False), "attn_mask"),
            ((ql, kl, kl), dict(dropout_p=0.1, is_causal=True), "dropout"),
            ((ql, kl, kl), dict(is_causal=False), "is_causal=False"),
            ((ql[:, :, :-1], kl[:, :, :-1], kl[:, :, :-1]), dict(is_causal=True), "sequence length"),
            ((ql.double(), kl.double(), kl.double()), dict(is_causal=True), "dtype torch.float64.*float32"),
            ((qa, ka, ka), dict(is_causal=True), "dtype torch.bfloat16.*float32.*autocast"),
            ((ql, kl.double(), kl), dict(is_causal=True), "key has dtype torch.float64"),
            ((ql[..., :8], kl[..., :8], kl[..., :8]), dict(is_causal=True), "head_dim 8"),
            ((ql[:, :2], kl, kl), dict(is_causal=True), "query has 2 heads"),
            ((ql, kl[:, :1], kl[:, :1]), dict(is_causal=True), "key/value have 1/1 heads"),
            ((ql, kl, kl.repeat_interleave(2, 1)), dict(is_causal=True), "key/value have 2/4 heads"),
            ((ql, kl, kl[:, :, :-1]), dict(is_causal=True), "value has sequence length"),
            ((ql, kl, kl[..., :8]), dict(is_causal=True), "value head_dim 8"),
            ((qd, kl, kl), dict(is_causal=True), "plain tensor"),
        ]
        for args, kwargs, msg in cases:
            with pytest.raises(ValueError, match=msg):
                F.scaled_dot_product_attention(*args, enable_gqa=True, **kwargs)
        with pytest.raises(ValueError, match="enable_gqa"):
            F.scaled_dot_product_attention(ql, kl, kl, is_causal=True)
        with pytest.raises(RuntimeError, match="already active"):
            with torch_dcp.context_parallel(mesh, batch=batch):
                pass
        _check_attention(ctx, rank, q, k, v, go, ref, True, True, "same context after errors")
    assert F.scaled_dot_product_attention is sdpa and DTensor._op_dispatcher._custom_op_handlers == handlers
    # an error that leaves the body: restored on exit, and the next context works
    with pytest.raises(ValueError, match="dtype"):
        with torch_dcp.context_parallel(mesh, batch=batch, block_size=8):
            F.scaled_dot_product_attention(ql.half(), kl.half(), kl.half(), is_causal=True, enable_gqa=True)
    assert F.scaled_dot_product_attention is sdpa and DTensor._op_dispatcher._custom_op_handlers == handlers
    with torch_dcp.context_parallel(mesh, batch=batch, block_size=8) as ctx:
        _check_attention(ctx, rank, q, k, v, go, ref, True, False, "next context after errors")

    full = BatchSpec(LENS, Full(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float32")
    with torch_dcp.context_parallel(mesh, batch=full, block_size=8) as ctx:
        n = ctx.plan.local_tokens(rank)
        ql = q[:n].transpose(0, 1).unsqueeze(0)
        kl = k[:n].transpose(0, 1).unsqueeze(0)
        with pytest.raises(ValueError, match="later key"):
            F.scaled_dot_product_attention(ql, kl, kl, is_causal=True, enable_gqa=True)

    # ranks that disagree on the batch
    other = BatchSpec(LENS if rank else LENS[::-1], Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float32")
    with pytest.raises(RuntimeError, match="different plans"):
        with torch_dcp.context_parallel(mesh, batch=other, block_size=8):
            pass
    with pytest.raises(ValueError, match="sequence length"):
        with torch_dcp.context_parallel(mesh, buffers=[tokens[:, :-1]], buffer_seq_dims=[1], batch=batch):
            pass
    with pytest.raises(ValueError, match="give batch=, plan= or buffers="):
        with torch_dcp.context_parallel(mesh):
            pass
    # PyTorch's own context parallel active -> refuse
    from torch.distributed.tensor.experimental import context_parallel as torch_cp

    buf = torch.zeros(1, 2 * world * 4)
    with torch_cp(mesh, buffers=[buf], buffer_seq_dims=[1]):
        with pytest.raises(RuntimeError, match="PyTorch context_parallel"):
            with torch_dcp.context_parallel(mesh, batch=batch):
                pass
    assert F.scaled_dot_product_attention is sdpa


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_sdpa_matches_reference(world, tmp_path):
    _spawn(_sdpa_matches_reference, world, tmp_path)


def test_context_parallel_head_parallel_plans(tmp_path):
    _spawn(_head_parallel_matches_reference, 4, tmp_path)


def test_context_parallel_errors_and_restoration(tmp_path):
    _spawn(_errors_and_restore, 2, tmp_path)


def _dtypes_and_backends(rank, world, mesh):
    """Every dtype, under the MATH backend and the default choice, GQA by enable_gqa and by
    repeated heads: the wrapper never reaches PyTorch's SDPA, so the backend does not matter."""
    masks = _masks()
    for dtype, mask_name in ((torch.float32, "causal"), (torch.float64, "shared_question"),
                             (torch.bfloat16, "lambda"), (torch.float16, "full")):
        mask, causal = masks[mask_name]
        batch = BatchSpec(LENS, mask, n_heads=8, n_kv_heads=2, head_dim=16, dtype=dtype)
        q, k, v, go = random_qkv(batch, dtype, seed=5)
        ref = reference_with_grads(batch, q, k, v, go)
        with torch_dcp.context_parallel(mesh, batch=batch, block_size=8) as ctx:
            for backend in ("math", "default"):
                for gqa in (True, False):
                    with sdpa_kernel(SDPBackend.MATH) if backend == "math" else contextlib.nullcontext():
                        _check_attention(ctx, rank, q, k, v, go, ref, causal, gqa,
                                         f"{dtype} {mask_name} {backend} gqa={gqa}")


def _aten_ops_reach_executor(rank, world, mesh):
    """A direct call of the aten CPU flash op (and, through autograd, its backward op) with
    DTensors inside the context runs the plan: exact against the document-masked reference."""
    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=4, head_dim=16, dtype="float32")
    q, k, v, go = random_qkv(batch, torch.float32, seed=7)
    ref = reference_with_grads(batch, q, k, v, go)
    with torch_dcp.context_parallel(mesh, batch=batch, block_size=8) as ctx:
        idx = torch.from_numpy(ctx.plan.token_indices(rank))
        ql, kl, vl = (t[idx].transpose(0, 1).unsqueeze(0).clone().requires_grad_(True) for t in (q, k, v))
        qd, kd, vd = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (ql, kl, vl))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qd, kd, vd, 0.0, True)
        assert isinstance(out, DTensor) and isinstance(lse, DTensor)
        assert lse.to_local().shape == (1, 4, len(idx)) and lse.dtype == torch.float32
        out.to_local().backward(go[idx].transpose(0, 1).unsqueeze(0))
        for what, got, want in (("out", out.to_local(), ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]),
                                ("dv", vl.grad, ref[3])):
            err = (got.detach()[0].transpose(0, 1).double() - want[idx]).abs().max().item()
            assert err <= 1e-5, f"aten op {what}: error {err:.2e}"
        # the torch_dcp op on DTensors sharded otherwise is refused
        from torch.distributed.tensor import Replicate

        rep = DTensor.from_local(ql.detach(), mesh, [Replicate()], run_check=False)
        with pytest.raises(ValueError, match="Shard"):
            torch.ops.torch_dcp.attention(rep, kd, vd, None)


# 4 ranks: test_context_parallel_sdpa_matches_reference[4]
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_every_dtype_and_sdpa_backend(world, tmp_path):
    _spawn(_dtypes_and_backends, world, tmp_path)


def test_context_parallel_direct_aten_sdpa_op_calls(tmp_path):
    _spawn(_aten_ops_reach_executor, 2, tmp_path)


def _single_rank_executor(batch):
    plan = torch_dcp.plan(batch, Topology.single_node(1), planner="greedy", block_size=4)
    return plan, RankExecutor(plan, 0, InProcessTransport(Mailbox(), 0))


def test_attention_op_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for dtype, lse_dtype in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                             (torch.float32, torch.float32), (torch.float64, torch.float64)):
        for hkv in (2, 8):
            with FakeTensorMode():  # no executor is bound: the fake impl needs none
                q = torch.empty(1, 8, 37, 16, dtype=dtype)
                k, v = torch.empty(1, hkv, 37, 16, dtype=dtype), torch.empty(1, hkv, 37, 16, dtype=dtype)
                out, lse, state = torch.ops.torch_dcp.attention(q, k, v, None)
                assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((1, 8, 37, 16), dtype, (1, 8, 37), lse_dtype)
                assert (state.shape, state.dtype) == ((0,), torch.uint8)  # nothing kept without a head-parallel plan
                dq, dk, dv = torch.ops.torch_dcp.attention_backward(out, q, k, v, out, lse, state, 0.25)
                assert [tuple(t.shape) for t in (dq, dk, dv)] == [(1, 8, 37, 16), (1, hkv, 37, 16), (1, hkv, 37, 16)]
                assert {t.dtype for t in (dq, dk, dv)} == {dtype}
                with pytest.raises(ValueError, match=r"\[1, heads, S_local, head_dim\]"):
                    torch.ops.torch_dcp.attention(q[0], k[0], v[0], None)


def test_attention_op_opcheck_and_plain_tensors():
    """On plain tensors the op runs the bound executor (this rank's shard); opcheck compares the
    real impl with the fake one and checks schema and autograd registration."""
    with pytest.raises(RuntimeError, match="context_parallel"):
        torch.ops.torch_dcp.attention(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    for dtype in (torch.float32, torch.bfloat16):
        batch = BatchSpec([5, 11], Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype=dtype)
        plan, ex = _single_rank_executor(batch)
        q, k, v, go = random_qkv(batch, dtype)
        ref = reference_with_grads(batch, q, k, v, go)
        idx = torch.from_numpy(plan.token_indices(0))
        sdpa = lambda t: t[idx].transpose(0, 1).unsqueeze(0).contiguous()  # noqa: E731
        args = [sdpa(q).requires_grad_(True), sdpa(k).requires_grad_(True), sdpa(v).requires_grad_(True), None]
        with use_executor(ex):
            if dtype == torch.bfloat16:  # (opcheck compiles: once is enough)
                torch.library.opcheck(torch.ops.torch_dcp.attention.default, args)
            out, lse, state = torch.ops.torch_dcp.attention(*args)
            assert not lse.requires_grad and not state.requires_grad
            out.backward(sdpa(go))
            if dtype == torch.bfloat16:
                torch.library.opcheck(torch.ops.torch_dcp.attention_backward.default,
                                      [sdpa(go), *(a.detach() for a in args[:3]), out.detach(), lse, state, 0.3])
            with pytest.raises(RuntimeError, match="already bound"):
                with use_executor(ex):
                    pass
        for what, got, want in (("out", out, ref[0]), ("dq", args[0].grad, ref[1]), ("dk", args[1].grad, ref[2]),
                                ("dv", args[2].grad, ref[3])):
            err = (got.detach()[0].transpose(0, 1).double() - want[idx]).abs().max().item()
            assert err <= TOLS[dtype] * max(1.0, want.abs().max().item()), f"{dtype} {what}: error {err:.2e}"


#: the fault tests' timeout (the issue's target: every rank raises within TIMEOUT + 5 s); a
#: frozen or absent rank stalls for STALL s, longer than that
TIMEOUT, STALL = 5, 7


def _frozen_rank(rank, world, mesh, planner="greedy", where=r"CommWait"):
    """Rank 1 stalls inside the body for longer than the timeout before its SDPA call; every rank
    must raise TransferTimeoutError within the timeout (+ 5 s) of starting to wait, naming where
    (a step of the plan, or a head-parallel plan's all-to-all)."""
    import time

    from torch_dcp.executor import TransferError, TransferTimeoutError

    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    q, k, v, _ = random_qkv(batch, torch.float32)
    with torch_dcp.context_parallel(mesh, batch=batch, planner=planner, block_size=8, divisions=2,
                                    timeout=TIMEOUT) as ctx:  # greedy: transfers on every rank
        idx = torch.from_numpy(ctx.plan.token_indices(rank))
        ql, kl, vl = (t[idx].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if rank == 1:
            time.sleep(STALL)
        t0 = time.monotonic()
        # the waiting rank times out; the late one then finds its peer gone (gloo closes a pair
        # that timed out) or times out in turn: a TransferError naming the phase either way
        expected = TransferTimeoutError if rank == 0 else TransferError
        with pytest.raises(expected, match=rf"forward pass, {where}\(phase=\d+\)|phase \d+: posting") as err:
            F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
        waited = time.monotonic() - t0
        assert waited < TIMEOUT + 5, f"rank {rank} waited {waited:.1f} s"
        assert err.value.peers and rank not in err.value.peers
    assert F.scaled_dot_product_attention is _SDPA  # restored after the error


_SDPA = F.scaled_dot_product_attention


# (the head all-to-alls are collectives: the late rank's first one completes against the posted one of
# the rank that timed out, and its next one, back to rows, finds the peer gone)
@pytest.mark.parametrize("planner, where", [("greedy", "CommWait"),
                                            ("ulysses", "head all-to-all (?:to heads|back to rows)")])
def test_a_frozen_rank_gives_every_rank_a_timeout(planner, where, tmp_path):
    run_ranks(functools.partial(_frozen_rank, planner=planner, where=where), 2, tmp_path, timeout=90, barrier=False)


def _tiny_batches(rank, world, mesh):
    """Batches smaller than one block (ranks with no tokens), one-token documents: exact, every
    planner, forward and backward, through the context."""
    for lens in ([5, 1], [1], [3, 1, 2]):
        batch = BatchSpec(lens, Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype="float64")
        q, k, v, go = random_qkv(batch, torch.float64, seed=2)
        ref = reference_with_grads(batch, q, k, v, go)
        for planner in ("greedy", "dcp", "ring", "fcp", "megatron"):
            errors = context_step_errors(mesh, batch, rank, q, k, v, go, ref, planner=planner, block_size=1024)
            for what, err in errors.items():
                assert err <= 1e-10, f"{lens} {planner} rank {rank} {what}: error {err:.2e}"


# 4 ranks: test_context_parallel_sdpa_matches_reference[4]
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_tiny_batches_and_empty_ranks(world, tmp_path):
    run_ranks(_tiny_batches, world, tmp_path, timeout=240)


def _exception_before_sdpa(rank, world, mesh):
    """One rank raises inside the body before its SDPA call: it leaves the context restored; the
    others raise a TransferError within the timeout + 5 s."""
    import time

    from torch_dcp.executor import TransferError

    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    q, k, v, _ = random_qkv(batch, torch.float32)
    t0 = time.monotonic()
    # a waiting rank times out (TransferTimeoutError), or finds that a peer that timed out first
    # closed its connection (TransferError): either names the phase and the peers
    expected = RuntimeError if rank == world - 1 else TransferError
    with pytest.raises(expected) as err:
        # greedy's plan of this batch has transfers on every rank (dcp's may keep documents whole)
        with torch_dcp.context_parallel(mesh, batch=batch, planner="greedy", block_size=8, divisions=2,
                                        timeout=TIMEOUT) as ctx:
            idx = torch.from_numpy(ctx.plan.token_indices(rank))
            ql, kl, vl = (t[idx].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            if rank == world - 1:
                raise RuntimeError("the model failed before attention")
            F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
    assert time.monotonic() - t0 < TIMEOUT + 5
    if rank != world - 1:  # it names the ranks it waited for (the failed one, or one waiting for it)
        assert err.value.peers and rank not in err.value.peers, err.value.peers
    assert F.scaled_dot_product_attention is _SDPA and torch_dcp.context._active is None


def test_an_exception_on_one_rank_gives_the_others_a_timeout(tmp_path):
    run_ranks(_exception_before_sdpa, 3, tmp_path, timeout=90, barrier=False)


def _killed_mid_step(rank, world, mesh):
    """Rank 1's process ends abruptly inside the body, after the forward: rank 0 raises a
    TransferError in its backward within the timeout + 5 s."""
    import os
    import time

    from torch_dcp.executor import TransferError

    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    q, k, v, go = random_qkv(batch, torch.float32)
    # greedy's plan of this batch has transfers in the backward (dcp's may keep every document whole)
    with torch_dcp.context_parallel(mesh, batch=batch, planner="greedy", block_size=8, divisions=2,
                                    timeout=TIMEOUT) as ctx:
        idx = torch.from_numpy(ctx.plan.token_indices(rank))
        ql, kl, vl = (t[idx].transpose(0, 1).unsqueeze(0).clone().requires_grad_(True) for t in (q, k, v))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
        if rank == 1:
            os._exit(0)  # killed
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="backward pass"):
            out.backward(go[idx].transpose(0, 1).unsqueeze(0))
        assert time.monotonic() - t0 < TIMEOUT + 5


def test_a_rank_killed_mid_step(tmp_path):
    run_ranks(_killed_mid_step, 2, tmp_path, timeout=90, dies=(1,), barrier=False)


def _repeated_errors(rank, world, mesh):
    """Entering and leaving the context after errors, many times: same threads, bounded memory."""
    import resource
    import threading

    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    q, k, v, _ = random_qkv(batch, torch.float32)
    plan = torch_dcp.plan(batch, world, block_size=8, divisions=2)

    def once():
        with pytest.raises(ValueError, match="attn_mask"):
            with torch_dcp.context_parallel(mesh, plan=plan) as ctx:
                idx = torch.from_numpy(ctx.plan.token_indices(rank))
                ql, kl, vl = (t[idx].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)  # works
                F.scaled_dot_product_attention(ql, kl, vl, attn_mask=torch.ones(1, dtype=torch.bool), enable_gqa=True)
        assert F.scaled_dot_product_attention is _SDPA and torch_dcp.context._active is None

    for _ in range(3):  # warm up (allocator, lazy imports)
        once()
    threads, rss = threading.active_count(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(30):
        once()
    assert threading.active_count() == threads, f"threads {threads} -> {threading.active_count()}"
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss  # KiB
    assert grown < 50 * 1024, f"peak memory grew by {grown} KiB over 30 failed contexts"


def test_repeated_contexts_after_errors_do_not_leak(tmp_path):
    run_ranks(_repeated_errors, 2, tmp_path, timeout=180)


def _never_enters(rank, world, mesh):
    """Rank 1 never enters the context: rank 0's plan check at entry times out."""
    import time

    from torch_dcp.executor import TransferTimeoutError

    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    if rank == 1:
        time.sleep(STALL)
        return
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="plan check at entry"):
        with torch_dcp.context_parallel(mesh, batch=batch, block_size=8, timeout=TIMEOUT):
            pass
    assert time.monotonic() - t0 < TIMEOUT + 5
    assert F.scaled_dot_product_attention is _SDPA and torch_dcp.context._active is None


def test_a_rank_that_never_enters_gives_a_timeout_at_entry(tmp_path):
    run_ranks(_never_enters, 2, tmp_path, timeout=60, barrier=False)


def _mismatched_plan(rank, world, mesh):
    """The last rank holds another plan. For the same world size every rank raises at the plan
    check at entry (the digests differ), restored, and the group stays in step: the next
    context is exact. A plan for another world size: that rank refuses it before any
    communication; the others raise a TransferError at the plan check. All within the timeout
    + 5 s."""
    import time

    from torch_dcp.executor import TransferError

    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    q, k, v, go = random_qkv(batch, torch.float32)
    ref = reference_with_grads(batch, q, k, v, go)
    odd = world - 1
    good = torch_dcp.plan(batch, world, block_size=8)
    mine = torch_dcp.plan(batch, world, planner="ring") if rank == odd else good
    tokens = torch.arange(batch.total_tokens).unsqueeze(0)
    before = tokens.clone()
    differ = list(range(odd)) if rank == odd else [odd]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"ranks hold different plans \(rank {rank} differs from ranks "
                                           rf"{re.escape(str(differ))}\)"):
        with torch_dcp.context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1], plan=mine, timeout=TIMEOUT):
            pytest.fail("entered the context with a mismatched plan")
    assert time.monotonic() - t0 < TIMEOUT + 5
    assert torch.equal(tokens, before)
    assert F.scaled_dot_product_attention is _SDPA and torch_dcp.context._active is None
    with torch_dcp.context_parallel(mesh, plan=good, timeout=TIMEOUT) as ctx:
        _check_attention(ctx, rank, q, k, v, go, ref, True, True, "after a mismatched plan")

    t0 = time.monotonic()
    if rank == odd:
        with pytest.raises(ValueError, match=rf"the plan is for {world + 1} ranks, the mesh has {world}"):
            with torch_dcp.context_parallel(mesh, plan=torch_dcp.plan(batch, world + 1, block_size=8)):
                pass
    else:  # it times out, or finds the odd rank's connection closed once that rank has left
        msg = rf"rank \d: the plan check at entry .*(within {TIMEOUT} s|closed)"
        with pytest.raises(TransferError, match=msg) as err:
            with torch_dcp.context_parallel(mesh, plan=good, timeout=TIMEOUT):
                pass
        assert rank not in err.value.peers and odd in err.value.peers
    assert time.monotonic() - t0 < TIMEOUT + 5
    assert F.scaled_dot_product_attention is _SDPA and torch_dcp.context._active is None


def test_a_mismatched_plan_on_one_rank(tmp_path):
    run_ranks(_mismatched_plan, 3, tmp_path, timeout=90, barrier=False)


def _recovery(rank, world, mesh):
    """A context works; in the next, rank 1 fails before attention and stays silent until rank 0
    has timed out (its receive stays queued in gloo). Both replace the process group with a
    fresh one, and the next context is exact again."""
    import time
    from pathlib import Path

    import spawn
    from torch_dcp.executor import TransferTimeoutError

    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    q, k, v, go = random_qkv(batch, torch.float32, seed=4)
    ref = reference_with_grads(batch, q, k, v, go)
    with torch_dcp.context_parallel(mesh, batch=batch, block_size=8, divisions=2, timeout=TIMEOUT) as ctx:
        _check_attention(ctx, rank, q, k, v, go, ref, True, True, "before the fault")
    caught = Path(spawn.run_dir) / "rank0-caught"
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError if rank == 0 else RuntimeError, match="phase|model failed"):
        with torch_dcp.context_parallel(mesh, batch=batch, planner="greedy", block_size=8, divisions=2,
                                        timeout=TIMEOUT) as ctx:  # greedy: transfers on every rank
            if rank == 1:
                raise RuntimeError("the model failed before attention")
            idx = torch.from_numpy(ctx.plan.token_indices(rank))
            F.scaled_dot_product_attention(*(t[idx].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                           is_causal=True, enable_gqa=True)
    assert F.scaled_dot_product_attention is _SDPA and torch_dcp.context._active is None
    if rank == 0:
        assert time.monotonic() - t0 < TIMEOUT + 5
        caught.touch()
    while not caught.exists():  # rank 1: silent, its group intact, until rank 0 has timed out
        assert time.monotonic() - t0 < TIMEOUT + 30, "rank 0 did not time out"
        time.sleep(0.05)
    mesh = spawn.fresh_group(rank, world, "init-fresh")
    with torch_dcp.context_parallel(mesh, batch=batch, block_size=8, timeout=TIMEOUT) as ctx:
        _check_attention(ctx, rank, q, k, v, go, ref, True, True, "fresh group after a timeout")


def test_the_next_context_on_a_fresh_group_works_after_a_timeout(tmp_path):
    run_ranks(_recovery, 2, tmp_path, timeout=90)
