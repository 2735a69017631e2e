"""The ``torch_dcp::attention`` custom op: a rank's executor as one PyTorch operator.

Inside :func:`torch_dcp.context_parallel` the wrapped ``F.scaled_dot_product_attention`` calls
``torch.ops.torch_dcp.attention`` instead of PyTorch's SDPA, so whichever backend SDPA would have
chosen (flash, efficient, cuDNN, CPU flash or the MATH decomposition) does not matter. Two ops
are defined once, at import:

- ``torch_dcp::attention(Tensor query, Tensor key, Tensor value, float? scale=None,
  bool? is_causal=None, bool enable_gqa=False) -> (Tensor out, Tensor lse, Tensor state)``
- ``torch_dcp::attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value,
  Tensor out, Tensor lse, Tensor state, float? scale=None) -> (Tensor grad_query,
  Tensor grad_key, Tensor grad_value)``

Tensors are in SDPA's layout for one packed sequence of this rank's tokens: ``query, out,
grad_out: [1, H, S_local, D]``, ``key, value: [1, H_kv, S_local, D]`` (GQA) or
``[1, H, S_local, D]`` (repeated heads), ``lse: [1, H, S_local]`` in float32 (float64 for
float64 inputs). ``state`` is what the executor keeps for the backward beyond those, as one
uint8 tensor: empty for an ordinary plan, the head-sharded Q, K, V, O and LSE of a head-parallel
plan (:meth:`~torch_dcp.executor.heads.HeadParallelExecutor.forward_keeping`). The mask is the
plan's (the BatchSpec's mask spec inside every document).

``is_causal`` and ``enable_gqa`` are SDPA's arguments, for the form of the call that
``torch.compile`` records (the SDPA wrapper calls it so while Dynamo traces): with ``is_causal``
given, the real implementation first checks the call against the bound context's plan (the
check :func:`use_executor` binds; the SDPA wrapper's checks and messages, raised before any
communication) and keeps no state (``state`` is empty: a head-parallel backward moves Q, K, V,
O and the LSE again). So every output's size is a function of the input shapes alone, and one
compiled graph serves every step's plan; nothing plan-specific is read at trace time. With
``is_causal=None`` (the eager wrapper, direct calls) nothing is checked beyond the executor's
own shape checks and the state is kept.

Each op has
- a real implementation on plain tensors (this rank's local shards): it runs the executor bound
  by :func:`use_executor` (the active context's), and raises ``RuntimeError`` when none is,
  ``ValueError`` for shapes or dtypes the plan does not have (or, in the traced form, a call
  the bound check refuses);
- a fake implementation (shapes, strides and dtypes only, no executor), for FakeTensor tracing;
- for ``attention``, autograd whose backward calls ``attention_backward`` (``lse`` is not
  differentiable);
- a DTensor handler (:func:`dtensor_handlers`, installed by the context only while it is
  active) that runs the executor on the local shards of DTensor arguments sharded on the
  sequence dimension (``Shard(2)``) and returns DTensors with the same placements, so that
  autograd through DTensors reaches ``attention_backward`` too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from .executor import RankExecutor

__all__ = ["attention_forward", "attention_backward", "use_executor", "dtensor_handlers", "lse_dtype", "as_dtensor"]

_executor: RankExecutor | None = None
#: ``check(query, key, value, is_causal, enable_gqa)``: the bound context's check of an SDPA call
_check: Callable[..., None] | None = None


@contextlib.contextmanager
def use_executor(executor: RankExecutor, check: Callable[..., None] | None = None) -> Iterator[RankExecutor]:
    """Bind ``executor`` as the one the ``torch_dcp`` ops run, for the body (restored on exit).

    Args:
        executor: this rank's executor.
        check: ``check(query, key, value, is_causal, enable_gqa)``, run by ``torch_dcp::attention``
            on calls that give ``is_causal`` (the traced form) before the executor; it raises
            ``ValueError`` for a call that contradicts the plan. ``None``: no check beyond the
            executor's own.

    Raises:
        RuntimeError: another executor is bound (contexts do not nest).
    """
    global _executor, _check
    if _executor is not None:
        raise RuntimeError("torch_dcp: an executor is already bound to torch_dcp::attention (contexts do not nest)")
    _executor, _check = executor, check
    try:
        yield executor
    finally:
        _executor, _check = None, None


def rebind(executor: RankExecutor) -> None:
    """Replace the bound executor (a context that learnt its attention's heads from the first
    SDPA call, :func:`torch_dcp.context_parallel`), keeping the bound check.

    Raises:
        RuntimeError: none is bound.
    """
    global _executor
    _bound()
    _executor = executor


def _bound() -> RankExecutor:
    if _executor is None:
        raise RuntimeError("torch_dcp::attention runs only inside torch_dcp.context_parallel (no executor is bound)")
    return _executor


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the LSE for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``[1, heads, S, D]`` -> ``[S, heads, D]`` (a view)."""
    if t.dim() != 4 or t.shape[0] != 1:
        raise ValueError(f"torch_dcp::attention: {name} must be [1, heads, S_local, head_dim], got {list(t.shape)}")
    return t[0].transpose(0, 1)


