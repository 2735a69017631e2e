"""The executor's CUDA path proven without a GPU: ``FakeTensorMode`` with ``device="cuda"`` tensors.

Needs a CUDA *build* of PyTorch (``torch.version.cuda`` set; skipped on a CPU build), no GPU and
no driver. Every tensor is a fake CUDA tensor (shapes, dtypes and devices, no data), so these
tests catch device mixing, dtype errors, host tensors inside kernels and host reads of device
data (``.item()`` / ``.tolist()``: a fake tensor has no data to read) on the path a GPU takes:

* ``emulate`` forward and backward with the varlen flash kernel, FlexAttention and the automatic
  choice, on plans of the DCP planner (block size 1024, GQA 8/2, head_dim 128, odd document
  lengths). The kernels' capability check is told the GPU (``assume_cuda_capability((9, 0))``,
  an H100): fake tensors have no compute capability, and no driver is there to ask.
* the Triton LSE merge, the ``torch_dcp::merge_lse`` operator (``torch.library.triton_op``):
  under fake mode it runs its fake implementation, and ``torch.compile(backend="aot_eager",
  fullgraph=True)`` traces into it (the kernel is in the graph).
* FlexAttention traced by ``torch.compile`` inside the executor (``FlexKernel(compile="aot_eager")``:
  Dynamo and AOTAutograd trace the forward with the plan's block masks, and the backward op up
  to flex's backward higher-order op, where Dynamo breaks the graph and runs the op eagerly).
  This found a host-side tensor of ours: the ``mask_mod`` of masks without a closed form indexed
  its range tables as ``starts[q_idx, 0]``; traced, that ``0`` became a tensor made at trace time
  on the device (a real CUDA allocation, "Found no NVIDIA driver" under fake mode). The tables are
  now flat and indexed by tensors only.

What cannot run without a GPU, each checked to fail for that reason only:

* Inductor's code generation (the default compiler of FlexKernel on CUDA): its lowering of flex
  queries the device (``Found no NVIDIA driver``). FlexKernel skips Inductor for fake tensors
  (flex's higher-order ops then give the outputs' shapes through their fake implementations);
  the ``aot_eager`` test above is the nearest check of the compiled path.
* the autograd engine on CUDA tensors, fake ones too: ``GraphTask::stash_current_streams`` asks
  the driver whether device 0 has a primary context (``hasPrimaryContext expects a valid device
  index``). This was the cause of flex's "RuntimeError when making fake tensor call": FlexKernel
  built the identity ``score_mod``'s joint graph (``torch.autograd.grad`` on scalars) on the
  inputs' device for its backward op, failed, fell back to recomputing the forward with
  autograd, and flex's own autograd traces that graph the same way. FlexKernel now builds it on
  the meta device (the graph holds no device), so its default backward (flex's backward op with
  the final LSE) runs under fake mode; the recomputing backward (``recompute=True``)
  differentiates through flex and cannot.

``aten._pin_memory`` has no fake implementation in torch 2.11: uploads pin their host buffer
only where a CUDA driver is there (:func:`~torch_dcp.executor.device_plan.host_to_device`), so
none happens here. :class:`_DryRun` (a dispatch mode above fake mode) counts the operators the
executor runs. No function of torch is patched.
"""

from __future__ import annotations

import collections
import functools
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_dcp
from torch_dcp import BatchSpec, Topology
from torch_dcp import masks as M
from torch_dcp.executor import FlexKernel, emulate
from torch_dcp.executor.triton_merge import triton_available
from torch_dcp.executor.kernels.varlen import assume_cuda_capability

pytestmark = [
    pytest.mark.fake_cuda,
    pytest.mark.skipif(torch.version.cuda is None,
                       reason="needs a CUDA build of PyTorch (this build has torch.version.cuda None); no GPU needed"),
]
needs_triton = pytest.mark.skipif(not triton_available("cuda"),
                                  reason="triton is not installed")

