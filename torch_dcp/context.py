"""``torch_dcp.context_parallel``: run a model's SDPA calls under a DCP plan, model unchanged.

The shape follows PyTorch's ``torch.distributed.tensor.experimental.context_parallel``:
buffers with a sequence dimension are resharded in place to this rank's planned tokens, and
attention is intercepted in two levels:

1. ``F.scaled_dot_product_attention`` is wrapped: the wrapper checks the call against the
   plan (mask, shapes, dtype, no ``attn_mask``, no dropout) before any communication, turns
   the tensors into DTensors sharded on the sequence dimension and calls the custom op
   ``torch_dcp::attention`` (:mod:`torch_dcp.attention_op`), never PyTorch's SDPA, so the
   SDPA backend PyTorch would have picked (flash, efficient, cuDNN, CPU flash, MATH) does
   not matter; it hands plain tensors back to the model;
2. DTensor custom op handlers run the plan's executor on the local shards and return
   DTensors, so autograd reaches the backward: for ``torch_dcp::attention`` and its backward
   op, and for the aten SDPA ops (flash, efficient, cuDNN, the CPU flash op, and their
   backward ops) for callers that reach those ops with DTensors directly.

Everything is restored on exit, also when the body raises.

``torch.compile``: while Dynamo traces the wrapper it checks what does not depend on the plan
(``attn_mask``, dropout, plain 4-D tensors, ``enable_gqa``) and records one
``torch_dcp::attention`` call on the plain tensors, with ``is_causal`` and ``enable_gqa``; the op
checks the rest against the plan bound when the graph runs, before any communication, with the
eager wrapper's messages. Nothing plan-specific is read while tracing, and the wrapper is the
same function in every context, so the graph has no break inside the attention and is not
recompiled for the next step's plan. (A plan-independent error found while tracing with
``fullgraph=True`` reaches the caller as Dynamo's ``Unsupported``, naming the ``ValueError``.)
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import typing
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from . import attention_op, teardown
from .api import DEFAULT_PLANNER, plan as make_plan
from .attention_op import as_dtensor, bind_args, like, local
from .batch import BatchSpec, canonical_dtype
from .buffers import RowLayout, context_parallel_unshard, remember, rows_batch, unshard
from .cost import CostModel
from .executor import RankExecutor, TorchDistributedTransport, make_executor
from .executor.allgather import collective_groups
from .executor.groups import cp_subgroups, host_group, transfer_group
from .executor.transport import RefusalChannel, TransferError, TransferTimeoutError, as_timedelta, is_timeout
from .executor.device_plan import DevicePlan, host_to_device
from .executor.padding import PaddedRows, PlaceholderRows, check_capacity
from .executor.replay import LayerReplay, Recorder, recorder_for
from .executor.kernels import DivisionKernel, get_kernel
from .masks import Causal, Full, MaskSpec
from .plan import Plan
from .sdpa_check import call_rows, check_sdpa_call, fold_rows, unfold_rows
from .topology import Topology

__all__ = ["context_parallel", "context_parallel_unshard", "unshard", "DCPContext", "active_context"]

aten = torch.ops.aten
_FWD_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": 2,
    "_scaled_dot_product_flash_attention": 9,
    "_scaled_dot_product_efficient_attention": 4,
    "_scaled_dot_product_cudnn_attention": 9,
}
_BWD_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu_backward": 3,
    "_scaled_dot_product_flash_attention_backward": 3,
    "_scaled_dot_product_efficient_attention_backward": 4,
    "_scaled_dot_product_cudnn_attention_backward": 3,
}

#: tokens per block of a context that plans its batch, unless told (:func:`torch_dcp.plan`'s default)
DEFAULT_BLOCK_SIZE = 1024

_active: "DCPContext | None" = None
#: context entries per group (by its ranks): every rank of a group counts alike, naming each entry's refusal key
_entries: dict[tuple[int, ...], int] = {}


def active_context() -> "DCPContext | None":
    """The :class:`DCPContext` of the active :func:`context_parallel`, or ``None`` outside one."""
    return _active


class DCPContext:
    """What :func:`context_parallel` yields: the step's plan and this rank's executor.

    Attributes:
        plan: the plan every rank runs (same digest on all ranks).
        rank: this rank in the mesh.
        executor: the :class:`~torch_dcp.executor.RankExecutor` the SDPA handlers use (inside
            a :class:`~torch_dcp.executor.replay.LayerReplay` when replay is on).
        replay: the context's :class:`~torch_dcp.executor.replay.LayerReplay`, or ``None``.
        mesh: the one-dimensional DCP mesh.
        refusals: the entry's :class:`~torch_dcp.executor.RefusalChannel` (``None``: refusals
            are not posted).
        rows: the sequence length of every SDPA call: this rank's tokens of the plan, or the
            context's ``padded_tokens``.
    """

    def __init__(self, mesh: Any, plan: Plan, executor: RankExecutor, refusals: RefusalChannel | None = None,
                 replay: LayerReplay | None = None, rows: int | None = None,
                 rebuild: "Callable[[Plan], tuple[Any, LayerReplay | None]] | None" = None, infer_mask: bool = False):
        self.mesh = mesh
        self.plan = plan
        self.rank = executor.rank
        self.executor = executor
        self.refusals = refusals
        self.replay = replay
        self.rows = plan.local_tokens(self.rank) if rows is None else rows
        #: whether this rank holds no tokens and its calls may carry a placeholder token instead
        #: (:class:`~torch_dcp.executor.padding.PlaceholderRows`)
        self.placeholder = rows is None and self.rows == 0
        self._rebuild, self._infer_mask = rebuild, infer_mask

    def bind(self, query: torch.Tensor, key: torch.Tensor, is_causal: bool) -> None:
        """A context without ``batch=`` planned with nominal heads unless its buffers held the
        attention's inputs: its first SDPA call (``query: [1, H, S_local, D]``, ``key: [1, H_kv,
        S_local, D]``) gives the plan its heads, head_dim and dtype
        (:meth:`~torch_dcp.Plan.with_heads`: the same placement, so the sharded buffers stay
        valid) and, where no mask was named and the call says ``is_causal=False``, the full mask
        (:meth:`~torch_dcp.Plan.with_mask`: the same token layout); the executor is built for it.
        Later calls are checked against it as usual.

        Raises:
            ValueError: heads the :class:`~torch_dcp.BatchSpec` refuses.
        """
        if self._rebuild is None or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key)):
            return
        rebuild, self._rebuild = self._rebuild, None
        plan = self.plan.with_mask(Full()) if self._infer_mask and not is_causal else self.plan
        plan = plan.with_heads(query.shape[1], key.shape[1], query.shape[3], canonical_dtype(query.dtype))
        if plan is self.plan:
            return
        if self.replay is not None:
            self.replay.close()
        self.executor, self.replay = rebuild(plan)
        self.plan = plan
        attention_op.rebind(self.executor)

    def refuse(self, reason: str) -> "typing.NoReturn":
        """Refuse the next SDPA call of this step before making it (an integration's own
        checks): post ``reason`` on the refusal channel, so that peers waiting for this rank's
        transfers raise :class:`~torch_dcp.executor.PeerRefusedError` naming this rank and
        ``reason`` within :data:`~torch_dcp.executor.transport.REFUSAL_POLL_S` s (not after
        ``timeout``), then raise here. Every rank refusing the same call stays in step.

        Raises:
            ValueError: always, with ``reason``.
        """
        if self.refusals is not None:
            self.refusals.post(reason, upcoming=True)
        raise ValueError(reason)

    def unshard(self, tensor: torch.Tensor, seq_dim: int = 0) -> torch.Tensor:
        """:func:`unshard` with this context's plan and mesh."""
        return unshard(tensor, self.plan, self.mesh, seq_dim)


