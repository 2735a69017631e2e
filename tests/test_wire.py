"""dK/dV partials on the wire in the K/V dtype (torch_dcp.executor.wire), partial outputs kept and
sent in it: what narrows and the bytes per token, the casts at both ends, bfloat16 close to the
float64 reference through node routes' reducers and relays, float64 exact (nothing cast). That
the executor moves the bytes the plan counts, bfloat16 too:
tests/test_plan.py::test_stats_match_bytes_the_executor_moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_dcp
from torch_dcp import BatchSpec, Causal, SharedQuestion
from torch_dcp.executor.wire import narrow_receives, narrow_send, narrowed
from torch_dcp.workload import Buf, item_token_bytes
from reference import assert_bf16_close, assert_emulation_exact


def test_only_dkv_narrows_and_only_below_the_accumulation_dtype():
    assert narrowed(Buf.DKV, torch.float32, torch.bfloat16) and narrowed(Buf.DKV, torch.float32, torch.float16)
    assert not narrowed(Buf.DKV, torch.float32, torch.float32) and not narrowed(Buf.DKV, torch.float64, torch.float64)
    assert not any(narrowed(k, torch.float32, torch.bfloat16) for k in (Buf.Q, Buf.KV, Buf.OPART, Buf.DQ))
    batch = BatchSpec([100], Causal(), n_heads=8, n_kv_heads=2, head_dim=64, dtype="bfloat16")
    itb = item_token_bytes(batch)
    assert itb[(True, Buf.DKV)] == itb[(True, Buf.KV)] == 2 * 2 * 64 * 2
    assert itb[(True, Buf.DQ)] == 8 * 64 * 4
    # partial outputs are kept and sent in the inputs' dtype as they are (no cast): O in bfloat16,
    # its LSE in float32
    assert itb[(False, Buf.OPART)] == 8 * 64 * 2 + 8 * 4


def test_a_send_casts_its_rows_and_receives_land_cast_in_their_rows():
    acc = torch.randn(10, 6, dtype=torch.float32)
    words = acc.view(torch.int64)  # a buffer's raw rows: 3 int64 words of 2 float32 each
    wire = narrow_send(words[2:5], torch.float32, torch.bfloat16)
    assert wire.dtype == torch.bfloat16 and torch.equal(wire, acc[2:5].bfloat16())
    dst = torch.zeros(10, 6)
    # two receives side by side (one cast), then one apart (another)
    messages, casts = narrow_receives([slice(1, 3), slice(3, 4), slice(6, 8)], dst, torch.bfloat16)
    assert [m.numel() for m in messages] == [2 * 6 * 2, 6 * 2, 2 * 6 * 2] and len(casts) == 2
    sent = torch.randn(10, 6).bfloat16()
    for m, rows in zip(messages, (slice(1, 3), slice(3, 4), slice(6, 8))):
        m.copy_(sent[rows].reshape(-1).view(torch.uint8))
    for d, s in casts:
        d.copy_(s)
    want = torch.zeros(10, 6)
    want[1:4], want[6:8] = sent[1:4].float(), sent[6:8].float()
    assert torch.equal(dst, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_returned_dkv_partials_stay_close_to_the_reference(dtype):
    """The greedy layout on 2 nodes x 2 ranks on node routes (dK/dV partials and partial outputs
    summed by a node's reducer, relayed home, under the shared-question mask): bfloat16, each
    dK/dV partial rounded once to the K/V dtype on its way and every partial output kept and sent
    in bfloat16 (merged in float32), stays within the bfloat16 bound of the float64 reference;
    float64, where nothing is cast, is exact."""
    import dataclasses

    from torch_dcp.api import divide
    from torch_dcp.planners import Routing

    batch = BatchSpec([37, 64, 23, 50], SharedQuestion(question_frac=0.25, n_answers=3), n_heads=4, n_kv_heads=2,
                      head_dim=8, dtype=dtype)
    topo = torch_dcp.Topology(n_nodes=2, ranks_per_node=2)
    greedy = torch_dcp.plan(batch, topo, planner="greedy", block_size=4).placement
    plan = divide(dataclasses.replace(greedy, routing=Routing.NODE), topo, 3)
    plan.validate()
    t = plan.tables
    node = topo.node_of
    assert np.any(node(t["ret_kv_rank"]) != node(t["ret_kv_dst"]))  # dK/dV partials cross nodes
    assert np.any(t["ret_kv_dst"] != plan.placement.block_rank[t["ret_kv_block"]])  # to a reducer or a relay
    assert np.any(node(t["ret_q_rank"]) != node(t["ret_q_dst"]))  # partial outputs cross nodes too
    if dtype == "float64":
        assert_emulation_exact(plan, batch)
    else:
        assert_bf16_close(plan, batch)


def test_received_partials_kept_in_the_kv_dtype_sum_as_cast_ones(interpret, monkeypatch):
    """The CUDA path (Triton's interpreter here): received dK/dV partials stay in the K/V dtype
    where they land, and the sums and the sends (a relay's too) read them there, converting as
    they read; no receive is cast. Through node routes' reducers and relays: the output and dQ
    as the cast path's, bit for bit, dK and dV within one bfloat16 step of them (the
    interpreter truncates where torch rounds) and within the bound of the float64 reference."""
    import dataclasses

    from torch_dcp.api import divide
    from torch_dcp.executor import executor as ex, wire
    from torch_dcp.planners import Routing
    from reference import random_qkv

    batch = BatchSpec([37, 64, 23, 50], SharedQuestion(question_frac=0.25, n_answers=3), n_heads=4, n_kv_heads=2,
                      head_dim=8, dtype="bfloat16")
    topo = torch_dcp.Topology(n_nodes=2, ranks_per_node=2)
    greedy = torch_dcp.plan(batch, topo, planner="greedy", block_size=4).placement
    plan = divide(dataclasses.replace(greedy, routing=Routing.NODE), topo, 3)
    t = plan.tables
    assert np.any(t["ret_kv_dst"] != plan.placement.block_rank[t["ret_kv_block"]])  # reducers or relays
    inputs = [x.bfloat16() for x in random_qkv(batch, torch.float64, 3)]
    cast = torch_dcp.emulate(plan, *inputs)
    sends, sums = [], []
    monkeypatch.setattr(ex, "keeps_wire", lambda t: True)
    real_send = wire.wire_send
    monkeypatch.setattr(wire, "wire_send", lambda *a: sends.append(a[3]) or real_send(*a))
    monkeypatch.setattr(wire, "narrow_receives", lambda *a: pytest.fail("a receive was cast"))
    monkeypatch.setattr(wire, "narrow_send", lambda *a: pytest.fail("a send was cast apart"))
    from torch_dcp.executor import reduce

    real = reduce._sum_in_one_launch
    monkeypatch.setattr(reduce, "_sum_in_one_launch", lambda *a: sums.append(len(a) > 6) or real(*a))
    kept = torch_dcp.emulate(plan, *inputs)
    assert sends and any(sums)
    for name, a, b in zip(("out", "dq", "dk", "dv"), kept, cast):
        if name in ("out", "dq"):
            assert torch.equal(a, b), name
        else:
            scale = b.double().abs().max().item()
            assert (a.double() - b.double()).abs().max().item() <= 2 ** -6 * scale, name
    assert_bf16_close(plan, batch)