H, HKV, D = 8, 2, 128
#: the plans of a GPU (the kernels are told an H100; without a GPU "auto" would plan for this CPU)
GPU_MODEL = "a100"
LENS = (1537, 301, 6049, 777)  # odd lengths, blocks of 1024: documents straddle blocks; at W = 4 the
# long document's causal work is split across ranks (their partials merged)
MASKS = {"causal": M.Causal(), "lambda": M.Lambda(sink=64, window=1500),
         "shared_question": M.SharedQuestion(question_frac=0.2, n_answers=4)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FLASH = "aten._flash_attention_forward.default"
MERGE = "torch_dcp.merge_lse.default"
# kernel x mask, each with one (dtype, world size): every pair of values of two of the four
# factors appears at least once (a pairwise cover of 3 x 3 x 2 x 2 in 9 cases)
CASES = [("varlen", "causal", "bfloat16", 4), ("varlen", "lambda", "float16", 1),
         ("varlen", "shared_question", "bfloat16", 1), ("flex", "causal", "float16", 4),
         ("flex", "lambda", "bfloat16", 1), ("flex", "shared_question", "bfloat16", 4),
         (None, "causal", "float16", 1), (None, "lambda", "bfloat16", 4), (None, "shared_question", "float16", 4)]


class _DryRun(TorchDispatchMode):
    """Above ``FakeTensorMode``: counts the operators dispatched (``seen[str(op)]``, higher-order
    ops too). Compiled regions run as usual (``ignore_compile_internals``)."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


@functools.lru_cache(maxsize=None)
def _plan(mask: str, dtype: str, world: int, head_parallel: "int | str" = 1):
    batch = BatchSpec(list(LENS), MASKS[mask], n_heads=H, n_kv_heads=HKV, head_dim=D, dtype=dtype)
    # dcp's own placements (its divisions and merges; the static runtimes have their own tests
    # below), by default without head parallelism (at N = W every placement runs alone)
    return torch_dcp.plan(batch, Topology(n_nodes=1, ranks_per_node=world), planner="dcp", block_size=1024,
                          cost_model=GPU_MODEL, rivals=("ring", "megatron", "allgather", "documents"),
                          head_parallel=head_parallel)


def _dry_run(plan, kernel, dtype: torch.dtype):
    """``emulate`` forward and backward on fake CUDA tensors: ``(outputs, operators seen)``."""
    T = plan.batch.total_tokens
    with assume_cuda_capability((9, 0)), FakeTensorMode(allow_non_fake_inputs=True), _DryRun() as mode:
        q, g = (torch.empty(T, H, D, device="cuda", dtype=dtype) for _ in range(2))
        k, v = (torch.empty(T, HKV, D, device="cuda", dtype=dtype) for _ in range(2))
        got = emulate(plan, q, k, v, g, kernel=kernel)
    for t, like in zip(got, (q, q, k, v)):  # out, dq, dk, dv
        assert t.device == torch.device("cuda", 0) and t.dtype == dtype and t.shape == like.shape
    return got, mode.seen


@pytest.mark.parametrize("kernel,mask,dtype,world", CASES)
def test_emulate_forward_backward(kernel, mask, dtype, world):
    plan = _plan(mask, dtype, world)
    _, seen = _dry_run(plan, kernel, DTYPES[dtype])
    flex = seen["flex_attention"] + seen["flex_attention_backward"]
    if kernel == "varlen":  # every division as flash varlen calls, nothing else
        assert seen[FLASH] and seen["aten._flash_attention_backward.default"] and not flex
    elif kernel == "flex":  # flex's forward and its backward op (the default, nothing recomputed)
        assert seen["flex_attention"] and seen["flex_attention_backward"] and not seen[FLASH]
    elif mask == "causal":  # the automatic choice: one varlen call covers a causal division
        assert seen[FLASH] and not flex
    else:  # one varlen call where it covers a division, one FlexAttention launch where it does not (λ's sink)
        assert seen["flex_attention"] and seen["flex_attention_backward"]
    if mask == "causal" and world > 1 and triton_available("cuda"):
        assert seen[MERGE]  # the long document's partials from several ranks, merged by the Triton op


@pytest.mark.parametrize("mask,n", [("causal", 1), ("lambda", 1), ("causal", 2)])
def test_allgather_runtime_on_the_cuda_path(mask, n):
    """All-gather CP on its own runtime (CP groups of 2 of 4 ranks; as the outer plan of 2-way
    head parallelism): one attention call per rank and pass, no host read of device data."""
    from torch_dcp.api import divide
    from torch_dcp.plan.heads import HeadLayout, HeadParallelPlan
    from torch_dcp.planners import plan_allgather

    batch = BatchSpec(list(LENS), MASKS[mask], n_heads=H, n_kv_heads=HKV, head_dim=D, dtype="bfloat16")
    topo = Topology(n_nodes=1, ranks_per_node=4)
    lay = HeadLayout.of(batch, n)
    ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
    plan = divide(plan_allgather(ob, ot, cp_size=2 if n == 1 else 1), ot, 1)
    plan = plan if n == 1 else HeadParallelPlan(plan, batch, topo, n, "allgather/cp1/hp2")
    _, seen = _dry_run(plan, None, torch.bfloat16)
    calls = seen[FLASH] + seen["flex_attention"]
    assert calls == 4  # one forward call per rank
    assert seen[MERGE] == 0  # every query's tiles on its rank: nothing to merge


@pytest.mark.parametrize("mask", ["causal", "lambda"])
def test_node_once_allgather_on_the_cuda_path(mask):
    """All-gather CP crossing each node once (2 nodes of 2 ranks, one CP group): two attention
    calls per rank and pass where its tiles read both nodes' keys, one Triton merge of their
    partial outputs each, no host read of device data."""
    import dataclasses

    from torch_dcp.api import divide
    from torch_dcp.planners import Runtime, plan_allgather

    batch = BatchSpec(list(LENS), MASKS[mask], n_heads=H, n_kv_heads=HKV, head_dim=D, dtype="bfloat16")
    topo = Topology(n_nodes=2, ranks_per_node=2)
    plan = divide(dataclasses.replace(plan_allgather(batch, topo), runtime=Runtime.DCP_NODE_ALLGATHER), topo, 1)
    _, seen = _dry_run(plan, None, torch.bfloat16)
    wl, pl = plan.workload, plan.placement
    node = topo.node_of(pl.block_rank)
    both = sum(len(set(node[wl.tile_kv[pl.tile_rank == r]].tolist())) == 2 for r in range(4))
    assert both >= 2
    assert seen[FLASH] + seen["flex_attention"] == 4 + both  # forward calls: one or two per rank
    if triton_available("cuda"):
        assert seen[MERGE] == both


@pytest.mark.parametrize("mask", ["causal", "lambda"])
def test_a_placement_alone_on_the_cuda_path(mask):
    """A placement that moves nothing, its documents in blocks of 256 tokens, run alone (the
    all-gather runtime with CP groups of one rank): one attention call per rank and pass over
    its blocks, nothing merged, no host read of device data."""
    import numpy as np

    from torch_dcp import Placement, Workload
    from torch_dcp.api import divide

    batch = BatchSpec(list(LENS), MASKS[mask], n_heads=H, n_kv_heads=HKV, head_dim=D, dtype="bfloat16")
    topo = Topology(n_nodes=1, ranks_per_node=4)
    wl = Workload.uniform(batch, 256)
    home = np.array([1, 0, 3, 2])[wl.block_doc]  # document d on rank (1, 0, 3, 2)[d], with its tiles
    placement = Placement(wl, 4, home, home[wl.tile_q], planner="dcp")
    _, seen = _dry_run(divide(placement.alone(), topo, 1), None, torch.bfloat16)
    assert seen[FLASH] + seen["flex_attention"] == 4 and seen[MERGE] == 0  # one forward call per rank


def test_head_all_to_alls_issue_a_few_operations_per_tensor():
    """Ulysses' shape at 8-way head parallelism (all-gather CP groups of one outer rank): the
    all-to-alls lay each tensor out by head group in one copy and receive straight into the
    result (no copy per peer): 10 forward and 20 backward device operations per rank beyond the
    outer plan's (72 and 113 when every peer's slice was copied and packed apart)."""
    import dataclasses

    from torch_dcp.api import divide
    from torch_dcp.benchmarks.ops import count_ops, per_division
    from torch_dcp.plan.heads import HeadLayout, HeadParallelPlan
    from torch_dcp.planners import Runtime, plan_allgather

    batch = BatchSpec([3000, 1200, 700, 2500, 600], MASKS["causal"], n_heads=8, n_kv_heads=2, head_dim=128,
                      dtype="bfloat16")
    topo = Topology(n_nodes=1, ranks_per_node=8)
    lay = HeadLayout.of(batch, 8)
    ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
    outer = dataclasses.replace(plan_allgather(ob, ot, cp_size=1), runtime=Runtime.DCP_ALLGATHER)
    plan = HeadParallelPlan(divide(outer, ot, 1), batch, topo, 8, "allgather/cp1/hp8")
    counted = per_division(count_ops(plan, device="cuda", kernel=None, seed=0, fake=True))
    # the outer plan alone (its attention and the runtime's own operations), counted the same way:
    # what the head-parallel plan issues beyond it are the all-to-alls' operations
    alone = per_division(count_ops(plan.outer, device="cuda", kernel=None, seed=0, fake=True))
    a2a = {name: counted[name] - alone[name] for name in counted}
    assert a2a["forward"] <= 12 and a2a["backward"] <= 22, (counted, alone)


@pytest.mark.parametrize("mask,n", [("causal", 1), ("lambda", 1), ("causal", 2)])
def test_ring_runtime_on_the_cuda_path(mask, n):
    """Ring attention on its own runtime (4 ranks; as HCP's ring across 2 head groups): one
    attention call per rank and step with tiles, one Triton merge per later step, no host read
    of device data."""
    import dataclasses

    from torch_dcp.api import divide
    from torch_dcp.executor.triton_merge import triton_available
    from torch_dcp.plan.heads import HeadLayout, HeadParallelPlan
    from torch_dcp.planners import Runtime, plan_ring

    batch = BatchSpec(list(LENS), MASKS[mask], n_heads=H, n_kv_heads=HKV, head_dim=D, dtype="bfloat16")
    topo = Topology(n_nodes=1, ranks_per_node=4)
    lay = HeadLayout.of(batch, n)
    ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
    plan = divide(dataclasses.replace(plan_ring(ob, ot), runtime=Runtime.DCP_RING), ot, ot.world_size)
    plan = plan if n == 1 else HeadParallelPlan(plan, batch, topo, n, "ring/hp2")
    _, seen = _dry_run(plan, None, torch.bfloat16)
    assert seen[FLASH] + seen["flex_attention"] > 4  # a call per step with tiles, not per rank
    if mask == "causal" and triton_available("cuda"):
        assert seen[MERGE]


def test_emulate_4x8_with_head_parallelism():
    """A 4 x 8 plan (dcp's default: head parallelism chosen by simulation), every rank emulated:
    all-to-alls, outer plan and kernels on CUDA with no host read."""
    batch = BatchSpec(list(LENS) * 3, MASKS["causal"], n_heads=H, n_kv_heads=HKV, head_dim=D, dtype="bfloat16")
    for hp in ("auto", 2):
        plan = torch_dcp.plan(batch, Topology(n_nodes=4, ranks_per_node=8), planner="dcp", block_size=1024,
                              head_parallel=hp, cost_model=GPU_MODEL)
        _, seen = _dry_run(plan, None, torch.bfloat16)
        assert seen[FLASH]


def test_flex_traced_by_torch_compile():
    """``FlexKernel(compile="aot_eager")``: Dynamo and AOTAutograd trace flex's forward inside the
    executor with the plan's block masks and mask_mod, and the backward op up to flex's backward
    higher-order op (the compiled path up to Inductor, which needs a driver: see the next test).
    Dynamo takes that op with pre-traced score graphs only from compiled autograd: the graph
    breaks there, and the op runs eagerly -- here its fake implementation, on a GPU PyTorch's
    dense one (as with Inductor: measured on an H100, torch 2.11). The breaks are at that op only,
    also when recompiled (a second plan: other shapes, dtype and mask)."""
    from torch._dynamo.utils import counters

    import torch_dcp.executor.kernels.flex as flex_mod

    torch._dynamo.reset()  # nothing compiled earlier in this process reused
    graphs, breaks = counters["stats"]["unique_graphs"], collections.Counter(counters["graph_break"])
    from torch_dcp.sim.runtimes import on_executor

    # one rank: its placement runs alone, unless on torch_dcp's executor (one division)
    _dry_run(on_executor(_plan("lambda", "float16", 1)), FlexKernel(compile="aot_eager"), torch.float16)
    assert "flex:aot_eager" in flex_mod._COMPILED and "backward:aot_eager" in flex_mod._COMPILED
    assert counters["stats"]["unique_graphs"] == graphs + 1  # the forward (no tensor op before flex's backward op)
    plan = on_executor(_plan("shared_question", "bfloat16", 4, "auto"))
    _, seen = _dry_run(plan, FlexKernel(compile="aot_eager"), torch.bfloat16)
    assert counters["stats"]["unique_graphs"] == graphs + 2  # the forward, recompiled
    new = collections.Counter(counters["graph_break"]) - breaks
    assert new and all("FlexAttentionBackward" in reason for reason in new), list(new)
    assert seen["flex_attention"] and seen["flex_attention_backward"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what fails without a GPU")
def test_what_needs_a_gpu():
    """Inductor's lowering of flex and the autograd engine on CUDA tensors need the driver: the
    two pieces that cannot run under fake mode here, each failing for that reason only."""
    from torch.nn.attention.flex_attention import flex_attention

    with FakeTensorMode():
        q = torch.empty(1, H, 256, D, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(Exception, match="no NVIDIA driver"):
            torch.compile(flex_attention)(q, q, q)  # Inductor: the default compiler of FlexKernel on CUDA
        x = torch.empty(3, device="cuda", requires_grad=True)
        with pytest.raises(RuntimeError, match="hasPrimaryContext"):
            torch.autograd.grad((x * 2).sum(), x)  # the engine asks the driver for device 0's context
    # so FlexKernel's recomputing backward, which differentiates through flex, cannot run
    with warnings.catch_warnings(), pytest.raises(Exception) as err:
        warnings.simplefilter("ignore")
        _dry_run(_plan("causal", "bfloat16", 1), FlexKernel(recompute=True), torch.bfloat16)
    chain, e = [], err.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert any("hasPrimaryContext" in m for m in chain)


# ------------------------------------------------------------------------ the Triton merge op
def _merge_args(fake: FakeTensorMode, n=6, p=3, h=H, d=D):
    with fake:
        src_o = torch.empty(n * p + 1, h, d, device="cuda")
        src_lse = torch.empty(n * p + 1, h, device="cuda")
        dst_o = torch.empty(n + 2, h, d, device="cuda", dtype=torch.bfloat16)
        dst_lse = torch.empty(n + 2, h, device="cuda")
        rows = torch.randperm(n * p, device="cuda")
    return src_o, src_lse, dst_o, dst_lse, rows, n, p


@needs_triton
def test_merge_op_under_fake_mode():
    from torch_dcp.executor.triton_merge import OP_NAME, merge_lse_triton

    assert OP_NAME == "torch_dcp::merge_lse" and hasattr(torch.ops.torch_dcp, "merge_lse")
    fake = FakeTensorMode()
    src_o, src_lse, dst_o, dst_lse, rows, n, p = _merge_args(fake)
    # index tensors or slices, a reversed slice (an index tensor made on the device)
    cases = [(rows, slice(1, 1 + n)), (slice(0, n * p), rows[:n] % n), (slice(n * p - 1, None, -1), slice(0, n))]
    with fake, _DryRun() as mode:
        for s_rows, d_rows in cases:
            merge_lse_triton(src_o, src_lse, dst_o, dst_lse, s_rows, d_rows, n, p)
        with pytest.raises(ValueError, match="src_rows"):
            merge_lse_triton(src_o, src_lse, dst_o, dst_lse, slice(0, n * p - 1), slice(0, n), n, p)
    # the op's fake implementation ran (a launch of the kernel would have needed the driver)
    assert mode.seen[MERGE] == 3
    assert dst_o.dtype == torch.bfloat16 and dst_o.device.type == "cuda"  # written in place


@needs_triton
def test_merge_op_traced_by_torch_compile():
    """``torch.compile(fullgraph=True, backend="aot_eager")`` of a function calling the merge: one
    graph, and AOTAutograd decomposes the op into its Triton kernel (a user-defined kernel in the
    graph). Without a driver AOTAutograd cannot compile the kernel to find which arguments it
    writes, and takes every tensor argument as written (a warning in the log)."""
    from torch._dynamo.backends.common import aot_autograd

    from torch_dcp.executor.triton_merge import merge_lse_triton

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    def merge(src_o, src_lse, dst_o, dst_lse, rows):
        merge_lse_triton(src_o, src_lse, dst_o, dst_lse, rows, slice(0, rows.shape[0] // 3), rows.shape[0] // 3, 3)
        return dst_o * 2, dst_lse

    fake = FakeTensorMode()
    src_o, src_lse, dst_o, dst_lse, rows, n, p = _merge_args(fake)
    compiled = torch.compile(merge, backend=aot_autograd(fw_compiler=capture), fullgraph=True)
    with fake:
        out, lse = compiled(src_o, src_lse, dst_o, dst_lse, rows)
    assert out.shape == dst_o.shape and out.dtype == torch.bfloat16 and out.device.type == "cuda"
    assert lse.shape == (n + 2, H) and lse.dtype == torch.float32
    code = "\n".join(g.code for g in graphs)
    assert len(graphs) == 1 and "triton_kernel_wrapper_functional" in code
    # and the op itself in a Dynamo graph (aot_eager: traced, run eagerly on the fake tensors)
    torch._dynamo.reset()
    eager = torch.compile(merge, backend="aot_eager", fullgraph=True)
    with fake:
        out, _ = eager(src_o, src_lse, dst_o, dst_lse, rows)
    assert out.shape == dst_o.shape and out.device.type == "cuda"


def test_device_operations_per_division_on_the_cuda_path():
    """The automatic kernel's CUDA path, counted by the ops benchmark (fake tensors, an H100 as
    far as the kernels can tell): one attention launch per division forward, and in the backward
    the one O' launch (LSE heads-first) and the fused backward, for causal documents (one varlen
    call) and λ (one FlexAttention launch); the executor's own operations per division stay small
    (the paper-scale figures: docs/gpu.md, ``python -m torch_dcp.benchmarks ops --fake``)."""
    from torch_dcp.benchmarks.common import batch_lengths
    from torch_dcp.benchmarks.ops import count_ops
    from torch_dcp.planners.dcp import OWN_RIVALS

    lens = batch_lengths("longtail", 16384, seed=0)
    for mask in (M.Causal(), M.Lambda(sink=64, window=512)):
        batch = BatchSpec(lens, mask, n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")
        # dcp's own placements on the executor (its static runtimes are counted apart: PRESET_CASES)
        plan = torch_dcp.plan(batch, Topology(n_nodes=2, ranks_per_node=4), planner="dcp", block_size=512,
                              divisions=4, head_parallel=1, cost_model=GPU_MODEL, rivals=OWN_RIVALS)
        rows = count_ops(plan, "cuda", fake=True)
        for name, launches, bound in (("forward", 1, 5.5), ("backward", 2, 12.0)):
            sel = [r for r in rows if r["pass"] == name]
            divs = sum(r["divisions"] for r in sel)
            assert sum(r["kernel_ops"] for r in sel) == launches * divs, (type(mask).__name__, name, sel)
            per_div = sum(r["device_ops"] for r in sel) / divs
            assert per_div <= bound, (type(mask).__name__, name, per_div)


@pytest.mark.parametrize("role", ["fast", "general", "alone", "gathered", "ring", "node", "heads", "heads_executor"])
def test_the_gpu_executor_preset_counts_todays_executor(role):
    """The GPU cost presets' fixed costs per division and per pass (``torch_dcp.cost.GPU_EXECUTOR``)
    are built from device operations counted on the executor (``ops --fake --device cuda
    --write-preset``): today's count stays within 10 % of the shipped one, each pass, or the preset
    is regenerated."""
    import json

    from torch_dcp.benchmarks.ops import count_preset_cases
    from torch_dcp.cost.model import GPU_EXECUTOR_PRESET

    from torch_dcp.benchmarks.ops import PER_PASS_ROLES

    shipped = json.loads(GPU_EXECUTOR_PRESET.read_text())["counted"][role]
    counted = count_preset_cases([role])[role]
    names = ("forward", "backward") + (("forward_pass", "backward_pass") if role in PER_PASS_ROLES else ())
    for name in names:
        assert abs(counted[name] - shipped[name]) <= 0.1 * shipped[name], (
            f"{role} {name}: {counted[name]} device operations per division (or pass) against {shipped[name]} in "
            f"{GPU_EXECUTOR_PRESET.name}: regenerate it with python -m torch_dcp.benchmarks ops --fake --device cuda "
            f"--write-preset {GPU_EXECUTOR_PRESET}")
