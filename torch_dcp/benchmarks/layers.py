"""Every rank of a plan run alone, layer after layer, eagerly or through layer replay: the
per-rank, per-layer times of one training step's attention (``step --layers``) and of the
calibration check (``calibrate --check --replay``).

All ranks run in this process. One eager step of every rank on the in-process transport records
the messages each rank receives (:class:`LoggingMailbox`); from then on every rank runs *alone*
on a :class:`RecordedTransport` that serves those messages, so a rank's forward or backward is one
uninterrupted call that a CUDA graph can record (:class:`~torch_dcp.executor.replay.LayerReplay`
with :class:`~torch_dcp.executor.replay.CUDAGraphRecorder`, the recorder ``context_parallel``
uses on CUDA; on the CPU :class:`~torch_dcp.executor.replay.EagerRecorder`). Timed runs leave the
received bytes where they are (``copies=False``: a real transport lands them in the work buffers
while the rank computes, so the emulated network's copies stay out of a rank's time, as in
:func:`~torch_dcp.benchmarks.measure.measure_plan`); the exactness check copies them in
(``copies=True``), so a replayed rank's results equal the eager emulation's bit for bit.

A step of ``L`` layers runs as training does: every layer's forward in order (its ``out`` and
``lse`` kept, each layer on inputs of its own), then every layer's backward in reverse order.
In a replayed step the first layer's forward and, the backward running in reverse, the last
layer's backward record (one warm-up run, then the capture); every other call replays. What
those two calls take beyond replayed ones is the recording's cost per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import numpy as np
import torch

from ..executor import Mailbox, RankExecutor, get_kernel
from ..executor.replay import EagerRecorder, LayerReplay, Recorder, default_recorder
from ..executor.transport import InProcessTransport, Transport
from ..plan import Plan
from .common import DTYPES, sync
from .measure import batch_inputs

__all__ = ["LoggingMailbox", "RecordedTransport", "EmulatedRanks", "emulate_ranks", "LayerTimes", "time_layers",
           "replay_error", "replayed_layer_syncs", "bench_recorder", "profile_layer"]

Key = tuple[int, int, int]  # (phase, tag, source rank)


class LoggingMailbox(Mailbox):
    """The in-process mailbox, keeping every message posted: :attr:`log` maps a receiving rank
    to ``{(phase, tag, source): message}`` (the sender's clone; never modified afterwards)."""

    def __init__(self):
        super().__init__()
        self.log: dict[int, dict[Key, torch.Tensor]] = {}

    def post(self, key, message):
        super().post(key, message)
        phase, tag, src, dst = key
        self.log.setdefault(dst, {})[(phase, tag, src)] = message

    def take(self) -> dict[int, dict[Key, torch.Tensor]]:
        """The log so far, emptied."""
        log, self.log = self.log, {}
        return log


class RecordedTransport(Transport):
    """One rank's transport that serves messages recorded from an earlier run of the same plan
    (:class:`LoggingMailbox`) and drops what it sends: the rank runs alone, without waiting.

    Args:
        copies: copy each received message into its receive buffer (exact results) or leave the
            buffer as it is (timing: the network's bytes stay out of the rank's time).

    Attributes:
        messages: ``{(phase, tag, source): uint8 tensor}`` of the pass about to run (the caller
            sets it before a pass: forward and backward messages differ).

    Raises (from ``wait``):
        KeyError: a receive with no recorded message (the plan is not the recorded one).
    """

    def __init__(self, copies: bool = False):
        self.copies = copies
        self.messages: dict[Key, torch.Tensor] = {}

    def launch(self, phase, sends, recvs):
        return phase, list(recvs)

    def wait(self, handle):
        phase, recvs = handle
        for peer, tag, buf in recvs:
            msg = self.messages.get((phase, tag, peer))
            if msg is None:
                raise KeyError(f"phase {phase}: no recorded message from rank {peer} (tag {tag})")
            if self.copies:
                if msg.numel() != buf.numel():
                    raise RuntimeError(f"phase {phase}: recorded message from rank {peer} has {msg.numel()} bytes, "
                                       f"the receive {buf.numel()}")
                buf.copy_(msg)
        return
        yield  # a generator that never waits


@dataclasses.dataclass
class EmulatedRanks:
    """A plan's ranks ready to run alone (:func:`emulate_ranks`).

    Attributes:
        plan: the plan (flat: head parallelism 1).
        inputs: per rank ``(q, k, v, grad_out)`` of its tokens.
        eager: per rank ``(out, lse, dq, dk, dv)`` of the eager in-process step.
        received: per rank ``(forward, backward)`` recorded messages.
        kernel: the kernel instance every rank's executor shares.
        device: where it runs.
    """

    plan: Plan
    inputs: list[tuple[torch.Tensor, ...]]
    eager: list[tuple[torch.Tensor, ...]]
    received: list[tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor]]]
    kernel: Any
    device: torch.device

    def executor(self, rank: int, copies: bool = False) -> tuple[RankExecutor, RecordedTransport]:
        """A fresh executor of ``rank`` on a :class:`RecordedTransport` (device plan uploaded)."""
        net = RecordedTransport(copies)
        ex = RankExecutor(self.plan, rank, net, kernel=self.kernel)
        ex.prepare(self.device)
        return ex, net

    def runner(self, rank: int, recorder: Recorder | None = None,
               copies: bool = False) -> tuple[Any, RecordedTransport]:
        """:meth:`executor`, through :class:`LayerReplay` with ``recorder`` (eager with None)."""
        ex, net = self.executor(rank, copies)
        return (LayerReplay(ex, recorder) if recorder is not None else ex), net

    def one_layer(self, rank: int, recorder: Recorder | None = None,
                  copies: bool = False) -> tuple[Callable[[], tuple[torch.Tensor, ...]], Any]:
        """``(layer, runner)``: ``runner`` from :meth:`runner` and ``layer()`` one layer of it on
        the rank's inputs, forward then backward, each pass served its recorded messages;
        ``layer()`` returns ``(out, lse, dq, dk, dv)``."""
        run, net = self.runner(rank, recorder, copies)
        q, k, v, go = self.inputs[rank]

        def layer() -> tuple[torch.Tensor, ...]:
            net.messages = self.received[rank][0]
            o, lse = run.forward(q, k, v)
            net.messages = self.received[rank][1]
            return (o, lse) + tuple(run.backward(q, k, v, o, lse, go))

        return layer, run