def _group(mesh: Any) -> Any:
    if hasattr(mesh, "get_group"):
        if mesh.ndim != 1:
            raise ValueError(f"torch_dcp: the DCP mesh must be one-dimensional, got {mesh.ndim} dimensions "
                             "(flatten the data and context dimensions into one)")
        return mesh.get_group()
    return mesh


def _mesh_device(mesh: Any) -> torch.device:
    """The device of a mesh's ranks (this process's current CUDA device for a CUDA mesh)."""
    kind = getattr(mesh, "device_type", "cpu")
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _pytorch_cp_active() -> bool:
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    ops = [getattr(aten, name).default for name in (*_FWD_OPS, *_BWD_OPS) if hasattr(aten, name)]
    return any(op in handlers for op in ops)


@contextlib.contextmanager
def context_parallel(
    mesh: Any,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
    batch: BatchSpec | None = None,
    plan: Plan | None = None,
    planner: str = DEFAULT_PLANNER,
    block_size: int | None = None,
    divisions: int | None = None,
    topology: Topology | None = None,
    kernel: str | DivisionKernel | None = None,
    timeout: "float | datetime.timedelta" = 600.0,
    device_plan: DevicePlan | None = None,
    head_parallel: int | str | None = None,
    replay: "bool | Recorder | None" = None,
    padded_tokens: int | None = None,
    cost_model: "CostModel | str | None" = "auto",
    mask: MaskSpec | None = None,
) -> Iterator[DCPContext]:
    """Run the body's ``F.scaled_dot_product_attention`` calls with dynamic context parallelism.

    Args:
        mesh: one-dimensional ``DeviceMesh`` of the DCP group (all ranks that share the
            global batch; DCP unifies data and context parallelism in this one dimension).
        buffers: tensors of the global batch, identical on every rank (token ids, labels,
            position ids, RoPE tables, the attention's inputs, ...): ``B`` rows of ``S``
            tokens, ``[B, ..., S, ...]`` (dim 0 the rows), or per-position tables ``[S, ...]``
            (seq dim 0) shared by the rows (:mod:`torch_dcp.buffers`). On entry each is resized
            in place to this rank's tokens, in ``plan.token_indices(rank)`` order, as one row:
            ``[1, ..., S_local, ...]`` (``[S_local, ...]`` for a per-position table). The
            plan's global token order is row after row.
        buffer_seq_dims: the sequence dimension of every buffer.
        no_restore_buffers: buffers (by identity) left sharded on exit; the others are restored.
        batch: the step's :class:`BatchSpec`, its documents laid out row after row over the
            buffers' ``B x S`` tokens (planned on entry with ``planner``, ``block_size``,
            ``divisions``, ``topology``, as :func:`torch_dcp.plan` does;
            ``divisions=None``: ``min(4, tiles)``), or
        plan: a precomputed :class:`Plan` (give at most one of ``batch`` and ``plan``; a
            ``device_plan`` alone gives its plan). Give neither, as code written for PyTorch's
            ``context_parallel`` does, and every row of the buffers is one document of ``S``
            tokens under ``mask``; the plan is made for the heads, head_dim and dtype of
            buffers shaped ``[B, H, S, D]`` (seq dim 2) if there are any, else for nominal ones
            that the first SDPA call replaces (:meth:`DCPContext.bind`; no head parallelism).
        mask: without ``batch=``/``plan=``: the mask of every row (a :mod:`torch_dcp.masks`
            spec; SDPA calls whose ``is_causal`` disagrees with it are refused). ``None``
            (default): causal, unless the first SDPA call says ``is_causal=False``: then
            :class:`~torch_dcp.masks.Full` on the same token layout (planned for causal
            attention: name ``mask=Full()`` to plan for it).
        planner: the planner (default ``"dcp"``, :data:`~torch_dcp.api.DEFAULT_PLANNER`, as
            every integration's).
        block_size: tokens per block (default 1024; without ``batch=``, at most ``B * S / (2 W)``
            rounded up, so that every rank can hold two blocks).
        topology: ranks per node and links, for planning (default: all ranks on one node).
        cost_model: the model that times a planner's candidates when planning here
            (:func:`torch_dcp.plan`; default ``"auto"``: this device's).
        kernel: the executor's attention kernel (default ``"auto"``).
        timeout: the longest any wait inside the context blocks (seconds or a ``timedelta``;
            default 10 minutes): the plan check at entry and, on CPU (gloo), every transfer.
            When it expires the waiting rank raises
            :class:`~torch_dcp.executor.TransferTimeoutError` naming the pass, the phase and
            the ranks that did not answer (at the plan check: "the plan check at entry"). On a
            device (NCCL) the host never waits for a transfer (waits are stream-ordered); the
            transfers run on a process group of their own created once with this timeout
            (:func:`~torch_dcp.executor.groups.transfer_group`), so a peer that stalls makes
            NCCL's watchdog abort the transfer and the process after ``timeout`` ("Watchdog
            caught collective operation timeout"; torchrun then reports the rank failed). The
            plan check runs on host tensors (the group's CPU backend, or a gloo group created
            once): no device-to-host read at entry.
        device_plan: this rank's :class:`~torch_dcp.executor.DevicePlan` of ``plan``, built
            (and uploaded) ahead, e.g. by :class:`torch_dcp.data.PlanningLoader`; entry then
            does not build it. Its kernel is the executor's (``kernel``, if given, must name
            the same one). The plan check across ranks at entry still runs.
        head_parallel: for planning, as :func:`torch_dcp.plan`'s (``None``: 1; ``"auto"``
            with ``"dcp"``); a head-parallel plan runs its all-to-alls inside the op.
        replay: layer replay (:mod:`torch_dcp.executor.replay`): the first attention call of
            each pass and shape records this rank's device work, every later layer of the step
            replays it; recordings are freed on exit. ``None`` (default): on for a CUDA
            device (CUDA graphs), off elsewhere; ``False``: off; ``True``: on (a CUDA device
            only); a :class:`~torch_dcp.executor.replay.Recorder`: on, with that recorder.
        padded_tokens: every SDPA call carries this many tokens (fixed shapes, e.g. pipeline
            stages: :mod:`torch_dcp.pipeline`): this rank's tokens of the plan first, then
            padding whose attention outputs and gradients are zero
            (:class:`~torch_dcp.executor.padding.PaddedRows`); the caller pads its own tensors
            (no ``buffers``). ``None``: calls carry exactly this rank's tokens.

    Inside, the model calls ``F.scaled_dot_product_attention(q, k, v, is_causal=...)`` with
    ``q: [1, H, S_local, D]`` and ``k, v: [1, H_kv, S_local, D]`` (``enable_gqa=True``) or
    ``[1, H, S_local, D]`` (repeated heads), or with ``B > 1`` rows ``[B, H, S_local / B, D]``
    that split this rank's tokens row after row (the output has the input's shape), in the
    BatchSpec's dtype. A rank may hold no tokens (``S_local = 0``); its model may run one
    placeholder token instead (``ctx.placeholder``; calls of one row, whose output and gradients
    are zero: :class:`~torch_dcp.executor.padding.PlaceholderRows`), (any of float32,
    bfloat16, float16, float64). The mask applied is the batch's mask spec inside every
    document. Whatever SDPA backend PyTorch would pick does not matter: the call goes to the
    ``torch_dcp::attention`` op.

    Yields:
        A :class:`DCPContext` (plan, executor, ``unshard``).

    Raises:
        ValueError: bad arguments (both ``batch`` and ``plan``, ``mask`` beside either,
            ``head_parallel`` without ``batch``, neither of them and no ``buffers``, buffers of
            different sequence lengths or row counts, rows times sequence length not the
            batch's tokens, a block size or
            divisions out of bounds (see :func:`torch_dcp.plan`), buffers and seq dims
            of different lengths, a buffer whose sequence length is not the batch's, a
            ``no_restore_buffers`` entry that is not a buffer, a plan for another world size,
            ``replay=True`` without a CUDA device, ``padded_tokens`` below this rank's tokens of the
            plan or given with ``buffers``,
            a mesh that is not one-dimensional, a ``device_plan`` for another plan, rank or
            kernel); inside the body, an SDPA call that
            contradicts the plan (an ``attn_mask``, dropout, ``is_causal`` against the mask,
            a sequence length that is not this rank's, another dtype, head count or head_dim
            than the BatchSpec's, DTensor inputs; see :func:`_check_call`), raised on every
            rank before any communication, so the process group stays usable (in a compiled
            model: when the graph runs, or while Dynamo traces it for the checks that do not
            depend on the plan, see the module's docstring); a rank that refuses a call its peers
            make posts the refusal (:meth:`DCPContext.refuse`) and its peers waiting for its
            transfers raise :class:`~torch_dcp.executor.PeerRefusedError` (a ``TransferError``)
            naming it and its reason within a fraction of a second on CPU (gloo). Inside
            ``torch.autocast``, query, key and value are first cast as autocast casts SDPA's
            inputs (floating tensors other than float64 to the autocast dtype of their device),
            so the BatchSpec's dtype is then the autocast dtype.
        RuntimeError: another torch_dcp or PyTorch context-parallel context is active, or the
            ranks hold different plans (raised on every rank at entry).
        TransferError: a wait inside the context failed: a peer's connection closed (it
            crashed or left), or :class:`~torch_dcp.executor.TransferTimeoutError` (a subclass)
            when the timeout expired.
    """
    global _active
    import torch.distributed as dist

    if _active is not None:
        raise RuntimeError("torch_dcp.context_parallel: another torch_dcp context is already active (they do not nest)")
    if _pytorch_cp_active():
        raise RuntimeError("torch_dcp.context_parallel: a PyTorch context_parallel context (or other SDPA DTensor "
                           "handlers) is active; exit it first")
    if mask is not None and (batch is not None or plan is not None or device_plan is not None):
        raise ValueError("torch_dcp.context_parallel: mask= is for a context without batch= or plan= (a BatchSpec "
                         "carries its own mask)")
    if device_plan is not None and plan is None and batch is None:
        plan = device_plan.plan
    if batch is not None and plan is not None:
        raise ValueError("torch_dcp.context_parallel: give at most one of batch= and plan=")
    if device_plan is not None:
        if device_plan.plan is not plan.attention_part(0)[0]:
            raise ValueError("torch_dcp.context_parallel: device_plan was built for another plan (pass its own plan, "
                             "device_plan.plan)")
        if kernel is not None and kernel != "auto" and get_kernel(kernel).name != device_plan.kernel.name:
            raise ValueError(f"torch_dcp.context_parallel: kernel={kernel!r}, but device_plan was built for the "
                             f"{device_plan.kernel.name!r} kernel")
        kernel = device_plan.kernel
    buffers = list(buffers or [])
    seq_dims = list(buffer_seq_dims or [])
    if len(buffers) != len(seq_dims):
        raise ValueError(f"torch_dcp.context_parallel: {len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims")
    no_restore = list(no_restore_buffers or [])
    for b in no_restore:
        if not any(b is x for x in buffers):
            raise ValueError("torch_dcp.context_parallel: no_restore_buffers must be a subset of buffers")
    if padded_tokens is not None and buffers:
        raise ValueError("torch_dcp.context_parallel: padded_tokens is for callers that pad their own tensors; "
                         "give no buffers with it")
    rows_are_documents = batch is None and plan is None
    if rows_are_documents and head_parallel not in (None, 1):
        raise ValueError("torch_dcp.context_parallel: head_parallel needs batch= (without it the attention's heads "
                         "are known only at the first SDPA call)")
    known_total = None if rows_are_documents else (plan.batch if plan is not None else batch).total_tokens
    layout = RowLayout.of(buffers, seq_dims, known_total)
    group = _group(mesh)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = buffers[0].device if buffers else _mesh_device(mesh)
    heads_known = True
    if rows_are_documents:
        batch, heads_known = rows_batch(layout, mask if mask is not None else Causal(), buffers, seq_dims, device)
        head_parallel = 1
        if block_size is None:  # at least two blocks per rank where the rows allow it
            block_size = min(DEFAULT_BLOCK_SIZE, max(1, -(-layout.total // (2 * world))))
    if plan is None:
        topo = topology if topology is not None else Topology.single_node(world)
        plan = make_plan(batch, topo, planner=planner, divisions=divisions, head_parallel=head_parallel,
                         cost_model=cost_model, block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size)
    if plan.world_size != world:
        raise ValueError(f"torch_dcp.context_parallel: the plan is for {plan.world_size} ranks, the mesh has {world}")
    if padded_tokens is not None:  # the same answer on every rank: they hold the same plan
        check_capacity(plan, padded_tokens, "torch_dcp.context_parallel: padded_tokens")
    wait_limit = as_timedelta(timeout, "torch_dcp.context_parallel: timeout")
    recorder = recorder_for(replay, device, "torch_dcp.context_parallel")
    _check_same_plan(plan, group, rank, world, wait_limit)
    if device_plan is not None and (device_plan.plan, device_plan.rank) != plan.attention_part(rank):
        raise ValueError(f"torch_dcp.context_parallel: device_plan is rank {device_plan.rank}'s, this is rank {rank}")
    # on a device the transfers run on a group of their own whose timeout bounds them (the
    # host never waits for the device); on CPU the host waits, at most wait_limit
    comm = None if device.type == "cpu" else transfer_group(group, wait_limit)
    members = tuple(dist.get_process_group_ranks(group))
    _entries[members] = entry = _entries.get(members, 0) + 1
    refusals = RefusalChannel(dist.distributed_c10d._get_default_store(),
                              f"torch_dcp/refusal/{'-'.join(map(str, members))}/{entry}", rank)
    cp_groups = cp_subgroups(group, collective_groups(plan, rank), wait_limit)  # once per group, then cached
    transport = TorchDistributedTransport(group, device=device, timeout=wait_limit, comm_group=comm,
                                          refusals=refusals, subgroups=cp_groups)
    teardown.track_transport(transport)  # released at interpreter exit (teardown.release_at_exit)

    def build(p: Plan) -> "tuple[Any, LayerReplay | None]":
        executor = make_executor(p, rank, transport, kernel=kernel, device_plan=device_plan)
        if heads_known:  # the device plan is built (unless given) and uploaded here, not in the first SDPA call
            executor.prepare(device)
        layers = LayerReplay(executor, recorder) if recorder is not None else None
        runner = layers if layers is not None else executor
        if padded_tokens is not None:
            runner = PaddedRows(runner, p.local_tokens(rank), padded_tokens)
        elif p.local_tokens(rank) == 0:  # its model may run a placeholder token
            runner = PlaceholderRows(runner)
        return runner, layers

    runner, layers = build(plan)
    ctx = DCPContext(mesh, plan, runner, refusals, layers, padded_tokens, rebuild=build if rows_are_documents else None,
                     infer_mask=rows_are_documents and mask is None)
    remember(mesh, plan, layout)
    idx = host_to_device(torch.from_numpy(plan.token_indices(rank)), device)
    originals = [None if any(b is x for x in no_restore) else b.clone() for b in buffers]
    from torch.distributed.tensor import DTensor

    saved_handlers = DTensor._op_dispatcher._custom_op_handlers
    saved_sdpa = F.scaled_dot_product_attention
    try:
        with torch.no_grad():
            for b, d in zip(buffers, seq_dims):
                shard = layout.shard(b, d % b.dim(), idx.to(b.device))
                b.resize_(shard.shape)
                b.copy_(shard)
        handlers = dict(saved_handlers)
        for name in (*_FWD_OPS, *_BWD_OPS):
            if hasattr(aten, name):
                handlers[getattr(aten, name).default] = _handler
        handlers.update(attention_op.dtensor_handlers())
        check = functools.partial(_check_traced_call, ctx)
        with attention_op.use_executor(ctx.executor, check):
            DTensor._op_dispatcher._custom_op_handlers = handlers
            _sdpa_wrapper.__wrapped__ = saved_sdpa  # type: ignore[attr-defined]
            _sdpa_wrapper.__doc__ = saved_sdpa.__doc__
            F.scaled_dot_product_attention = _sdpa_wrapper
            _active = ctx
            yield ctx
    finally:
        _active = None
        if ctx.replay is not None:
            ctx.replay.close()
        F.scaled_dot_product_attention = saved_sdpa
        DTensor._op_dispatcher._custom_op_handlers = saved_handlers
        with torch.no_grad():
            for b, orig in zip(buffers, originals):
                if orig is not None:  # a leaf made to require grad inside (PyTorch's tests do) is restored too
                    wants_grad = b.is_leaf and b.requires_grad
                    b.requires_grad_(False) if wants_grad else None
                    b.resize_(orig.shape)
                    b.copy_(orig)
                    b.requires_grad_(True) if wants_grad else None


def _check_same_plan(plan: Plan, group: Any, rank: int, world: int, timeout: datetime.timedelta) -> None:
    """All-gather the plans' SHA-256 digests on host tensors (one collective on a CPU backend
    of the group, :func:`~torch_dcp.executor.groups.host_group`: nothing is read back from a
    device, nothing queues behind the device's collectives), waited at most ``timeout``; raise
    on every rank when they differ."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    others = [r for r in range(world) if r != rank]
    with unset_fake_temporarily():  # host bytes, also when a test runs the step on fake tensors
        mine = torch.frombuffer(bytearray(bytes.fromhex(plan.digest())), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(world)]
        work = dist.all_gather(parts, mine, group=host_group(group), async_op=True)
        try:
            work.wait(timeout)
        except RuntimeError as err:
            if not is_timeout(err):
                raise TransferError(f"torch_dcp.context_parallel: rank {rank}: the plan check at entry (all-gather of "
                                    f"the plan digests) failed: a peer's connection closed (it failed or left): {err}",
                                    -1, others) from None
            raise TransferTimeoutError(f"torch_dcp.context_parallel: rank {rank}: the plan check at entry (all-gather "
                                       f"of the plan digests) did not complete within {timeout.total_seconds():g} s: "
                                       "some rank did not enter the context", -1, others) from None
        differ = [r for r, d in enumerate(parts) if d.numpy().tobytes() != mine.numpy().tobytes()]
    if differ:
        raise RuntimeError(f"torch_dcp.context_parallel: ranks hold different plans (rank {rank} differs from ranks "
                           f"{differ}); build the batch identically on every rank")


def _check_call(ctx: DCPContext | None, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> None:
    """:func:`~torch_dcp.sdpa_check.check_sdpa_call`, the call counted on the context's refusal
    channel; a refusal
    inside a context is posted there before it is raised, so that peers waiting for this
    rank's transfers raise too (:class:`~torch_dcp.executor.RefusalChannel`)."""
    if ctx is not None and ctx.refusals is not None:
        ctx.refusals.begin_call()
    try:
        if ctx is not None:
            ctx.bind(query, key, bool(is_causal))
        check_sdpa_call(ctx, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    except ValueError as err:
        if ctx is not None and ctx.refusals is not None:
            ctx.refusals.post(str(err))
        raise


def _check_traced_call(ctx: DCPContext, query, key, value, is_causal, enable_gqa) -> None:
    """:func:`_check_call` of a call in the form ``torch.compile`` records, run by the
    ``torch_dcp::attention`` op on this rank's tensors before the executor (the wrapper has
    checked ``attn_mask`` and dropout while tracing)."""
    _check_call(ctx, query, key, value, None, 0.0, is_causal, enable_gqa)


def _sdpa_wrapper(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` inside :func:`context_parallel` (one function for every
    context, so that what ``torch.compile`` compiled in one step's context serves the next).

    Inside ``torch.autocast`` query, key and value are first cast as autocast casts SDPA's
    inputs (:func:`_autocast`). Eagerly: the call is checked against the active context's plan (:func:`_check_call`), its
    tensors become DTensors sharded on the sequence dimension, and ``torch_dcp::attention`` runs
    through its DTensor handler. While Dynamo traces it: the checks that do not depend on the plan,
    then ``torch_dcp::attention`` on the plain tensors with ``is_causal`` and ``enable_gqa``, which
    checks the rest against the plan bound when the graph runs; nothing plan-specific is read
    while tracing (no graph break, no guard on the step's plan).

    Raises:
        ValueError: the call contradicts the plan (see :func:`_check_call`), on every rank before
            any communication.
    """
    query, key, value = _autocast(query, key, value)
    tracing = torch.compiler.is_compiling()
    n_rows = call_rows(query, key, value, None if tracing else _active)  # nothing plan-specific read while tracing
    if n_rows > 1:
        query, key, value = (fold_rows(t) for t in (query, key, value))
    if tracing:
        _check_call(None, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        out, _, _ = torch.ops.torch_dcp.attention(query, key, value, scale, bool(is_causal), bool(enable_gqa))
        return unfold_rows(out, n_rows)
    from torch.distributed.tensor import Shard

    ctx = _active
    if ctx is None:  # pragma: no cover - the wrapper is installed only inside the context
        raise RuntimeError("torch_dcp: SDPA wrapper called outside torch_dcp.context_parallel")
    _check_call(ctx, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    total = ctx.plan.batch.total_tokens
    q, k, v = (as_dtensor(t, ctx.mesh, [Shard(2)], (1, t.shape[1], total, t.shape[3])) for t in (query, key, value))
    out, _, _ = torch.ops.torch_dcp.attention(q, k, v, scale)
    return unfold_rows(out.to_local(), n_rows)


_sdpa_wrapper.__name__ = _sdpa_wrapper.__qualname__ = "scaled_dot_product_attention"


def _autocast(*tensors: Any) -> tuple:
    """``tensors`` as ``torch.autocast`` casts SDPA's inputs (SDPA runs in the lower precision
    on CPU and CUDA): floating tensors other than float64 to the autocast dtype of their
    device when autocast is enabled there; anything else as is."""
    out = []
    for t in tensors:
        kind = t.device.type if isinstance(t, torch.Tensor) else None
        if kind is not None and t.is_floating_point() and t.dtype != torch.float64 and torch.is_autocast_enabled(kind):
            t = t.to(torch.get_autocast_dtype(kind))
        out.append(t)
    return tuple(out)


def _handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor custom op handler of the aten SDPA ops: the same executor path as
    ``torch_dcp::attention`` (:func:`torch_dcp.attention_op.attention_forward`/``_backward``)."""
    from torch.distributed.tensor import Replicate

    ctx = _active
    if ctx is None:  # pragma: no cover - handlers are installed only inside the context
        raise RuntimeError("torch_dcp: SDPA handler called outside torch_dcp.context_parallel")
    name = op_call._schema.name.split("::")[-1]
    a = bind_args(op_call, args, kwargs)
    qd = a["query"]
    attention_op.check_placements(name, {n: a[n] for n in ("query", "key", "value")})
    q, k, v = (local(a[n]) for n in ("query", "key", "value"))
    scale = a.get("scale")

    def placeholder() -> Any:
        return as_dtensor(torch.empty(0, device=q.device), qd.device_mesh, [Replicate()], (0,))

    if name in _FWD_OPS:
        mask = a.get("attn_mask", a.get("attn_bias"))
        _check_call(ctx, q, k, v, mask, a.get("dropout_p", 0.0), a.get("is_causal", False), True)
        out, lse, _ = attention_op.attention_forward(ctx.executor, q, k, v, scale)  # PyTorch's ops keep no state
        results = [like(out, qd), like(lse, qd, tuple(qd.shape[:3]))]
        n_out = _FWD_OPS[name]
        if n_out == 4:  # efficient: philox seed, offset
            results += [placeholder(), placeholder()]
        elif n_out == 9:  # flash/cudnn: cum_seq_q, cum_seq_k, max_q, max_k, philox seed, offset, debug mask
            s = q.shape[2]
            results += [placeholder(), placeholder(), s, s, placeholder(), placeholder(), placeholder()]
        return tuple(results)
    if name in _BWD_OPS:
        grads = attention_op.attention_backward(ctx.executor, local(a["grad_out"]), q, k, v, local(a["out"]),
                                                local(a["logsumexp"]), scale=scale)
        results = [like(g, a[n]) for g, n in zip(grads, ("query", "key", "value"))]
        if _BWD_OPS[name] == 4:
            results.append(None)
        return tuple(results)
    raise NotImplementedError(f"torch_dcp: no handler for {name}")  # pragma: no cover
