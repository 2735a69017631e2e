"""Layer replay (torch_dcp.executor.replay) on CPU, through the eager recorder: when it records,
what it keys on, that replayed results are bit-identical to eager ones, the fallback after a
failed recording, and that recordings are freed when the context exits."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_dcp
from torch_dcp import BatchSpec, Topology
from torch_dcp.executor import InProcessTransport, Mailbox, RankExecutor
from torch_dcp.executor.replay import EagerRecorder, LayerReplay, default_recorder
from reference import random_qkv
from spawn import run_ranks


def _executor(batch: BatchSpec) -> RankExecutor:
    plan = torch_dcp.plan(batch, Topology.single_node(1), planner="greedy", block_size=16)
    return RankExecutor(plan, 0, InProcessTransport(Mailbox(), 0), kernel="reference")


class _Failing:
    bounded = True

    def record(self, fn):
        raise RuntimeError("capture is not permitted here")


def test_records_once_per_key_and_replays_bit_identical():
    batch = BatchSpec([37, 20, 11], torch_dcp.Lambda(sink=2, window=9), n_heads=4, n_kv_heads=2, head_dim=8,
                      dtype="float32")
    eager = _executor(batch)
    rec = EagerRecorder()
    layers = LayerReplay(_executor(batch), rec)
    assert layers.rank == 0 and layers.plan is layers.executor.plan  # other attributes are the executor's
    for layer in range(4):  # four layers: different values, the same shapes
        q, k, v, go = random_qkv(batch, torch.float32, seed=layer)
        want = eager.forward_keeping(q, k, v, None)
        got = layers.forward_keeping(q, k, v, None)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), layer
        gwant = eager.backward(q, k, v, want[0], want[1], go, None, want[2])
        ggot = layers.backward(q, k, v, got[0], got[1], go, None, got[2])
        assert all(torch.equal(a, b) for a, b in zip(ggot, gwant)), layer
    assert rec.records == 2 and [key[0] for key in layers.recorded] == ["forward_keeping", "backward"]
    assert layers.replays == 8 and layers.eager_calls == 0
    # what the key holds beyond the plan: the pass and the scale (and the inputs' shapes and dtypes)
    layers.forward(q, k, v, None)
    layers.forward(q, k, v, 0.5)
    assert rec.records == 4
    out_half, _ = layers.forward(q, k, v, 0.5)
    assert torch.equal(out_half, eager.forward(q, k, v, 0.5)[0])
    assert rec.records == 4
    # outputs are the caller's: a later replay does not overwrite them
    first, _ = layers.forward(q, k, v, None)
    layers.forward(q * 2, k, v, None)
    assert torch.equal(first, eager.forward(q, k, v, None)[0])
    layers.close()
    assert layers.recorded == []


def test_a_failed_recording_warns_once_and_runs_eagerly():
    batch = BatchSpec([30, 9], torch_dcp.Causal(), n_heads=2, n_kv_heads=1, head_dim=8, dtype="float64")
    eager, layers = _executor(batch), LayerReplay(_executor(batch), _Failing())
    q, k, v, _ = random_qkv(batch, torch.float64)
    with pytest.warns(RuntimeWarning, match="recording the forward pass for layer replay failed "
                                            r"\(RuntimeError: capture is not permitted here\)"):
        got = layers.forward(q, k, v)
    assert torch.equal(got[0], eager.forward(q, k, v)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the rest runs eagerly
        for _ in range(3):
            assert torch.equal(layers.forward(q, k, v)[0], got[0])
    assert layers.eager_calls == 4 and layers.replays == 0 and layers.recorded == []
    assert "capture is not permitted" in layers.failure


def test_default_recorder_only_on_a_cuda_device():
    assert default_recorder(torch.device("cpu")) is None


# ---------------------------------------------------------------------- inside context_parallel
LAYERS = 3


def _model_step(mesh, batch, q, k, v, go, **context_args):
    """LAYERS attention layers (the same q, k, v scaled per layer) forward and backward inside one
    context; returns the per-layer outputs, the input gradients and the context."""
    qb, kb, vb, gb = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, go))
    with torch_dcp.context_parallel(mesh, buffers=[qb, kb, vb, gb], buffer_seq_dims=[2, 2, 2, 2], batch=batch,
                                    planner="dcp", block_size=16, **context_args) as ctx:
        ql, kl, vl = (t.clone().requires_grad_(True) for t in (qb, kb, vb))
        outs = [F.scaled_dot_product_attention(ql * (i + 1), kl, vl, is_causal=True, enable_gqa=True)
                for i in range(LAYERS)]
        torch.stack(outs).sum(0).backward(gb)
        return [o.detach() for o in outs], (ql.grad, kl.grad, vl.grad), ctx


def _context_ranks(rank, world, mesh):
    batch = BatchSpec([70, 13, 41, 90], torch_dcp.Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype="float32")
    q, k, v, go = random_qkv(batch, torch.float32, seed=5)
    rec = EagerRecorder()
    outs, grads, ctx = _model_step(mesh, batch, q, k, v, go, replay=rec)
    ref_outs, ref_grads, ref_ctx = _model_step(mesh, batch, q, k, v, go, replay=False)
    assert ref_ctx.replay is None
    for a, b in zip(outs + list(grads), ref_outs + list(ref_grads)):
        assert torch.equal(a, b)  # bit-identical to the eager path
    # one recording per pass (the first layer's), every layer replayed, freed at exit
    assert rec.records == 2 and ctx.replay.replays == 2 * LAYERS and ctx.replay.recorded == []
    for bad, what in ((True, "replay=True needs a CUDA device"), ("yes", "replay must be None, a bool or a Recorder")):
        with pytest.raises(ValueError, match=what):
            _model_step(mesh, batch, q, k, v, go, replay=bad)


def test_context_parallel_replays_every_layer_after_the_first(tmp_path):
    run_ranks(_context_ranks, 2, tmp_path, timeout=120)
