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
from torch_dcp.benchmarks import layers as bench_layers
from torch_dcp.executor.replay import CUDAGraphRecorder, EagerRecorder, LayerReplay, default_recorder
from reference import needs_cuda, random_qkv
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
    (fwd_static, _), (bwd_static, _) = layers._recordings.values()
    assert all(a is b for a, b in zip(fwd_static, bwd_static[:3]))  # q, k, v: one scratch buffer each
    assert len({id(t) for t in bwd_static if t is not None}) == sum(t is not None for t in bwd_static)
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


# ---------------------------------------------------------------------- the benchmarks' replayed ranks
def test_replayed_ranks_alone_match_the_eager_emulation():
    """Every rank run alone on the messages recorded from one eager step (what ``step --layers``
    and ``calibrate --check --replay`` time): bit-identical through the recorder, and the layered
    step times every rank and layer."""
    batch = BatchSpec([90, 13, 57, 33], torch_dcp.Lambda(sink=4, window=24), n_heads=4, n_kv_heads=2, head_dim=8,
                      dtype="float64")
    plan = torch_dcp.plan(batch, Topology.single_node(3), planner="greedy", block_size=16)
    assert plan.stats()["comm_bytes"] > 0  # the ranks exchange messages
    ranks = bench_layers.emulate_ranks(plan, torch.device("cpu"), "reference", seed=3)
    assert bench_layers.replay_error(ranks, EagerRecorder()) == {"forward": 0.0, "backward": 0.0,
                                                                  "eager_backward_spread": 0.0}
    rec = EagerRecorder()
    times = bench_layers.time_layers(ranks, 3, rec)
    assert times.total.shape == (3, 3) and (times.total > 0).all() and times.replay and times.fallbacks == ()
    assert rec.records == 2 * 3  # a forward and a backward recording per rank, the later layers replayed
    eager = bench_layers.time_layers(ranks, 2)
    assert eager.total.shape == (2, 3) and not eager.replay and eager.peak_bytes is None
    with pytest.raises(ValueError, match="layers must be at least 1"):
        bench_layers.time_layers(ranks, 0)
    # a transport that does not copy leaves the received rows as they are: not the eager results
    ex, net = ranks.executor(0, copies=False)
    net.messages = ranks.received[0][0]
    q, k, v, _ = ranks.inputs[0]
    ex.forward(q, k, v)  # runs without waiting for any peer
    net.messages = {}
    with pytest.raises(KeyError, match="no recorded message"):
        ex.forward(q, k, v)


@needs_cuda("needs CUDA (CUDA graphs)")
@pytest.mark.parametrize("mask", ["causal", "lambda"])
def test_cuda_graph_replay_is_bit_identical_on_cuda(mask):
    """CUDA graphs (what ``context_parallel`` records on CUDA) replay every emulated rank's
    forward and backward, messages included, as the eager step computed them."""
    m = torch_dcp.Causal() if mask == "causal" else torch_dcp.Lambda(sink=64, window=256)
    batch = BatchSpec([1500, 300, 2200, 96], m, n_heads=8, n_kv_heads=2, head_dim=64, dtype="bfloat16")
    plan = torch_dcp.plan(batch, Topology.single_node(3), planner="dcp", block_size=256, head_parallel=1)
    ranks = bench_layers.emulate_ranks(plan, torch.device("cuda"), "auto", seed=1)
    err = bench_layers.replay_error(ranks, CUDAGraphRecorder())
    # the forward bit for bit; the backward within the eager backward's own run-to-run spread
    # (flash attention's backward adds dQ with atomics) and bf16 rounding
    assert err["forward"] == 0.0 and err["backward"] <= max(2 * err["eager_backward_spread"], 1e-2), err
    times = bench_layers.time_layers(ranks, 3, CUDAGraphRecorder())
    assert times.fallbacks == () and times.peak_bytes > 0
    assert bench_layers.replayed_layer_syncs(ranks, CUDAGraphRecorder()) is None


class _Syncing:
    """An executor whose forward reads a device value on the host first: no CUDA graph can
    record it."""

    def __init__(self, executor):
        self.executor = executor

    def forward(self, q, k, v, scale=None):
        if float(q.float().sum()) != float(q.float().sum()):  # a host read of device data
            raise AssertionError("NaN in the inputs")
        return self.executor.forward(q, k, v, scale)


@needs_cuda("needs CUDA (CUDA graphs)")
def test_a_failed_cuda_graph_recording_falls_back_to_eager_with_one_warning():
    batch = BatchSpec([300, 90], torch_dcp.Causal(), n_heads=4, n_kv_heads=2, head_dim=64, dtype="bfloat16")
    plan = torch_dcp.plan(batch, Topology.single_node(1), planner="dcp", block_size=128)
    eager = RankExecutor(plan, 0, InProcessTransport(Mailbox(), 0))
    layers = LayerReplay(_Syncing(RankExecutor(plan, 0, InProcessTransport(Mailbox(), 0))), CUDAGraphRecorder())
    q, k, v, _ = (t.cuda() for t in random_qkv(batch, torch.bfloat16))
    with pytest.warns(RuntimeWarning, match="recording the forward pass for layer replay failed"):
        got = layers.forward(q, k, v)
    assert torch.equal(got[0], eager.forward(q, k, v)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning: the later layers run eagerly, without another
        for _ in range(2):
            assert torch.equal(layers.forward(q, k, v)[0], got[0])
    assert layers.eager_calls == 3 and layers.replays == 0
    torch.cuda.synchronize()  # the device is usable after the failed capture


def test_layer_times_leave_out_the_recording_calls():
    """A replayed step records in layer 0's forward and in layer L-1's backward (the backward runs
    last layer first): the steady layer and the recording's cost leave exactly those out."""
    import numpy as np

    fwd = np.array([[9.0, 5.0], [1.0, 2.0], [1.0, 2.0]])  # layer 0's forward records
    bwd = np.array([[3.0, 4.0], [3.0, 4.0], [8.0, 10.0]])  # layer 2's backward records
    t = bench_layers.LayerTimes(fwd, bwd, None, replay=True)
    assert t.steady().tolist() == [4.0, 6.0] and t.recording().tolist() == [8.0 + 5.0, 3.0 + 6.0]
    eager = bench_layers.LayerTimes(fwd, bwd, None, replay=False)
    assert eager.steady().tolist() == [1.0 + 3.0, 2.0 + 4.0] and eager.recording().tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="2 layers or more"):
        bench_layers.LayerTimes(fwd[:1], bwd[:1], None, replay=True).steady()
