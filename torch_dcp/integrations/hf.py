"""Hugging Face ``transformers`` models under torch_dcp: an attention backend and a packing helper.

    import torch_dcp.integrations.hf as dcp_hf      # registers attn_implementation="torch_dcp"

    model = AutoModelForCausalLM.from_config(config, attn_implementation="torch_dcp")
    packed = dcp_hf.pack(documents, model.config, dtype="float32")   # the global batch, on every rank
    with torch_dcp.context_parallel(mesh, buffers=packed.buffers, buffer_seq_dims=packed.buffer_seq_dims,
                                    no_restore_buffers=set(packed.buffers), batch=packed.batch):
        loss = model(**packed.model_inputs()).loss   # this rank's tokens' loss sum / the global label count
        (loss * mesh.size()).backward()              # FSDP2 averages gradients over the mesh

Importing this module registers ``"torch_dcp"`` with transformers' ``AttentionInterface`` (the
attention function :func:`attention_forward`) and ``AttentionMaskInterface`` (:func:`mask_function`).
Inside :func:`torch_dcp.context_parallel` the mask function builds no mask (transformers would
build a 4-D document mask from each rank's reordered positions on some ranks and not others) and
the attention function runs ``F.scaled_dot_product_attention`` with the BatchSpec's mask: GQA
without ``repeat_kv``, the module's ``scaling`` honoured, a layer's ``sliding_window`` checked
against the batch's mask (:class:`~torch_dcp.Lambda` with ``window`` = the layer's window, its
``sink`` the BatchSpec's choice; any causal mask is accepted for documents no longer than the
window, so Gemma-style mixes of sliding and full layers run while no document is longer).
Attention dropout, soft-capping, attention sinks, a position bias, a 4-D mask, padding (a 2-D
``attention_mask`` with zeros) and position ids that are not the documents' (forgotten ones:
``0..S_local-1``) are refused through :meth:`~torch_dcp.DCPContext.refuse`,
so peers waiting for the refusing rank raise too. Outside a context both fall back to
transformers' ``"sdpa"`` functions (the model then behaves as with ``attn_implementation="sdpa"``).

:func:`pack` turns documents (or one packed row with ``position_ids`` or ``cu_seqlens``) into
what the model call needs (:class:`PackedBatch`): ``input_ids``, per-document ``position_ids``,
labels shifted inside each document (``-100`` at every document's last token, passed as
transformers' ``shift_labels``: HF's own shift of ``labels=input_ids`` would run in the local,
reordered token order), the global count of valid labels (``num_items_in_batch``: the loss is
then this rank's sum over the global count, and the ranks' losses add up to the global mean),
the :class:`~torch_dcp.BatchSpec` and the context's ``buffers``.

This module imports transformers (``pip install 'torch-dcp[hf]'``, ``transformers>=4.56``);
``import torch_dcp`` does not import it.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from torch_dcp import BatchSpec, Causal, Lambda
from torch_dcp.context import DCPContext, active_context
from torch_dcp.data import packed_document_lengths
from torch_dcp.executor.device_plan import host_to_device
from torch_dcp.executor.padding import PLACEHOLDER_ROWS
from torch_dcp.masks import MaskSpec

__all__ = ["NAME", "attention_forward", "mask_function", "pack", "PackedBatch", "batch_mask", "model_heads",
           "DCPTrainer", "DCPSFTTrainer", "TrainerDCPConfig"]

#: the ``attn_implementation`` this module registers
NAME = "torch_dcp"

#: keyword arguments transformers may pass that torch_dcp cannot honour (refused when not None)
_UNSUPPORTED = {"softcap": "logit soft-capping", "s_aux": "attention sinks", "sinks": "attention sinks",
                "position_bias": "a position bias"}


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function for ``attn_implementation="torch_dcp"``.

    Args:
        module: the attention module (``is_causal``, ``layer_idx`` and ``config`` are read).
        query: ``[1, H, S_local, D]``; key, value: ``[1, H_kv, S_local, D]`` (this rank's tokens
            inside a context; any batch outside).
        attention_mask: ``None`` inside a context (:func:`mask_function` builds none).
        dropout: attention dropout probability (refused unless 0 inside a context).
        scaling: softmax scale (default ``1 / sqrt(D)``).
        is_causal: the layer's causality (default ``module.is_causal``, else True); it must
            agree with the batch's mask.
        sliding_window: the layer's window (query ``i`` sees keys ``j > i - window``), or None.
        **kwargs: what else transformers passes: ``position_ids`` ``[1, S_local]`` must be the
            document-local positions of this rank's tokens (checked once per forward);
            ``softcap``, ``s_aux``/``sinks`` and ``position_bias`` are refused when not None;
            the rest (flash-attention metadata, ``output_attentions``) is unused.

    Returns:
        ``(out [1, S_local, H, D], None)`` (no attention weights).

    Raises:
        ValueError: inside a context, what torch_dcp cannot run exactly (dropout, soft-capping,
            sinks, a position bias, a mask, a window the batch's mask does not have, position
            ids that are not the documents' (forgotten: ``0..S_local-1``), or what
            the SDPA interception refuses: dtype, shapes, causality), posted to the peers first.
    """
    ctx = active_context()
    if ctx is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, is_causal=is_causal, sliding_window=sliding_window,
                                              **kwargs)
    where = f"torch_dcp (transformers {type(module).__name__}, layer {getattr(module, 'layer_idx', '?')})"
    if dropout:
        ctx.refuse(f"{where}: attention dropout {dropout} is not supported; set config.attention_dropout = 0 "
                   "or call model.eval()")
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            ctx.refuse(f"{where}: {what} ({name}=...) is not supported by torch_dcp")
    if attention_mask is not None:
        ctx.refuse(f"{where}: the attention got a mask {list(attention_mask.shape)}; under torch_dcp the mask is the "
                   "BatchSpec's (pass no 4-D attention_mask to the model)")
    placeholder = _holds_placeholder(ctx, query)
    reason = _window_mismatch(ctx, module, sliding_window) or (
        None if placeholder else _positions_mismatch(ctx, kwargs.get("position_ids")))
    if reason:
        ctx.refuse(f"{where}: {reason}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # a placeholder token (a rank holding none of the batch) runs as the context runs one: output 0
    out = F.scaled_dot_product_attention(query, key, value, is_causal=bool(causal), scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _holds_placeholder(ctx: DCPContext, query: torch.Tensor) -> bool:
    """Whether the call carries :meth:`PackedBatch.model_inputs`'s placeholder token of a rank
    holding none of the batch (rather than this rank's tokens of the plan)."""
    return ctx.placeholder and query.dim() == 4 and query.shape[2] == PLACEHOLDER_ROWS


def _window_mismatch(ctx: DCPContext, module: torch.nn.Module, window: int | None) -> str | None:
    """Why the layer's window (``None``: full attention) disagrees with the batch's masks, or
    ``None`` when every document gets the layer's mask (documents no longer than the window
    get it under any causal mask)."""
    batch = ctx.plan.batch
    whole = np.iinfo(np.int64).max
    if window is not None:  # longest document each of the batch's masks serves as the layer's
        limits = [whole if isinstance(m, Lambda) and m.window == window else window for m in batch.masks]
        what, hint = (f"the layer has a sliding window of {window} tokens",
                      f"build the BatchSpec with Lambda(sink=0, window={window}) (batch_mask(config))")
    elif _has_sliding_layers(module):
        limits = [m.window if isinstance(m, Lambda) else whole for m in batch.masks]
        what, hint = ("the layer attends fully", "a model mixing sliding-window and full layers runs under one plan "
                      "only when no document is longer than the window (one plan serves one mask)")
    else:
        return None
    bad = np.nonzero(batch.doc_lens > np.array(limits, np.int64)[batch.doc_mask])[0]
    if not len(bad):
        return None
    d = int(bad[0])
    return f"{what}, document {d} ({batch.doc_lens[d]} tokens) has the mask {batch.mask_of(d)!r}; {hint}"


#: weak references to the (context, position ids tensor) last found right, and the tensor's version: a
#: forward's layers share one tensor, checked once (weak: nothing here keeps a context or its group alive)
_positions_checked: tuple = (lambda: None, lambda: None, -1)


def _positions_mismatch(ctx: DCPContext, position_ids: Any) -> str | None:
    """Why the model's ``[1, S_local]`` position ids are not the document-local positions of
    this rank's tokens (forgotten position ids become ``0..S_local-1``: RoPE silently wrong),
    or ``None``. Read once per forward (one device-to-host copy)."""
    global _positions_checked
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None  # not given, or another layout (e.g. multimodal 3-D positions): nothing to compare
    last_ctx, last_pos, version = _positions_checked
    if last_ctx() is ctx and last_pos() is position_ids and version == position_ids._version:
        return None
    batch, idx = ctx.plan.batch, ctx.plan.token_indices(ctx.rank)
    cu = batch.cu_seqlens
    want = idx - cu[np.searchsorted(cu, idx, side="right") - 1]
    got = position_ids[0].detach().cpu().numpy()
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = int(np.argmax(got != want)) if got.shape == want.shape else 0
        return (f"position_ids are not the document-local positions of rank {ctx.rank}'s tokens (local token {bad}: "
                f"{got[bad] if got.size else None}, expected {want[bad] if want.size else None}); pass the batch's "
                "position ids, sharded with the other buffers (torch_dcp.integrations.hf.pack)")
    _positions_checked = (weakref.ref(ctx), weakref.ref(position_ids), position_ids._version)
    return None


def _has_sliding_layers(module: torch.nn.Module) -> bool:
    return "sliding_attention" in (getattr(getattr(module, "config", None), "layer_types", None) or ())


def mask_function(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask function for ``"torch_dcp"`` (called as transformers calls its mask
    interface, with keyword arguments). Inside a context: no mask (``None``); a 2-D
    ``attention_mask`` with a zero (padding) is refused, one of ones is accepted (one read of
    it per mask), and so is the zero of a rank's placeholder token
    (:meth:`PackedBatch.model_inputs`) without a read. Outside: transformers' ``"sdpa"`` mask
    function.

    Raises:
        ValueError: inside a context, padding in the 2-D attention mask.
    """
    ctx = active_context()
    if ctx is None:
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)
    pad = kwargs.get("attention_mask")
    placeholder = ctx.placeholder and isinstance(pad, torch.Tensor) and pad.shape[-1:] == (PLACEHOLDER_ROWS,)
    if isinstance(pad, torch.Tensor) and pad.dim() == 2 and not placeholder and not bool(pad.all()):
        ctx.refuse("torch_dcp (transformers): the attention_mask has padding (zeros); pack documents without padding "
                   "(torch_dcp.integrations.hf.pack) and pass no attention_mask")
    return None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, mask_function)


# ---------------------------------------------------------------------- packing
@dataclasses.dataclass
class PackedBatch:
    """A packed global batch for a transformers causal LM under torch_dcp (from :func:`pack`).

    Attributes:
        input_ids: int64 ``[1, T]``, the documents back to back.
        position_ids: int64 ``[1, T]``, restarting at 0 in every document (or the ones given).
        labels: int64 ``[1, T]``, shifted inside each document: ``labels[0, i]`` is the token
            after ``i`` in its document, ``-100`` at every document's last token and where the
            given labels were ``-100``.
        num_items_in_batch: the global count of labels that are not ``-100``.
        batch: the :class:`~torch_dcp.BatchSpec` (documents, mask, heads, dtype).

    ``buffers`` (the three tensors, sharded in place by the context) and ``buffer_seq_dims``
    go to :func:`torch_dcp.context_parallel`; inside it, :meth:`model_inputs` are this rank's
    (a rank may hold no tokens: its buffers are ``[1, 0]``; it still runs the forward and the
    backward, on a placeholder token, and takes part in every transfer).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    num_items_in_batch: int
    batch: BatchSpec

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [self.input_ids, self.position_ids, self.labels]

    @property
    def buffer_seq_dims(self) -> list[int]:
        return [1, 1, 1]

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the model call: ids, positions, the shifted labels (as ``labels``
        and ``shift_labels``, so transformers does not shift them again), ``num_items_in_batch``
        (the loss is the sum over the tokens held divided by it) and ``use_cache=False``.

        Inside a context also ``attention_mask``, bool ``[1, S_local]`` ones: transformers
        then goes straight to the backend's :func:`mask_function` (which builds no mask) instead
        of first searching the position ids for packed documents (a host read per forward). A
        rank that holds no tokens gets a placeholder row of one token
        (id 0, position 0, no label, attention mask 0 so that token counts such as TRL's
        ``num_tokens`` leave it out): transformers' layers cannot run an empty sequence, so the
        model runs that token, the context runs its attention on no rows (the rank takes part in
        every transfer) with output 0 for the placeholder
        (:class:`~torch_dcp.executor.padding.PlaceholderRows`), and it adds nothing to the loss or
        the gradients.
        Outside a context no ``attention_mask``: transformers' SDPA masks every document on its
        own from the position ids (an all-ones mask would let the documents see each other)."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "labels": self.labels,
                  "shift_labels": self.labels, "num_items_in_batch": self.num_items_in_batch, "use_cache": False}
        ctx = active_context()
        if ctx is None:
            return inputs
        device = self.input_ids.device
        if ctx.placeholder:  # this rank holds no tokens
            row = torch.zeros((1, PLACEHOLDER_ROWS), dtype=torch.long, device=device)
            inputs.update(input_ids=row, position_ids=row, labels=row - 100, shift_labels=row - 100)
            mask = torch.zeros(row.shape, dtype=torch.bool, device=device)  # counted as no token (TRL's num_tokens)
        else:
            mask = torch.ones(self.input_ids.shape, dtype=torch.bool, device=device)
        inputs["attention_mask"] = mask
        return inputs


def model_heads(config: Any) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)`` of a transformers config."""
    h = int(config.num_attention_heads)
    h_kv = int(getattr(config, "num_key_value_heads", None) or h)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // h)
    return h, h_kv, d


def batch_mask(config: Any) -> MaskSpec:
    """The mask of a transformers config's attention layers: ``Lambda(sink=0, window=W)`` when
    every layer slides over ``config.sliding_window = W`` tokens (Mistral; ``layer_types`` all
    ``"sliding_attention"``), else :class:`~torch_dcp.Causal` (for a mix of sliding and full
    layers this is exact only for documents no longer than the window; :func:`pack` checks)."""
    window = getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or ())
    if window and (all(t == "sliding_attention" for t in types) if types else True):
        return Lambda(sink=0, window=int(window))
    return Causal()


def _as_row(name: str, t: Any) -> np.ndarray:
    a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"pack: {name} must be a non-empty integer row [T] or [1, T], got {a.dtype} {list(a.shape)}")
    return a.astype(np.int64)


def pack(documents: Sequence[Any] | None = None, config: Any = None, *, input_ids: Any = None,
         position_ids: Any = None, cu_seqlens: Any = None, labels: Any = None, mask: MaskSpec | None = None,
         n_heads: int | None = None, n_kv_heads: int | None = None, head_dim: int | None = None,
         dtype: "str | torch.dtype" = "float32", device: "torch.device | str" = "cpu") -> PackedBatch:
    """Pack a global batch for a transformers causal LM under torch_dcp (every rank the same).

    Args:
        documents: token id sequences (lists, arrays or tensors), one per document; or
        input_ids: one packed row ``[T]`` or ``[1, T]`` with ``position_ids`` (a document starts
            where the position is 0; positions must rise by 1 inside a document) or
            ``cu_seqlens`` (``[n_docs + 1]`` offsets from 0 to T).
        config: the model's config (heads, head_dim, sliding window); or give ``n_heads``,
            ``n_kv_heads``, ``head_dim``.
        labels: HF-style labels like the tokens (``-100``: no loss), per document, or one row
            like ``input_ids``; default: the tokens themselves. They are shifted here.
        mask: the BatchSpec's mask (default :func:`batch_mask` of ``config``, else Causal).
        dtype: the dtype attention runs in (under ``torch.autocast``: the autocast dtype).
        device: where the tensors go.

    Returns:
        A :class:`PackedBatch`.

    Raises:
        ValueError: both or neither of ``documents``/``input_ids``, neither or both of
            ``position_ids``/``cu_seqlens`` with ``input_ids``, empty or non-integer documents,
            positions that do not rise by 1 inside a document, labels of another length,
            neither a config nor head counts, a document longer than the window of a model
            mixing sliding and full layers, or what :class:`~torch_dcp.BatchSpec` refuses.
    """
    if (documents is None) == (input_ids is None):
        raise ValueError("pack: give exactly one of documents and input_ids")
    if documents is not None:
        docs = [_as_row(f"documents[{i}]", d) for i, d in enumerate(documents)]
        if not docs:
            raise ValueError("pack: no documents")
        tokens = np.concatenate(docs)
        lens = np.array([len(d) for d in docs], np.int64)
        positions = None
        if labels is not None:
            labels = np.concatenate([_as_row(f"labels[{i}]", x) for i, x in enumerate(labels)])
    else:
        tokens = _as_row("input_ids", input_ids)
        if (position_ids is None) == (cu_seqlens is None):
            raise ValueError("pack: with input_ids give exactly one of position_ids and cu_seqlens")
        positions = None
        if position_ids is not None:
            positions = _as_row("position_ids", position_ids)
            if positions.shape != tokens.shape:
                raise ValueError(f"pack: position_ids has {positions.size} tokens, input_ids {tokens.size}")
            if positions[0] != 0:
                raise ValueError(f"pack: position_ids must start a document (0) at token 0, got {positions[0]}")
            lens = packed_document_lengths(positions[None], tokens[None])
        else:
            lens = np.diff(_as_row("cu_seqlens", cu_seqlens))
            if _as_row("cu_seqlens", cu_seqlens)[0] != 0 or lens.sum() != tokens.size or np.any(lens <= 0):
                raise ValueError(f"pack: cu_seqlens must rise from 0 to {tokens.size} (input_ids' length)")
        if labels is not None:
            labels = _as_row("labels", labels)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    local = np.arange(tokens.size) - np.repeat(starts, lens)
    if positions is None:
        positions = local
    elif not np.array_equal(positions - np.repeat(positions[starts], lens), local):
        raise ValueError("pack: position_ids must rise by 1 inside every document (a document starts at 0)")
    labels = tokens if labels is None else labels
    if labels.shape != tokens.shape:
        raise ValueError(f"pack: labels have {labels.size} tokens, the batch {tokens.size}")
    shifted = np.full_like(tokens, -100)
    shifted[:-1] = labels[1:]
    shifted[np.cumsum(lens) - 1] = -100  # the last token of every document predicts nothing
    if config is not None:
        n_heads, n_kv_heads, head_dim = model_heads(config)
        mask = batch_mask(config) if mask is None else mask
        window = getattr(config, "sliding_window", None)
        types = set(getattr(config, "layer_types", None) or ())
        if window and {"sliding_attention", "full_attention"} <= types and lens.max() > window:
            raise ValueError(f"pack: the model mixes sliding-window ({window} tokens) and full attention layers and a "
                             f"document has {int(lens.max())} tokens; one plan serves one mask, so documents must not "
                             "be longer than the window")
    if n_heads is None or head_dim is None:
        raise ValueError("pack: give the model's config, or n_heads and head_dim (and n_kv_heads)")
    batch = BatchSpec(lens, mask if mask is not None else Causal(), n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim, dtype=dtype)
    dev = torch.device(device)
    t_ids, t_pos, t_lab = (host_to_device(torch.from_numpy(np.ascontiguousarray(a))[None], dev)
                           for a in (tokens, positions, shifted))
    return PackedBatch(t_ids, t_pos, t_lab, int((shifted != -100).sum()), batch)


#: what :mod:`torch_dcp.integrations.hf_trainer` gives this module, imported on first use
_TRAINER_NAMES = ("DCPTrainer", "DCPSFTTrainer", "TrainerDCPConfig")


def __getattr__(name: str) -> Any:
    """``DCPTrainer``, ``DCPSFTTrainer`` and ``TrainerDCPConfig``
    (:mod:`torch_dcp.integrations.hf_trainer`), imported on first use: they need accelerate (and
    trl for ``DCPSFTTrainer``, imported only when it is asked for)."""
    if name in _TRAINER_NAMES:
        from . import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