def _sdpa_layout(t: torch.Tensor) -> torch.Tensor:
    """``[S, heads, D]`` -> ``[1, heads, S, D]`` or ``[S, heads]`` -> ``[1, heads, S]`` (a view)."""
    return t.transpose(0, 1).unsqueeze(0)


def attention_forward(executor: RankExecutor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float | None = None, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward attention of this rank's tokens with ``executor``, in SDPA's layout.

    Args:
        query: ``[1, H, S_local, D]``; key, value: ``[1, H_kv, S_local, D]`` or
            ``[1, H, S_local, D]``; plain tensors, dtype the plan's.
        scale: softmax scale (default ``1 / sqrt(D)``).
        keep: keep the executor's state for the backward (``False``: an empty state).

    Returns:
        ``(out [1, H, S_local, D] in query.dtype, lse [1, H, S_local] float32, float64 for
        float64 inputs, state [executor.state_nbytes(H_kv)] uint8, empty without keep)``.

    Raises:
        ValueError: shapes or dtype that do not match the executor's plan.
    """
    rows = (_rows("query", query), _rows("key", key), _rows("value", value))
    if keep:
        out, lse, state = executor.forward_keeping(*rows, scale)
    else:
        (out, lse), state = executor.forward(*rows, scale), query.new_empty(0, dtype=torch.uint8)
    return _sdpa_layout(out), _sdpa_layout(lse.to(lse_dtype(query.dtype))), state


def attention_backward(executor: RankExecutor, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, state: torch.Tensor | None = None,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of this rank's query, key, value with ``executor``, in SDPA's layout.

    Args:
        grad_out, query, out: ``[1, H, S_local, D]``; key, value: ``[1, H_kv, S_local, D]`` or
            ``[1, H, S_local, D]``; lse: ``[1, H, S_local]`` and state (from
            :func:`attention_forward`; ``None``: nothing kept, the executor sends what it needs).

    Returns:
        ``(grad_query, grad_key, grad_value)`` shaped and typed like ``query, key, value``,
        complete (partial gradients computed on other ranks are received and summed).

    Raises:
        ValueError: shapes or dtype that do not match the executor's plan.
    """
    if lse.dim() != 3 or lse.shape[0] != 1:
        raise ValueError(f"torch_dcp::attention_backward: lse must be [1, heads, S_local], got {list(lse.shape)}")
    dq, dk, dv = executor.backward(_rows("query", query), _rows("key", key), _rows("value", value),
                                   _rows("out", out), lse[0].transpose(0, 1), _rows("grad_out", grad_out), scale,
                                   state)
    return _sdpa_layout(dq), _sdpa_layout(dk), _sdpa_layout(dv)


# ---------------------------------------------------------------------------- the ops
@torch.library.custom_op("torch_dcp::attention", mutates_args=(),
                         schema="(Tensor query, Tensor key, Tensor value, float? scale=None, bool? is_causal=None, "
                                "bool enable_gqa=False) -> (Tensor, Tensor, Tensor)")
def _attention_op(query, key, value, scale=None, is_causal=None, enable_gqa=False):
    executor = _bound()
    _check_traced(query, key, value, is_causal, enable_gqa)
    return attention_forward(executor, query, key, value, scale, keep=is_causal is None)


def _check_traced(query, key, value, is_causal, enable_gqa) -> None:
    """The bound context's check of a call in the traced form (``is_causal`` given)."""
    if is_causal is not None and _check is not None:
        _check(query, key, value, is_causal, enable_gqa)


@torch.library.custom_op("torch_dcp::attention_backward", mutates_args=(),
                         schema="(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
                                "Tensor state, float? scale=None) -> (Tensor, Tensor, Tensor)")
def _attention_backward_op(grad_out, query, key, value, out, lse, state, scale=None):
    return attention_backward(_bound(), grad_out, query, key, value, out, lse, state, scale)


def _empty_rows(like: torch.Tensor, heads: int, dtype: torch.dtype | None = None, head_dim: bool = True) -> torch.Tensor:
    """An empty tensor with the strides the real ops return (an ``[S, heads(, D)]`` buffer seen
    in SDPA's layout)."""
    s, d = like.shape[2], like.shape[3]
    shape = (s, heads, d) if head_dim else (s, heads)
    return _sdpa_layout(like.new_empty(shape, dtype=dtype or like.dtype))


@_attention_op.register_fake
def _attention_fake(query, key, value, scale=None, is_causal=None, enable_gqa=False):
    for name, t in (("query", query), ("key", key), ("value", value)):
        _rows(name, t)
    # the state's size is the bound executor's (a function of the plan, never of data); none outside a context,
    # none in the traced form (is_causal given), whose graph must not depend on the plan
    n_state = 0 if _executor is None or is_causal is not None else _executor.state_nbytes(key.shape[1])
    return (_empty_rows(query, query.shape[1]), _empty_rows(query, query.shape[1], lse_dtype(query.dtype), False),
            query.new_empty(n_state, dtype=torch.uint8))


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out, query, key, value, out, lse, state, scale=None):
    return _empty_rows(query, query.shape[1]), _empty_rows(key, key.shape[1]), _empty_rows(value, value.shape[1])


