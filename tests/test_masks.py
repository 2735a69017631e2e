"""Tests of torch_dcp.masks against brute-force, per-element references of each mask.

The references below are written from the mask definitions only (no library call).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_dcp.masks import (
    TILE_EMPTY,
    TILE_FULL,
    TILE_PARTIAL,
    BlockwiseCausal,
    Causal,
    Full,
    Lambda,
    Ranges,
    SharedQuestion,
    count_visible_pairs,
    mask_from_dict,
)

# --------------------------------------------------------------------------- references


def ref_causal(L):
    return lambda i, j: j <= i


def ref_full(L):
    return lambda i, j: True


def ref_lambda(sink, window):
    def make(L):
        return lambda i, j: j <= i and (j < sink or j > i - window)

    return make


def ref_blockwise(block, window_blocks, sink_blocks):
    def make(L):
        def sees(i, j):
            if j > i:
                return False
            bi, bj = i // block, j // block
            return bj < sink_blocks or bi - bj < window_blocks

        return sees

    return make


def ref_shared_question(question_frac, n_answers):
    def make(L):
        q = round(question_frac * L)  # Python round: half to even
        rest = L - q
        owner = [-1] * q  # -1: question token, else answer index
        for a in range(n_answers):
            size = rest // n_answers + (1 if a < rest % n_answers else 0)
            owner.extend([a] * size)
        assert len(owner) == L

        def sees(i, j):
            if j > i:
                return False
            if owner[i] == -1:  # question: causal among question tokens (j <= i < q)
                return True
            if owner[j] == -1:  # answer token sees the whole question
                return True
            return owner[j] == owner[i]

        return sees

    return make


def ref_ranges(rows):
    def make(L):
        assert L == len(rows)

        def sees(i, j):
            return any(s <= j < e for s, e in rows[i])

        return sees

    return make


def brute_dense(make_ref, L):
    sees = make_ref(L)
    out = np.zeros((L, L), dtype=bool)
    for i in range(L):
        for j in range(L):
            out[i, j] = bool(sees(i, j))
    return out


def brute_rows(make_ref, L, rows):
    sees = make_ref(L)
    return np.array([[bool(sees(i, j)) for j in range(L)] for i in rows], dtype=bool).reshape(len(rows), L)


def reference_of(mask, L):
    """Per-element reference predicate factory of a library mask (by its parameters)."""
    if isinstance(mask, Causal):
        return ref_causal
    if isinstance(mask, Full):
        return ref_full
    if isinstance(mask, Lambda):
        return ref_lambda(mask.sink, mask.window)
    if isinstance(mask, BlockwiseCausal):
        return ref_blockwise(mask.block, mask.window_blocks, mask.sink_blocks)
    if isinstance(mask, SharedQuestion):
        return ref_shared_question(mask.question_frac, mask.n_answers)
    raise TypeError(mask)


# --------------------------------------------------------------------------- 1. dense vs reference

SMALL_LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 13, 16, 17, 23, 31, 32, 33, 50]

SMALL_MASKS = [
    Causal(),
    Full(),
    Lambda(3, 5),
    Lambda(0, 1),
    Lambda(1, 1),
    Lambda(2, 3),
    Lambda(10, 2),
    BlockwiseCausal(4, 2, 1),
    BlockwiseCausal(3, 1, 0),
    BlockwiseCausal(1, 1, 0),
    BlockwiseCausal(5, 3, 2),
    BlockwiseCausal(2, 4, 0),
    SharedQuestion(0.2, 4),
    SharedQuestion(0.5, 3),
    SharedQuestion(0.0, 2),
    SharedQuestion(1.0, 2),
    SharedQuestion(0.3, 1),
    SharedQuestion(0.1, 7),
]


@pytest.mark.parametrize("mask", SMALL_MASKS, ids=repr)
def test_dense_matches_reference_small(mask):
    for L in SMALL_LENGTHS:
        got = mask.dense(L)
        assert got.shape == (L, L) and got.dtype == bool
        want = brute_dense(reference_of(mask, L), L)
        np.testing.assert_array_equal(got, want, err_msg=f"{mask!r} L={L}")


def test_shared_question_rounds_half_to_even():
    # 0.5 * 5 = 2.5 -> 2 question tokens; 0.5 * 7 = 3.5 -> 4 question tokens.
    m = SharedQuestion(0.5, 1)
    d5 = m.dense(5)
    assert d5[2, 0] and d5[2, 1] and d5[2, 2]  # token 2 is the first answer token: sees q
    assert not d5[1, 2]
    d7 = m.dense(7)
    assert d7[3].tolist() == [True, True, True, True, False, False, False]
    # answers 0..3 of length 2, 2, 1, 1 for rest 6 and 4 answers (earlier answers longer)
    m4 = SharedQuestion(0.0, 4)
    d = m4.dense(6)
    assert d[1, 0] and not d[2, 1] and d[3, 2] and not d[4, 3] and not d[5, 4]


@pytest.mark.parametrize(
    "mask, L",
    [
        (BlockwiseCausal(), 1100),  # 256-token blocks; 1100 is not a multiple of 256
        (BlockwiseCausal(block=100, window_blocks=3, sink_blocks=2), 777),
        (Lambda(sink=64, window=128), 500),
        (SharedQuestion(), 1003),
        (SharedQuestion(0.35, 5), 641),
    ],
    ids=repr,
)
def test_dense_matches_reference_defaults(mask, L):
    got = mask.dense(L)
    want = brute_dense(reference_of(mask, L), L)
    np.testing.assert_array_equal(got, want)


def test_lambda_paper_defaults_sampled_rows():
    # The 4096-token window only matters beyond 4096 tokens: compare sampled rows.
    mask = Lambda()
    assert (mask.sink, mask.window) == (64, 4096)
    L = 4500
    rows = [0, 1, 63, 64, 65, 2000, 4095, 4096, 4097, 4159, 4160, 4161, 4300, 4499]
    starts, ends = mask.key_ranges(L)
    j = np.arange(L)
    got = np.array([np.any((j[:, None] >= starts[i]) & (j[:, None] < ends[i]), axis=1) for i in rows])
    want = brute_rows(ref_lambda(64, 4096), L, rows)
    np.testing.assert_array_equal(got, want)
    # the sliding window really excludes middle keys of late queries
    assert not want[-1, 100] and want[-1, 63] and want[-1, 4499 - 4095]


def test_paper_defaults():
    assert BlockwiseCausal() == BlockwiseCausal(256, 2, 1)
    assert SharedQuestion() == SharedQuestion(0.2, 4)
    assert Lambda() == Lambda(64, 4096)


def test_ranges_dense_matches_reference():
    rows = [
        [(0, 1)],
        [],
        [(0, 1), (2, 3)],
        [(1, 4), (0, 2)],  # overlapping, unordered
        [(3, 5), (0, 1), (4, 6), (2, 2)],  # overlapping, unordered, empty
        [(0, 6)],
    ]
    m = Ranges(rows)
    assert m.length == 6
    np.testing.assert_array_equal(m.dense(6), brute_dense(ref_ranges(rows), 6))
    # normalised: sorted, disjoint, merged
    assert m.starts[3].tolist()[:1] == [0] and m.ends[3].tolist()[:1] == [4]
    assert not m.is_causal


# --------------------------------------------------------------------------- 2. hypothesis properties


@st.composite
def ranges_rows(draw, L):
    rows = []
    for _ in range(L):
        n = draw(st.integers(0, 4))
        row = []
        for _ in range(n):
            a = draw(st.integers(0, L))
            b = draw(st.integers(a, L))
            row.append((a, b))
        rows.append(row)
    return rows


@st.composite
def mask_and_length(draw, max_len=60):
    L = draw(st.integers(1, max_len))
    kind = draw(st.sampled_from(["causal", "full", "lambda", "blockwise", "sq", "ranges"]))
    if kind == "causal":
        m, ref = Causal(), ref_causal
    elif kind == "full":
        m, ref = Full(), ref_full
    elif kind == "lambda":
        sink, window = draw(st.integers(0, 12)), draw(st.integers(1, 25))
        m, ref = Lambda(sink, window), ref_lambda(sink, window)
    elif kind == "blockwise":
        b, w, s = draw(st.integers(1, 9)), draw(st.integers(1, 5)), draw(st.integers(0, 3))
        m, ref = BlockwiseCausal(b, w, s), ref_blockwise(b, w, s)
    elif kind == "sq":
        frac = draw(st.one_of(st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.5, 0.75, 1.0]), st.floats(0.0, 1.0)))
        n = draw(st.integers(1, 8))
        m, ref = SharedQuestion(frac, n), ref_shared_question(frac, n)
    else:
        rows = draw(ranges_rows(L))
        m, ref = Ranges(rows), ref_ranges(rows)
    return m, ref, L


@st.composite
def spans(draw, L, n):
    out = []
    for _ in range(n):
        a = draw(st.integers(0, L))
        b = draw(st.integers(a, L))
        out.append((a, b))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_classify_matches_dense(data):
    m, ref, L = data.draw(mask_and_length())
    dense = brute_dense(ref, L)
    np.testing.assert_array_equal(m.dense(L), dense)
    n = data.draw(st.integers(1, 12))
    q = data.draw(spans(L, n))
    k = data.draw(spans(L, n))
    qs, qe = [a for a, _ in q], [b for _, b in q]
    ks, ke = [a for a, _ in k], [b for _, b in k]
    kind, count = m.classify(L, qs, qe, ks, ke)
    assert kind.shape == (n,) and count.shape == (n,)
    for t in range(n):
        want = int(dense[qs[t]:qe[t], ks[t]:ke[t]].sum())
        area = (qe[t] - qs[t]) * (ke[t] - ks[t])
        assert int(count[t]) == want, (m, L, t, q[t], k[t])
        if want == 0:
            assert kind[t] == TILE_EMPTY
        elif want == area:
            assert kind[t] == TILE_FULL
        else:
            assert kind[t] == TILE_PARTIAL


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_key_ranges_reproduce_dense_rows(data):
    m, ref, L = data.draw(mask_and_length())
    a = data.draw(st.integers(0, L))
    b = data.draw(st.integers(a, L))
    starts, ends = m.key_ranges(L, a, b)
    assert starts.shape == ends.shape
    assert starts.shape[0] == b - a
    assert starts.shape[1] == m.n_ranges
    dense = brute_dense(ref, L)
    for n in range(b - a):
        row = np.zeros(L, dtype=bool)
        real = [(int(s), int(e)) for s, e in zip(starts[n], ends[n]) if e > s]
        for s, e in real:
            assert 0 <= s < e <= L
            row[s:e] = True
        np.testing.assert_array_equal(row, dense[a + n], err_msg=f"{m!r} L={L} row {a + n}")
        # nonempty ranges of a row are pairwise disjoint
        real.sort()
        for (s0, e0), (s1, e1) in zip(real, real[1:]):
            assert e0 <= s1, (m, L, a + n, real)
        # and every range is well-formed (empty ranges have start == end)
        assert all(int(s) <= int(e) for s, e in zip(starts[n], ends[n]))


def test_classify_scalar_and_empty_spans():
    m = Causal()
    kind, count = m.classify(8, 2, 5, 0, 8)
    assert count.tolist() == [3 + 4 + 5] and kind.tolist() == [TILE_PARTIAL]
    kind, count = m.classify(8, [3, 0, 4], [3, 4, 8], [0, 4, 0], [5, 8, 4])
    assert count.tolist() == [0, 0, 16]
    assert kind.tolist() == [TILE_EMPTY, TILE_EMPTY, TILE_FULL]


def test_classify_span_outside_document_raises():
    with pytest.raises(ValueError, match="query span"):
        Causal().classify(8, [0], [9], [0], [1])
    with pytest.raises(ValueError, match="key span"):
        Causal().classify(8, [0], [1], [-1], [1])
    with pytest.raises(ValueError, match="key span"):
        Causal().classify(8, [0], [1], [5], [4])


# --------------------------------------------------------------------------- 3. count_visible_pairs


@st.composite
def cvp_inputs(draw):
    n_groups = draw(st.integers(1, 5))
    sizes = [draw(st.integers(0, 5)) for _ in range(n_groups)]
    R = draw(st.integers(1, 4))
    top = draw(st.integers(1, 30))
    starts, ends = [], []
    for _ in range(sum(sizes)):
        # disjoint ranges: sorted distinct bounds paired up; then padded with empty ranges
        k = draw(st.integers(0, min(R, (top + 1) // 2)))
        bounds = sorted(draw(st.lists(st.integers(0, top), min_size=2 * k, max_size=2 * k, unique=True)))
        row = [(bounds[2 * r], bounds[2 * r + 1]) for r in range(k)]
        while len(row) < R:
            x = draw(st.integers(0, top))
            row.insert(draw(st.integers(0, len(row))), (x, x))
        row_order = draw(st.permutations(row))
        starts.append([s for s, _ in row_order])
        ends.append([e for _, e in row_order])
    row_ptr = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    n_tiles = draw(st.integers(1, 15))
    tg, ks, ke = [], [], []
    for _ in range(n_tiles):
        tg.append(draw(st.integers(0, n_groups - 1)))
        a = draw(st.integers(0, top + 3))
        ks.append(a)
        ke.append(draw(st.integers(a, top + 3)))
    st_arr = np.array(starts, np.int64).reshape(-1, R)
    en_arr = np.array(ends, np.int64).reshape(-1, R)
    return st_arr, en_arr, row_ptr, np.array(tg), np.array(ks), np.array(ke)


@settings(max_examples=200, deadline=None)
@given(inp=cvp_inputs())
def test_count_visible_pairs_brute_force(inp):
    starts, ends, row_ptr, tg, ks, ke = inp
    got = count_visible_pairs(starts, ends, row_ptr, tg, ks, ke)
    assert got.dtype == np.int64 and got.shape == tg.shape
    for t in range(len(tg)):
        g = tg[t]
        want = 0
        for i in range(row_ptr[g], row_ptr[g + 1]):
            for j in range(ks[t], ke[t]):
                want += any(starts[i, r] <= j < ends[i, r] for r in range(starts.shape[1]))
        assert int(got[t]) == want, (t, g, ks[t], ke[t])


def test_count_visible_pairs_no_tiles():
    out = count_visible_pairs(np.zeros((2, 1)), np.ones((2, 1)), [0, 2], [], [], [])
    assert out.shape == (0,)


# --------------------------------------------------------------------------- 4. errors


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Lambda(window=0), r"Lambda\.window"),
        (lambda: Lambda(sink=-1), r"Lambda\.sink"),
        (lambda: BlockwiseCausal(block=0), r"BlockwiseCausal\.block"),
        (lambda: BlockwiseCausal(window_blocks=0), r"BlockwiseCausal\.window_blocks"),
        (lambda: BlockwiseCausal(sink_blocks=-1), r"BlockwiseCausal\.sink_blocks"),
        (lambda: SharedQuestion(question_frac=1.5), r"SharedQuestion\.question_frac"),
        (lambda: SharedQuestion(question_frac=-0.1), r"SharedQuestion\.question_frac"),
        (lambda: SharedQuestion(n_answers=0), r"SharedQuestion\.n_answers"),
        (lambda: Ranges([[(0, 1)], [(0, 3)]]), r"Ranges.*leaves the document of length 2"),
        (lambda: Ranges([[(-1, 1)], [(0, 1)]]), r"Ranges.*leaves the document"),
        (lambda: Ranges([[(1, 0)], [(0, 1)]]), r"Ranges.*leaves the document"),
        (lambda: Ranges([]), r"Ranges"),
    ],
)
def test_invalid_masks_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("mask", [Causal(), Lambda(3, 5), SharedQuestion(), Full()], ids=repr)
@pytest.mark.parametrize("span", [(-1, 3), (5, 11), (6, 5)])
def test_key_ranges_outside_document_raises(mask, span):
    with pytest.raises(ValueError, match="outside a document of length 10"):
        mask.key_ranges(10, *span)


def test_ranges_mask_wrong_length_raises():
    m = Ranges([[(0, 1)], [(0, 2)], [(1, 3)]])
    np.testing.assert_array_equal(m.dense(3), [[1, 0, 0], [1, 1, 0], [0, 1, 1]])
    with pytest.raises(ValueError, match="length 3"):
        m.dense(4)
    with pytest.raises(ValueError, match="length 3"):
        m.key_ranges(2, 0, 1)
    with pytest.raises(ValueError, match="length 3"):
        m.classify(4, [0], [1], [0], [1])
    with pytest.raises(ValueError, match="length 3"):
        m.ranges_at(np.array([0]), np.array([5]))


def test_nonpositive_length_raises():
    with pytest.raises(ValueError, match="positive"):
        Causal().dense(0)


def test_mask_from_dict_unknown_type():
    with pytest.raises(ValueError, match="unknown mask type"):
        mask_from_dict({"type": "Diagonal"})


# --------------------------------------------------------------------------- 5. serialisation, is_causal

ROUND_TRIP = [
    Causal(),
    Full(),
    Lambda(),
    Lambda(3, 5),
    BlockwiseCausal(),
    BlockwiseCausal(3, 1, 0),
    SharedQuestion(),
    SharedQuestion(0.5, 3),
    Ranges([[(0, 1)], [(1, 2), (0, 1)], [(0, 3)], []]),
    Ranges((np.array([[0, 2], [1, 1]]), np.array([[1, 2], [2, 1]]))),
]


@pytest.mark.parametrize("mask", ROUND_TRIP, ids=repr)
def test_mask_dict_round_trip(mask):
    import json

    d = mask.to_dict()
    d2 = json.loads(json.dumps(d))  # JSON-able
    back = mask_from_dict(d2)
    assert type(back) is type(mask)
    assert back == mask
    assert hash(back) == hash(mask)
    L = mask.length if isinstance(mask, Ranges) else 13
    np.testing.assert_array_equal(back.dense(L), mask.dense(L))


def test_distinct_masks_compare_unequal():
    assert Lambda(3, 5) != Lambda(3, 6)
    assert Ranges([[(0, 1)], [(0, 1)]]) != Ranges([[(0, 1)], [(0, 2)]])
    assert Ranges([[(0, 1)], [(0, 2)]]) == Ranges([[(0, 1)], [(1, 2), (0, 1)]])


@pytest.mark.parametrize(
    "mask, causal",
    [
        (Causal(), True),
        (Full(), False),
        (Lambda(3, 5), True),
        (BlockwiseCausal(), True),
        (SharedQuestion(), True),
        (Ranges([[(0, 1)], [(0, 2)], [(0, 1), (2, 3)]]), True),
        (Ranges([[(0, 1)], [(0, 3)], [(0, 3)]]), False),
        (Ranges([[(1, 2)], [(0, 1)]]), False),
        (Ranges([[], []]), True),
    ],
    ids=repr,
)
def test_is_causal(mask, causal):
    assert mask.is_causal is causal
    # consistent with the dense mask when the mask is causal
    L = mask.length if isinstance(mask, Ranges) else 20
    upper = np.triu(mask.dense(L), k=1)
    assert (not upper.any()) == causal


# --------------------------------------------------------------------------- 6. vectorisation


@pytest.mark.parametrize("mask", [Causal(), Lambda(), BlockwiseCausal(), SharedQuestion()], ids=repr)
def test_classify_many_tiles_is_fast(mask):
    L = 131072
    rng = np.random.default_rng(0)
    qb = 1024
    n_q = L // qb  # 128 query blocks covering the whole document
    n_k = 160
    kcuts = np.sort(rng.choice(np.arange(1, L), n_k - 1, replace=False))
    kb = np.concatenate(([0], kcuts, [L]))
    qi, ki = np.meshgrid(np.arange(n_q), np.arange(n_k), indexing="ij")
    qi, ki = qi.ravel(), ki.ravel()
    qs, qe = qi * qb, (qi + 1) * qb
    ks, ke = kb[ki], kb[ki + 1]
    assert len(qs) >= 20000
    t0 = time.perf_counter()
    kind, count = mask.classify(L, qs, qe, ks, ke)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"classify of {len(qs)} tiles took {elapsed:.2f} s"
    # the key spans partition the document: per query block, the counts add up to the
    # number of visible pairs of those rows
    starts, ends = mask.key_ranges(L)
    row_pairs = (ends - starts).sum(axis=1)
    per_block = count.reshape(n_q, n_k).sum(axis=1)
    np.testing.assert_array_equal(per_block, row_pairs.reshape(n_q, qb).sum(axis=1))
    # spot-check some tiles against the per-element reference
    make = reference_of(mask, L)
    sees = make(L)
    for t in rng.choice(len(qs), 3, replace=False):
        q0, q1 = qs[t], min(qe[t], qs[t] + 6)  # a few rows of the tile
        k0, k1 = ks[t], ke[t]
        want = sum(sees(i, j) for i in range(q0, q1) for j in range(k0, k1))
        _, c = mask.classify(L, [q0], [q1], [k0], [k1])
        assert int(c[0]) == want
    assert set(np.unique(kind)) <= {TILE_EMPTY, TILE_PARTIAL, TILE_FULL}
    if isinstance(mask, Causal):
        # causal tiles: fully below the diagonal are full, fully above are empty
        full = ke <= qs + 1
        empty = ks >= qe
        assert np.all(kind[full] == TILE_FULL) and np.all(kind[empty] == TILE_EMPTY)
