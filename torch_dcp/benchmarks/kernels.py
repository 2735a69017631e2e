"""Kernel micro-benchmarks.

``reduce``: the fused ``BlockwiseReduction`` against the per-block loop, and against the
memory-bound limit (bytes read and written once over the bandwidth of a plain copy)::

    python -m torch_dcp.benchmarks kernels reduce                       # 128K tokens x 8 heads x 128, 8 partials
    python -m torch_dcp.benchmarks kernels reduce --tokens 16384 --repeat 3   # smaller, for a CPU

``table``: attention TFLOP/s against work per launch, written in the format of
:meth:`torch_dcp.cost.CostModel.from_json`::

    python -m torch_dcp.benchmarks kernels table --out table.json
    python -m torch_dcp.benchmarks kernels table --out t.json --tokens 128,256 --head-dims 64

``division``: one division holding every tile of a few causal documents cut into blocks (the
executor's kernel, one launch per division) against one dense FlexAttention call over the same
contiguous documents (document-causal block mask), forward and backward, in TFLOP/s of useful
work::

    python -m torch_dcp.benchmarks kernels division --docs 16384,16384   # >= 16K x 16K useful pairs

``plan``: every rank of a plan of a 131,072-token long-tail batch on 4 x 8 ranks, run on this
one device with the in-process transport and timed per instruction (``emulate(timings=True)``),
against the simulator's prediction of each rank's compute (``--cost a100|h100|table.json``)::

    python -m torch_dcp.benchmarks kernels plan --planner dcp --cost h100
    python -m torch_dcp.benchmarks kernels plan --tokens 8192 --nodes 1 --ranks-per-node 4 --cost t.json  # CPU

Each table point is one launch over one document (one tile, one division) run through
:func:`torch_dcp.emulate` with ``timings=True``: ``full`` at ``n = tokens``, ``causal`` at
``n = tokens * sqrt(2)`` (so that ``sqrt(visible pairs)``, the cost model's work measure, is
``tokens`` for both). TFLOP/s = the workload's FLOPs (4 per pair per head-dim element
forward, 10 backward) over the attention time less the measured launch overhead.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .common import (DTYPES, DenseAttention, device_name, kernel_name, pick_device, sync, time_median, varlen_calls,
                     varlen_unavailable)

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import BlockwiseReduction

__all__ = ["bench_reduce", "measure_table", "bench_division", "bench_plan", "copy_bandwidth", "launch_overhead"]

def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28, repeat: int = 5) -> float:
    """Device memory bandwidth in bytes/s: ``2 * nbytes`` (read + write) over the time of a
    plain ``copy_`` of ``nbytes``."""
    n = max(1, nbytes // 4)
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_median(lambda: dst.copy_(src), device, repeat)
    return 2.0 * n * 4 / t


def launch_overhead(device: torch.device, n: int = 2000) -> float:
    """Seconds per launch of a trivial kernel (a one-element in-place add)."""
    x = torch.zeros(1, device=device)
    for _ in range(10):
        x.add_(1)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    sync(device)
    return (time.perf_counter() - t0) / n


# ---------------------------------------------------------------------- reduce
def _reduction_case(tokens: int, heads: int, head_dim: int, partials: int, block: int, op: str,
                    dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A reduction of ``partials`` slots per destination block, the slots scattered over the
    source buffer: the instruction (for the loop), its source and destination tensors, and the
    executor's merge arguments (row-major source rows, in order destinations)."""
    import types

    from ..plan import BlockwiseReduction, ReduceOp
    from ..workload import Buf

    rop = ReduceOp(op)
    nb = -(-tokens // block)
    tokens = nb * block
    rng = np.random.default_rng(seed)
    slots = rng.permutation(nb * partials).astype(np.int64)  # partial slots scattered over the buffer
    ins = BlockwiseReduction(rop, Buf.OPART, Buf.OUT, np.arange(nb, dtype=np.int64), np.arange(nb, dtype=np.int64) * block,
                             np.arange(nb + 1, dtype=np.int64) * partials, slots * block)
    block_len = np.full(nb, block, np.int64)
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = nb * partials * block
    src = [torch.randn(rows, heads, head_dim, generator=g).to(device=device, dtype=dtype)]
    dst = [torch.empty(tokens, heads, head_dim, dtype=dtype, device=device)]
    if rop is ReduceOp.LSE_MERGE:
        src.append(torch.randn(rows, heads, generator=g).to(device=device, dtype=dtype))
        dst.append(torch.empty(tokens, heads, dtype=dtype, device=device))
    # the executor's form: source rows [tokens, partials] row-major, destinations 0 .. tokens-1
    first = (slots * block).reshape(nb, partials)
    src_rows = (np.repeat(first, block, axis=0) + np.tile(np.arange(block), nb)[:, None]).reshape(-1)
    names = ("o", "lse")
    s_buf = types.SimpleNamespace(fields=dict(zip(names, src)), flat=src[0].view(rows, -1) if len(src) == 1 else None)
    d_buf = types.SimpleNamespace(fields=dict(zip(names, dst)), flat=dst[0].view(tokens, -1) if len(dst) == 1 else None)
    merge = (rop, s_buf, d_buf, torch.from_numpy(src_rows).to(device), slice(0, tokens), tokens, partials)
    return ins, block_len, src, dst, merge


def reduction_bytes(ins: "BlockwiseReduction", block_len: np.ndarray, src: list[torch.Tensor],
                    dst: list[torch.Tensor]) -> int:
    """Bytes a reduction must move at least: every source row read once, every destination
    row written once."""
    lens = np.asarray(block_len[ins.dst_block], np.int64)
    nsrc = np.diff(ins.src_ptr)
    read_rows = int((lens * nsrc).sum())
    write_rows = int(lens.sum())
    return sum(read_rows * math.prod(s.shape[1:]) * s.element_size() for s in src) + \
        sum(write_rows * math.prod(t.shape[1:]) * t.element_size() for t in dst)


def bench_reduce(tokens: int = 131072, heads: int = 8, head_dim: int = 128, partials: int = 8, block: int = 512,
                 op: str = "lse_merge", dtype: str = "float32", device: str | None = None, repeat: int = 5,
                 copy_mb: int = 256, check: bool = True) -> dict[str, float]:
    """Time the executor's merge (:func:`~torch_dcp.executor.reduce.merge_partials`): its torch
    path, and for the LSE merge on CUDA with Triton its one-pass Triton kernel, against the
    per-block loop and the memory-bound limit.

    Args:
        tokens: destination rows (rounded up to whole blocks); heads, head_dim: row shape.
        partials: sources per destination block; block: rows per destination block.
        op: ``"lse_merge"`` (partial outputs + LSE) or ``"sum"``.
        dtype: accumulation dtype of the buffers (the executor's is float32).
        device: ``"cuda"``, ``"cpu"`` or ``"auto"``/None (CUDA when available).
        copy_mb: size of the plain copy that measures the bandwidth, MiB.
        check: compare the merge's result with the loop's.

    Returns:
        seconds (``loop_s``, ``fused_s`` -- the torch merge --, ``triton_s`` -- the Triton merge,
        NaN where it does not run (CPU, no Triton, sums) --, ``limit_s``), ``speedup`` (loop /
        merge), ``bytes`` (minimum bytes moved), ``bandwidth`` (bytes/s), ``of_limit`` and
        ``triton_of_limit`` (limit / merge), ``max_abs_diff`` and ``triton_max_abs_diff``
        (against the loop).
    """
    from ..executor.reduce import merge_partials, reduce_loop
    from ..executor.triton_merge import triton_available

    dev = pick_device(device)
    tdt = DTYPES[dtype]
    ins, blen, src, dst, merge = _reduction_case(tokens, heads, head_dim, partials, block, op, tdt, dev)
    loop_s = time_median(lambda: reduce_loop(ins, blen, src, dst), dev, repeat)
    ref = [t.clone() for t in dst]

    def diff() -> float:
        return max(float((a - b).abs().max()) for a, b in zip(dst, ref)) if check else float("nan")

    fused_s = time_median(lambda: merge_partials(*merge, use_triton=False), dev, repeat)
    fused_diff = diff()
    triton_s = triton_diff = float("nan")
    if op == "lse_merge" and partials >= 2 and dev.type == "cuda" and triton_available(dev):
        for t in dst:
            t.fill_(float("nan"))
        triton_s = time_median(lambda: merge_partials(*merge, use_triton=True), dev, repeat)
        triton_diff = diff()
    nbytes = reduction_bytes(ins, blen, src, dst)
    bw = copy_bandwidth(dev, copy_mb << 20, repeat)
    limit = nbytes / bw
    return {"loop_s": loop_s, "fused_s": fused_s, "triton_s": triton_s, "speedup": loop_s / fused_s,
            "bytes": float(nbytes), "bandwidth": bw, "limit_s": limit, "of_limit": limit / fused_s,
            "triton_of_limit": limit / triton_s, "max_abs_diff": fused_diff, "triton_max_abs_diff": triton_diff}


# ---------------------------------------------------------------------- efficiency table
def _point(n: int, causal: bool, heads: int, kv_heads: int, head_dim: int, dtype: str, kernel: str,
           device: torch.device, repeat: int) -> tuple[float, float, float, float, float]:
    """``(pairs, fwd_seconds, bwd_seconds, fwd_flops, bwd_flops)`` of one single-launch document."""
    import torch_dcp
    from torch_dcp.masks import Causal, Full

    batch = torch_dcp.BatchSpec([n], Causal() if causal else Full(), n_heads=heads, n_kv_heads=kv_heads,
                                head_dim=head_dim, dtype=dtype)
    plan = torch_dcp.plan(batch, 1, planner="greedy", block_size=n, divisions=1)
    wl = plan.workload
    t = _timed_attention(plan, dtype, kernel, device, repeat)
    return (float(wl.tile_pairs.sum()), float(t["fwd_attention"][0]), float(t["bwd_attention"][0]),
            float(wl.tile_flops_fwd.sum()), float(wl.tile_flops_bwd.sum()))


def measure_table(tokens: list[int], head_dim: int = 128, heads: int = 8, kv_heads: int = 2, dtype: str | None = None,
                  kernel: str = "auto", device: str | None = None, repeat: int = 3, copy_mb: int = 256,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure a kernel efficiency table.

    Args:
        tokens: increasing equivalent square sides (``sqrt(visible pairs)``) to measure.
        head_dim, heads, kv_heads: attention shape (GQA when ``kv_heads < heads``).
        dtype: input dtype; default bfloat16 on CUDA, float32 elsewhere.
        kernel: executor kernel name (``"auto"``, ``"flex"``, ``"sdpa"``, ``"reference"``).
        repeat: timed runs per point (median), after one warm-up run.

    Returns:
        a dict with the keys of :meth:`torch_dcp.cost.CostModel.to_json` (``kernel``:
        ``tokens``, ``fwd_full``, ``fwd_causal``, ``bwd_full``, ``bwd_causal`` in TFLOP/s;
        ``memory_bandwidth`` in bytes/s; ``launch_overhead`` in seconds) plus ``meta``.

    Raises:
        ValueError: ``tokens`` empty, not positive or not increasing.
    """
    if not tokens or any(t <= 0 for t in tokens) or list(tokens) != sorted(set(tokens)):
        raise ValueError(f"tokens must be positive and increasing, got {tokens}")
    dev = pick_device(device)
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    overhead = launch_overhead(dev)
    bw = copy_bandwidth(dev, copy_mb << 20)
    cols: dict[str, list[float]] = {c: [] for c in ("fwd_full", "fwd_causal", "bwd_full", "bwd_causal")}
    for x in tokens:
        for causal in (False, True):
            n = int(round(x * math.sqrt(2))) if causal else int(x)
            pairs, tf, tb, ff, fb = _point(n, causal, heads, kv_heads, head_dim, dtype, kernel, dev, repeat)
            name = "causal" if causal else "full"
            for pas, t, fl in (("fwd", tf, ff), ("bwd", tb, fb)):
                busy = max(t - overhead, 0.1 * t)
                cols[f"{pas}_{name}"].append(fl / busy / 1e12)
            if log:
                log(f"tokens {x:6d} {name:6s} n={n:6d} sqrt(pairs)={math.sqrt(pairs):8.0f}  "
                    f"fwd {tf * 1e3:8.3f} ms {cols[f'fwd_{name}'][-1]:8.3f} TFLOP/s  "
                    f"bwd {tb * 1e3:8.3f} ms {cols[f'bwd_{name}'][-1]:8.3f} TFLOP/s")
    kern = kernel_name(kernel, dev)
    return {"kernel": {"tokens": [float(t) for t in tokens], **cols}, "memory_bandwidth": bw,
            "launch_overhead": overhead,
            "meta": {"device": device_name(dev), "kernel": kern, "dtype": dtype, "head_dim": head_dim,
                     "heads": heads, "kv_heads": kv_heads, "repeat": repeat, "torch": torch.__version__}}


def _timed_attention(plan, dtype: str, kernel: str, device: torch.device, repeat: int, seed: int = 0):
    """Per-rank attention/compute seconds of ``plan`` run on ``device`` (median over ``repeat``
    runs after a warm-up): ``{"fwd_attention": [W], "bwd_attention": [W], "fwd_compute": [W],
    "bwd_compute": [W]}`` (compute = attention + copies + reductions + message packing)."""
    import torch_dcp

    b = plan.batch
    t = b.total_tokens
    g = torch.Generator(device="cpu").manual_seed(seed)
    tdt = DTYPES[dtype]
    q = torch.randn(t, b.n_heads, b.head_dim, generator=g).to(device=device, dtype=tdt)
    k = torch.randn(t, b.n_kv_heads, b.head_dim, generator=g).to(device=device, dtype=tdt)
    v = torch.randn(t, b.n_kv_heads, b.head_dim, generator=g).to(device=device, dtype=tdt)
    go = torch.randn(t, b.n_heads, b.head_dim, generator=g).to(device=device, dtype=tdt)
    kern = torch_dcp.executor.get_kernel(kernel, device=device, dtype=tdt, head_dim=b.head_dim)
    runs = []
    for i in range(repeat + 1):
        _, times = torch_dcp.emulate(plan, q, k, v, go, kernel=kern, timings=True)
        if i == 0:
            continue
        w = plan.world_size
        res = {key: np.zeros(w) for key in ("fwd_attention", "bwd_attention", "fwd_compute", "bwd_compute")}
        for r, items in times.items():
            for it in items:
                pas = "bwd" if it.backward else "fwd"
                res[f"{pas}_compute"][r] += it.seconds
                if it.kind == "attention":
                    res[f"{pas}_attention"][r] += it.seconds
        runs.append(res)
    return {key: np.median([r[key] for r in runs], axis=0) for key in runs[0]}


def bench_division(doc_lens: list[int], block: int = 1024, heads: int = 8, kv_heads: int = 2, head_dim: int = 128,
                   dtype: str | None = None, kernel: str = "auto", device: str | None = None,
                   repeat: int = 3, flex_recompute: bool = False) -> dict[str, float]:
    """One division with every tile of causal documents ``doc_lens`` cut into ``block``-token
    blocks (one rank, ``divisions=1``), through the executor's kernel, against the faster of
    one dense FlexAttention call over the contiguous documents (document-causal mask) and one
    varlen flash call (CUDA, 16-bit), per direction.

    ``flex_recompute`` (with ``kernel="flex"``): the backward recomputes the division's forward
    (``FlexKernel(recompute=True)``), to compare with flex's backward op.

    Returns:
        seconds and TFLOP/s (useful FLOPs only) of both, forward and backward, and the ratios
        ``fwd_ratio = division TFLOP/s / dense TFLOP/s`` (likewise ``bwd_ratio``; NaN where
        the dense call cannot run backward, i.e. FlexAttention on CPU).

    Raises:
        ValueError: ``flex_recompute`` with a kernel other than ``"flex"``.
    """
    import torch_dcp
    from torch_dcp.executor.kernels.flex import FlexKernel
    from torch_dcp.masks import Causal

    if flex_recompute:
        if kernel != "flex":
            raise ValueError(f"flex_recompute needs kernel='flex', got kernel={kernel!r}")
        kernel = FlexKernel(recompute=True)
    dev = pick_device(device)
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    batch = torch_dcp.BatchSpec(doc_lens, Causal(), n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                                dtype=dtype)
    plan = torch_dcp.plan(batch, 1, planner="greedy", block_size=block, divisions=1)
    wl = plan.workload
    ff, fb = float(wl.tile_flops_fwd.sum()), float(wl.tile_flops_bwd.sum())
    t = _timed_attention(plan, dtype, kernel, dev, repeat)
    div_f, div_b = float(t["fwd_attention"][0]), float(t["bwd_attention"][0])
    flex_f, flex_b = _dense_flex(doc_lens, heads, kv_heads, head_dim, dtype, dev, repeat)
    var_f, var_b = _dense_varlen(batch, dev, repeat)
    # the faster dense kernel on the same useful work, per direction
    dense_f = min(flex_f, var_f) if var_f == var_f else flex_f
    dense_b = min(flex_b, var_b) if var_b == var_b and flex_b == flex_b else flex_b
    out = {"useful_pairs": float(wl.tile_pairs.sum()), "division_fwd_s": div_f, "division_bwd_s": div_b,
           "flex_fwd_s": flex_f, "flex_bwd_s": flex_b, "varlen_fwd_s": var_f, "varlen_bwd_s": var_b,
           "dense_fwd_s": dense_f, "dense_bwd_s": dense_b,
           "division_fwd_tflops": ff / div_f / 1e12, "division_bwd_tflops": fb / div_b / 1e12,
           "dense_fwd_tflops": ff / dense_f / 1e12, "dense_bwd_tflops": fb / dense_b / 1e12 if dense_b == dense_b else
           float("nan")}
    out["fwd_ratio"] = dense_f / div_f
    out["bwd_ratio"] = dense_b / div_b if dense_b == dense_b else float("nan")
    return out


def _dense_varlen(batch, dev: torch.device, repeat: int) -> tuple[float, float]:
    """Seconds of one varlen flash call (forward; forward + backward less forward) over the
    batch's documents; NaN where it cannot run (see :func:`~.common.varlen_unavailable`)."""
    if varlen_unavailable(batch, dev) is not None:
        return float("nan"), float("nan")
    g = torch.Generator(device="cpu").manual_seed(1)
    tdt = DTYPES[batch.dtype]
    t, h, hkv, d = batch.total_tokens, batch.n_heads, batch.n_kv_heads, batch.head_dim
    q, go = (torch.randn(t, h, d, generator=g).to(device=dev, dtype=tdt) for _ in range(2))
    k, v = (torch.randn(t, hkv, d, generator=g).to(device=dev, dtype=tdt) for _ in range(2))
    forward, both = varlen_calls(batch, dev, q, k, v, go)
    fwd = time_median(forward, dev, repeat)
    return fwd, max(time_median(both, dev, repeat) - fwd, 1e-12)


def _dense_flex(doc_lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: str, dev: torch.device,
                repeat: int) -> tuple[float, float]:
    """Seconds of one FlexAttention call (forward; forward + backward less forward) over
    contiguous causal documents; backward NaN where flex has none (CPU)."""
    import torch_dcp
    from torch_dcp.masks import Causal

    batch = torch_dcp.BatchSpec(doc_lens, Causal(), n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                                dtype=dtype)
    fn = DenseAttention(batch, dev, flex=True)
    t = batch.total_tokens
    g = torch.Generator(device="cpu").manual_seed(1)
    tdt = DTYPES[dtype]
    q = torch.randn(1, heads, t, head_dim, generator=g).to(device=dev, dtype=tdt)
    k = torch.randn(1, kv_heads, t, head_dim, generator=g).to(device=dev, dtype=tdt)
    v = torch.randn(1, kv_heads, t, head_dim, generator=g).to(device=dev, dtype=tdt)
    fwd = time_median(lambda: fn(q, k, v), dev, repeat)
    if dev.type != "cuda":
        return fwd, float("nan")
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    go = torch.randn_like(q)

    def both():
        fn(qg, kg, vg).backward(go)

    return fwd, max(time_median(both, dev, repeat) - fwd, 1e-12)


def bench_plan(planner: str = "dcp", tokens: int = 131072, nodes: int = 4, ranks_per_node: int = 8,
               block: int = 1024, cost: str = "h100", dtype: str | None = None, kernel: str = "auto",
               device: str | None = None, repeat: int = 1, seed: int = 0) -> dict[str, Any]:
    """Measured per-rank compute of a plan (all ranks run on this one device, one after
    another, timed per instruction) against the simulator's prediction.

    The batch: :func:`torch_dcp.data.long_tail_lengths` ``(tokens)``, causal, GQA 8/2,
    head_dim 128. ``cost``: ``"a100"``, ``"h100"`` or a JSON table file (e.g. from ``table``).

    Returns:
        per rank: measured and predicted forward/backward attention seconds, and summary
        ratios (measured / predicted: median, min, max; makespan-relevant max-rank ratio).
    """

    import torch_dcp
    from torch_dcp.cost import CostModel
    from torch_dcp.data import long_tail_lengths
    from torch_dcp.masks import Causal
    from torch_dcp.sim.simulate import simulate

    dev = pick_device(device)
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    cm = CostModel.load(cost)
    lens = long_tail_lengths(tokens, max_len=min(32768, tokens), seed=seed)
    batch = torch_dcp.BatchSpec(lens, Causal(), n_heads=8, n_kv_heads=2, head_dim=128, dtype=dtype)
    plan = torch_dcp.plan(batch, torch_dcp.Topology(n_nodes=nodes, ranks_per_node=ranks_per_node), planner=planner,
                          block_size=block)
    sim = simulate(plan, cm)
    pred = {"fwd": _sim_attention(sim.forward), "bwd": _sim_attention(sim.backward)}
    meas = _timed_attention(plan, dtype, kernel, dev, repeat)
    out: dict[str, Any] = {"planner": planner, "tokens": tokens, "world_size": plan.world_size, "device":
                           device_name(dev), "kernel": kernel_name(kernel, dev), "dtype": dtype}
    for pas in ("fwd", "bwd"):
        m, p_ = meas[f"{pas}_attention"], pred[pas]
        ratio = m / np.maximum(p_, 1e-12)
        out[f"{pas}_measured_s"] = m.tolist()
        out[f"{pas}_predicted_s"] = p_.tolist()
        out[f"{pas}_ratio_median"] = float(np.median(ratio))
        out[f"{pas}_ratio_min"] = float(ratio.min())
        out[f"{pas}_ratio_max"] = float(ratio.max())
        out[f"{pas}_max_rank_ratio"] = float(m.max() / max(p_.max(), 1e-12))
    return out


def _sim_attention(p) -> np.ndarray:
    """Per-rank simulated attention seconds of a pass."""
    w = len(p.events)
    return np.array([sum(e - s for kind, s, e in p.events[r] if kind == "attention") for r in range(w)])
