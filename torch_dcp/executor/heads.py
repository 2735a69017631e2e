"""Head parallelism's all-to-alls around a rank's outer executor.

Rank ``(g, i)`` of a :class:`~torch_dcp.plan.heads.HeadParallelPlan` holds chunk ``i`` of head
group ``g``'s tokens with every head. Forward: an all-to-all inside the group trades Q, K, V so
that the rank holds every token of the group for its ``H / N`` query heads (and its key/value
heads); a :class:`~torch_dcp.executor.executor.RankExecutor` runs the outer plan as outer rank
``g`` with the ranks of the same inner index in other groups; a second all-to-all brings O and
the LSE back to the chunk's owner. The forward can keep the head-sharded Q, K, V, O and
LSE (:meth:`HeadParallelExecutor.forward_keeping`, what the ``torch_dcp::attention`` op saves
for its backward): the backward then sends only dO to the head owners; without them (PyTorch's
own SDPA ops reached through DTensor have no place for them) Q, K, V, O and the LSE travel
again. The outer backward runs, and dQ, dK, dV come back, replicated key/value heads' partials
summed by the owner. Each tensor is traded by one all-to-all on the head group
(:meth:`~torch_dcp.executor.transport.Transport.all_to_all`: NCCL's or gloo's
``all_to_all_single`` on the head group's process group, which the context creates at entry,
copying the own rows inside it; point-to-point messages on a transport without it), in phases of
their own.
"""

from __future__ import annotations

import math
from typing import Any, Generator, Sequence

import torch

from ..plan.heads import HeadParallelPlan
from .executor import _drain, dcp_attention
from .runtime import plan_executor
from .transport import Message, Transport, TransferError, located

__all__ = ["HeadParallelExecutor", "A2A_PHASES"]

#: transport phases of the all-to-alls (far above any plan's own phases)
A2A_PHASES = {(False, "in"): 1 << 20, (False, "out"): (1 << 20) + 1, (True, "in"): (1 << 20) + 2,
              (True, "out"): (1 << 20) + 3}
#: what each all-to-all phase is, for the errors of its transfers
A2A_NAMES = {phase: f"{'backward' if backward else 'forward'} pass, head all-to-all "
                    f"{'to heads' if way == 'in' else 'back to rows'}" for (backward, way), phase in A2A_PHASES.items()}


