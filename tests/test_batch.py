"""Tests of torch_dcp.BatchSpec and torch_dcp.Topology."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_dcp import BatchSpec, Topology
from torch_dcp.batch import DTYPE_SIZES, MAX_TOKENS, canonical_dtype
from torch_dcp.masks import BlockwiseCausal, Causal, Full, Lambda, Ranges, SharedQuestion

# --------------------------------------------------------------------------- 1. construction


def test_doc_lens_and_cu_seqlens_agree():
    a = BatchSpec([5, 3, 8], Lambda(1, 2))
    b = BatchSpec(cu_seqlens=[0, 5, 8, 16], mask=Lambda(1, 2))
    assert a == b
    assert a.to_dict() == b.to_dict()
    for x in (a, b):
        assert x.n_docs == 3
        assert x.total_tokens == 16
        assert x.doc_lens.tolist() == [5, 3, 8]
        assert x.doc_lens.dtype == np.int64
        assert x.cu_seqlens.tolist() == [0, 5, 8, 16]
        assert x.cu_seqlens.dtype == np.int64
        assert x.masks == (Lambda(1, 2),)
        assert x.doc_mask.tolist() == [0, 0, 0]
        assert all(x.mask_of(d) == Lambda(1, 2) for d in range(3))


def test_array_and_tensor_inputs():
    a = BatchSpec(np.array([4, 9]))
    b = BatchSpec(cu_seqlens=torch.tensor([0, 4, 13], dtype=torch.int32))
    assert a == b
    assert a.cu_seqlens.tolist() == [0, 4, 13]
    assert a.total_tokens == 13 and a.n_docs == 2


def test_default_mask_and_heads():
    b = BatchSpec([7])
    assert b.masks == (Causal(),)
    assert b.is_causal
    assert (b.n_heads, b.n_kv_heads, b.head_dim, b.dtype) == (8, 2, 128, "bfloat16")
    mha = BatchSpec([7], n_heads=6, n_kv_heads=None)
    assert mha.n_kv_heads == 6


def test_per_document_masks_are_deduplicated():
    r = Ranges([[(0, 1)], [(0, 2)], [(1, 3)]])
    masks = [Causal(), Lambda(3, 5), Causal(), r, Lambda(3, 5), Full(), Ranges([[(0, 1)], [(0, 2)], [(2, 3), (1, 2)]])]
    lens = [10, 20, 5, 3, 17, 4, 3]
    b = BatchSpec(lens, masks)
    assert b.masks == (Causal(), Lambda(3, 5), r, Full())
    assert b.doc_mask.tolist() == [0, 1, 0, 2, 1, 3, 2]
    for d, m in enumerate(masks):
        assert b.mask_of(d) == m
    assert not b.is_causal  # Full is bidirectional
    assert BatchSpec([3, 4], [Causal(), Lambda(1, 1)]).is_causal


def test_mask_list_of_one_shared_mask():
    b = BatchSpec([3, 4, 5], [SharedQuestion(), SharedQuestion(), SharedQuestion()])
    assert b.masks == (SharedQuestion(),)
    assert b.doc_mask.tolist() == [0, 0, 0]


# --------------------------------------------------------------------------- 2. errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(doc_lens=[]), r"doc_lens.*empty batch"),
        (dict(cu_seqlens=[0]), r"cu_seqlens.*empty batch.*\[0\]"),
        (dict(doc_lens=[4, 0, 3]), r"doc_lens\[1\] must be positive, got 0"),
        (dict(doc_lens=[4, -3]), r"doc_lens\[1\] must be positive, got -3"),
        (dict(cu_seqlens=[0, 5, 5, 9]), r"cu_seqlens must be strictly increasing; document 1 has length 0"),
        (dict(cu_seqlens=[0, 5, 3]), r"cu_seqlens must be strictly increasing; document 1 has length -2"),
        (dict(cu_seqlens=[1, 5]), r"cu_seqlens must start at 0, got 1"),
        (dict(doc_lens=[3], cu_seqlens=[0, 3]), r"exactly one of doc_lens and cu_seqlens"),
        (dict(), r"exactly one of doc_lens and cu_seqlens"),
        (dict(doc_lens=[3], n_heads=8, n_kv_heads=3), r"n_kv_heads=3 must divide n_heads=8"),
        (dict(doc_lens=[3], head_dim=0), r"head_dim must be a positive integer, got 0"),
        (dict(doc_lens=[3], head_dim=-64), r"head_dim must be a positive integer, got -64"),
        (dict(doc_lens=[3], n_heads=0), r"n_heads must be a positive integer, got 0"),
        (dict(doc_lens=[3], n_kv_heads=0), r"n_kv_heads must be a positive integer, got 0"),
        (dict(doc_lens=[3], dtype="int8"), r"dtype.*'int8'"),
        (dict(doc_lens=[3], dtype="float8"), r"dtype.*'float8'"),
        (dict(doc_lens=[3], dtype=torch.int8), r"dtype.*int8"),
        (dict(doc_lens=[3, 4], mask=[Causal()]), r"mask: 1 masks for 2 documents"),
        (dict(doc_lens=[3, 4], mask=[Causal(), Causal(), Causal()]), r"mask: 3 masks for 2 documents"),
        (
            dict(doc_lens=[3, 5], mask=[Causal(), Ranges([[(0, 1)], [(0, 2)], [(0, 3)]])]),
            r"mask of document 1 \(length 5\).*Ranges mask is for a document of length 3",
        ),
        (
            dict(doc_lens=[3, 4], mask=Ranges([[(0, 1)], [(0, 2)], [(0, 3)]])),
            r"mask of document 1 \(length 4\)",
        ),
        (dict(doc_lens=[3, 4], mask=[Causal(), "causal"]), r"mask\[1\] is not a MaskSpec"),
        (dict(doc_lens=[[3, 4]]), r"doc_lens must be one-dimensional"),
        (dict(doc_lens=[3.5]), r"doc_lens must hold integers"),
    ],
)
def test_invalid_batch_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchSpec(**kwargs)


# --------------------------------------------------------------------------- 3. dtypes


@pytest.mark.parametrize(
    "dtype, name, size, acc",
    [
        ("bf16", "bfloat16", 2, "float32"),
        ("bfloat16", "bfloat16", 2, "float32"),
        (torch.bfloat16, "bfloat16", 2, "float32"),
        ("fp16", "float16", 2, "float32"),
        ("half", "float16", 2, "float32"),
        (torch.float16, "float16", 2, "float32"),
        ("fp32", "float32", 4, "float32"),
        ("float", "float32", 4, "float32"),
        (torch.float32, "float32", 4, "float32"),
        (torch.float64, "float64", 8, "float64"),
        ("fp64", "float64", 8, "float64"),
        ("double", "float64", 8, "float64"),
    ],
)
def test_dtype_aliases(dtype, name, size, acc):
    assert canonical_dtype(dtype) == name
    b = BatchSpec([4], dtype=dtype)
    assert b.dtype == name
    assert b.elem_size == size == DTYPE_SIZES[name]
    assert b.acc_dtype == acc
    assert b.acc_size == (8 if acc == "float64" else 4)


# --------------------------------------------------------------------------- 4. serialisation


def test_to_dict_round_trip_single_mask():
    b = BatchSpec([100, 7, 33], BlockwiseCausal(4, 2, 1), n_heads=12, n_kv_heads=4, head_dim=64, dtype="fp32")
    d = json.loads(json.dumps(b.to_dict()))
    back = BatchSpec.from_dict(d)
    assert back == b
    assert back.masks == (BlockwiseCausal(4, 2, 1),)
    assert (back.n_heads, back.n_kv_heads, back.head_dim, back.dtype) == (12, 4, 64, "float32")
    assert back.doc_lens.tolist() == [100, 7, 33]


def test_to_dict_round_trip_per_document_with_ranges():
    r = Ranges([[(0, 1)], [(0, 2)], [(0, 1), (2, 3)], [(3, 4), (0, 1), (1, 2)]])
    masks = [SharedQuestion(0.5, 3), r, Causal(), Full(), SharedQuestion(0.5, 3)]
    b = BatchSpec([9, 4, 6, 5, 11], masks, n_heads=4, n_kv_heads=4, head_dim=16, dtype=torch.float64)
    d = json.loads(json.dumps(b.to_dict()))
    back = BatchSpec.from_dict(d)
    assert back == b
    assert back.to_dict() == b.to_dict()
    assert back.doc_mask.tolist() == [0, 1, 2, 3, 0]
    for doc in range(b.n_docs):
        assert back.mask_of(doc) == masks[doc]
    np.testing.assert_array_equal(back.mask_of(1).dense(4), r.dense(4))
    assert back.dtype == "float64"


def test_batch_inequality():
    assert BatchSpec([3, 4]) != BatchSpec([3, 5])
    assert BatchSpec([3, 4]) != BatchSpec([3, 4], Full())
    assert BatchSpec([3, 4]) != BatchSpec([3, 4], dtype="fp16")


# --------------------------------------------------------------------------- 5. key_ranges


def _dense_from_ranges(starts, ends, L):
    j = np.arange(L)[None, :, None]
    return np.any((j >= starts[:, None, :]) & (j < ends[:, None, :]), axis=2)


def test_batch_key_ranges_match_each_mask():
    r = Ranges([[(0, 1), (2, 3)], [(0, 3)], [(1, 2)]])
    masks = [Causal(), Lambda(2, 3), BlockwiseCausal(3, 1, 1), SharedQuestion(0.25, 3), Full(), r, Causal()]
    lens = [6, 17, 10, 13, 5, 3, 1]
    b = BatchSpec(lens, masks)
    # every query of the batch, in a shuffled order (vectorised over documents and masks)
    doc = np.repeat(np.arange(len(lens)), lens)
    pos = np.concatenate([np.arange(L) for L in lens])
    perm = np.random.default_rng(1).permutation(len(doc))
    doc, pos = doc[perm], pos[perm]
    starts, ends = b.key_ranges(doc, pos)
    assert starts.shape == ends.shape == (len(doc), max(m.n_ranges for m in masks))
    assert np.all(starts <= ends)
    for d, (m, L) in enumerate(zip(masks, lens)):
        sel = np.nonzero(doc == d)[0]
        order = sel[np.argsort(pos[sel])]
        assert pos[order].tolist() == list(range(L))
        got = _dense_from_ranges(starts[order], ends[order], L)
        np.testing.assert_array_equal(got, m.dense(L), err_msg=f"document {d} {m!r}")
        assert np.all(ends[order] <= L)


def test_batch_key_ranges_subset():
    b = BatchSpec([4, 8], [Full(), Lambda(1, 2)])
    s, e = b.key_ranges(np.array([1, 0, 1]), np.array([7, 2, 0]))
    assert _dense_from_ranges(s, e, 8).tolist() == [
        [True, False, False, False, False, False, True, True],
        [True, True, True, True, False, False, False, False],
        [True, False, False, False, False, False, False, False],
    ]


# --------------------------------------------------------------------------- 6. topology


def test_topology_defaults():
    t = Topology()
    assert (t.n_nodes, t.ranks_per_node) == (4, 8)
    assert t.world_size == 32
    assert t.intra_bandwidth > t.inter_bandwidth > 0
    assert t.intra_latency >= 0 and t.inter_latency >= 0


def test_topology_node_of():
    t = Topology(n_nodes=3, ranks_per_node=4)
    assert t.node_of(0) == 0 and t.node_of(3) == 0 and t.node_of(4) == 1 and t.node_of(11) == 2
    assert isinstance(t.node_of(5), int)
    assert t.node_of(np.int64(9)) == 2
    np.testing.assert_array_equal(t.node_of(np.arange(12)), np.repeat(np.arange(3), 4))
    np.testing.assert_array_equal(t.node_of([0, 7, 8]), [0, 1, 2])


def test_topology_coerce():
    t = Topology.coerce(4)
    assert (t.n_nodes, t.ranks_per_node, t.world_size) == (1, 4, 4)
    assert t == Topology.single_node(4)
    assert Topology.coerce(np.int64(2)).world_size == 2
    custom = Topology(n_nodes=2, ranks_per_node=2)
    assert Topology.coerce(custom) is custom
    for bad in ("x", 0, -2, True, 2.0, None):
        with pytest.raises(ValueError, match="topology must be a Topology or a positive world size"):
            Topology.coerce(bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_nodes=0), r"Topology\.n_nodes must be a positive integer, got 0"),
        (dict(ranks_per_node=-1), r"Topology\.ranks_per_node must be a positive integer, got -1"),
        (dict(n_nodes=2.0), r"Topology\.n_nodes"),
        (dict(inter_bandwidth=0), r"Topology\.inter_bandwidth must be positive, got 0"),
        (dict(intra_bandwidth=-1.0), r"Topology\.intra_bandwidth must be positive"),
        (dict(intra_bandwidth=float("nan")), r"Topology\.intra_bandwidth must be positive"),
        (dict(inter_latency=-1e-6), r"Topology\.inter_latency must be >= 0"),
        (dict(intra_latency=-1.0), r"Topology\.intra_latency must be >= 0"),
    ],
)
def test_topology_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_topology_zero_latency_allowed():
    t = Topology(intra_latency=0.0, inter_latency=0)
    assert t.intra_latency == 0.0


def test_topology_dict_round_trip():
    t = Topology(n_nodes=2, ranks_per_node=3, intra_bandwidth=1e11, intra_latency=1e-6, inter_bandwidth=2e10, inter_latency=0.0)
    d = json.loads(json.dumps(t.to_dict()))
    assert Topology.from_dict(d) == t
    assert Topology.from_dict(Topology().to_dict()) == Topology()


def test_topology_from_mesh_single_rank(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    init_file = tmp_path / "pg_init"
    dist.init_process_group(backend="gloo", init_method=f"file://{init_file}", world_size=1, rank=0)
    try:
        mesh = init_device_mesh("cpu", (1,))
        t = Topology.from_mesh(mesh)
        assert t.world_size == 1
        assert (t.n_nodes, t.ranks_per_node) == (1, 1)
        # explicit ranks_per_node and links pass through; a process group works too
        t2 = Topology.from_mesh(mesh.get_group(), ranks_per_node=1, inter_latency=0.0)
        assert t2.world_size == 1 and t2.inter_latency == 0.0
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_error_messages_name_values():
    # the messages name the offending field and value, verbatim
    with pytest.raises(ValueError) as info:
        BatchSpec([3], dtype="int8")
    assert re.search(r"BatchSpec\.dtype", str(info.value)) and "'int8'" in str(info.value)
    with pytest.raises(ValueError) as info:
        BatchSpec(cu_seqlens=[2, 5])
    assert "BatchSpec.cu_seqlens" in str(info.value) and "2" in str(info.value)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=2**62), min_size=1, max_size=6))
def test_batch_token_bound(lens):
    total = sum(lens)
    if total <= MAX_TOKENS:
        assert BatchSpec(lens).total_tokens == total
    else:
        with pytest.raises(ValueError, match=f"at most {MAX_TOKENS}"):
            BatchSpec(lens)


def test_batch_bounds_named_in_errors():
    with pytest.raises(ValueError, match="at most"):
        BatchSpec([2**62] * 4)  # an int64 sum would wrap to 0
    with pytest.raises(ValueError, match="at most"):
        BatchSpec([2**40])
    assert BatchSpec([MAX_TOKENS]).total_tokens == MAX_TOKENS
