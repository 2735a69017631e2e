"""Layer replay: a rank's attention device work recorded once per step, replayed by every layer.

Every layer of a training step runs the same plan on buffers of the same shapes, so what a
rank's executor enqueues on the device (gathers, kernels, merges, transfers) is the same in
every layer. The DCP paper's executor (Jiang et al., arXiv 2510.10620, §6) captures the
forward at one layer and the backward at another as CUDA graphs and replays them in every
other layer of the iteration, recaptured each iteration; MagiAttention likewise builds its
metadata once per batch for every layer. :class:`LayerReplay` does that around any executor:

* calls are keyed by what the recording depends on beyond the plan and kernel (fixed for one
  executor): the pass (``forward``, ``forward_keeping``, ``backward``), every input's shape,
  dtype and device, the softmax scale, and whether a backward gets the forward's state;
* the first call of a key copies its inputs into static buffers and records the executor on
  them (:meth:`Recorder.record`); it and every later call of that key copy the inputs in,
  replay, and copy the outputs out, so results are bit-identical to the eager path (the same
  kernels on the same values). The static input buffers are scratch shared by every recording
  of one :class:`LayerReplay` (inputs of one layout share a buffer: the backward's ``q``,
  ``k``, ``v`` are the forward's), since each call fills them before it replays;
* a recording that fails (the recorder raises) is not retried: that key, and every later one
  in the same :class:`LayerReplay`, runs the executor eagerly, after one ``RuntimeWarning``
  naming the cause (never silently);
* :meth:`LayerReplay.close` frees every recording (``torch_dcp.context_parallel`` calls it
  when the step's context exits).

Recorders: :class:`CUDAGraphRecorder` (``torch.cuda.CUDAGraph``: one warm-up run on a side
stream, then a capture; what ``context_parallel`` uses on CUDA by default) and
:class:`EagerRecorder` (runs the executor again at every replay; no device needed: the replay
logic's tests on CPU use it). A captured graph's NCCL transfers are not tracked by NCCL's
watchdog; the transfers of a replayed step are bounded as the eager ones are only where the
recorder says so (:attr:`Recorder.bounded`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Protocol, Sequence

import torch

__all__ = ["Recorder", "Recording", "EagerRecorder", "CUDAGraphRecorder", "LayerReplay", "default_recorder",
           "recorder_for"]

Outputs = tuple[torch.Tensor, ...]


class Recording(Protocol):
    """One recorded call: :attr:`outputs` are its static output buffers, rewritten by
    :meth:`replay` from the current values of the static inputs the recording was made on."""

    outputs: Outputs

    def replay(self) -> None: ...


class Recorder(Protocol):
    """Makes :class:`Recording` objects.

    Attributes:
        bounded: whether a replayed recording's transfers are bounded by the executor's
            timeout as eager ones are (False for CUDA graphs, whose NCCL work the watchdog does
            not track).
    """

    bounded: bool

    def record(self, fn: Callable[[], Outputs]) -> Recording:
        """Record ``fn`` (a call of the executor on static inputs that returns its outputs).

        Raises:
            Exception: whatever made the recording fail (the caller falls back to eager).
        """
        ...


class _EagerRecording:
    def __init__(self, fn: Callable[[], Outputs]):
        self.fn = fn
        self.outputs = tuple(fn())

    def replay(self) -> None:
        for buf, value in zip(self.outputs, self.fn()):
            buf.copy_(value)


class EagerRecorder:
    """A recorder whose replay runs the recorded call again (any device; for the replay
    logic's tests on CPU, where nothing can be captured). ``records`` counts its recordings."""

    bounded = True

    def __init__(self):
        self.records = 0

    def record(self, fn: Callable[[], Outputs]) -> Recording:
        self.records += 1
        return _EagerRecording(fn)


class _GraphRecording:
    def __init__(self, graph: Any, outputs: Outputs):
        self.graph, self.outputs = graph, outputs

    def replay(self) -> None:
        self.graph.replay()


class CUDAGraphRecorder:
    """Records with ``torch.cuda.CUDAGraph``: one warm-up run of the call on a side stream
    (lazy initialisation of kernels and communicators happens outside the capture, as
    PyTorch's CUDA graph notes ask), then one capture on that stream with the graph's own
    memory pool. The call's NCCL point-to-point transfers are captured too (NCCL ≥ 2.9; the
    transfer group must have been created eagerly and used before the capture)."""

    bounded = False

    def __init__(self, pool: Any = None):
        self.pool = pool

    def record(self, fn: Callable[[], Outputs]) -> Recording:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            outputs = tuple(fn())
        return _GraphRecording(graph, outputs)


def default_recorder(device: torch.device) -> Recorder | None:
    """The recorder ``context_parallel`` uses on ``device`` by default: CUDA graphs on a CUDA
    device (one that exists: none under fake CUDA tensors without a driver), none elsewhere
    (on CPU with gloo the host runs every transfer: nothing to record)."""
    return CUDAGraphRecorder() if device.type == "cuda" and torch.cuda.is_available() else None


def recorder_for(replay: "bool | Recorder | None", device: torch.device, caller: str) -> Recorder | None:
    """The recorder of a ``replay=`` option on ``device`` (``None``: no replay): ``None`` or
    ``True``: :func:`default_recorder`; ``False``: none; a recorder: itself.

    Raises:
        ValueError: ``replay=True`` without a CUDA device, or a ``replay`` that is neither a
            bool, ``None`` nor a recorder (named with ``caller``).
    """
    if replay is None or replay is True:
        recorder = default_recorder(device)
        if replay is True and recorder is None:
            raise ValueError(f"{caller}: replay=True needs a CUDA device (the step runs on {device}); pass "
                             "replay=None or False, or a Recorder")
        return recorder
    if replay is False:
        return None
    if not callable(getattr(replay, "record", None)):
        raise ValueError(f"{caller}: replay must be None, a bool or a Recorder, got {replay!r}")
    return replay


def _key(kind: str, tensors: Sequence[torch.Tensor | None], scale: float | None) -> tuple:
    return (kind, scale, tuple(None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
                               for t in tensors))


class LayerReplay:
    """An executor whose calls are recorded once per key and replayed (see the module).

    It offers the executor interface the ``torch_dcp`` ops use (``forward``,
    ``forward_keeping``, ``backward``; every other attribute is the wrapped executor's).

    Args:
        executor: a :class:`~torch_dcp.executor.RankExecutor` or head-parallel executor.
        recorder: how calls are recorded.

    Attributes:
        recorded: keys recorded so far (a key is one pass over inputs of one shape and dtype).
        replays: calls served by a recording (the recording call included).
        eager_calls: calls run eagerly after a recording failed.
        failure: the cause of the failed recording, or ``None``.
    """

    def __init__(self, executor: Any, recorder: Recorder):
        self.executor, self.recorder = executor, recorder
        self._recordings: dict[tuple, tuple[tuple[torch.Tensor, ...], Recording]] = {}
        self._scratch: dict[tuple, list[torch.Tensor]] = {}
        self.replays = 0
        self.eager_calls = 0
        self.failure: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["executor"], name)

    @property
    def recorded(self) -> list[tuple]:
        return list(self._recordings)

    def _call(self, kind: str, method: Callable[..., Any], tensors: Sequence[torch.Tensor | None],
              scale: float | None, n_out: int) -> Outputs:
        if self.failure is not None:
            self.eager_calls += 1
            return tuple(method(*tensors, scale))[:n_out]
        key = _key(kind, tensors, scale)
        entry = self._recordings.get(key)
        if entry is None:
            static = self._static_inputs(tensors)
            try:
                recording = self.recorder.record(lambda: tuple(method(*static, scale))[:n_out])
            except Exception as err:  # noqa: BLE001 - reported once, then eager
                self.failure = f"{type(err).__name__}: {err}"
                warnings.warn(f"torch_dcp: recording the {kind} pass for layer replay failed ({self.failure}); "
                              "this step's attention runs eagerly", RuntimeWarning, stacklevel=4)
                self.eager_calls += 1
                return tuple(method(*tensors, scale))[:n_out]
            entry = self._recordings[key] = (static, recording)
        else:
            for buf, t in zip(entry[0], tensors):
                if buf is not None:
                    buf.copy_(t)
        entry[1].replay()
        self.replays += 1
        return tuple(o.clone() for o in entry[1].outputs)

    def _static_inputs(self, tensors: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """The static input buffers of a new recording, holding ``tensors``' values. Every call
        copies its inputs in before it replays, so the buffers are scratch shared by all
        recordings: the n-th input of one shape, stride and dtype in a call is the n-th buffer of
        that layout (the backward's ``q``, ``k``, ``v`` are the forward's buffers)."""
        seen: dict[tuple, int] = {}
        out = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            layout = (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
            n = seen[layout] = seen.get(layout, -1) + 1
            bufs = self._scratch.setdefault(layout, [])
            if n == len(bufs):
                bufs.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))
            out.append(bufs[n].copy_(t.detach()))
        return tuple(out)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
        """The executor's ``forward``, recorded or replayed: ``(out, lse)``."""
        return self._call("forward", lambda q, k, v, s: self.executor.forward(q, k, v, s), (q, k, v), scale, 2)

    def forward_keeping(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
        """The executor's ``forward_keeping``, recorded or replayed: ``(out, lse, state)``."""
        return self._call("forward_keeping", lambda q, k, v, s: self.executor.forward_keeping(q, k, v, s), (q, k, v),
                          scale, 3)

    def backward(self, q, k, v, out, lse, dout, scale: float | None = None, state: torch.Tensor | None = None):
        """The executor's ``backward``, recorded or replayed: ``(dq, dk, dv)``."""
        def run(q, k, v, out, lse, dout, state, s):
            return self.executor.backward(q, k, v, out, lse, dout, s, state)

        return self._call("backward", run, (q, k, v, out, lse, dout, state), scale, 3)

    def close(self) -> None:
        """Free every recording (its graph and static buffers)."""
        self._recordings.clear()
        self._scratch.clear()
