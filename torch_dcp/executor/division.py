"""Index view of one ``BlockwiseAttention`` instruction (a division), for kernels that run
all its groups in one launch.

Packed layout:

* queries: the query blocks of the groups, concatenated in group order (``n_q`` rows);
* keys/values: the distinct key/value blocks the division reads, sorted by their ``kvws``
  row (``n_k`` rows).

A (query, key) pair of the packed layout is visible when the pair's tile -- (query block of
the query's group, key block) -- is one of the instruction's tiles and the batch's mask lets
the query see the key (document-local key ranges ``[start, end)``). Tiles of the same blocks
that the plan runs elsewhere are not visible here, so no pair is counted twice.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from ..masks import MaskSpec
from ..plan import BlockwiseAttention
from ..workload import Workload, spans_to_indices

__all__ = ["Division", "build_division"]


@dataclasses.dataclass(frozen=True, eq=False)
class Division:
    """All groups of one ``BlockwiseAttention`` instruction as flat index arrays (int64 NumPy).

    Attributes:
        division: the instruction's division number.
        q_rows: ``[n_q]`` ``qws`` rows of the packed queries.
        out_rows: ``[n_q]`` rows where each packed query's result goes (``opart`` forward,
            ``dqws`` backward).
        kv_rows: ``[n_k]`` ``kvws`` (and ``dkvws``) rows of the packed keys/values.
        q_ptr: ``[G + 1]``; group ``g`` owns packed query rows ``q_ptr[g]:q_ptr[g+1]``.
        k_ptr: ``[J + 1]``; distinct key block ``j`` owns packed key rows ``k_ptr[j]:k_ptr[j+1]``.
        q_group: ``[n_q]`` group of each packed query; k_block: ``[n_k]`` distinct key block
            index ``j`` of each packed key.
        tile_group, tile_key: ``[n_tiles]`` ``(g, j)`` of each tile; tile_full: bool
            ``[n_tiles]``, every pair of the tile visible.
        q_doc: ``[n_q]`` document of each packed query (a tile pairs blocks of one document);
            k_doc: ``[n_k]`` the same for the keys.
        q_pos: ``[n_q]`` document-local position of each packed query; k_pos: ``[n_k]`` the
            same for the keys.
        key_starts, key_ends: ``[n_q, R]`` document-local key ranges ``[start, end)`` of each
            packed query (``R`` = the batch's widest mask; unused ranges are empty).
        mask: the mask spec of every document of the division's queries, or None when they
            have different ones.
    """

    division: int
    q_rows: np.ndarray
    out_rows: np.ndarray
    kv_rows: np.ndarray
    q_ptr: np.ndarray
    k_ptr: np.ndarray
    q_group: np.ndarray
    k_block: np.ndarray
    tile_group: np.ndarray
    tile_key: np.ndarray
    tile_full: np.ndarray
    q_doc: np.ndarray
    k_doc: np.ndarray
    q_pos: np.ndarray
    k_pos: np.ndarray
    key_starts: np.ndarray
    key_ends: np.ndarray
    mask: MaskSpec | None = None

    @property
    def n_q(self) -> int:
        return len(self.q_rows)

    @property
    def n_k(self) -> int:
        return len(self.kv_rows)

    @property
    def n_groups(self) -> int:
        return len(self.q_ptr) - 1

    @property
    def n_key_blocks(self) -> int:
        return len(self.k_ptr) - 1

    def reachable(self) -> np.ndarray:
        """bool ``[G, J]``: key block ``j`` is of group ``g``'s document and meets the hull of
        one of its queries' key ranges (a superset of the pairs with a visible pair: where this
        is False, the mask hides every pair)."""
        kb_lo = self.k_pos[self.k_ptr[:-1]]
        kb_hi = self.k_pos[self.k_ptr[1:] - 1] + 1
        nonempty = self.key_starts < self.key_ends
        big = np.iinfo(np.int64).max
        lo = np.minimum.reduceat(np.where(nonempty, self.key_starts, big), self.q_ptr[:-1], axis=0)  # [G, R]
        hi = np.maximum.reduceat(np.where(nonempty, self.key_ends, -1), self.q_ptr[:-1], axis=0)
        meets = ((kb_lo[None, :, None] < hi[:, None, :]) & (kb_hi[None, :, None] > lo[:, None, :])).any(-1)
        return meets & (self.q_doc[self.q_ptr[:-1]][:, None] == self.k_doc[self.k_ptr[:-1]][None, :])

    def tile_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """``(present, full)``: bool ``[G, J]``, tile ``(g, j)`` is in the division / is full."""
        present = np.zeros((self.n_groups, self.n_key_blocks), bool)
        full = np.zeros_like(present)
        present[self.tile_group, self.tile_key] = True
        full[self.tile_group, self.tile_key] = self.tile_full
        return present, full


def build_division(ins: BlockwiseAttention, workload: Workload) -> Division:
    """The :class:`Division` of ``ins`` (vectorised; no per-token Python loop).

    Raises:
        ValueError: the instruction reads one key/value workspace row for two different blocks.
    """
    blen = workload.block_len
    qlen = blen[ins.q_block]
    q_ptr = np.concatenate(([0], np.cumsum(qlen))).astype(np.int64)
    q_rows = spans_to_indices(ins.q_row, qlen)
    out_rows = spans_to_indices(ins.out_row, qlen)
    q_group = np.repeat(np.arange(len(ins.q_block), dtype=np.int64), qlen)

    uniq_row, first, inv = np.unique(ins.kv_row, return_index=True, return_inverse=True)
    kblocks = ins.kv_block[first]
    if len(np.unique(ins.kv_block)) != len(uniq_row):
        raise ValueError(f"division {ins.division}: key/value blocks and kvws rows do not match one to one")
    klen = blen[kblocks]
    k_ptr = np.concatenate(([0], np.cumsum(klen))).astype(np.int64)
    kv_rows = spans_to_indices(uniq_row, klen)
    k_block = np.repeat(np.arange(len(uniq_row), dtype=np.int64), klen)

    tile_group = np.repeat(np.arange(len(ins.q_block), dtype=np.int64), np.diff(ins.kv_ptr))
    tile_key = np.asarray(inv, np.int64).reshape(-1)
    q_doc, q_pos = workload.block_positions(ins.q_block)
    k_doc, k_pos = workload.block_positions(kblocks)
    starts, ends = workload.batch.key_ranges(q_doc, q_pos)
    mask_ids = np.unique(workload.batch.doc_mask[np.unique(q_doc)])
    mask = workload.batch.masks[int(mask_ids[0])] if len(mask_ids) == 1 else None
    return Division(
        division=int(ins.division), q_rows=q_rows, out_rows=out_rows, kv_rows=kv_rows, q_ptr=q_ptr, k_ptr=k_ptr,
        q_group=q_group, k_block=k_block, tile_group=tile_group, tile_key=tile_key,
        tile_full=np.asarray(workload.tile_full[ins.tile], bool), q_doc=q_doc, k_doc=k_doc, q_pos=q_pos, k_pos=k_pos,
        key_starts=starts, key_ends=ends, mask=mask,
    )
