"""BatchSpec: what one attention step of a global packed batch is.

No torch import here: the planning layers work on NumPy only.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .masks import Causal, MaskSpec, mask_from_dict

__all__ = ["BatchSpec", "DTYPE_SIZES", "MAX_TOKENS", "canonical_dtype"]

#: The most tokens one batch may hold (the kernels index tokens and cumulative offsets with int32:
#: flash's ``cu_seqlens``, FlexAttention's block indices).
MAX_TOKENS = 2**31 - 1

#: Element size in bytes of the supported attention dtypes.
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}


def canonical_dtype(dtype: Any) -> str:
    """Canonical name (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"float64"``) of a dtype
    given as a string or a ``torch.dtype``.

    Raises:
        ValueError: unknown dtype.
    """
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_SIZES:
        raise ValueError(f"BatchSpec.dtype: unknown dtype {dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
    return name


class BatchSpec:
    """The documents of a global batch (all ranks of the DCP group) and their attention.

    Args:
        doc_lens: document lengths in tokens (a sequence of positive ints), or ``None`` when
            ``cu_seqlens`` is given.
        mask: one :class:`~torch_dcp.masks.MaskSpec` for every document, or a sequence with one
            mask per document. Default :class:`~torch_dcp.masks.Causal`.
        cu_seqlens: cumulative document offsets ``[0, l0, l0+l1, ...]`` instead of ``doc_lens``.
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads ``H_kv`` (GQA); ``n_heads % n_kv_heads == 0``.
        head_dim: head dimension ``D``.
        dtype: attention dtype of Q, K, V, O (name or ``torch.dtype``).

    Defaults follow the DCP paper's microbenchmarks (§7.1): 8 query heads, 2 KV heads,
    head_dim 128, bf16.

    Raises:
        ValueError: naming the field and value, for an empty batch, a non-positive length, both
            or neither of ``doc_lens``/``cu_seqlens``, a non-increasing ``cu_seqlens``,
            ``n_heads % n_kv_heads != 0``, non-positive head counts or dims, an unknown dtype,
            a mask list of the wrong length, or a mask that does not fit its document (e.g. a
            :class:`~torch_dcp.masks.Ranges` mask whose ranges leave the document).
    """

    def __init__(
        self,
        doc_lens: Sequence[int] | np.ndarray | None = None,
        mask: MaskSpec | Sequence[MaskSpec] | None = None,
        *,
        cu_seqlens: Sequence[int] | np.ndarray | None = None,
        n_heads: int = 8,
        n_kv_heads: int | None = 2,
        head_dim: int = 128,
        dtype: Any = "bfloat16",
    ):
        if (doc_lens is None) == (cu_seqlens is None):
            raise ValueError("BatchSpec: give exactly one of doc_lens and cu_seqlens")
        if cu_seqlens is not None:
            cu = _as_int_array("cu_seqlens", cu_seqlens)
            if len(cu) < 2:
                raise ValueError(f"BatchSpec.cu_seqlens: empty batch (cu_seqlens={cu.tolist()})")
            if cu[0] != 0:
                raise ValueError(f"BatchSpec.cu_seqlens must start at 0, got {cu[0]}")
            lens = np.diff(cu)
            if np.any(lens <= 0):
                i = int(np.argmax(lens <= 0))
                raise ValueError(
                    f"BatchSpec.cu_seqlens must be strictly increasing; document {i} has length {lens[i]}"
                )
        else:
            lens = _as_int_array("doc_lens", doc_lens)
            if len(lens) == 0:
                raise ValueError("BatchSpec.doc_lens: empty batch (no documents)")
            if np.any(lens <= 0):
                i = int(np.argmax(lens <= 0))
                raise ValueError(f"BatchSpec.doc_lens[{i}] must be positive, got {lens[i]}")
        total = int(lens.astype(object).sum())  # exact: an int64 sum could wrap
        if total > MAX_TOKENS:
            raise ValueError(f"BatchSpec: {total} tokens in all; at most {MAX_TOKENS} (2**31 - 1: the kernels index "
                             "tokens and cumulative offsets with int32)")
        for name, v in (("n_heads", n_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"BatchSpec.{name} must be a positive integer, got {v!r}")
        if n_kv_heads is None:
            n_kv_heads = n_heads
        if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, (int, np.integer)) or n_kv_heads <= 0:
            raise ValueError(f"BatchSpec.n_kv_heads must be a positive integer, got {n_kv_heads!r}")
        if n_heads % n_kv_heads != 0:
            raise ValueError(
                f"BatchSpec.n_kv_heads={n_kv_heads} must divide n_heads={n_heads} (GQA groups)"
            )
        self.dtype = canonical_dtype(dtype)
        self.n_heads = int(n_heads)
        self.n_kv_heads = int(n_kv_heads)
        self.head_dim = int(head_dim)
        self.doc_lens = lens.astype(np.int64)
        self.doc_lens.setflags(write=False)

        if mask is None:
            mask = Causal()
        if isinstance(mask, MaskSpec):
            self.masks: tuple[MaskSpec, ...] = (mask,)
            self.doc_mask = np.zeros(len(lens), np.int64)
        else:
            mask_list = list(mask)
            if len(mask_list) != len(lens):
                raise ValueError(
                    f"BatchSpec.mask: {len(mask_list)} masks for {len(lens)} documents (give one, or one per document)"
                )
            uniq: list[MaskSpec] = []
            ids = np.empty(len(lens), np.int64)
            for i, m in enumerate(mask_list):
                if not isinstance(m, MaskSpec):
                    raise ValueError(f"BatchSpec.mask[{i}] is not a MaskSpec: {m!r}")
                for u, seen in enumerate(uniq):
                    if seen is m or (type(seen) is type(m) and seen == m):
                        ids[i] = u
                        break
                else:
                    ids[i] = len(uniq)
                    uniq.append(m)
            self.masks = tuple(uniq)
            self.doc_mask = ids
        self.doc_mask.setflags(write=False)
        for i, length in enumerate(self.doc_lens):
            try:
                self.masks[self.doc_mask[i]].check_length(int(length))
            except ValueError as err:
                raise ValueError(f"BatchSpec.mask of document {i} (length {length}): {err}") from None

    # ------------------------------------------------------------------ properties
    @property
    def n_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def total_tokens(self) -> int:
        return int(self.doc_lens.sum())

    @property
    def cu_seqlens(self) -> np.ndarray:
        """int64 ``[n_docs + 1]`` document offsets in the global token order."""
        return np.concatenate(([0], np.cumsum(self.doc_lens))).astype(np.int64)

    @property
    def elem_size(self) -> int:
        """Bytes per element of Q, K, V, O, dO."""
        return DTYPE_SIZES[self.dtype]

    @property
    def acc_dtype(self) -> str:
        """Dtype of partial outputs, LSE and gradient partials: float64 for float64 inputs,
        float32 otherwise."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def acc_size(self) -> int:
        return DTYPE_SIZES[self.acc_dtype]

    @property
    def is_causal(self) -> bool:
        """True when no query of any document sees a later key."""
        return all(m.is_causal for m in self.masks)

    def mask_of(self, doc: int) -> MaskSpec:
        return self.masks[int(self.doc_mask[doc])]

    def key_ranges(self, doc: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Key ranges (document-local) of queries at document-local ``pos`` of documents ``doc``.

        ``doc``, ``pos``: int arrays ``[n]``. Returns int64 ``(starts, ends)``, ``[n, R]`` with
        ``R`` the widest mask of the batch (narrower masks padded with empty ranges).
        Vectorised per distinct mask.
        """
        doc = np.asarray(doc, np.int64)
        pos = np.asarray(pos, np.int64)
        width = max(m.n_ranges for m in self.masks)
        starts = np.zeros((len(pos), width), np.int64)
        ends = np.zeros_like(starts)
        mids = self.doc_mask[doc]
        for u, m in enumerate(self.masks):
            sel = np.nonzero(mids == u)[0]
            if len(sel) == 0:
                continue
            s, e = m.ranges_at(pos[sel], self.doc_lens[doc[sel]])
            starts[sel, : s.shape[1]] = s
            ends[sel, : e.shape[1]] = e
        return starts, ends

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "doc_lens": self.doc_lens.tolist(),
            "masks": [m.to_dict() for m in self.masks],
            "doc_mask": self.doc_mask.tolist(),
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BatchSpec":
        masks = [mask_from_dict(m) for m in d["masks"]]
        per_doc = [masks[i] for i in d["doc_mask"]]
        return cls(
            d["doc_lens"],
            per_doc if len(masks) > 1 else masks[0],
            n_heads=d["n_heads"],
            n_kv_heads=d["n_kv_heads"],
            head_dim=d["head_dim"],
            dtype=d["dtype"],
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSpec) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        masks = ", ".join(repr(m) for m in self.masks)
        return (
            f"BatchSpec(n_docs={self.n_docs}, total_tokens={self.total_tokens}, masks=[{masks}], "
            f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype})"
        )


def _as_int_array(name: str, values: Any) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor, without importing torch
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"BatchSpec.{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.mod(arr, 1) == 0):
            raise ValueError(f"BatchSpec.{name} must hold integers, got {arr.tolist()}")
    return arr.astype(np.int64)
