"""The one-launch copy of a pass's local inputs into its work buffers (``torch_dcp::copy_rows``)
against torch's field-by-field copies: on CPU in Triton's interpreter, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra installs it on Linux x86-64)")

from torch_dcp.executor.executor import _Buffer  # noqa: E402
from torch_dcp.executor.triton_rows import copy_rows_triton, gather_rows_triton, row_copyable  # noqa: E402


def _buffers(rows, h, hkv, d, e, acc):
    q = _Buffer(rows, [("q", e, (h, d)), ("do", e, (h, d)), ("lse", acc, (h,)), ("delta", acc, (h,))],
                torch.device("cpu"))
    kv = _Buffer(rows, [("k", e, (hkv, d)), ("v", e, (hkv, d))], torch.device("cpu"))
    for b in (q, kv):
        b.words.fill_(-1)
    return q, kv


@pytest.mark.parametrize("e,acc", [(torch.bfloat16, torch.float32), (torch.float64, torch.float64),
                                   (torch.float16, torch.float32)])
@pytest.mark.parametrize("h,hkv,d", [(8, 2, 32), (3, 3, 9)])
def test_backward_inputs_bit_for_bit(interpret, e, acc, h, hkv, d):
    """Q, dO, the LSE and K, V (five tensors, two buffers, mixed dtypes, odd sizes) into rows
    ``[0, n)``; rows past ``n`` and the ``delta`` field left as they were."""
    g = torch.Generator().manual_seed(h + d)
    n, rows = 7, 10
    q, do = (torch.randn(n, h, d, generator=g).to(e) for _ in range(2))
    k, v = (torch.randn(n + 2, hkv, d, generator=g).to(e) for _ in range(2))  # longer: only n rows copied
    lse = torch.randn(h, n, generator=g).to(acc).t()  # a strided (transposed) source: rows not dense
    assert not row_copyable(lse) and row_copyable(lse.contiguous()) and row_copyable(k[1:])
    lse = lse.contiguous()
    got, want = _buffers(rows, h, hkv, d, e, acc), _buffers(rows, h, hkv, d, e, acc)
    spans = {name: off for b in got for name, _, _, off, _ in b.spans}
    copy_rows_triton([q, do, lse, k, v], [got[0].words, got[1].words], [0, 0, 0, 1, 1],
                     [spans[f] for f in ("q", "do", "lse", "k", "v")], n)
    for t, f, b in ((q, "q", 0), (do, "do", 0), (lse, "lse", 0), (k, "k", 1), (v, "v", 1)):
        want[b].fields[f][:n].copy_(t[:n])
    for a, b in zip(got, want):
        assert torch.equal(a.words, b.words)


def test_one_buffer_and_errors(interpret):
    """The forward's Q alone into one buffer; sources, buffers and offsets that do not fit raise."""
    q = torch.randn(5, 2, 4, dtype=torch.bfloat16)
    buf, _ = _buffers(6, 2, 1, 4, torch.bfloat16, torch.float32)
    copy_rows_triton([q], [buf.words], [0], [0], 5)
    assert torch.equal(buf.fields["q"][:5], q)
    copy_rows_triton([q], [buf.words], [0], [0], 0)  # no rows: nothing
    with pytest.raises(ValueError, match="does not fit"):
        copy_rows_triton([q], [buf.words], [0], [1], 5)  # an odd byte offset
    with pytest.raises(ValueError, match="does not fit"):
        copy_rows_triton([q], [buf.words], [0], [0], 6)  # more rows than the source has
    with pytest.raises(ValueError, match="does not fit"):
        copy_rows_triton([torch.zeros(5, 3, dtype=torch.int8)], [buf.words], [0], [0], 5)  # bytes, not 16-bit words
    with pytest.raises(ValueError, match="up to 5 sources"):
        copy_rows_triton([q] * 6, [buf.words], [0] * 6, [0] * 6, 5)
    with pytest.raises(ValueError, match="out of range"):
        copy_rows_triton([q], [buf.words], [1], [0], 5)


def test_gather_rows_as_index_select(interpret):
    """Two buffers' rows by index (repeated, out of order, none) in one launch, wider rows than
    one program's block of words."""
    g = torch.Generator().manual_seed(2)
    a = torch.randint(-2 ** 62, 2 ** 62, (9, 1500), generator=g, dtype=torch.int64)
    b = torch.randint(-2 ** 62, 2 ** 62, (12, 5), generator=g, dtype=torch.int64)[:, :3]  # a row stride of 5
    for ra, rb in ((torch.tensor([3, 0, 3, 8]), torch.tensor([11, 2])), (torch.tensor([], dtype=torch.int64),
                                                                         torch.tensor([1, 1, 0, 5, 7, 9]))):
        got = gather_rows_triton(a, ra, b, rb)
        assert torch.equal(got[0], a.index_select(0, ra)) and torch.equal(got[1], b.index_select(0, rb))
    with pytest.raises(ValueError, match="int64 buffers"):
        gather_rows_triton(a.float(), torch.tensor([0]), b, torch.tensor([0]))
    with pytest.raises(ValueError, match="int64 indices"):
        gather_rows_triton(a, torch.tensor([0], dtype=torch.int32), b, torch.tensor([0]))


def test_refused_without_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="Triton is not available"):
        copy_rows_triton([torch.zeros(2, 2)], [torch.zeros(2, 2, dtype=torch.int64)], [0], [0], 2)


def test_executor_end_to_end(interpret, monkeypatch):
    """A whole forward and backward (float64, several ranks, fetches and returns) with every
    pass's local inputs copied by the one launch, and a division's query and key/value rows
    gathered by one: exact against the dense reference."""
    import torch_dcp
    from torch_dcp.executor import executor as executor_mod
    from torch_dcp.executor import triton_rows
    from test_exact import _batch, _check

    seen, gathers = [], []
    real, real_gather = triton_rows.copy_rows_triton, triton_rows.gather_rows_triton

    def spy(srcs, *args):
        seen.append(len(srcs))
        return real(srcs, *args)

    def spy_gather(*args):
        gathers.append(len(args))
        return real_gather(*args)

    monkeypatch.setattr(triton_rows, "copy_rows_triton", spy)
    monkeypatch.setattr(triton_rows, "gather_rows_triton", spy_gather)
    monkeypatch.setattr(executor_mod, "triton_runs_on", lambda t: True)
    batch = _batch("lambda", "gqa8/2-d32")
    plan = torch_dcp.plan(batch, torch_dcp.Topology(n_nodes=2, ranks_per_node=2), planner="dcp", block_size=4,
                          divisions=2, rivals=(), head_parallel=1)
    _check(plan, batch)
    assert sorted(set(seen)) == [3, 5]  # forward: Q, K, V; backward: Q, dO, the LSE, K, V
    assert gathers  # divisions whose query and key/value rows are both gathered: one launch
