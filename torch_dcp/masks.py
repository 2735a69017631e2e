"""Attention mask specifications for documents of a packed batch.

Every mask is defined on positions local to one document: query ``i`` may see key ``j``
(both in ``[0, length)``) when the mask says so. A mask never lets a token see another
document; document boundaries are added by :class:`torch_dcp.BatchSpec`.

Each mask describes, for any query position, a small set of disjoint half-open key ranges
``[start, end)`` (sorted, padded with empty ranges). Everything else is derived from those
ranges with vectorised NumPy:

* :meth:`MaskSpec.key_ranges` -- the key ranges of a span of queries, ``[n, R]`` arrays;
* :meth:`MaskSpec.classify` -- the class (empty / partial / full) of any tiles
  ``(query span) x (key span)`` with their exact number of visible (query, key) pairs;
* :meth:`MaskSpec.dense` -- the dense boolean mask, for references and tests.

The masks with parameters follow the DCP paper (Jiang et al., "DCP: Addressing Input
Dynamism In Long-Context Training via Dynamic Context Parallelism", arXiv 2510.10620,
§7.1 and figure 6); their defaults are the paper's.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

__all__ = [
    "MaskSpec",
    "Causal",
    "Full",
    "Lambda",
    "BlockwiseCausal",
    "SharedQuestion",
    "Ranges",
    "TILE_EMPTY",
    "TILE_PARTIAL",
    "TILE_FULL",
    "count_visible_pairs",
    "mask_from_dict",
]

TILE_EMPTY = 0
TILE_PARTIAL = 1
TILE_FULL = 2


def count_visible_pairs(
    starts: np.ndarray,
    ends: np.ndarray,
    row_ptr: np.ndarray,
    tile_group: np.ndarray,
    key_start: np.ndarray,
    key_end: np.ndarray,
) -> np.ndarray:
    """Exact number of visible (query, key) pairs of many tiles, fully vectorised.

    Query rows are grouped into contiguous row groups (``row_ptr``, CSR: group ``g`` owns
    rows ``row_ptr[g]:row_ptr[g+1]``). Row ``i`` sees the keys in the disjoint ranges
    ``[starts[i, r], ends[i, r])``. Tile ``t`` is the rows of group ``tile_group[t]`` against
    keys ``[key_start[t], key_end[t])``.

    With ``F(g, x) = sum over rows of g, ranges r of |[s, e) ∩ [0, x)|
    = sum (x - s)^+ - (x - e)^+``, the count of tile ``t`` is
    ``F(g, key_end) - F(g, key_start)``. ``F`` is evaluated for all tiles at once with one
    sort of the range bounds keyed by group and prefix sums, so the cost is
    ``O(N R log(N R) + n_tiles log(N R))`` whatever the mask.

    Args:
        starts, ends: int arrays ``[N, R]``; ranges of one row must be disjoint; empty ranges
            have ``start == end``.
        row_ptr: int array ``[G + 1]``, nondecreasing, ``row_ptr[0] == 0``, ``row_ptr[-1] == N``.
        tile_group, key_start, key_end: int arrays ``[n_tiles]``.

    Returns:
        int64 array ``[n_tiles]`` of visible pairs.
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    row_ptr = np.asarray(row_ptr, dtype=np.int64)
    tile_group = np.asarray(tile_group, dtype=np.int64)
    key_start = np.asarray(key_start, dtype=np.int64)
    key_end = np.asarray(key_end, dtype=np.int64)
    n_rows, n_ranges = starts.shape
    n_groups = len(row_ptr) - 1
    if len(tile_group) == 0:
        return np.zeros(0, dtype=np.int64)
    top = 1
    for arr in (ends, key_end, starts):
        if arr.size:
            top = max(top, int(arr.max()) + 1)
    stride = top + 1
    row_group = np.repeat(np.arange(n_groups, dtype=np.int64), np.diff(row_ptr))
    base = np.repeat(row_group * stride, n_ranges)

    group_key = tile_group * stride

    def prefix_eval(bounds: np.ndarray):
        # x -> sum over bounds b of group g with b < x of (x - b); one sort per bounds array
        vals = bounds.reshape(-1)
        order = np.argsort(base + vals, kind="stable")
        keys = (base + vals)[order]
        csum = np.concatenate(([0], np.cumsum(vals[order])))
        lo = np.searchsorted(keys, group_key, side="left")

        def at(x: np.ndarray) -> np.ndarray:
            hi = np.searchsorted(keys, group_key + x, side="left")
            return (hi - lo) * x - (csum[hi] - csum[lo])
        return at

    from_starts, from_ends = prefix_eval(starts), prefix_eval(ends)

    def f(x: np.ndarray) -> np.ndarray:
        return from_starts(x) - from_ends(x)

    return f(key_end) - f(key_start)


