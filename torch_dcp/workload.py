"""Workload: token blocks and the attention tiles a batch's mask needs (DCP paper §4.1).

A token block is a span ``[start, end)`` of one document. A tile is a pair
``(q_block, kv_block)`` of blocks of the same document whose (query, key) pairs are not all
masked; tiles that the mask empties do not exist. FLOPs and bytes are counted exactly from
the visible pairs.
"""

from __future__ import annotations

import enum
import hashlib
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from .batch import MAX_TOKENS, BatchSpec
from .masks import count_visible_pairs

__all__ = ["Workload", "Buf", "FWD_FLOPS_PER_PAIR", "BWD_FLOPS_PER_PAIR", "spans_to_indices", "item_token_bytes",
           "resident_token_bytes", "check_block_size"]


def check_block_size(block_size: Any) -> int:
    """``block_size`` as an ``int`` when it is an integer in ``1 .. MAX_TOKENS`` (a larger block
    than the batch is fine: one block per document).

    Raises:
        ValueError: not an integer, or outside ``1 .. MAX_TOKENS`` (the message names the bound).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"block_size must be an integer in 1..{MAX_TOKENS}, got {block_size!r}")
    if not 1 <= block_size <= MAX_TOKENS:
        raise ValueError(f"block_size must lie in 1..{MAX_TOKENS} (MAX_TOKENS, the most tokens a batch holds), "
                         f"got {block_size}")
    return int(block_size)


class Buf(enum.IntEnum):
    """The buffers of a rank's attention programs (rows = tokens).

    A transfer moves rows of one buffer from a rank's copy to a peer's, so the same names are
    the transfer kinds: ``Q`` and ``KV`` are inputs fetched from their home, ``OPART``, ``DQ``
    and ``DKV`` partial results returned home.

    * ``Q``: query side -- Q forward; Q, dO, LSE and ``delta = rowsum(dO * O)`` backward.
    * ``KV``: K and V.
    * ``OPART``: partial outputs (in the inputs' dtype) with their LSE (forward, accumulation
      dtype).
    * ``DQ``, ``DKV``: dQ and dK/dV accumulators and received gradient partials (backward;
      dK/dV partials travel in the K/V dtype, :func:`item_token_bytes`).
    * ``OUT``, ``OUT_DQ``, ``OUT_DKV``: the rank's results in local token order: O and LSE
      (forward); dQ and dK/dV (backward).
    """

    Q = 0
    KV = 1
    OPART = 2
    DQ = 3
    DKV = 4
    OUT = 5
    OUT_DQ = 6
    OUT_DKV = 7

#: Forward attention FLOPs per visible (query, key) pair, per head and head-dim element:
#: QK^T (2) + PV (2).
FWD_FLOPS_PER_PAIR = 4
#: Backward FLOPs per visible pair, per head and head-dim element: recomputed QK^T (2),
#: dV (2), dP (2), dQ (2), dK (2) -- 2.5x forward, as FlashAttention counts.
BWD_FLOPS_PER_PAIR = 10

#: the last few uniform workloads, ``(id(batch), block_size) -> (weak reference, workload)``:
#: one plan builds the workload of a batch for every candidate layout (a workload is immutable)
_UNIFORM: "OrderedDict[tuple[int, int], tuple[weakref.ref, Workload]]" = OrderedDict()
_UNIFORM_KEEP = 8
#: the needed tiles of the last few block layouts, ``content digest -> (masks, (tile_q, tile_kv,
#: pairs))``: they depend on the documents, their masks and the blocks, not on heads, so the
#: outer batch of every head parallelism and ring attention's and all-gather CP's zig-zag
#: layouts of one plan share them (the masks kept are compared by identity); at most
#: :data:`_TILES_KEEP` layouts and :data:`_TILES_MAX` tiles in all
_TILES: "OrderedDict[bytes, tuple[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]]" = OrderedDict()
_TILES_KEEP = 8
_TILES_MAX = 1 << 23
#: the key ranges of every token of the last few batches (in token order), ``digest of the
#: documents and their masks' indices -> (masks, (starts, ends))``: every block layout of a batch
#: lists its tokens in that order (blocks sorted by document and start), so the static rivals'
#: layouts of one plan share them
_KEY_RANGES: "OrderedDict[bytes, tuple[tuple, tuple[np.ndarray, np.ndarray]]]" = OrderedDict()
_KEY_RANGES_KEEP = 4


def _memo(cache: OrderedDict, batch: BatchSpec, arrays: tuple, compute: Any, full: Any) -> Any:
    """``compute()`` memoised in ``cache`` by a digest of the batch's documents, their masks'
    indices and ``arrays`` (the masks themselves compared by identity); the oldest entries
    dropped while ``full()``."""
    key = hashlib.blake2b(b"".join(np.ascontiguousarray(a, np.int64).tobytes() for a in (
        batch.doc_lens, batch.doc_mask, *arrays)), digest_size=16).digest()
    hit = cache.get(key)
    if hit is not None and len(hit[0]) == len(batch.masks) and all(a is b for a, b in zip(hit[0], batch.masks)):
        cache.move_to_end(key)
        return hit[1]
    value = compute()
    cache[key] = (batch.masks, value)
    while full():
        cache.popitem(last=False)
    return value


def resident_token_bytes(batch: BatchSpec) -> int:
    """Resident bytes per token of Q, K, V and O (the memory weight of a token)."""
    return (2 * batch.n_heads + 2 * batch.n_kv_heads) * batch.head_dim * batch.elem_size


def item_token_bytes(batch: BatchSpec) -> dict[tuple[bool, str], int]:
    """Bytes per token of every transfer kind, keyed ``(backward, kind)`` with ``kind`` a :class:`Buf`.

    Forward: ``Q`` (Q), ``KV`` (K, V), ``OPART`` (partial O in the inputs' dtype, as an
    attention kernel writes it, and its LSE in the accumulation dtype: torch_dcp's executor keeps
    and sends its partial outputs so, and merges them in the accumulation dtype).
    Backward: ``Q`` (Q, dO, LSE, delta), ``KV`` (K, V), ``DQ`` (dQ partials, accumulation
    dtype) and ``DKV`` (dK/dV partials in the K/V dtype, as TransformerEngine's context
    parallelism sends them: torch_dcp's executor casts its float32 partials as it sends them and
    adds them up in float32 where they arrive). Every runtime moves exactly these bytes.
    """
    e, a = batch.elem_size, batch.acc_size
    hd, kvd, h = batch.n_heads * batch.head_dim, batch.n_kv_heads * batch.head_dim, batch.n_heads
    return {
        (False, Buf.Q): hd * e,
        (False, Buf.KV): 2 * kvd * e,
        (False, Buf.OPART): hd * e + h * a,
        (True, Buf.Q): 2 * hd * e + 2 * h * a,
        (True, Buf.KV): 2 * kvd * e,
        (True, Buf.DQ): hd * a,
        (True, Buf.DKV): 2 * kvd * e,
    }


def smallest_int(max_value: int) -> type:
    """The narrowest signed NumPy integer type holding ``0 .. max_value``."""
    for t in (np.int8, np.int16, np.int32):
        if max_value <= np.iinfo(t).max:
            return t
    return np.int64


def spans_to_indices(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], starts[i] + lengths[i])`` for all ``i`` (int64, vectorised)."""
    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    first = np.cumsum(lengths) - lengths  # works for no spans too
    return np.repeat(starts - first, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _frozen(a: np.ndarray, dtype: Any = np.int64) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=dtype)
    a.setflags(write=False)
    return a