def emulate_ranks(plan: Plan, device: torch.device, kernel: Any = "auto", seed: int = 0,
                  inputs: tuple[torch.Tensor, ...] | None = None) -> EmulatedRanks:
    """Run one eager step of every rank of ``plan`` in this process (in-process transport),
    recording the messages each rank receives.

    Args:
        inputs: global ``(q, k, v, grad_out)`` in token order (default: random, :func:`batch_inputs`).
    """
    from .._interleave import interleave

    W, b = plan.world_size, plan.batch
    kern = get_kernel(kernel, device=device, dtype=DTYPES[b.dtype], head_dim=b.head_dim)  # an instance as is
    mailbox = LoggingMailbox()
    execs = [RankExecutor(plan, r, InProcessTransport(mailbox, r), kernel=kern) for r in range(W)]
    for e in execs:
        e.prepare(device)
    q, k, v, go = inputs if inputs is not None else batch_inputs(b, device, seed)
    idx = [torch.from_numpy(plan.token_indices(r)).to(device) for r in range(W)]
    local = [(q[i], k[i], v[i], go[i]) for i in idx]
    fwd = interleave([e.forward_steps(*x[:3]) for e, x in zip(execs, local)], lambda: mailbox.events)
    fwd_log = mailbox.take()
    bwd = interleave([e.backward_steps(*x[:3], o, lse, x[3]) for e, x, (o, lse) in zip(execs, local, fwd)],
                     lambda: mailbox.events)
    bwd_log = mailbox.take()
    eager = [(o, lse) + tuple(g) for (o, lse), g in zip(fwd, bwd)]
    received = [(fwd_log.get(r, {}), bwd_log.get(r, {})) for r in range(W)]
    return EmulatedRanks(plan, local, eager, received, kern, device)