def _setup_context(ctx, inputs, output):
    query, key, value, scale = inputs[:4]
    out, lse, state = output
    ctx.mark_non_differentiable(lse, state)
    ctx.save_for_backward(query, key, value, out, lse, state)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse, grad_state):
    query, key, value, out, lse, state = ctx.saved_tensors
    dq, dk, dv = torch.ops.torch_dcp.attention_backward(grad_out, query, key, value, out, lse, state, ctx.scale)
    return dq, dk, dv, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------- DTensor handlers
def bind_args(op_call: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op call's arguments by schema name (defaults included)."""
    bound = {a.name: a.default_value for a in op_call._schema.arguments if a.has_default_value()}
    bound.update(zip((a.name for a in op_call._schema.arguments), args))
    bound.update(kwargs)
    return bound


def local(t: Any) -> Any:
    """The local shard of a DTensor (anything else as is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def as_dtensor(t: torch.Tensor, mesh: Any, placements: Any, shape: tuple[int, ...]) -> Any:
    """The local shard ``t`` as a DTensor of global ``shape`` (contiguous strides) on ``mesh``.
    The shape is given because ranks hold different numbers of tokens."""
    from torch.distributed.tensor import DTensor

    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=tuple(reversed(stride)))


def like(t: torch.Tensor, ref: Any, shape: tuple[int, ...] | None = None) -> Any:
    """The local shard ``t`` as a DTensor placed like the DTensor ``ref``, of global shape
    ``shape`` (default ``ref``'s)."""
    return as_dtensor(t, ref.device_mesh, ref.placements, tuple(ref.shape if shape is None else shape))


def check_placements(op_name: str, tensors: dict[str, Any]) -> None:
    """Raise unless every one of ``tensors`` is a DTensor sharded on the sequence dimension
    (``Shard(2)``) of a one-dimensional mesh.

    Raises:
        ValueError: a plain tensor among DTensors, or other placements.
    """
    from torch.distributed.tensor import DTensor, Shard

    for name, t in tensors.items():
        if not isinstance(t, DTensor):
            raise ValueError(f"torch_dcp: {op_name} got a plain tensor as {name} and DTensors as other arguments")
        if tuple(t.placements) != (Shard(2),):
            raise ValueError(f"torch_dcp: {op_name} {name} must be a DTensor sharded on the sequence dimension "
                             f"(placements (Shard(2),) on the one-dimensional DCP mesh), got {tuple(t.placements)}")


def _state_dtensor(executor: Any, state: torch.Tensor, ref: Any, kv_heads: int, keep: bool = True) -> Any:
    """The executor's state as a DTensor sharded on its only dimension (``Shard(0)``), of the
    global size every rank computes alike (the sum over ranks, from the plan; 0 without keep)."""
    from torch.distributed.tensor import Shard

    total = executor.state_nbytes(kv_heads, every_rank=True) if keep else 0
    return as_dtensor(state, ref.device_mesh, [Shard(0)], (total,))


def _dtensor_attention(op_call: Any, args: tuple, kwargs: dict) -> Any:
    a = bind_args(op_call, args, kwargs)
    check_placements("torch_dcp::attention", {n: a[n] for n in ("query", "key", "value")})
    q = a["query"]
    executor = _bound()
    ql, kl, vl = local(q), local(a["key"]), local(a["value"])
    _check_traced(ql, kl, vl, a["is_causal"], a["enable_gqa"])
    keep = a["is_causal"] is None
    out, lse, state = attention_forward(executor, ql, kl, vl, a["scale"], keep=keep)
    return like(out, q), like(lse, q, tuple(q.shape[:3])), _state_dtensor(executor, state, q, a["key"].shape[1], keep)


def _dtensor_attention_backward(op_call: Any, args: tuple, kwargs: dict) -> Any:
    a = bind_args(op_call, args, kwargs)
    names = ("grad_out", "query", "key", "value", "out", "lse")
    check_placements("torch_dcp::attention_backward", {n: a[n] for n in names})
    grads = attention_backward(_bound(), *(local(a[n]) for n in names), local(a["state"]), a["scale"])
    return tuple(like(g, a[n]) for g, n in zip(grads, ("query", "key", "value")))


def dtensor_handlers() -> dict[Any, Any]:
    """DTensor custom op handlers (``DTensor._op_dispatcher._custom_op_handlers`` entries) of
    the ``torch_dcp`` ops."""
    return {
        torch.ops.torch_dcp.attention.default: _dtensor_attention,
        torch.ops.torch_dcp.attention_backward.default: _dtensor_attention_backward,
    }