class _InnerTransport(Transport):
    """The outer plan's transport of inner index ``inner``: outer rank ``g`` is rank
    ``g * N + inner`` of the DCP group; its collectives are the base transport's on those
    ranks."""

    def __init__(self, base: Transport, n: int, inner: int, outer_world: int, outer_rank: int):
        self.base, self.n, self.inner, self.world_size, self.rank = base, n, inner, outer_world, outer_rank

    def _map(self, msgs: Sequence[Message]) -> list[Message]:
        return [(peer * self.n + self.inner, tag, t) for peer, tag, t in msgs]

    def launch(self, phase, sends, recvs):
        return self.base.launch(phase, self._map(sends), self._map(recvs))

    def wait(self, handle):
        return self.base.wait(handle)

    # collectives on the ranks of this inner index: the base transport's (NCCL's on a device)
    def all_gather(self, phase, shard, out, members):
        return self.base.all_gather(phase, shard, out, [m * self.n + self.inner for m in members])

    def reduce_scatter(self, phase, inp, out, members):
        return self.base.reduce_scatter(phase, inp, out, [m * self.n + self.inner for m in members])

    def finish(self, collective):
        return self.base.finish(collective)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def _unpack(msg: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    out, off = [], 0
    for shape, dtype in specs:
        n = _nbytes(shape, dtype)
        out.append(msg[off:off + n].view(dtype).view(shape))
        off += n
    return out


class HeadParallelExecutor:
    """Executes rank ``rank``'s part of a head-parallel plan (see the module).

    Args:
        plan: the :class:`~torch_dcp.plan.heads.HeadParallelPlan`.
        rank: this rank in the DCP group.
        transport: the DCP group's transport (the all-to-alls and the outer plan's messages).
        kernel, scale, timings: as for :class:`~torch_dcp.executor.executor.RankExecutor`
            (the outer executor's).
        device_plan: the outer executor's device plan (built for outer rank ``rank // N``).

    Raises:
        ValueError: ``rank`` outside the plan or a transport group of another size.
    """

    def __init__(self, plan: HeadParallelPlan, rank: int, transport: Transport, kernel: Any = None,
                 scale: float | None = None, timings: bool = False, device_plan: Any = None):
        group_size = getattr(transport, "world_size", None)
        if group_size is not None and group_size != plan.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks, the transport's group has {group_size}")
        self.plan, self.rank, self.transport = plan, int(rank), transport
        self.group, self.inner = plan.group_of(rank)
        lay = plan.layout
        self.n = lay.size
        self.members = [self.group * self.n + j for j in range(self.n)]
        # the outer plan on its runtime: the general executor, or all-gather CP's (Ulysses' one
        # attention call per rank where every outer rank keeps its documents: CP groups of 1)
        outer = plan_executor(plan.outer)
        self.outer = outer(plan.outer, self.group, _InnerTransport(transport, self.n, self.inner, plan.outer.world_size,
                                                                   self.group),
                           kernel=kernel, scale=scale, timings=timings, device_plan=device_plan)
        self.chunks = lay.chunks(plan.outer.local_tokens(self.group))
        self.local_rows = int(self.chunks[self.inner + 1] - self.chunks[self.inner])
        self.chunk_rows = [int(self.chunks[j + 1] - self.chunks[j]) for j in range(self.n)]  # each member's rows
        self.scale = self.outer.scale
        self._a2a_sent = 0
        self._a2a_received = 0

    # ------------------------------------------------------------------ pass-through
    @property
    def bytes_sent(self) -> int:
        """Bytes this executor has sent so far (all calls): the all-to-alls and the outer plan's."""
        return self._a2a_sent + self.outer.bytes_sent

    @property
    def bytes_received(self) -> int:
        """Bytes this executor has received so far (all calls)."""
        return self._a2a_received + self.outer.bytes_received

    @property
    def kernel(self):
        return self.outer.kernel

    @property
    def device_plan(self):
        return self.outer.device_plan

    def prepare(self, device: torch.device | str) -> Any:
        """Prepare the outer executor (see :meth:`RankExecutor.prepare`)."""
        return self.outer.prepare(device)

    @property
    def timings(self):
        return self.outer.timings

    def reset_timings(self) -> None:
        self.outer.reset_timings()

    # ------------------------------------------------------------------ checks
    def _check(self, name: str, t: torch.Tensor, heads: tuple[int, ...], device: torch.device | None = None) -> None:
        b = self.plan.batch
        if t.dim() != 3 or t.shape[0] != self.local_rows or t.shape[1] not in heads or t.shape[2] != b.head_dim:
            raise ValueError(f"{name}: expected [{self.local_rows}, {' or '.join(map(str, heads))}, {b.head_dim}] "
                             f"(rank {self.rank}'s tokens, heads, head_dim), got {list(t.shape)}")
        if t.dtype != self.outer.dtype:
            raise ValueError(f"{name}: expected dtype {self.outer.dtype} (the plan's BatchSpec.dtype), got {t.dtype}")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")

    def _check_inputs(self, q, k, v) -> None:
        b = self.plan.batch
        self._check("q", q, (b.n_heads,))
        self._check("k", k, (b.n_kv_heads, b.n_heads), q.device)
        self._check("v", v, (b.n_kv_heads, b.n_heads), q.device)
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v have {k.shape[1]} and {v.shape[1]} heads; they must have the same")

    def _blocks(self, kind: str, t: torch.Tensor) -> tuple[int, int]:
        """``(width, replicas)``: the heads of ``t`` each inner index holds, and how many
        consecutive inner indices hold the same ones (query heads, or key/value heads given
        repeated to ``H``: ``H / N`` each, no replicas; else the layout's key/value heads, each
        block on :attr:`~torch_dcp.plan.heads.HeadLayout.kv_replicas` indices)."""
        lay = self.plan.layout
        if kind == "q" or t.shape[1] == self.plan.batch.n_heads:
            return lay.q_heads, 1
        return lay.kv_heads, lay.kv_replicas

    # ------------------------------------------------------------------ all-to-all
    def _exchange(self, phase: int, tensors: list[tuple[torch.Tensor, torch.Tensor, list[int], list[int]]]
                  ) -> Generator:
        """One all-to-all per tensor on the head group (:meth:`~torch_dcp.executor.transport.Transport.all_to_all`,
        told apart by the tensor's index): ``(inp, out, in_rows, out_rows)``, contiguous,
        row ranges per member in member order; the own range is copied across by the
        collective (NCCL's, inside it), so no operation here copies it."""
        posted = []
        try:
            for x, (inp, out, in_rows, out_rows) in enumerate(tensors):
                posted.append(self.transport.all_to_all(phase, inp, out, in_rows, out_rows, self.members, tag=x))
                row_in = math.prod(inp.shape[1:]) * inp.element_size()
                row_out = math.prod(out.shape[1:]) * out.element_size()
                self._a2a_sent += row_in * (sum(in_rows) - in_rows[self.inner])
                self._a2a_received += row_out * (sum(out_rows) - out_rows[self.inner])
            for c in posted:
                yield from self.transport.finish(c)
        except TransferError as err:  # where this rank was, as the outer plan's steps say it
            raise located(err, f"torch_dcp (plan {self.plan.digest()[:12]}): {A2A_NAMES[phase]}(phase={phase})") \
                from None

    def _to_heads(self, backward: bool, tensors: list[torch.Tensor], kinds: list[str],
                  into: Sequence[torch.Tensor] | None = None) -> Generator:
        """Sequence-sharded ``[S_r, heads, ...]`` tensors to head-sharded ``[S_g, heads / N, ...]``
        (``kinds``: ``"q"`` query heads, ``"kv"`` key/value heads). Each tensor is laid out by
        inner index in one copy (``[N, S_r, width, ...]``, replicated key/value heads repeated)
        and traded by one all-to-all, each member's rows received straight into the result (a
        new tensor, or the contiguous one of ``into`` given for it)."""
        posts, fulls = [], []
        for x, (t, kind) in enumerate(zip(tensors, kinds)):
            width, reps = self._blocks(kind, t)
            s, rest = t.shape[0], tuple(t.shape[2:])
            blocks = self.n // reps
            send = (t.unflatten(1, (blocks, width)).transpose(0, 1).unsqueeze(1)
                    .expand(blocks, reps, s, width, *rest).reshape(self.n * s, width, *rest).contiguous())
            fulls.append(into[x] if into is not None else
                         torch.empty((int(self.chunks[-1]), width) + rest, dtype=t.dtype, device=t.device))
            posts.append((send, fulls[-1], [s] * self.n, self.chunk_rows))
        yield from self._exchange(A2A_PHASES[(backward, "in")], posts)
        return fulls

    def _to_rows(self, backward: bool, tensors: list[torch.Tensor], kinds: list[str],
                 like: list[torch.Tensor]) -> Generator:
        """Head-sharded ``[S_g, heads / N, ...]`` back to sequence-sharded tensors shaped like
        ``like`` (``kinds`` as for :meth:`_to_heads`; replicated key/value heads summed). Each
        member's rows are sent as they lie by one all-to-all; what comes back is received into
        one ``[N, S_r, width, ...]`` buffer per tensor and laid out by heads in one copy
        (replicas summed as they are laid out)."""
        posts, recv = [], []
        for t in tensors:
            t = t.contiguous()
            buf = torch.empty((self.n * self.local_rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            posts.append((t, buf, self.chunk_rows, [self.local_rows] * self.n))
            recv.append(buf.view((self.n, self.local_rows) + tuple(t.shape[1:])))
        yield from self._exchange(A2A_PHASES[(backward, "out")], posts)
        out = []
        for buf, kind, ref in zip(recv, kinds, like):
            width, reps = self._blocks(kind, ref)
            rest = tuple(buf.shape[3:])
            blocks = self.n // reps
            res = torch.empty((self.local_rows, blocks * width) + rest, dtype=buf.dtype, device=buf.device)
            view = res.view((self.local_rows, blocks, width) + rest).transpose(0, 1)
            if reps > 1:  # replicas of a key/value head: their partials add up, written in the heads' layout
                torch.sum(buf.unflatten(0, (blocks, reps)), 1, out=view)
            else:
                view.copy_(buf)
            out.append(res)
        return out

    # ------------------------------------------------------------------ passes
    def _state_specs(self, kv_heads: int, group: int | None = None) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the kept head-sharded Q, K, V, O, LSE of a rank of ``group``
        (default this rank's; keys/values given with ``kv_heads`` heads: ``H_kv``, or ``H``
        repeated)."""
        lay, b, e = self.plan.layout, self.plan.batch, self.outer.dtype
        s, d = self.plan.outer.local_tokens(self.group if group is None else group), b.head_dim
        hk = lay.q_heads if kv_heads == b.n_heads else lay.kv_heads
        return [((s, lay.q_heads, d), e), ((s, hk, d), e), ((s, hk, d), e), ((s, lay.q_heads, d), e),
                ((s, lay.q_heads), self.outer.acc)]

    def state_nbytes(self, kv_heads: int, every_rank: bool = False) -> int:
        """Bytes of :meth:`forward_keeping`'s state for keys/values with ``kv_heads`` heads (of
        every rank together with ``every_rank``)."""
        groups = range(self.plan.outer.world_size) if every_rank else [self.group]
        n = self.n if every_rank else 1
        return n * sum(_nbytes(*spec) for g in groups for spec in self._state_specs(kv_heads, g))

    def forward_steps(self, q, k, v, scale: float | None = None, keep: bool = False) -> Generator[None, None, tuple]:
        """:meth:`forward` as a generator that yields while waiting for messages (``keep``: as
        :meth:`forward_keeping`)."""
        self._check_inputs(q, k, v)
        state = kept = None
        if keep:  # the head-sharded tensors land in the kept state itself: Q, K, V received there, O
            # and the LSE written there by an outer executor that takes them (else copied in after it)
            state = torch.empty(self.state_nbytes(k.shape[1]), dtype=torch.uint8, device=q.device)
            kept = _unpack(state, self._state_specs(k.shape[1]))
        qg, kg, vg = yield from self._to_heads(False, [q, k, v], ["q", "kv", "kv"],
                                               into=None if kept is None else kept[:3])
        if kept is not None and getattr(self.outer, "takes_out", False):
            og, lseg = yield from self.outer.forward_steps(qg, kg, vg, scale, out=(kept[3], kept[4]))
        else:
            og, lseg = yield from self.outer.forward_steps(qg, kg, vg, scale)
            if kept is not None:  # O and the LSE after Q, K, V in the state, in one copy
                start = sum(t.numel() * t.element_size() for t in kept[:3])
                torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in (og, lseg)], out=state[start:])
        out, lse = yield from self._to_rows(False, [og, lseg], ["q", "q"], [q, q])
        return (out, lse, state) if keep else (out, lse)

    def backward_steps(self, q, k, v, out, lse, dout, scale: float | None = None,
                       state: torch.Tensor | None = None) -> Generator[None, None, tuple]:
        """:meth:`backward` as a generator that yields while waiting for messages."""
        b = self.plan.batch
        self._check_inputs(q, k, v)
        self._check("out", out, (b.n_heads,), q.device)
        self._check("dout", dout, (b.n_heads,), q.device)
        if tuple(lse.shape) != (self.local_rows, b.n_heads) or not lse.is_floating_point() or lse.device != q.device:
            raise ValueError(f"lse: expected a floating [S_local, heads] = {[self.local_rows, b.n_heads]} tensor on "
                             f"{q.device} (the forward's), got {lse.dtype} {list(lse.shape)} on {lse.device}")
        if state is not None and state.numel():  # the forward's head-sharded tensors: only dO travels in
            if state.dtype != torch.uint8 or state.numel() != self.state_nbytes(k.shape[1]):
                raise ValueError(f"state: expected the forward's {self.state_nbytes(k.shape[1])} uint8 bytes, got "
                                 f"{state.numel()} {state.dtype}")
            qg, kg, vg, og, lseg = _unpack(state, self._state_specs(k.shape[1]))
            (dog,) = yield from self._to_heads(True, [dout], ["q"])
        else:  # nothing kept: Q, K, V, O and the LSE travel again
            qg, kg, vg, og, lseg, dog = yield from self._to_heads(
                True, [q, k, v, out, lse.to(self.outer.acc), dout], ["q", "kv", "kv", "q", "q", "q"])
        dqg, dkg, dvg = yield from self.outer.backward_steps(qg, kg, vg, og, lseg, dog, scale)
        dq, dk, dv = yield from self._to_rows(True, [dqg, dkg, dvg], ["q", "kv", "kv"], [q, k, v])
        return dq, dk, dv

    # ------------------------------------------------------------------ public API
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`RankExecutor.forward <torch_dcp.executor.executor.RankExecutor.forward>`:
        ``q [S_local, H, D]``, ``k, v [S_local, H_kv or H, D]`` of this rank's tokens; returns
        ``(out [S_local, H, D], lse [S_local, H])``.

        Raises:
            ValueError: shapes, dtype or devices that do not match the plan and this rank.
        """
        return _drain(self.forward_steps(q, k, v, scale))

    def forward_keeping(self, q, k, v, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward`, plus the head-sharded Q, K, V, O and LSE packed in one uint8 tensor
        (:meth:`state_nbytes` bytes), so that the backward given it moves only dO in (as
        TransformerEngine's ``a2a`` keeps them)."""
        return _drain(self.forward_steps(q, k, v, scale, keep=True))

    def backward(self, q, k, v, out, lse, dout, scale: float | None = None, state: torch.Tensor | None = None):
        """As :meth:`RankExecutor.backward <torch_dcp.executor.executor.RankExecutor.backward>`;
        with ``state`` (:meth:`forward_keeping`'s) only dO travels in.

        Raises:
            ValueError: as :meth:`forward`, or a ``state`` that is not this rank's forward's.
        """
        return _drain(self.backward_steps(q, k, v, out, lse, dout, scale, state))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Differentiable forward (:func:`~torch_dcp.executor.executor.dcp_attention`)."""
        return dcp_attention(q, k, v, self)