def bench_recorder(device: torch.device) -> Recorder:
    """The recorder of the benchmarks' replayed runs: CUDA graphs on CUDA (what
    ``context_parallel`` uses), the eager recorder elsewhere."""
    return default_recorder(device) or EagerRecorder()


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """Seconds of every rank's attention in every layer of one step.

    Attributes:
        forward, backward: float64 ``[L, W]``: layer ``l``'s pass on rank ``r`` (for a replayed
            step, layer 0's forward and layer L-1's backward include the recording).
        peak_bytes: the device's peak allocated bytes during the step over what was allocated
            before it (the inputs); None off CUDA.
        replay: whether the step ran through layer replay.
        fallbacks: ranks whose recording failed and ran eagerly (replay only).
    """

    forward: np.ndarray
    backward: np.ndarray
    peak_bytes: int | None
    replay: bool
    fallbacks: tuple[int, ...] = ()

    @property
    def total(self) -> np.ndarray:
        """``[L, W]`` forward + backward."""
        return self.forward + self.backward

    def steady(self) -> np.ndarray:
        """``[W]``: each rank's layer that records nothing, forward + backward (median over the
        layers; replayed: the forward of layers 1.. and the backward of layers ..L-2, since
        layer 0's forward and, the backward running last layer first, layer L-1's backward
        record)."""
        if not self.replay:
            return np.median(self.forward, axis=0) + np.median(self.backward, axis=0)
        if len(self.forward) < 2:
            raise ValueError("a replayed step needs 2 layers or more for a layer that records nothing")
        return np.median(self.forward[1:], axis=0) + np.median(self.backward[:-1], axis=0)

    def recording(self) -> np.ndarray:
        """``[W]``: what recording cost each rank per step (replayed steps): the recording forward
        and backward over the steady ones."""
        if not self.replay:
            return np.zeros(self.forward.shape[1])
        return (self.forward[0] - np.median(self.forward[1:], axis=0)
                + self.backward[-1] - np.median(self.backward[:-1], axis=0))


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    res = fn()
    sync(device)
    return time.perf_counter() - t0, res


