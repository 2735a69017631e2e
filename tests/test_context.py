"""torch_dcp.context_parallel on real gloo process groups."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import torch_dcp
from torch_dcp import BatchSpec, BlockwiseCausal, Causal, Full, Lambda, Ranges, SharedQuestion
from reference import random_qkv, reference_with_grads

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
    mp.spawn(_entry, args=(fn, world, str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        err = tmp_path / f"err{r}"
        assert not err.exists(), err.read_text()
        assert (tmp_path / f"ok{r}").exists()


def _entry(rank, fn, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        fn(rank, world, mesh)
        open(f"{tmp}/ok{rank}", "w").close()
    except BaseException:
        with open(f"{tmp}/err{rank}", "w") as f:
            f.write(traceback.format_exc())
    finally:
        dist.destroy_process_group()


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


def _errors_and_restore(rank, world, mesh):
    sdpa, handlers = F.scaled_dot_product_attention, dict(DTensor._op_dispatcher._custom_op_handlers)
    batch = BatchSpec(LENS, Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float32")
    q, k, v, _ = random_qkv(batch, torch.float32)
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

    with torch_dcp.context_parallel(mesh, batch=batch, block_size=8) as ctx:
        n = ctx.plan.local_tokens(rank)
        ql = q[:n].transpose(0, 1).unsqueeze(0)
        kl = k[:n].transpose(0, 1).unsqueeze(0)
        cases = [
            (dict(attn_mask=torch.ones(n, n, dtype=torch.bool), is_causal=False), "attn_mask"),
            (dict(dropout_p=0.1, is_causal=True), "dropout"),
            (dict(is_causal=False), "is_causal=False"),
        ]
        for kwargs, msg in cases:
            with pytest.raises(ValueError, match=msg):
                F.scaled_dot_product_attention(ql, kl, kl, enable_gqa=True, **kwargs)
        with pytest.raises(ValueError, match="sequence length"):
            F.scaled_dot_product_attention(ql[:, :, :-1], kl[:, :, :-1], kl[:, :, :-1], is_causal=True, enable_gqa=True)
        with pytest.raises(ValueError, match="enable_gqa"):
            F.scaled_dot_product_attention(ql, kl, kl, is_causal=True)
        with pytest.raises(RuntimeError, match="already active"):
            with torch_dcp.context_parallel(mesh, batch=batch):
                pass
    assert F.scaled_dot_product_attention is sdpa and DTensor._op_dispatcher._custom_op_handlers == handlers

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
    with pytest.raises(ValueError, match="exactly one"):
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


def test_context_parallel_errors_and_restoration(tmp_path):
    _spawn(_errors_and_restore, 2, tmp_path)
