"""The buffers of a :func:`torch_dcp.context_parallel` context: how the caller's tensors map to
the plan's global tokens, how they are sharded on entry and gathered back.

A context's buffers hold ``B`` rows of ``S`` tokens. The plan's global token order is row-major:
global token ``g`` is token ``g % S`` of row ``g // S`` (one packed row, ``B = 1``, when the
documents are described with ``batch=``; ``B`` documents of ``S`` tokens, one per row, as PyTorch's
``context_parallel`` assumes, without it). Two kinds of buffer (:class:`BufferKind`):

* rows, ``[B, ..., S, ...]`` (the batch dimension first, the sequence dimension later: token
  ids, labels, position ids, ``q: [B, H, S, D]``): sharded to ``[1, ..., S_local, ...]``, this
  rank's tokens in ``plan.token_indices(rank)`` order as one row;
* positions, ``[S, ...]`` (sequence dimension 0, e.g. RoPE's ``freqs_cis``) or
  ``[1, ..., S, ...]`` beside buffers of ``B > 1`` rows: one entry per position, shared by every
  row, sharded to the positions of this rank's tokens in their rows.

PyTorch's ``context_parallel`` splits every row into equal head-tail chunks; torch_dcp's shards
hold whole documents or the blocks the plan gave this rank, so they differ in length from rank
to rank (a rank may hold none) and :func:`context_parallel_unshard` needs the plan, which it
takes from the mesh's last context (:func:`remember`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Sequence

import torch

from .batch import BatchSpec, canonical_dtype
from .masks import MaskSpec
from .plan import Plan

__all__ = ["BufferKind", "RowLayout", "unshard", "context_parallel_unshard", "remember", "rows_batch", "NOMINAL_HEADS"]

#: ``(heads, head_dim)`` a context without ``batch=`` plans with until its first SDPA call names the
#: attention's (:func:`rows_batch`)
NOMINAL_HEADS = (8, 128)


class BufferKind(enum.Enum):
    """What a buffer's entries are (see the module's docstring)."""

    ROWS = "rows"
    POSITIONS = "positions"


def _dim(t: torch.Tensor, d: int, i: int, where: str) -> int:
    if isinstance(d, bool) or not isinstance(d, int) or not -t.dim() <= d < t.dim():
        raise ValueError(f"{where}: buffer {i} has {t.dim()} dims, seq dim {d!r} is out of range")
    return d % t.dim()


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """``rows`` rows of ``row_len`` tokens, in the plan's row-major global token order.

    Raises:
        ValueError: a count below 1.
    """

    rows: int
    row_len: int

    def __post_init__(self):
        if self.rows < 1 or self.row_len < 1:
            raise ValueError(f"RowLayout: rows and row_len must be positive, got {self.rows} x {self.row_len}")

    @property
    def total(self) -> int:
        """Tokens of all rows: the plan's ``batch.total_tokens``."""
        return self.rows * self.row_len

    @classmethod
    def of(cls, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], total: int | None,
           where: str = "torch_dcp.context_parallel") -> "RowLayout":
        """The layout of ``buffers`` (``total``: the plan's tokens, ``None`` when the rows are
        the documents). Every buffer has one sequence length ``S``; the buffers whose sequence
        dimension is not 0 and whose dimension 0 is not 1 give the rows ``B`` (one count).

        Raises:
            ValueError: a seq dim out of range, buffers of different sequence lengths or row
                counts, or ``B * S`` not the plan's ``total`` (naming both).
        """
        if not buffers:
            if total is None:
                raise ValueError(f"{where}: give batch=, plan= or buffers= (without batch=, each row of the buffers' "
                                 "batch dimension is one document)")
            return cls(1, total)
        dims = [_dim(b, d, i, where) for i, (b, d) in enumerate(zip(buffers, seq_dims))]
        lens = {int(b.shape[d]) for b, d in zip(buffers, dims)}
        if len(lens) != 1:
            shown = ", ".join(f"buffer {i}: {b.shape[d]}" for i, (b, d) in enumerate(zip(buffers, dims)))
            raise ValueError(f"{where}: the buffers have different sequence lengths ({shown})")
        s = lens.pop()
        counts = {int(b.shape[0]) for b, d in zip(buffers, dims) if d > 0 and b.shape[0] != 1}
        if s == 0:
            raise ValueError(f"{where}: the buffers' sequence length is 0")
        if total is not None and s == total:  # one packed row: dim 0 is no row count
            return cls(1, s)
        if len(counts) > 1:
            raise ValueError(f"{where}: the buffers have different batch sizes {sorted(counts)} in dim 0 (a buffer's "
                             "dim 0 is its rows when its sequence dim is not 0)")
        rows = counts.pop() if counts else 1
        if total is not None and rows * s != total:
            if rows == 1:
                raise ValueError(f"{where}: the buffers have sequence length {s}, the batch has {total} tokens")
            raise ValueError(f"{where}: the buffers hold {rows} rows of {s} tokens ({rows * s}), the batch has {total} "
                             "tokens (the batch's documents are laid out row after row)")
        return cls(rows, s)

    def kind(self, t: torch.Tensor, seq_dim: int) -> BufferKind:
        """Rows or positions (the module's docstring), for a buffer of this layout."""
        if self.rows > 1 and seq_dim > 0 and t.shape[0] == self.rows:
            return BufferKind.ROWS
        return BufferKind.POSITIONS

    def shard(self, t: torch.Tensor, seq_dim: int, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of buffer ``t`` (a new tensor; ``tokens``: the rank's global token
        indices, int64 on ``t``'s device)."""
        if self.kind(t, seq_dim) is BufferKind.POSITIONS:
            return t.index_select(seq_dim, tokens % self.row_len)
        flat = t.movedim(0, seq_dim - 1).flatten(seq_dim - 1, seq_dim)  # [..., B * S, ...]
        return flat.index_select(seq_dim - 1, tokens).unsqueeze(0)

    def gather(self, t: torch.Tensor, seq_dim: int, plan: Plan, mesh: Any) -> torch.Tensor:
        """The inverse of :meth:`shard` on every rank: ``t`` (this rank's ``[b, ..., s, ...]``
        with ``b * s`` its tokens, or ``[S_local, ...]`` for seq dim 0) gathered into
        ``[B, ..., S, ...]`` (``[B * S, ...]`` for seq dim 0), global token order.

        Raises:
            ValueError: the tensor does not hold this rank's tokens.
        """
        import torch.distributed as dist

        group = mesh.get_group() if hasattr(mesh, "get_group") else mesh
        n = plan.local_tokens(dist.get_rank(group))
        if seq_dim == 0 or (t.shape[0] != 1 and t.shape[seq_dim] == n):  # no rows to restore
            return unshard(t, plan, mesh, seq_dim)
        flat = t.movedim(0, seq_dim - 1).flatten(seq_dim - 1, seq_dim)
        full = unshard(flat, plan, mesh, seq_dim - 1)
        return full.unflatten(seq_dim - 1, (self.rows, self.row_len)).movedim(seq_dim - 1, 0)


#: the last context's ``(plan, layout)`` of every group (by its ranks), for :func:`context_parallel_unshard`
_last: dict[tuple[int, ...], tuple[Plan, RowLayout]] = {}


def _members(mesh: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    group = mesh.get_group() if hasattr(mesh, "get_group") else mesh
    return tuple(dist.get_process_group_ranks(group))


def remember(mesh: Any, plan: Plan, layout: RowLayout) -> None:
    """Record ``plan`` and ``layout`` as the mesh's last context's (replacing the one before)."""
    _last[_members(mesh)] = (plan, layout)


@torch.no_grad()
def unshard(tensor: torch.Tensor, plan: Plan, mesh: Any, seq_dim: int = 0) -> torch.Tensor:
    """Gather every rank's local tensor back to global token order (the inverse of the
    buffer sharding of :func:`~torch_dcp.context_parallel` for one packed row).

    Args:
        tensor: this rank's tensor, ``plan.local_tokens(rank)`` long in ``seq_dim``.
        plan: the step's plan.
        mesh: the DCP mesh (or its process group).
        seq_dim: the sequence dimension.

    Returns:
        The global tensor (``plan.batch.total_tokens`` long in ``seq_dim``), on every rank.

    Raises:
        ValueError: the plan is for another world size, or the tensor's sequence length is not
            this rank's token count.
    """
    import torch.distributed as dist

    group = mesh.get_group() if hasattr(mesh, "get_group") else mesh
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if plan.world_size != world:
        raise ValueError(f"torch_dcp.unshard: the plan is for {plan.world_size} ranks, the mesh has {world}")
    n = plan.local_tokens(rank)
    if tensor.shape[seq_dim] != n:
        raise ValueError(f"torch_dcp.unshard: rank {rank} holds {n} tokens, the tensor has {tensor.shape[seq_dim]} "
                         f"in dim {seq_dim}")
    t = tensor.detach().movedim(seq_dim, 0).contiguous()
    longest = max(plan.local_tokens(r) for r in range(world))
    padded = t.new_zeros((longest, *t.shape[1:]))
    padded[:n] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    out = t.new_empty((plan.batch.total_tokens, *t.shape[1:]))
    for r in range(world):
        idx = torch.from_numpy(plan.token_indices(r)).to(out.device)
        out[idx] = parts[r][: len(idx)]
    return out.movedim(0, seq_dim)


@torch.no_grad()
def context_parallel_unshard(mesh: Any, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                             load_balancer: Any = None) -> list[torch.Tensor]:
    """PyTorch's ``context_parallel_unshard`` for torch_dcp's shards: every tensor of this
    rank's tokens (an SDPA output, a gradient, a sharded buffer) gathered back to the caller's
    layout, on every rank, with the plan and layout of the mesh's last (or active)
    :func:`~torch_dcp.context_parallel`.

    Args:
        mesh: the context's one-dimensional DCP mesh (or its process group).
        buffers: this rank's tensors: ``[b, ..., s, ...]`` with ``b * s`` this rank's tokens
            (``b`` is 1 for the context's shards) or, for seq dim 0, ``[S_local, ...]``.
        seq_dims: the sequence dimension of each.
        load_balancer: PyTorch's argument, refused unless ``None`` (the plan decides the layout).

    Returns:
        The gathered tensors: ``[B, ..., S, ...]`` (``B`` rows of ``S`` tokens, as the
        context's buffers were), ``[B * S, ...]`` for seq dim 0.

    Raises:
        ValueError: ``buffers`` and ``seq_dims`` of different lengths, a seq dim out of range,
            a ``load_balancer``, a tensor that does not hold this rank's tokens, or no context
            ran on the mesh.
    """
    where = "torch_dcp.context_parallel_unshard"
    if load_balancer is not None:
        raise ValueError(f"{where}: load_balancer must be None (the plan of the context decides the layout)")
    if len(buffers) != len(seq_dims):
        raise ValueError(f"{where}: {len(buffers)} buffers but {len(seq_dims)} seq_dims")
    found = _last.get(_members(mesh))
    if found is None:
        raise ValueError(f"{where}: no torch_dcp.context_parallel context has run on this mesh")
    plan, layout = found
    return [layout.gather(b, _dim(b, d, i, where), plan, mesh) for i, (b, d) in enumerate(zip(buffers, seq_dims))]


def rows_batch(layout: RowLayout, mask: MaskSpec, buffers: list[torch.Tensor], seq_dims: list[int],
                device: torch.device) -> tuple[BatchSpec, bool]:
    """The BatchSpec of a context without ``batch=``: one document of ``S`` tokens per row under
    ``mask``, and whether its heads are the attention's. They are where the buffers hold the
    attention's inputs (floating ``[B, H, S, D]`` buffers with seq dim 2: the most and fewest
    heads are the query's and the key/value's); else nominal ones
    (:data:`NOMINAL_HEADS`, the device's usual dtype), which the first SDPA call replaces
    (:meth:`DCPContext.bind`): the placement depends on the heads only through the ratio of
    bytes to FLOPs per token."""
    if not isinstance(mask, MaskSpec):
        raise ValueError(f"torch_dcp.context_parallel: mask must be a torch_dcp mask spec (Causal(), Full(), "
                         f"Lambda(...), ...), got {mask!r}")
    qkv = [b for b, d in zip(buffers, seq_dims) if b.dim() == 4 and d % 4 == 2 and b.is_floating_point()]
    heads = sorted({int(b.shape[1]) for b in qkv})
    dims = {int(b.shape[3]) for b in qkv}
    dtypes = {b.dtype for b in qkv}
    known = bool(qkv) and len(dims) == 1 and len(dtypes) == 1 and heads[-1] % heads[0] == 0
    if known:
        n_heads, n_kv, head_dim, dtype = heads[-1], heads[0], dims.pop(), canonical_dtype(dtypes.pop())
    else:
        n_heads = n_kv = NOMINAL_HEADS[0]
        head_dim, dtype = NOMINAL_HEADS[1], "bfloat16" if device.type == "cuda" else "float32"
    spec = BatchSpec([layout.row_len] * layout.rows, mask, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                     dtype=dtype)
    return spec, known