class MaskSpec(ABC):
    """Base class of attention masks; positions are local to one document.

    Subclasses implement :meth:`_ranges`; everything else derives from it.

    Attributes:
        n_ranges: the most key ranges any query has (the width ``R`` of range arrays).
        is_causal: True when no query ever sees a later key (``j <= i`` always holds).
    """

    n_ranges: int = 1
    is_causal: bool = True

    @abstractmethod
    def _ranges(self, pos: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Key ranges of queries at ``pos`` in documents of ``length`` (arrays ``[n]``).

        Returns ``(starts, ends)``, int64 ``[n, n_ranges]``; disjoint, sorted, empty ranges
        have ``start == end``.
        """

    # ------------------------------------------------------------------ derived API
    def key_ranges(
        self, length: int, q_start: int = 0, q_end: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Key ranges of the queries ``[q_start, q_end)`` of a document of ``length`` tokens.

        Returns:
            ``(starts, ends)``: int64 arrays ``[q_end - q_start, n_ranges]``; query ``q_start + n``
            sees keys ``[starts[n, r], ends[n, r])`` for every ``r``.

        Raises:
            ValueError: the span leaves the document, or the mask does not fit ``length``.
        """
        length = int(length)
        q_end = length if q_end is None else int(q_end)
        q_start = int(q_start)
        if not 0 <= q_start <= q_end <= length:
            raise ValueError(
                f"query span [{q_start}, {q_end}) is outside a document of length {length}"
            )
        self.check_length(length)
        pos = np.arange(q_start, q_end, dtype=np.int64)
        return self._ranges(pos, np.full_like(pos, length))

    def ranges_at(self, pos: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Key ranges of queries at positions ``pos`` of documents of lengths ``length``.

        Vectorised over many documents at once. ``pos``, ``length``: int arrays ``[n]``.
        Returns int64 ``(starts, ends)`` of shape ``[n, n_ranges]``.
        """
        pos = np.asarray(pos, dtype=np.int64)
        length = np.asarray(length, dtype=np.int64)
        return self._ranges(pos, length)

    def check_length(self, length: int) -> None:
        """Raise ``ValueError`` when this mask cannot apply to a document of ``length``."""
        if int(length) <= 0:
            raise ValueError(f"document length must be positive, got {length}")

    def classify(
        self,
        length: int,
        q_start: Sequence[int] | np.ndarray,
        q_end: Sequence[int] | np.ndarray,
        k_start: Sequence[int] | np.ndarray,
        k_end: Sequence[int] | np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Class and exact visible-pair count of tiles of one document.

        Tile ``t`` is queries ``[q_start[t], q_end[t])`` against keys ``[k_start[t], k_end[t])``.

        Returns:
            ``(kind, count)``: int8 ``[n]`` with ``TILE_EMPTY``/``TILE_PARTIAL``/``TILE_FULL``, and
            int64 ``[n]`` visible pairs.

        Raises:
            ValueError: a span leaves the document.
        """
        length = int(length)
        self.check_length(length)
        qs, qe, ks, ke = (np.atleast_1d(np.asarray(a, dtype=np.int64)) for a in (q_start, q_end, k_start, k_end))
        for name, a, b in (("query", qs, qe), ("key", ks, ke)):
            if np.any(a < 0) or np.any(b > length) or np.any(a > b):
                raise ValueError(f"a {name} span leaves the document of length {length}")
        spans, inverse = np.unique(np.stack([qs, qe], axis=1), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        span_len = spans[:, 1] - spans[:, 0]
        row_ptr = np.concatenate(([0], np.cumsum(span_len)))
        pos = np.repeat(spans[:, 0] - row_ptr[:-1], span_len) + np.arange(row_ptr[-1])
        starts, ends = self._ranges(pos, np.full_like(pos, length))
        count = count_visible_pairs(starts, ends, row_ptr, inverse, ks, ke)
        kind = np.where(count == 0, TILE_EMPTY, np.where(count == (qe - qs) * (ke - ks), TILE_FULL, TILE_PARTIAL))
        return kind.astype(np.int8), count

    def dense(self, length: int) -> np.ndarray:
        """Dense mask of a document: bool ``[length, length]``, ``[i, j]`` true when query ``i``
        sees key ``j``."""
        starts, ends = self.key_ranges(length)
        j = np.arange(int(length))[None, :, None]
        return np.any((j >= starts[:, None, :]) & (j < ends[:, None, :]), axis=2)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-able description; inverse of :func:`mask_from_dict`."""
        return {"type": type(self).__name__, **dataclasses.asdict(self)}  # type: ignore[call-overload]


def _causal_end(pos: np.ndarray) -> np.ndarray:
    return pos + 1


@dataclasses.dataclass(frozen=True)
class Causal(MaskSpec):
    """Query ``i`` sees keys ``j <= i``."""

    n_ranges = 1
    is_causal = True

    def _ranges(self, pos, length):
        return np.zeros((len(pos), 1), np.int64), _causal_end(pos)[:, None]


@dataclasses.dataclass(frozen=True)
class Full(MaskSpec):
    """Every query of a document sees every key of it (bidirectional attention)."""

    n_ranges = 1
    is_causal = False

    def _ranges(self, pos, length):
        return np.zeros((len(pos), 1), np.int64), np.asarray(length, np.int64)[:, None].copy()


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def _sink_and_window(pos: np.ndarray, sink_end: int, window_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal ranges ``[0, sink_end)`` and ``[window_start, pos]``, made disjoint (the window
    starts at or after the sink)."""
    end = pos + 1
    s1 = np.minimum(np.maximum(sink_end, window_start), end)
    return np.stack([np.zeros_like(pos), s1], axis=1), np.stack([np.minimum(sink_end, end), end], axis=1)


@dataclasses.dataclass(frozen=True)
class Lambda(MaskSpec):
    """λ-shaped mask (attention sink + sliding window), DCP paper §7.1.

    Query ``i`` sees key ``j`` when ``j <= i`` and (``j < sink`` or ``j > i - window``).
    Defaults: 64 sink tokens, window 4096.
    """

    sink: int = 64
    window: int = 4096
    n_ranges = 2
    is_causal = True

    def __post_init__(self):
        _check_int("Lambda", "sink", self.sink, 0)
        _check_int("Lambda", "window", self.window, 1)

    def _ranges(self, pos, length):
        return _sink_and_window(pos, self.sink, pos - self.window + 1)


@dataclasses.dataclass(frozen=True)
class BlockwiseCausal(MaskSpec):
    """Causal-blockwise mask, DCP paper §7.1 (figure 6c).

    Query ``i`` sees key ``j`` when ``j <= i`` and (``j // block < sink_blocks`` or
    ``i // block - j // block < window_blocks``). Defaults: block 256, window 2 blocks,
    1 sink block.
    """

    block: int = 256
    window_blocks: int = 2
    sink_blocks: int = 1
    n_ranges = 2
    is_causal = True

    def __post_init__(self):
        _check_int("BlockwiseCausal", "block", self.block, 1)
        _check_int("BlockwiseCausal", "window_blocks", self.window_blocks, 1)
        _check_int("BlockwiseCausal", "sink_blocks", self.sink_blocks, 0)

    def _ranges(self, pos, length):
        return _sink_and_window(pos, self.sink_blocks * self.block, (pos // self.block - self.window_blocks + 1) * self.block)


@dataclasses.dataclass(frozen=True)
class SharedQuestion(MaskSpec):
    """Shared-question mask (one question, several answers), DCP paper §7.1 (figure 6d).

    The first ``round(question_frac * L)`` tokens (round half to even, as Python's ``round``)
    are the question; the rest is split into ``n_answers`` answers as evenly as possible,
    earlier answers one token longer. Question tokens are causal among themselves; an answer
    token sees the whole question and, causally, its own answer only. Defaults: question 20%
    of the document, 4 answers.
    """

    question_frac: float = 0.2
    n_answers: int = 4
    n_ranges = 2
    is_causal = True

    def __post_init__(self):
        if not (isinstance(self.question_frac, (int, float)) and 0.0 <= float(self.question_frac) <= 1.0):
            raise ValueError(
                f"SharedQuestion.question_frac must be a number in [0, 1], got {self.question_frac!r}"
            )
        _check_int("SharedQuestion", "n_answers", self.n_answers, 1)

    def question_length(self, length: np.ndarray | int) -> np.ndarray:
        """Question tokens of documents of ``length`` tokens (vectorised)."""
        return np.rint(float(self.question_frac) * np.asarray(length, dtype=np.float64)).astype(np.int64)

    def _ranges(self, pos, length):
        q_len = self.question_length(length)
        rest = length - q_len
        base = rest // self.n_answers
        extra = rest % self.n_answers
        u = pos - q_len
        long_span = extra * (base + 1)
        in_long = u < long_span
        a0_long = q_len + (u // (base + 1)) * (base + 1)
        a0_short = q_len + long_span + ((u - long_span) // np.maximum(base, 1)) * base
        a0 = np.where(in_long, a0_long, a0_short)
        end = pos + 1
        is_q = pos < q_len
        s0 = np.zeros_like(pos)
        e0 = np.where(is_q, end, q_len)
        s1 = np.where(is_q, end, a0)
        return np.stack([s0, s1], axis=1), np.stack([e0, end], axis=1)


class Ranges(MaskSpec):
    """General mask: query ``i`` sees the keys of any number of ranges ``ranges[i]``.

    ``ranges`` is either a sequence (one entry per query of the document) of sequences of
    ``(start, end)`` pairs, or a pair of int arrays ``(starts, ends)`` of shape ``[L, R]``.
    The document length is ``L = len(ranges)``. Ranges may overlap or be unordered; they are
    normalised to sorted disjoint ranges (empty ranges dropped).

    Raises:
        ValueError: a range leaves the document (``start < 0``, ``end > L`` or ``start > end``),
            or the input is malformed.
    """

    is_causal: bool

    def __init__(self, ranges: Any):
        if isinstance(ranges, tuple) and len(ranges) == 2 and all(isinstance(a, np.ndarray) for a in ranges):
            starts = np.asarray(ranges[0], dtype=np.int64)
            ends = np.asarray(ranges[1], dtype=np.int64)
            if starts.ndim != 2 or starts.shape != ends.shape:
                raise ValueError(
                    f"Ranges: starts and ends must be [L, R] arrays of one shape, got {starts.shape} and {ends.shape}"
                )
        else:
            rows = list(ranges)
            width = max((len(r) for r in rows), default=0)
            starts = np.zeros((len(rows), max(width, 1)), np.int64)
            ends = np.zeros_like(starts)
            for i, row in enumerate(rows):
                for r, pair in enumerate(row):
                    if len(pair) != 2:
                        raise ValueError(f"Ranges: query {i} has a range that is not a (start, end) pair: {pair!r}")
                    starts[i, r], ends[i, r] = int(pair[0]), int(pair[1])
        length = starts.shape[0]
        if length == 0:
            raise ValueError("Ranges: needs at least one query (got an empty list)")
        bad = (starts < 0) | (ends > length) | (starts > ends)
        if bad.any():
            i, r = np.argwhere(bad)[0]
            raise ValueError(
                f"Ranges: query {i} range ({starts[i, r]}, {ends[i, r]}) leaves the document of length {length}"
            )
        self._starts, self._ends = _normalise_ranges(starts, ends)
        self._starts.setflags(write=False)
        self._ends.setflags(write=False)
        self.length = length
        self.n_ranges = self._starts.shape[1]
        self.is_causal = bool(np.all(self._ends <= np.arange(1, length + 1)[:, None]))

    @property
    def starts(self) -> np.ndarray:
        """Normalised range starts, int64 ``[L, R]`` (read-only)."""
        return self._starts

    @property
    def ends(self) -> np.ndarray:
        """Normalised range ends, int64 ``[L, R]`` (read-only)."""
        return self._ends

    def check_length(self, length: int) -> None:
        if int(length) != self.length:
            raise ValueError(f"Ranges mask is for a document of length {self.length}, not {length}")

    def _ranges(self, pos, length):
        if np.any(np.asarray(length) != self.length):
            raise ValueError(f"Ranges mask is for a document of length {self.length}, not {np.unique(length)}")
        return self._starts[pos], self._ends[pos]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Ranges)
            and self._starts.shape == other._starts.shape
            and np.array_equal(self._starts, other._starts)
            and np.array_equal(self._ends, other._ends)
        )

    def __hash__(self) -> int:
        return hash((self.length, self._starts.tobytes(), self._ends.tobytes()))

    def __repr__(self) -> str:
        return f"Ranges(length={self.length}, n_ranges={self.n_ranges})"

    def to_dict(self) -> dict[str, Any]:
        return {"type": "Ranges", "starts": self._starts.tolist(), "ends": self._ends.tolist()}


def _normalise_ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each row's ranges, drop empty ones and merge overlapping/adjacent ones (vectorised)."""
    big = np.iinfo(np.int64).max // 4
    empty = starts >= ends
    s = np.where(empty, big, starts)
    e = np.where(empty, big, ends)
    order = np.argsort(s, axis=1, kind="stable")
    s = np.take_along_axis(s, order, axis=1)
    e = np.take_along_axis(e, order, axis=1)
    run_end = np.maximum.accumulate(e, axis=1)
    new = np.ones_like(s, dtype=bool)
    new[:, 1:] = s[:, 1:] > run_end[:, :-1]
    new &= s < big
    group = np.cumsum(new, axis=1) - 1
    width = max(int(new.sum(axis=1).max(initial=0)), 1)
    out_s = np.zeros((s.shape[0], width), np.int64)
    out_e = np.zeros_like(out_s)
    rows, cols = np.nonzero(new)
    out_s[rows, group[rows, cols]] = s[rows, cols]
    valid = s < big
    rows, cols = np.nonzero(valid)
    np.maximum.at(out_e, (rows, group[rows, cols]), run_end[rows, cols])
    # empty padding: (0, 0)
    return out_s, out_e


_MASK_TYPES = {cls.__name__: cls for cls in (Causal, Full, Lambda, BlockwiseCausal, SharedQuestion)}


def mask_from_dict(d: dict[str, Any]) -> MaskSpec:
    """Rebuild a mask from :meth:`MaskSpec.to_dict` output.

    Raises:
        ValueError: unknown mask type or bad parameters.
    """
    d = dict(d)
    kind = d.pop("type", None)
    if kind == "Ranges":
        return Ranges((np.asarray(d["starts"], np.int64), np.asarray(d["ends"], np.int64)))
    if kind not in _MASK_TYPES:
        raise ValueError(f"unknown mask type {kind!r}; expected one of {sorted(_MASK_TYPES) + ['Ranges']}")
    return _MASK_TYPES[kind](**d)


def mask_to_json(mask: MaskSpec) -> str:
    """Canonical JSON text of a mask (sorted keys)."""
    return json.dumps(mask.to_dict(), sort_keys=True, separators=(",", ":"))
