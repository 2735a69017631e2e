"""FlexKernel (division-level FlexAttention), the merge benchmark, timed emulation and the
kernel benchmarks.

On CPU FlexAttention runs eagerly: the forward, and flex's backward op with ``recompute=False``
(PyTorch's dense implementations); FlexKernel's default CPU backward recomputes through its dense
stand-in with the same block mask and mask_mod (see torch_dcp/executor/kernels/flex.py). The tests
marked ``cuda`` run the compiled kernel, forward and backward, and skip without CUDA.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import torch_dcp
from torch_dcp import BatchSpec, Ranges
from torch_dcp.benchmarks.cli import main as bench_main
from torch_dcp.benchmarks.kernels import bench_reduce
from torch_dcp.executor import get_kernel
from torch_dcp.executor.division import build_division
from torch_dcp.executor.kernels.flex import FlexKernel, division_tiles
from torch_dcp.executor.kernels import AutoKernel, SDPAKernel
from torch_dcp.plan import BlockwiseAttention
from reference import needs_cuda, random_qkv, reference_with_grads
from test_exact import BLOCK, MASKS, _batch

cuda = needs_cuda("needs CUDA (compiled FlexAttention, bf16)")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: OpenMP barriers cost more than they save, and much more on a shared 2-core box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _check(plan, batch, kernel, tol=1e-10, backward=True, seed=0, **kw):
    q, k, v, go = random_qkv(batch, torch.float64, seed)
    ref = reference_with_grads(batch, q, k, v, go)
    got = torch_dcp.emulate(plan, q, k, v, go if backward else None, kernel=kernel, **kw)
    got = got if backward else (got,)
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, ref):
        err = (g - want).abs().max().item()
        assert err <= tol, f"{name}: max abs error {err:.3e} > {tol}"


# (planner, world size) cases; flex tiles of 8 rows so that block masks have full,
# partial and absent tiles and divisions straddle them
CASES = [("ring", 2), ("greedy", 3), ("dcp", 4), ("fcp", 8), ("megatron", 4)]


#: every mask with two of the cases, every case with two or three masks (a flex call on CPU
#: takes about a second: the full cross is 30 of them)
MASK_CASES = [(m, *CASES[(i + j) % len(CASES)]) for i, m in enumerate(MASKS) for j in (0, 2)]


@pytest.mark.parametrize("mask_name,planner,world_size", MASK_CASES)
def test_flex_exact_forward_backward(mask_name, planner, world_size):
    heads = "gqa8/2-d32" if (world_size + len(mask_name)) % 2 else "mha4-d32"
    batch = _batch(mask_name, heads)
    plan = torch_dcp.plan(batch, world_size, planner=planner, block_size=BLOCK, divisions=1 + world_size % 3)
    _check(plan, batch, FlexKernel(block_size=8))


def test_flex_default_block_size_and_forward_only():
    batch = _batch("lambda", "gqa8/2-d64")
    plan = torch_dcp.plan(batch, 3, planner="greedy", block_size=BLOCK, divisions=2)
    _check(plan, batch, "flex", backward=False)  # one 128-row flex tile per division, forward = real flex


@pytest.mark.parametrize("recompute", [True, False])
def test_flex_backward_inside_the_attention_op(recompute):
    # the op's backward runs with autograd's dispatch keys excluded; flex's recomputation must
    # still record its graph (this failed the main job on CUDA), and flex's backward op must run
    from torch_dcp.attention_op import use_executor
    from torch_dcp.executor import InProcessTransport, Mailbox, RankExecutor

    batch = BatchSpec([5, 11], torch_dcp.Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype="float32")
    plan = torch_dcp.plan(batch, 1, planner="greedy", block_size=4, divisions=2)
    ex = RankExecutor(plan, 0, InProcessTransport(Mailbox(), 0), kernel=FlexKernel(block_size=4, recompute=recompute))
    q, k, v, go = random_qkv(batch, torch.float32)
    ref = reference_with_grads(batch, q, k, v, go)
    idx = torch.from_numpy(plan.token_indices(0))
    sdpa = lambda t: t[idx].transpose(0, 1).unsqueeze(0).contiguous()  # noqa: E731
    args = [sdpa(t).requires_grad_(True) for t in (q, k, v)]
    with use_executor(ex):
        out, _, _ = torch.ops.torch_dcp.attention(*args, None)
        out.backward(sdpa(go))
    for got, want in zip(args, ref[1:]):
        assert (got.grad[0].transpose(0, 1).double() - want[idx]).abs().max().item() < 1e-5


def test_flex_mask_mod_closed_forms():
    from torch_dcp import Causal, Lambda

    for mask in (Causal(), Lambda(sink=3, window=5)):
        batch = BatchSpec([40, 23, 7], mask, n_heads=2, n_kv_heads=1, head_dim=8, dtype="float64")
        plan = torch_dcp.plan(batch, 1, planner="greedy", block_size=8, divisions=1)
        ins = next(i for i in plan.program(0).instructions if isinstance(i, BlockwiseAttention))
        static = FlexKernel(block_size=8).prepare(build_division(ins, plan.workload)).static
        assert static[-2:] == (mask, False), "one rank: closed form on two codes, no tile lookup"
        _check(plan, batch, FlexKernel(block_size=8))
    batch = _batch("shared_question", "mha4-d32")
    plan = torch_dcp.plan(batch, 3, planner="greedy", block_size=BLOCK, divisions=2)
    ins = next(i for i in plan.program(0).instructions if isinstance(i, BlockwiseAttention))
    assert FlexKernel(block_size=8).prepare(build_division(ins, plan.workload)).static[-2] is None  # ranges


def test_flex_fully_masked_rows():
    n0, n1 = 6, 9
    r0 = Ranges([[]] + [[(0, i)] for i in range(1, n0)])
    r1 = Ranges([[] for _ in range(4)] + [[(0, i + 1)] for i in range(4, n1)])
    batch = BatchSpec([n0, n1], [r0, r1], n_heads=2, n_kv_heads=1, head_dim=8, dtype="float64")
    for w in (1, 2):
        plan = torch_dcp.plan(batch, w, planner="greedy", block_size=4, divisions=2)
        _check(plan, batch, FlexKernel(block_size=4))


def _dense_mask(div):
    """Visible pairs of a division's packed layout, bool ``[n_q, n_k]``, element by element
    from its tile matrix and key ranges (the reference for the flex tiles)."""
    present, _ = div.tile_matrix()
    m = present[div.q_group][:, div.k_block]
    kp = div.k_pos[None, :, None]
    return m & ((kp >= div.key_starts[:, None, :]) & (kp < div.key_ends[:, None, :])).any(axis=2)


def test_division_layout_and_flex_tiles():
    batch = _batch("shared_question", "gqa8/2-d32")
    plan = torch_dcp.plan(batch, 3, planner="dcp", block_size=BLOCK, divisions=3)
    wl = plan.workload
    seen = np.zeros(wl.n_tiles, int)
    for rank in range(3):
        for ins in plan.program(rank).instructions:
            if not isinstance(ins, BlockwiseAttention):
                continue
            div = build_division(ins, wl)
            seen[ins.tile] += 1
            dense = _dense_mask(div)
            # the packed mask has exactly the division's visible pairs
            assert dense.sum() == wl.tile_pairs[ins.tile].sum()
            for bs in (4, 8, 16):
                full, partial = division_tiles(div, bs)
                nq, nk = full.shape
                padded = np.zeros((nq * bs, nk * bs), bool)
                padded[:div.n_q, :div.n_k] = dense
                t = padded.reshape(nq, bs, nk, bs).transpose(0, 2, 1, 3).reshape(nq, nk, -1)
                assert not (full & partial).any()
                assert not (t.any(-1) & ~(full | partial)).any(), "a tile with visible pairs is missing"
                assert t[full].all(), "a tile marked full has masked pairs"
    assert (seen == 1).all()  # every tile in exactly one division


def test_cpu_backward_stand_in_matches_flex_forward():
    # the CPU backward recomputes the partial forward densely; it must be flex's forward
    batch = _batch("ranges", "gqa8/2-d32")
    plan = torch_dcp.plan(batch, 2, planner="greedy", block_size=BLOCK, divisions=2)
    kern = FlexKernel(block_size=8)
    g = torch.Generator().manual_seed(0)
    for ins in plan.program(0).instructions:
        if isinstance(ins, BlockwiseAttention):
            div = build_division(ins, plan.workload)
            layout = kern.prepare(div)
            meta = kern.bind({k: torch.from_numpy(a) for k, a in layout.arrays.items()}, layout.static)
            q = torch.randn(1, 8, layout.q_rows, 32, generator=g, dtype=torch.float64)
            k, v = (torch.randn(1, 2, layout.k_rows, 32, generator=g, dtype=torch.float64) for _ in range(2))
            o1, l1 = kern._flex(q, k, v, meta, 0.2)
            o2, l2 = kern._dense(q, k, v, meta, 0.2)
            assert torch.equal(torch.isinf(l1), torch.isinf(l2))
            assert (o1 - o2).abs().max() < 1e-12
            fin = torch.isfinite(l1)
            assert (l1[fin] - l2[fin]).abs().max() < 1e-12


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_flex_backward_without_recompute_exact(mask_name):
    # flex's backward op with the final LSE, nothing recomputed (the CUDA default; on CPU the
    # recomputing backward is the default, exact in every case above)
    import torch_dcp.executor.kernels.flex as flex_mod

    heads = "gqa8/2-d32" if len(mask_name) % 2 else "mha4-d32"
    batch = _batch(mask_name, heads)
    plan = torch_dcp.plan(batch, 3, planner="dcp", block_size=BLOCK, divisions=3)
    _check(plan, batch, FlexKernel(block_size=8, recompute=False))
    assert flex_mod._DIRECT_BACKWARD.get("cpu") is True  # the op ran: no fallback


def test_flex_backward_op_traces_under_torch_compile(monkeypatch):
    # the CUDA path compiles the forward and the backward op; inductor has no CPU lowering of
    # flex's backward, so dynamo and AOTAutograd trace both here (backend "aot_eager"): the call,
    # its score-mod graphs and block mask go through torch.compile as they do on CUDA
    import torch_dcp.executor.kernels.flex as flex_mod

    monkeypatch.setattr(flex_mod, "_DIRECT_BACKWARD", {})
    monkeypatch.setitem(flex_mod._COMPILED, "flex", torch.compile(flex_mod.flex_attention, backend="aot_eager"))
    monkeypatch.setitem(flex_mod._COMPILED, "backward", torch.compile(flex_mod._backward_op, backend="aot_eager"))
    batch = _batch("lambda", "gqa8/2-d32")
    plan = torch_dcp.plan(batch, 2, planner="greedy", block_size=BLOCK, divisions=1)
    _check(plan, batch, FlexKernel(block_size=8, compile=True, recompute=False))
    assert flex_mod._DIRECT_BACKWARD.get("cpu") is True  # the compiled op ran: no fallback


def _compiled_variants(kernel):
    """Two masks through ``kernel``'s forward: different closed forms, so two compiled variants
    of flex (Dynamo's caches emptied before and after: they live on flex's code object). The
    compiled backward op takes its variants through the same limit (the test above traces it)."""
    torch._dynamo.reset()
    try:
        for mask in ("causal", "lambda"):
            batch = _batch(mask, "gqa8/2-d32")
            _check(torch_dcp.plan(batch, 2, planner="greedy", block_size=BLOCK, divisions=1), batch, kernel,
                   backward=False)
    finally:
        torch._dynamo.reset()


def test_compiled_flex_keeps_its_variants_past_a_low_global_recompile_limit(monkeypatch):
    # Dynamo's default limit (8 variants of one function) was hit on an H200 by the CUDA tests of
    # several masks in one process: flex then ran uncompiled (dense scores, a host synchronisation
    # caught by sync debug mode). Here the process limit is 1 and hitting it fails loudly: the
    # kernel's own limit must let both masks compile
    import torch_dcp.executor.kernels.flex as flex_mod

    monkeypatch.setattr(flex_mod, "_COMPILED", {})
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        _compiled_variants(FlexKernel(block_size=8, compile="eager", recompute=False))


def test_compiled_flex_past_its_recompile_limit_stops_with_the_setting_to_raise(monkeypatch):
    import torch_dcp.executor.kernels.flex as flex_mod

    monkeypatch.setattr(flex_mod, "_COMPILED", {})
    monkeypatch.setattr(flex_mod, "RECOMPILE_LIMIT", 1)
    with torch._dynamo.config.patch(recompile_limit=1):
        with pytest.raises(RuntimeError, match=r"flex:eager hit its recompile limit \(1 variants.*"
                                               r"torch._dynamo.config.recompile_limit"):
            _compiled_variants(FlexKernel(block_size=8, compile="eager", recompute=False))


def test_flex_backward_falls_back_once_when_the_op_fails(monkeypatch):
    import torch_dcp.executor.kernels.flex as flex_mod

    def broken(*args, **kwargs):
        raise TypeError("flex_attention_backward() takes 13 positional arguments")

    monkeypatch.setattr(flex_mod, "_flex_backward_op", broken)
    monkeypatch.setattr(flex_mod, "_DIRECT_BACKWARD", {})
    batch = _batch("causal", "mha4-d32")
    plan = torch_dcp.plan(batch, 2, planner="greedy", block_size=BLOCK, divisions=2)
    with pytest.warns(RuntimeWarning, match="backward op failed on cpu .*TypeError.*recomputes") as rec:
        _check(plan, batch, FlexKernel(block_size=8, recompute=False))
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1  # once per device type
    assert flex_mod._DIRECT_BACKWARD == {"cpu": False}


def test_flex_float32_and_bfloat16_inputs_on_cpu():
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 3e-2)):
        batch = _batch("causal", "gqa8/2-d32", dtype=dtype)
        plan = torch_dcp.plan(batch, 2, planner="greedy", block_size=BLOCK, divisions=2)
        tdt = getattr(torch, dtype)
        q, k, v, go = random_qkv(batch, tdt)
        got = torch_dcp.emulate(plan, q, k, v, go, kernel=FlexKernel(block_size=8))
        for a, b in zip(got, reference_with_grads(batch, q, k, v, go)):
            assert a.dtype == tdt
            assert (a.double() - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def test_get_kernel_names_and_auto():
    assert isinstance(get_kernel("flex"), FlexKernel)
    assert isinstance(get_kernel("auto", device="cpu"), SDPAKernel)
    assert isinstance(get_kernel(None), SDPAKernel)
    auto = get_kernel("auto", device="cuda")  # constructing needs no GPU
    assert auto.name == "auto" and isinstance(auto.general, FlexKernel) and auto.fast is None  # no dtype: no varlen
    batch = _batch("causal", "mha4-d32")
    plan = torch_dcp.plan(batch, 2, block_size=BLOCK)
    ex = torch_dcp.RankExecutor(plan, 0, torch_dcp.executor.InProcessTransport(torch_dcp.executor.Mailbox(), 0))
    assert ex.kernel is None
    with pytest.raises(ValueError, match="unknown kernel"):
        torch_dcp.RankExecutor(plan, 0, torch_dcp.executor.InProcessTransport(torch_dcp.executor.Mailbox(), 0),
                               kernel="tree")


# ---------------------------------------------------------------------- the merge benchmark
def test_bench_reduce_runs_small():
    res = bench_reduce(tokens=256, heads=2, head_dim=8, partials=3, block=32, device="cpu", repeat=1, copy_mb=1)
    assert res["max_abs_diff"] < 1e-5
    assert res["loop_s"] > 0 and res["fused_s"] > 0 and res["bandwidth"] > 0 and res["limit_s"] > 0


# ---------------------------------------------------------------------- timings and the efficiency table
def test_timed_emulation():
    batch = _batch("causal", "gqa8/2-d32")
    plan = torch_dcp.plan(batch, 3, planner="greedy", block_size=BLOCK, divisions=3)
    q, k, v, go = random_qkv(batch)
    (out, dq, dk, dv), times = torch_dcp.emulate(plan, q, k, v, go, timings=True)
    assert torch.equal(out, torch_dcp.emulate(plan, q, k, v))
    out2, times2 = torch_dcp.emulate(plan, q, k, v, timings=True)
    assert torch.equal(out2, out) and set(times2) == {0, 1, 2}
    assert set(times) == {0, 1, 2}
    for r, ts in times.items():
        kinds = {t.kind for t in ts}
        assert {"copy", "attention", "reduction"} <= kinds <= {"copy", "pack", "attention", "unpack", "reduction"}
        assert all(t.seconds >= 0 and 0 <= t.division < plan.divisions for t in ts)
        assert all(t.seconds < 5 for t in ts)
        n_attn = sum(isinstance(i, BlockwiseAttention) for p in (False, True) for i in plan.program(r, p).instructions)
        assert sum(t.kind == "attention" for t in ts) == n_attn
        assert {t.backward for t in ts} == {False, True}
        assert not any(t.backward for t in times2[r])


def test_efficiency_table_json(tmp_path, capsys):
    out = tmp_path / "table.json"
    rc = bench_main(["kernels", "table", "--out", str(out), "--tokens", "16,32", "--head-dims", "16", "--heads",
                     "2", "--kv-heads", "1", "--kernel", "sdpa", "--device", "cpu", "--repeat", "1", "--copy-mb", "1"])
    assert rc == 0
    text = out.read_text()
    cm = torch_dcp.CostModel.from_json(text)
    assert cm.kernel.tokens == (16.0, 32.0)
    assert cm.memory_bandwidth > 0 and cm.launch_overhead > 0
    assert min(cm.kernel.fwd_full + cm.kernel.bwd_causal) > 0
    assert json.loads(text)["meta"]["kernel"] == "sdpa"
    assert "TFLOP/s" in capsys.readouterr().out


def test_division_and_plan_benchmarks_run_small():
    from torch_dcp.benchmarks.kernels import bench_division, bench_plan

    res = bench_division([96, 40], block=32, heads=2, kv_heads=1, head_dim=16, kernel="flex", device="cpu", repeat=1)
    assert res["useful_pairs"] == 96 * 97 // 2 + 40 * 41 // 2
    assert res["division_fwd_s"] > 0 and res["dense_fwd_s"] > 0 and res["fwd_ratio"] > 0
    assert res["dense_bwd_s"] != res["dense_bwd_s"]  # no flex backward on CPU: reported as NaN
    rec = bench_division([96, 40], block=32, heads=2, kv_heads=1, head_dim=16, kernel="flex", device="cpu", repeat=1,
                         flex_recompute=True)
    assert rec["useful_pairs"] == res["useful_pairs"] and rec["division_bwd_s"] > 0
    with pytest.raises(ValueError, match="flex_recompute needs kernel='flex'"):
        bench_division([96], block=32, kernel="sdpa", device="cpu", flex_recompute=True)
    out = bench_plan("greedy", tokens=1024, nodes=1, ranks_per_node=2, block=128, cost="a100", device="cpu")
    assert out["world_size"] == 2 and len(out["fwd_measured_s"]) == 2
    assert all(x > 0 for x in out["fwd_measured_s"] + out["bwd_predicted_s"])
    assert out["fwd_ratio_min"] <= out["fwd_ratio_median"] <= out["fwd_ratio_max"]


# ---------------------------------------------------------------------- CUDA only
@cuda
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_flex_cuda_compiled_bf16(mask_name):
    batch = _batch(mask_name, "gqa8/2-d64", dtype="bfloat16")
    plan = torch_dcp.plan(batch, 4, planner="dcp", block_size=BLOCK, divisions=3)
    q, k, v, go = (t.cuda() for t in random_qkv(batch, torch.bfloat16))
    auto = get_kernel("auto", device="cuda")  # no dtype given: flex for every division, no varlen path
    assert isinstance(auto, AutoKernel) and isinstance(auto.general, FlexKernel) and auto.fast is None
    kern = get_kernel("flex")
    assert isinstance(kern, FlexKernel)
    got = torch_dcp.emulate(plan, q, k, v, go, kernel=kern)
    ref = reference_with_grads(batch, *(t.cpu() for t in (q, k, v, go)))
    for a, b in zip(got, ref):
        assert a.dtype == torch.bfloat16 and a.is_cuda
        assert (a.cpu().double() - b).abs().max().item() <= 3e-2 * max(1.0, b.abs().max().item())
    import torch_dcp.executor.kernels.flex as flex_mod

    assert flex_mod._DIRECT_BACKWARD.get("cuda") is True  # flex's backward op, compiled: nothing recomputed


@cuda
def test_flex_cuda_float32_exact_and_timed():
    batch = _batch("ranges", "gqa8/2-d32", dtype="float32")
    plan = torch_dcp.plan(batch, 3, planner="greedy", block_size=BLOCK, divisions=2)
    q, k, v, go = (t.cuda() for t in random_qkv(batch, torch.float32))
    with _no_tf32():
        got, times = torch_dcp.emulate(plan, q, k, v, go, kernel="flex", timings=True)
    ref = reference_with_grads(batch, *(t.cpu() for t in (q, k, v, go)))
    for a, b in zip(got, ref):
        assert (a.cpu().double() - b).abs().max().item() <= 5e-3 * max(1.0, b.abs().max().item())
    assert all(t.seconds > 0 for ts in times.values() for t in ts if t.kind == "attention")


class _no_tf32:
    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old
