"""Every rank of a plan in one process: :func:`emulate` runs the ranks' programs interleaved on
the in-process transport, through the executor of the plan's type
(:func:`~torch_dcp.executor.make.make_executor`), for tests, debugging and kernel timings."""

from __future__ import annotations

from typing import Any

import torch

from .._interleave import interleave
from ..plan import Plan
from .kernels import DivisionKernel, get_kernel
from .make import make_executor
from .transport import InProcessTransport, Mailbox

__all__ = ["emulate"]


def emulate(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor | None = None,
            kernel: str | DivisionKernel | None = None, scale: float | None = None, timings: bool = False) -> Any:
    """Run every rank of ``plan`` in this process on the in-process transport.

    Args:
        q: ``[T, H, D]``, k, v: ``[T, H_kv, D]``: the whole batch in global token order
            (``T = plan.batch.total_tokens``), dtype the plan's.
        grad_out: ``[T, H, D]`` gradient of the output, for a backward pass too.
        kernel, scale: as for :class:`~torch_dcp.executor.executor.RankExecutor`.
        timings: also measure every rank's compute (the ranks run one after another on one
            device, so each instruction's time is that rank's own).

    Returns:
        ``out: [T, H, D]`` when ``grad_out`` is None, else ``(out, dq, dk, dv)``, all in
        global token order. With ``timings=True``: ``(that, times)`` where ``times`` maps each
        rank to its list of :class:`~torch_dcp.executor.timing.InstructionTime`
        ``(division, kind, seconds, backward)``, forward program first, in program order.

    Raises:
        ValueError: shapes or dtypes that do not match the plan's batch.
        RuntimeError: the plan deadlocks (a rank waits for a message nobody sends).
    """
    b = plan.batch
    T = b.total_tokens
    for name, t, heads in (("q", q, b.n_heads), ("k", k, b.n_kv_heads), ("v", v, b.n_kv_heads)) + (
            (("grad_out", grad_out, b.n_heads),) if grad_out is not None else ()):
        if tuple(t.shape) != (T, heads, b.head_dim):
            raise ValueError(f"emulate: {name} must be [{T}, {heads}, {b.head_dim}] (total tokens, heads, head_dim), got {list(t.shape)}")
    mailbox = Mailbox()
    ranks = range(plan.world_size)
    idx = [torch.from_numpy(plan.token_indices(r)).to(q.device) for r in ranks]
    kern = get_kernel(kernel, device=q.device, dtype=q.dtype, head_dim=q.shape[-1])  # one kernel instance (and its caches) for all ranks
    # the executor of the plan's type (head-parallel plans too)
    execs = [make_executor(plan, r, InProcessTransport(mailbox, r), kernel=kern, scale=scale, timings=timings)
             for r in ranks]
    local = [(q[i], k[i], v[i]) for i in idx]
    # as the torch_dcp::attention op runs them: the forward keeps what the backward needs
    fwd = interleave([e.forward_steps(*x, keep=True) for e, x in zip(execs, local)], lambda: mailbox.events)
    out = torch.empty_like(q)
    for i, (o, _, _) in zip(idx, fwd):
        out[i] = o
    if grad_out is None:
        return (out, {r: e.timings for r, e in zip(ranks, execs)}) if timings else out
    bwd = interleave([e.backward_steps(*x, o, lse, grad_out[i], None, st)
                      for e, x, (o, lse, st), i in zip(execs, local, fwd, idx)], lambda: mailbox.events)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for i, (a, bk, c) in zip(idx, bwd):
        dq[i], dk[i], dv[i] = a, bk, c
    if timings:
        return (out, dq, dk, dv), {r: e.timings for r, e in zip(ranks, execs)}
    return out, dq, dk, dv
