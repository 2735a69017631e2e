"""Every rank of a plan measured alone, in this process: the executor's own time per rank and
pass, and per instruction, with the emulated network's copies left out (``calibrate`` and its
check).

All ranks' :class:`~torch_dcp.executor.RankExecutor` run on the in-process transport, their
device plans prepared first. Each rank's forward and backward are timed on their own: the device
synchronised around every stretch a rank runs between its waits. The in-process transport's
copies (its send clone and its receive copy: the bytes a real transport moves over the links
while the rank computes) are timed apart and subtracted, from the pass and from the
``CommLaunch`` that posted them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from ..executor import InProcessTransport, Mailbox, RankExecutor, get_kernel
from ..executor.timing import InstructionTime
from ..batch import BatchSpec
from ..plan import Plan
from .common import DTYPES, sync

__all__ = ["RankTimes", "measure_plan", "batch_inputs", "NetworkTimedTransport", "timed_stretches"]


class NetworkTimedTransport(InProcessTransport):
    """The in-process transport, timing its own copies: :attr:`seconds` in all, and
    :attr:`launches` for each ``launch`` call in order."""

    def __init__(self, mailbox: Mailbox, rank: int, device: torch.device):
        super().__init__(mailbox, rank)
        self.device = device
        self.seconds = 0.0
        self.launches: list[float] = []

    def launch(self, phase, sends, recvs):
        sync(self.device)
        t0 = time.perf_counter()
        handle = super().launch(phase, sends, recvs)
        sync(self.device)
        dt = time.perf_counter() - t0
        self.seconds += dt
        self.launches.append(dt)
        return handle

    def wait(self, handle):
        gen = super().wait(handle)
        while True:
            sync(self.device)
            t0 = time.perf_counter()
            try:
                next(gen)
            except StopIteration:
                return
            finally:
                sync(self.device)
                self.seconds += time.perf_counter() - t0
            yield


def timed_stretches(gen, seconds: np.ndarray, rank: int, device: torch.device):
    """Drive ``gen``, adding the time of every stretch it runs (between its yields) to
    ``seconds[rank]``."""
    while True:
        sync(device)
        t0 = time.perf_counter()
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value
        finally:
            sync(device)
            seconds[rank] += time.perf_counter() - t0
        yield


@dataclasses.dataclass(frozen=True)
class RankTimes:
    """Measured times of every rank of a plan (seconds, median over the timed runs).

    Attributes:
        forward, backward: float64 ``[W]``: each rank's pass, network copies excluded.
        instructions: per rank, ``(forward, backward)`` lists of
            :class:`~torch_dcp.executor.timing.InstructionTime` of one timed run, ``pack``
            times without the network copies (empty unless measured with ``instructions``).
    """

    forward: np.ndarray
    backward: np.ndarray
    instructions: list[tuple[list[InstructionTime], list[InstructionTime]]]

    @property
    def total(self) -> np.ndarray:
        return self.forward + self.backward


def batch_inputs(batch: BatchSpec, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random ``q, k, v, grad_out`` of the whole batch in global token order, the batch's dtype:
    ``q, grad_out: [T, H, D]``, ``k, v: [T, H_kv, D]``."""
    g = torch.Generator(device=device).manual_seed(seed)
    T, H, Hkv, D = batch.total_tokens, batch.n_heads, batch.n_kv_heads, batch.head_dim
    shapes = ((T, H, D), (T, Hkv, D), (T, Hkv, D), (T, H, D))
    return tuple(torch.randn(s, generator=g, device=device, dtype=torch.float32).to(DTYPES[batch.dtype])
                 for s in shapes)


def measure_plan(plan: Plan, device: torch.device, kernel: Any = "auto", repeat: int = 3,
                 instructions: bool = False, seed: int = 0) -> RankTimes:
    """Run every rank of ``plan`` here, ``1 + repeat`` steps (the first uploads and warms up),
    and time each rank's forward and backward alone (module docstring).

    Args:
        plan: a flat :class:`~torch_dcp.Plan` (head parallelism 1).
        kernel: the executor's kernel (:func:`~torch_dcp.executor.get_kernel`).
        instructions: also record every instruction's time (``RankExecutor(timings=True)``).

    Raises:
        ValueError: ``repeat`` below 1.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    from .._interleave import interleave

    W, b = plan.world_size, plan.batch
    mailbox = Mailbox()
    nets = [NetworkTimedTransport(mailbox, r, device) for r in range(W)]
    kern = get_kernel(kernel, device=device, dtype=DTYPES[b.dtype], head_dim=b.head_dim)
    execs = [RankExecutor(plan, r, nets[r], kernel=kern, timings=instructions) for r in range(W)]
    for e in execs:
        e.prepare(device)
    q, k, v, go = batch_inputs(plan.batch, device, seed)
    idx = [torch.from_numpy(plan.token_indices(r)).to(device) for r in range(W)]
    local = [(q[i], k[i], v[i], go[i]) for i in idx]
    fwd_runs, bwd_runs, last = [], [], []
    for it in range(1 + repeat):
        for e, n in zip(execs, nets):
            e.reset_timings()
            n.seconds, n.launches = 0.0, []
        busy_f, busy_b = np.zeros(W), np.zeros(W)
        fwd = interleave([timed_stretches(e.forward_steps(*x[:3]), busy_f, r, device) for r, (e, x) in enumerate(zip(execs, local))],
                         lambda: mailbox.events)
        net_f = np.array([n.seconds for n in nets])
        launches_f = [list(n.launches) for n in nets]
        for n in nets:
            n.seconds, n.launches = 0.0, []
        interleave([timed_stretches(e.backward_steps(*x[:3], o, lse, x[3]), busy_b, r, device)
                    for r, (e, x, (o, lse)) in enumerate(zip(execs, local, fwd))], lambda: mailbox.events)
        net_b = np.array([n.seconds for n in nets])
        if it == 0:
            continue
        fwd_runs.append(busy_f - net_f)
        bwd_runs.append(busy_b - net_b)
        if instructions and it == repeat:
            for r, e in enumerate(execs):
                times = e.timings
                per_pass = []
                for backward, net in ((False, launches_f[r]), (True, list(nets[r].launches))):
                    sel = [t for t in times if t.backward == backward]
                    out, i = [], 0
                    for t in sel:
                        if t.kind == "pack" and i < len(net):
                            t = t._replace(seconds=max(0.0, t.seconds - net[i]))
                            i += 1
                        out.append(t)
                    per_pass.append(out)
                last.append((per_pass[0], per_pass[1]))
    return RankTimes(np.median(fwd_runs, axis=0), np.median(bwd_runs, axis=0), last)