def time_layers(ranks: EmulatedRanks, layers: int, recorder: Recorder | None = None) -> LayerTimes:
    """One step of ``layers`` layers on every rank, each rank alone and timed on its own (the
    device synchronised around every call), received bytes not copied (module docstring).
    ``recorder``: run every rank through :class:`LayerReplay` with it; None: eagerly.

    Raises:
        ValueError: ``layers`` below 1.
    """
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    dev, W = ranks.device, ranks.plan.world_size
    runners, nets = zip(*(ranks.runner(r, recorder) for r in range(W)))
    fwd, bwd = np.zeros((layers, W)), np.zeros((layers, W))
    cuda = dev.type == "cuda"
    if cuda:
        sync(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    kept: list[list[tuple[torch.Tensor, ...]]] = []
    for layer in range(layers):  # every layer's forward, its inputs and results kept for its backward
        row = []
        for r in range(W):
            q, k, v, go = (t.clone() for t in ranks.inputs[r])  # each layer's own inputs
            nets[r].messages = ranks.received[r][0]
            fwd[layer, r], (o, lse) = _timed(lambda: runners[r].forward(q, k, v), dev)
            row.append((q, k, v, go, o, lse))
        kept.append(row)
    for layer in reversed(range(layers)):
        for r in range(W):
            q, k, v, go, o, lse = kept[layer][r]
            nets[r].messages = ranks.received[r][1]
            bwd[layer, r], _ = _timed(lambda: runners[r].backward(q, k, v, o, lse, go), dev)
        kept[layer] = []  # a layer's activations freed after its backward, as autograd does
    peak = None
    if cuda:
        sync(dev)
        peak = int(torch.cuda.max_memory_allocated(dev) - base)
    fallbacks = ()
    if recorder is not None:
        fallbacks = tuple(r for r, x in enumerate(runners) if x.failure is not None)
        for x in runners:
            x.close()
    return LayerTimes(fwd, bwd, peak, recorder is not None, fallbacks)


def _max_diff(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    return max((float((a.float() - b.float()).abs().max()) for a, b in zip(got, want) if a.numel()), default=0.0)


def replay_error(ranks: EmulatedRanks, recorder: Recorder, ranks_to_check: list[int] | None = None) -> dict[str, float]:
    """Every checked rank's replayed results (recorded, then replayed once more, received bytes
    copied in) against its eager results: the largest absolute difference of the forward's
    ``(out, lse)`` (``"forward"``; 0.0: bit for bit) and of the gradients (``"backward"``),
    beside the eager backward's own run-to-run spread (``"eager_backward_spread"``: the same
    eager backward run again; flash attention's backward adds ``dQ`` with atomics, so it is not
    bit-reproducible)."""
    worst = {"forward": 0.0, "backward": 0.0, "eager_backward_spread": 0.0}
    for r in (range(ranks.plan.world_size) if ranks_to_check is None else ranks_to_check):
        layer, rep = ranks.one_layer(r, recorder, copies=True)
        layer()  # records
        o, lse, *grads = layer()  # replays
        rep.close()
        eo, else_, *egrads = ranks.eager[r]
        again = ranks.one_layer(r, None, copies=True)[0]()[2:]  # eager, the same inputs and messages
        worst["forward"] = max(worst["forward"], _max_diff((o, lse), (eo, else_)))
        worst["backward"] = max(worst["backward"], _max_diff(tuple(grads), tuple(egrads)))
        worst["eager_backward_spread"] = max(worst["eager_backward_spread"], _max_diff(tuple(again), tuple(egrads)))
    return worst


def replayed_layer_syncs(ranks: EmulatedRanks, recorder: Recorder, rank: int = 0) -> str | None:
    """Record ``rank``'s forward and backward, then replay one more layer of it under
    ``torch.cuda.set_sync_debug_mode("error")``: None when nothing synchronised with the host,
    else the error (off CUDA: None, nothing to check)."""
    if ranks.device.type != "cuda":
        return None
    layer, rep = ranks.one_layer(rank, recorder, copies=True)
    layer()  # records
    sync(ranks.device)
    err = None
    with _sync_debug_error():
        try:
            layer()
        except RuntimeError as e:
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    sync(ranks.device)
    rep.close()
    return err


def profile_layer(ranks: EmulatedRanks, rank: int, recorder: Recorder | None = None, top: int = 12) -> dict[str, Any]:
    """Where one layer's time goes on ``rank``: its forward and backward (replayed through
    ``recorder`` after a recording layer, or eager with None) under ``torch.profiler``.

    Returns a dict: ``wall_s`` (the layer, synchronised), ``device_s`` (the sum of its device
    kernels' times; on the CPU the sum of its top-level operators' self times), ``kernels``
    (device kernels launched; CPU: operators), ``per_division`` (kernels / the rank's divisions
    in both passes) and ``top``: the ``top`` kernels by total time, ``[name, calls, seconds]``.
    """
    from torch.profiler import ProfilerActivity, profile

    dev = ranks.device
    layer, run = ranks.one_layer(rank, recorder)
    layer()  # records (replay) or warms up (eager)
    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        wall, _ = _timed(layer, dev)
    if isinstance(run, LayerReplay):
        run.close()
    if cuda:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.cpu_parent is None]
    per_name: dict[str, list] = {}
    for e in events:
        us = e.device_time if cuda else e.self_cpu_time_total
        row = per_name.setdefault(e.name[:90], [e.name[:90], 0, 0.0])
        row[1] += 1
        row[2] += us * 1e-6
    rows = sorted(per_name.values(), key=lambda r: -r[2])
    divisions = max(1, len(ranks.plan.program(rank).divisions))
    return {"rank": rank, "replay": recorder is not None, "wall_s": wall, "device_s": sum(r[2] for r in rows),
            "kernels": len(events), "per_division": len(events) / (2 * divisions), "top": rows[:top]}


@contextlib.contextmanager
def _sync_debug_error():
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)