class Workload:
    """Token blocks and needed tiles of a batch.

    Blocks are kept sorted by global token offset (so block ids follow the global token
    order) and partition every document. Use :meth:`uniform` for blocks of ``block_size``
    tokens (the last block of a document may be short) or :meth:`from_spans` for any layout.

    Attributes (all read-only NumPy arrays):
        block_doc, block_start, block_end: int64 ``[n_blocks]``; document and document-local
            span of each block.
        block_offset: int64 ``[n_blocks]``, global token index of each block's first token.
        block_len: int64 ``[n_blocks]``.
        tile_q, tile_kv: int64 ``[n_tiles]``, block ids of each tile (same document), sorted
            by ``(tile_q, tile_kv)``.
        tile_pairs: int64 ``[n_tiles]``, visible (query, key) pairs, ``> 0``.
        tile_full: bool ``[n_tiles]``, every pair of the tile visible.
        tile_flops_fwd, tile_flops_bwd: float64 ``[n_tiles]``, FLOPs over all heads.
    """

    def __init__(self, batch: BatchSpec, block_doc: Any, block_start: Any, block_end: Any, *,
                 block_size: int | None = None):
        self.batch = batch
        self.block_size = block_size
        doc = np.asarray(block_doc, np.int64)
        start = np.asarray(block_start, np.int64)
        end = np.asarray(block_end, np.int64)
        if not (doc.ndim == start.ndim == end.ndim == 1 and len(doc) == len(start) == len(end)):
            raise ValueError("Workload: block_doc, block_start, block_end must be 1-D arrays of one length")
        if len(doc) == 0:
            raise ValueError("Workload: no blocks")
        if np.any((doc < 0) | (doc >= batch.n_docs)):
            raise ValueError(f"Workload: block_doc out of range [0, {batch.n_docs})")
        if np.any(start >= end):
            i = int(np.argmax(start >= end))
            raise ValueError(f"Workload: block {i} is empty or reversed: [{start[i]}, {end[i]})")
        order = np.lexsort((start, doc))
        doc, start, end = doc[order], start[order], end[order]
        first = np.ones(len(doc), bool)
        first[1:] = doc[1:] != doc[:-1]
        last = np.ones(len(doc), bool)
        last[:-1] = doc[1:] != doc[:-1]
        ok = np.all(start[first] == 0) and np.all(end[last] == batch.doc_lens[doc[last]])
        ok = ok and np.all(start[~first] == end[np.nonzero(~first)[0] - 1])
        ok = ok and len(np.unique(doc)) == batch.n_docs
        if not ok:
            raise ValueError("Workload: block spans must partition every document exactly (no gap, no overlap)")
        self.block_doc = _frozen(doc)
        self.block_start = _frozen(start)
        self.block_end = _frozen(end)
        self.block_len = _frozen(end - start)
        self.block_offset = _frozen(batch.cu_seqlens[doc] + start)
        tq, tkv, pairs = self._needed_tiles()
        self.tile_q = _frozen(tq)
        self.tile_kv = _frozen(tkv)
        self.tile_pairs = _frozen(pairs)
        self.tile_full = _frozen(pairs == self.block_len[tq] * self.block_len[tkv], bool)
        hd = batch.n_heads * batch.head_dim
        self.tile_flops_fwd = _frozen(pairs * float(FWD_FLOPS_PER_PAIR * hd), np.float64)
        self.tile_flops_bwd = _frozen(pairs * float(BWD_FLOPS_PER_PAIR * hd), np.float64)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def uniform(cls, batch: BatchSpec, block_size: int) -> "Workload":
        """Blocks of ``block_size`` tokens per document; the last block of a document may be
        shorter. The same batch object and block size give the same (immutable) workload
        object while it is among the last few built.

        Raises:
            ValueError: ``block_size`` is not an integer in ``1 .. MAX_TOKENS``.
        """
        block_size = check_block_size(block_size)
        key = (id(batch), int(block_size))
        hit = _UNIFORM.get(key)
        if hit is not None and hit[0]() is batch:
            _UNIFORM.move_to_end(key)
            return hit[1]
        lens = batch.doc_lens
        nb = -(-lens // block_size)
        doc = np.repeat(np.arange(batch.n_docs), nb)
        first = np.concatenate(([0], np.cumsum(nb)[:-1]))
        idx = np.arange(nb.sum()) - np.repeat(first, nb)
        start = idx * block_size
        end = np.minimum(start + block_size, lens[doc])
        wl = cls(batch, doc, start, end, block_size=int(block_size))
        _UNIFORM[key] = (weakref.ref(batch), wl)
        while len(_UNIFORM) > _UNIFORM_KEEP:
            _UNIFORM.popitem(last=False)
        return wl

    @classmethod
    def from_spans(cls, batch: BatchSpec, block_doc: Any, block_start: Any, block_end: Any) -> "Workload":
        """Blocks given as document-local spans (any sizes, any order).

        Raises:
            ValueError: the spans do not partition every document.
        """
        return cls(batch, block_doc, block_start, block_end)

    # ------------------------------------------------------------------ tiles
    def _needed_tiles(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _memo(_TILES, self.batch, (self.block_doc, self.block_start, self.block_end), self._count_tiles,
                     lambda: len(_TILES) > _TILES_KEEP or (
                         len(_TILES) > 1 and sum(len(v[1][0]) for v in _TILES.values()) > _TILES_MAX))

    def _count_tiles(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        batch = self.batch
        nb = len(self.block_doc)
        doc_nb = np.bincount(self.block_doc, minlength=batch.n_docs)
        doc_first = np.concatenate(([0], np.cumsum(doc_nb)[:-1]))
        per_q = doc_nb[self.block_doc]
        tile_q = np.repeat(np.arange(nb), per_q)
        q_first = np.concatenate(([0], np.cumsum(per_q)[:-1]))
        tile_kv = doc_first[self.block_doc][tile_q] + (np.arange(len(tile_q)) - q_first[tile_q])
        # key ranges of every token of the batch, rows grouped by block (blocks in document order:
        # the batch's token order)
        starts, ends = self._token_key_ranges()
        row_ptr = np.concatenate(([0], np.cumsum(self.block_len)))
        pairs = count_visible_pairs(starts, ends, row_ptr, tile_q, self.block_start[tile_kv], self.block_end[tile_kv])
        keep = pairs > 0
        return _frozen(tile_q[keep]), _frozen(tile_kv[keep]), _frozen(pairs[keep])

    def _token_key_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`~torch_dcp.batch.BatchSpec.key_ranges` of every token of the batch, in token
        order (shared by every block layout of the documents and masks: :data:`_KEY_RANGES`)."""
        return _memo(_KEY_RANGES, self.batch, (),
                     lambda: tuple(_frozen(a) for a in self.batch.key_ranges(*self.block_positions(
                         np.arange(self.n_blocks)))),
                     lambda: len(_KEY_RANGES) > _KEY_RANGES_KEEP)

    # ------------------------------------------------------------------ sizes
    @property
    def n_blocks(self) -> int:
        return len(self.block_doc)

    @property
    def n_tiles(self) -> int:
        return len(self.tile_q)

    def token_bytes(self) -> int:
        """Resident bytes per token of Q, K, V and O (the memory weight of a token block)."""
        return resident_token_bytes(self.batch)

    def block_bytes(self) -> np.ndarray:
        """Resident bytes of each block (Q, K, V, O), float64 ``[n_blocks]``."""
        return self.block_len * float(self.token_bytes())

    def tokens_of_blocks(self, blocks: np.ndarray) -> np.ndarray:
        """Global token indices of ``blocks`` (in the given block order), int64."""
        blocks = np.asarray(blocks, np.int64)
        return spans_to_indices(self.block_offset[blocks], self.block_len[blocks])

    def block_positions(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(doc, pos)`` of every token of ``blocks``, document-local positions, int64."""
        blocks = np.asarray(blocks, np.int64)
        pos = spans_to_indices(self.block_start[blocks], self.block_len[blocks])
        return np.repeat(self.block_doc[blocks], self.block_len[blocks]), pos

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays that define this workload (for serialisation): the block spans only;
        tiles are a deterministic function of them and the batch's masks."""
        return {
            "block_doc": self.block_doc.astype(smallest_int(self.batch.n_docs)),
            "block_start": self.block_start.astype(smallest_int(int(self.batch.doc_lens.max()))),
            "block_end": self.block_end.astype(smallest_int(int(self.batch.doc_lens.max()))),
        }

    @classmethod
    def from_arrays(cls, batch: BatchSpec, arrays: dict[str, np.ndarray], block_size: int | None = None) -> "Workload":
        """Inverse of :meth:`arrays` (tiles recomputed from the batch's masks)."""
        return cls(batch, arrays["block_doc"], arrays["block_start"], arrays["block_end"], block_size=block_size)

    def __repr__(self) -> str:
        return f"Workload(n_blocks={self.n_blocks}, n_tiles={self.n_tiles}, block_size={self.block_size})"
