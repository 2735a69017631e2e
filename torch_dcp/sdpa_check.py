"""The contract of an SDPA call under a plan: what :func:`torch_dcp.context_parallel`'s wrapper
and the ``torch_dcp::attention`` op check before any communication (an explicit mask, dropout,
``is_causal`` against the mask, shapes, heads, dtype and device against the plan's BatchSpec and
this rank's rows), so that a call the plan cannot honour raises ``ValueError`` on every rank
instead of computing a wrong answer."""

from __future__ import annotations

from typing import Any

import torch

from .executor.padding import PLACEHOLDER_ROWS

__all__ = ["check_sdpa_call", "call_rows", "fold_rows", "unfold_rows"]


def check_sdpa_call(ctx: Any, query, key, value, attn_mask, dropout_p, is_causal,
                     enable_gqa) -> None:
    """Raise ``ValueError`` when an SDPA call contradicts the plan (never compute a silently
    wrong answer). Only local metadata and the plan are read, before any communication (a rank
    whose call differs from its peers' posts its refusal for them). ``ctx=None``: only what
    does not depend on the plan (an ``attn_mask``, dropout, inputs that are not plain
    ``[1, heads, S, head_dim]`` tensors on one device, fewer key/value heads without
    ``enable_gqa``), what the wrapper checks while Dynamo traces it (the rest is checked by
    the op when it runs: :func:`_check_traced_call`)."""
    if attn_mask is not None:
        raise ValueError("torch_dcp: SDPA got an explicit attn_mask; under torch_dcp the mask is the BatchSpec's mask "
                         "spec with document boundaries (remove attn_mask; a transformers model: "
                         "attn_implementation=\"torch_dcp\", from torch_dcp.integrations.hf)")
    if dropout_p:
        raise ValueError(f"torch_dcp: attention dropout (dropout_p={dropout_p}) is not supported")
    from torch.distributed.tensor import DTensor

    if ctx is None:
        for name, t in (("query", query), ("key", key), ("value", value)):
            _check_tensor(name, t, query, DTensor)
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ValueError("torch_dcp: key/value have fewer heads than query; pass enable_gqa=True")
        return
    b = ctx.plan.batch
    s_local = ctx.rows
    if bool(is_causal) != b.is_causal:
        if is_causal:
            raise ValueError("torch_dcp: SDPA called with is_causal=True, but the batch's mask lets a query see a later "
                             "key (Full or a forward-looking Ranges mask)")
        raise ValueError("torch_dcp: SDPA called with is_causal=False, but the context's mask is causal (a BatchSpec's, "
                         "named with mask=, or set by the context's first SDPA call); pass is_causal=True (the masks "
                         "decide the exact pattern), or for bidirectional attention name the mask: "
                         "context_parallel(..., mask=torch_dcp.Full()), or a BatchSpec with Full()")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t, None, DTensor)
        if t.dtype != getattr(torch, b.dtype):
            raise ValueError(f"torch_dcp: SDPA {name} has dtype {t.dtype}, but the plan's BatchSpec dtype is {b.dtype} "
                             "(a cast changed it? build the BatchSpec with the dtype attention runs in: under "
                             "torch.autocast, the autocast dtype)")
        if t.device != query.device:
            raise ValueError(f"torch_dcp: SDPA {name} is on {t.device}, query on {query.device}")
        if t.shape[2] != s_local and not (ctx.placeholder and t.shape[2] == PLACEHOLDER_ROWS):
            raise ValueError(f"torch_dcp: SDPA {name} has sequence length {t.shape[2]}, but rank {ctx.rank} holds "
                             f"{s_local} tokens of the plan (shard the inputs with buffers=...)")
        if t.shape[3] != b.head_dim:
            raise ValueError(f"torch_dcp: SDPA {name} head_dim {t.shape[3]} differs from the batch's {b.head_dim}")
    if query.shape[1] != b.n_heads:
        raise ValueError(f"torch_dcp: SDPA query has {query.shape[1]} heads, the batch {b.n_heads}")
    hkv = key.shape[1]
    if value.shape[1] != hkv or hkv not in (b.n_kv_heads, b.n_heads):
        raise ValueError(f"torch_dcp: SDPA key/value have {hkv}/{value.shape[1]} heads; expected {b.n_kv_heads} "
                         f"(GQA) or {b.n_heads} (repeated)")
    if hkv != query.shape[1] and not enable_gqa:
        raise ValueError("torch_dcp: key/value have fewer heads than query; pass enable_gqa=True")


def _check_tensor(name: str, t: Any, query: Any, dtensor: type) -> None:
    """Raise ``ValueError`` unless ``t`` is a plain ``[1, heads, S, head_dim]`` tensor (on
    ``query``'s device, when ``query`` is given)."""
    if not isinstance(t, torch.Tensor) or isinstance(t, dtensor) or t.dim() != 4 or t.shape[0] != 1:
        raise ValueError(f"torch_dcp: SDPA {name} must be a plain tensor [1, heads, S_local, head_dim] (one packed "
                         f"sequence of this rank's tokens), got {type(t).__name__} {list(getattr(t, 'shape', []))}")
    if query is not None and t.device != query.device:
        raise ValueError(f"torch_dcp: SDPA {name} is on {t.device}, query on {query.device}")


def call_rows(query: Any, key: Any, value: Any, ctx: Any) -> int:
    """``B`` of an SDPA call ``[B, H, s, D]`` whose rows split this rank's tokens (row-major:
    row ``b`` holds tokens ``b * s .. (b + 1) * s`` of the rank's local order): 1 for one row or
    inputs the checks refuse anyway (not plain 4-D tensors).

    Raises:
        ValueError: query, key and value with different ``B``, or (eagerly) ``B * s`` not this
            rank's tokens (posted as a refusal).
    """
    from torch.distributed.tensor import DTensor

    if not all(isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() == 4 for t in (query, key, value)):
        return 1
    b = int(query.shape[0])
    if b == 1 and key.shape[0] == 1 and value.shape[0] == 1:
        return 1
    reason = None
    if key.shape[0] != b or value.shape[0] != b:
        reason = (f"torch_dcp: SDPA query/key/value have batch sizes {b}/{key.shape[0]}/{value.shape[0]}; "
                  "they must agree")
    elif ctx is not None and b * query.shape[2] not in (ctx.rows, PLACEHOLDER_ROWS if ctx.placeholder else ctx.rows):
        reason = (f"torch_dcp: SDPA query [{b}, {query.shape[1]}, {query.shape[2]}, {query.shape[3]}] holds "
                  f"{b * query.shape[2]} tokens, but rank {ctx.rank} holds {ctx.rows} tokens of the plan (inside the "
                  "context a rank's tokens are one row [1, S_local] of every sharded buffer; B > 1 rows must split "
                  "exactly those tokens, row after row)")
    if reason is not None:
        if ctx is not None and ctx.refusals is not None:
            ctx.refusals.begin_call()
            ctx.refusals.post(reason)
        raise ValueError(reason)
    return b


def fold_rows(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, s, D]`` -> ``[1, H, B * s, D]``, rows one after the other."""
    b, h, s, d = t.shape
    return t.transpose(0, 1).reshape(1, h, b * s, d)


def unfold_rows(t: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The inverse of :func:`fold_rows` for ``n_rows`` rows (``n_rows == 1``: ``t`` itself)."""
    if n_rows == 1:
        return t
    return t[0].unflatten(1, (n_rows, t.shape[2] // n_rows)).transpose(0, 1)
