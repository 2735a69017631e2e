"""``python -m torch_dcp.benchmarks calibrate``: the cost model of this device, measured from the
executor itself, and the check of a model against the executor, rank by rank.

Calibrate (at most about 5 minutes on a 2-core CPU, 3 on a GPU)::

    python -m torch_dcp.benchmarks calibrate                         # this device; stored in the cache
    python -m torch_dcp.benchmarks calibrate --device cpu --out my_cpu.json
    torchrun --standalone --nproc-per-node 4 -m torch_dcp.benchmarks calibrate   # + the group's links

It plans synthetic batches (long-tail and corpus document lengths, causal, λ and shared-question
masks, several world sizes and block sizes), runs every rank of each plan through the executor in
this process (:func:`~torch_dcp.benchmarks.measure.measure_plan`: every instruction timed, the
emulated network's copies left out), fits the executor's costs to those times
(:func:`torch_dcp.cost.fit.fit_executor`; the residuals are printed) and writes the model as JSON:
by default where ``cost_model="auto"`` finds it (:func:`torch_dcp.cost.auto.cache_path`: keyed by
the device's name and the torch version; ``TORCH_DCP_COST_MODEL=FILE`` overrides). Under
``torchrun`` with 2 or more ranks it also measures the process group's point-to-point latency and
bandwidth and its all-to-all bandwidth (:class:`~torch_dcp.cost.Links`), which plans made with the
model use for the group's links; where the ranks share fewer cores than there are ranks (CPU
ranks on one machine), also the host cost of a transfer (:func:`measure_shared_cores`), so that
the simulator holds each pass to the ranks' total work over the cores.

Check (``--check``): for long-tail and corpus batches, every rank's forward + backward measured
alone beside the simulator's busy time of that rank under the model in use (``--cost``, default
``auto``); per case the ratio measured / predicted of the busiest rank and of the median rank
(target 0.8-1.25). Under ``torchrun`` (``torchrun --nproc-per-node 4 -m
torch_dcp.benchmarks.calibrate --check``) the group's own runs instead: dcp's and ring
attention's plans for the whole group, each run through ``context_parallel`` on it, against the
simulator's makespan (:func:`check_group`). The last line is JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import torch_dcp

from ..cost import CostModel, ExecutorCosts, KernelCosts, KernelTable, LaunchCosts
from ..cost.auto import cache_path, device_key
from ..cost.auto import device_name as model_device_name
from ..cost.executor import KERNEL_WORK, cell_kernels, launch_features, memory_kind
from ..cost.fit import FitReport, LaunchSample, MemorySample, PassSample, fit_executor
from ..plan import BlockwiseAttention, BlockwiseCopy, BlockwiseReduction, CommLaunch, CommWait, Plan
from ..sim.runtimes import on_executor
from ..sim.timeline import instruction_bytes, pass_local_bytes, pass_row_bytes, send_bytes
from .common import DTYPES, MASKS, batch_lengths, device_name, pick_device, progress, topology_of
from .measure import RankTimes, measure_plan

__all__ = ["add_arguments", "run", "main", "calibration_plans", "check_cases", "samples_of", "CHECK_RANGE"]

#: measured / predicted of the busiest and the median rank that the check accepts
CHECK_RANGE = (0.8, 1.25)

_SHAPES = {"cuda": {"heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16"},
           "cpu": {"heads": 4, "kv_heads": 2, "head_dim": 32, "dtype": "float32"}}
#: (batch, mask, tokens, world size, block size) of the calibration plans per size
_PLANS = {
    "full": [("longtail", "causal", 8192, 4, 128), ("corpus", "causal", 8192, 8, 256),
             ("longtail", "lambda", 8192, 4, 256), ("corpus", "lambda", 8192, 8, 128),
             ("longtail", "shared_question", 8192, 8, 512), ("corpus", "shared_question", 8192, 4, 512),
             ("longtail", "causal", 16384, 8, 512), ("corpus", "lambda", 16384, 4, 512),
             ("longtail", "lambda", 4096, 2, 128), ("corpus", "causal", 4096, 2, 256),
             ("longtail", "lambda", 32768, 8, 512), ("corpus", "shared_question", 32768, 4, 512),
             # one division per rank (what dcp picks on a CPU for long-tail batches): a rank's largest launches
             ("longtail", "causal", 12288, 8, 256, 1), ("longtail", "lambda", 16384, 8, 128, 1),
             ("longtail", "shared_question", 12288, 4, 256, 1)],
    "tiny": [("longtail", "causal", 768, 2, 128), ("longtail", "lambda", 768, 2, 128)],
}
_GPU_SCALE = 8  # GPU calibration plans: 8 x the tokens, 4 x the block sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m torch_dcp.benchmarks calibrate``."""
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    p.add_argument("--kernel", default="auto", help="the executor's kernel (default auto, as the executor chooses)")
    p.add_argument("--out", default=None, help="write the model here (default: the cache 'auto' reads)")
    p.add_argument("--size", choices=sorted(_PLANS), default="full", help="calibration plans (tiny: for tests)")
    p.add_argument("--repeat", type=int, default=2, help="timed steps per plan, median (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: as set)")
    p.add_argument("--check", action="store_true", help="check a model against the executor instead of fitting")
    p.add_argument("--cost", default="auto",
                   help="with --check: the model to check (auto, a100, h100, a100-executor, h100-executor or JSON)")
    p.add_argument("--cases", default=None,
                   help="with --check: BATCH:MASK:TOKENS:W:BLOCK,... (default: long-tail and corpus, 8K-32K "
                        "tokens, W = 4 and 8, blocks 128-512, causal, lambda, shared_question)")
    p.add_argument("--replay", action="store_true",
                   help="--check: measure each rank through layer replay (CUDA graphs on CUDA) instead of eagerly")
    p.add_argument("--seed", type=int, default=0)


def _shape(dev: torch.device) -> dict[str, Any]:
    return _SHAPES["cuda" if dev.type == "cuda" else "cpu"]


def _batch(kind: str, mask: str, tokens: int, shape: dict[str, Any], seed: int) -> torch_dcp.BatchSpec:
    lens = batch_lengths(kind, tokens, seed=seed, max_doc_len=max(256, tokens // 2))
    return torch_dcp.BatchSpec(lens, MASKS[mask], n_heads=shape["heads"], n_kv_heads=shape["kv_heads"],
                               head_dim=shape["head_dim"], dtype=shape["dtype"])


def _plan(batch: torch_dcp.BatchSpec, world: "int | str", block: int, planner: str, cost: Any,
          divisions: int | None = None) -> Plan:
    topo = topology_of(world)
    opts: dict[str, Any] = {"head_parallel": 1} if planner == "dcp" else {}
    if divisions is not None:
        opts["divisions"] = divisions
    # measured on torch_dcp's executor: a baseline's plan as the executor runs it
    return on_executor(torch_dcp.plan(batch, topo, planner=planner, block_size=block, cost_model=cost, **opts))


def calibration_plans(dev: torch.device, size: str = "full", seed: int = 0) -> list[Plan]:
    """The synthetic plans a calibration measures: dcp's and ring attention's plans (many small
    and a few large divisions, and a few of one division per rank) of long-tail and corpus
    batches under three masks."""
    shape = _shape(dev)
    scale = _GPU_SCALE if dev.type == "cuda" else 1
    plans = []
    for i, (kind, mask, tokens, world, block, *divisions) in enumerate(_PLANS[size]):
        batch = _batch(kind, mask, tokens * scale, shape, seed + i)
        planner = "ring" if i % 5 == 4 and not divisions else "dcp"
        plans.append(_plan(batch, world, block * min(scale, 4), planner, "h100", *divisions))
    return plans


def samples_of(plan: Plan, times: RankTimes, general: str, fast: str | None) -> tuple[list, list, list]:
    """The fit's samples of one measured plan: ``(launches, memory, passes)``
    (:mod:`torch_dcp.cost.fit`).

    Raises:
        RuntimeError: the instruction timings do not follow the plan's programs.
    """
    wl = plan.workload
    blen = wl.block_len
    kinds = ExecutorCosts(KernelCosts(general, LaunchCosts(), LaunchCosts()),
                          KernelCosts(fast, LaunchCosts(), LaunchCosts()) if fast else None)
    launches, memory, passes = [], [], []
    for r, per_pass in enumerate(times.instructions):
        for backward, timed in zip((False, True), per_pass):
            prog = [ins for ins in plan.program(r, backward).instructions if not isinstance(ins, CommWait)]
            if len(prog) != len(timed):
                raise RuntimeError(f"rank {r}: {len(timed)} timed instructions for {len(prog)} in its program")
            rows = pass_row_bytes(plan.batch, backward)
            for ins, t in zip(prog, timed):
                if isinstance(ins, BlockwiseAttention):
                    cell = np.zeros(len(ins.tile), np.int64)
                    name = fast if cell_kernels(wl, ins.tile, cell, 1, kinds)[0] else general
                    f = launch_features(wl, ins.tile, cell, 1, KERNEL_WORK[name], backward)[0]
                    launches.append(LaunchSample(name, backward, tuple(f.tolist()), t.seconds))
                elif isinstance(ins, (BlockwiseCopy, BlockwiseReduction)):
                    kind = memory_kind(ins)
                    if kind != "alias":
                        memory.append(MemorySample(kind, backward, instruction_bytes(ins, blen, rows), t.seconds))
                elif isinstance(ins, CommLaunch) and ins.sends:
                    memory.append(MemorySample("pack", backward, send_bytes(ins, rows), t.seconds))
            busy = (times.backward if backward else times.forward)[r]
            passes.append(PassSample(backward, float(pass_local_bytes(plan, backward)[r]),
                                     float(busy - sum(t.seconds for t in timed))))
    return launches, memory, passes


def _kernel_names(dev: torch.device, kernel: str) -> tuple[str, str | None]:
    """The model's (general, fast) kernels for the executor's ``kernel`` on ``dev``."""
    from ..executor.kernels import AutoKernel, get_kernel

    shape = _shape(dev)
    k = get_kernel(kernel, device=dev, dtype=getattr(torch, shape["dtype"]), head_dim=shape["head_dim"])
    if isinstance(k, AutoKernel):
        return k.general.name, (k.fast.name if k.fast is not None else None)
    return k.name, None


def _progress(items: list, desc: str) -> Any:
    """``items``, with the benchmarks' progress bar (:func:`~torch_dcp.benchmarks.common.progress`)."""
    with progress(len(items), desc) as bar:
        for item in items:
            yield item
            bar.update(1)


def calibrate(dev: torch.device, kernel: str = "auto", size: str = "full", repeat: int = 2,
              seed: int = 0) -> tuple[CostModel, FitReport, dict[str, Any]]:
    """Measure the calibration plans on ``dev`` and fit the model: ``(model, residuals, meta)``."""
    general, fast = _kernel_names(dev, kernel)
    launches, memory, passes = [], [], []
    t0 = time.perf_counter()
    plans = calibration_plans(dev, size, seed)
    for plan in _progress(plans, "calibrate"):
        times = measure_plan(plan, dev, kernel, repeat=repeat, instructions=True, seed=seed)
        got = samples_of(plan, times, general, fast)
        launches += got[0]
        memory += got[1]
        passes += got[2]
    if fast is not None and not any(s.kernel == fast for s in launches):
        fast = None  # no division ran the fast kernel: the model keeps the general one
    costs, report = fit_executor(launches, memory, passes, general, fast)
    name = model_device_name(dev)
    meta = {"device": name, "torch": torch.__version__, "key": device_key(dev), "kernel": kernel,
            "threads": torch.get_num_threads(), "plans": len(plans), "launch_samples": len(launches),
            "seconds": round(time.perf_counter() - t0, 1), "date": datetime.date.today().isoformat()}
    g = costs.general.forward, costs.general.backward
    # the kernel table: the general kernel's throughput on full tiles (no launch is faster), so the
    # floors built on it stay lower bounds of the executor-aware times
    tf = [1e-12 / lc.flop if lc.flop else 1e3 for lc in g]
    table = KernelTable(tokens=(1.0,), fwd_full=(tf[0],), fwd_causal=(tf[0],), bwd_full=(tf[1],), bwd_causal=(tf[1],))
    bw = 1.0 / costs.copy.byte if costs.copy.byte > 0 else 1e12
    model = CostModel(table, bw, 0.0, executor=costs,
                      source=f"calibrated on {name}, torch {torch.__version__}, {meta['date']}")
    return model, report, meta


# ---------------------------------------------------------------------- links under torchrun
def measure_links(device: torch.device, repeat: int = 5) -> "torch_dcp.cost.Links":
    """Point-to-point latency and bandwidth (ranks 0 and 1, ping-pong) and all-to-all bandwidth of
    the default process group; every rank must call it. The bandwidth kept is the lower of the
    two (bytes each rank sends per second).

    Raises:
        RuntimeError: no process group, or fewer than 2 ranks.
    """
    import torch.distributed as dist

    from ..cost import Links

    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise RuntimeError("measure_links needs a process group of 2 or more ranks")
    rank, world = dist.get_rank(), dist.get_world_size()

    def ping(nbytes: int) -> float:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        times = []
        for _ in range(repeat + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) / 2)
        return float(np.median(times[1:]))

    small, big = 8, 8 << 20
    t_small, t_big = ping(small), ping(big)
    p2p_bw = (big - small) / max(t_big - t_small, 1e-9)
    chunk = (4 << 20) // world
    send = torch.zeros(chunk * world // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    a2a = []
    for _ in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        a2a.append(time.perf_counter() - t0)
    a2a_bw = chunk * (world - 1) / max(float(np.median(a2a[1:])) - t_small, 1e-9)
    stats = torch.tensor([t_small, min(p2p_bw, a2a_bw)], dtype=torch.float64)
    dist.broadcast(stats, 0)  # rank 0's measurement (ranks 0 and 1 ran the ping-pong) for everyone
    return Links(float(stats[0]), float(stats[1]), world, dist.get_backend())


# ---------------------------------------------------------------------- ranks sharing cores
#: (batch, planner) of the plans that fit the host costs of transfers where ranks share cores:
#: plans of the same batches that move different bytes in different numbers of transfers
_SHARED_PLANS = [(kind, planner) for kind in ("longtail", "corpus")
                 for planner in ("ring", "allgather", "megatron", "dcp")]


def cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return os.cpu_count() or 1


def _start_group(dev: torch.device) -> torch.device:
    """Under torchrun: this rank's device (its local GPU on CUDA) and the default process group
    (NCCL on CUDA, gloo on the CPU)."""
    import torch.distributed as dist

    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=20))
    return dev


def _group_mesh(dev: torch.device) -> Any:
    """A one-dimensional mesh of the default process group (the DCP group the checks plan for)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(dev.type, (dist.get_world_size(),))


def group_seconds(plan: Plan, mesh: Any, dev: torch.device, repeat: int = 3, seed: int = 0) -> float:
    """Wall seconds of one attention forward + backward of ``plan`` on the default process group
    (every rank calls it): ``F.scaled_dot_product_attention`` inside
    :func:`torch_dcp.context_parallel` on ``mesh``, between barriers, the fastest of ``repeat``
    after one that builds and uploads the device plan."""
    import torch.distributed as dist
    import torch.nn.functional as F

    b = plan.batch
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(1, h, b.total_tokens, b.head_dim, generator=gen).to(DTYPES[b.dtype])
           for h in (b.n_heads, b.n_kv_heads, b.n_kv_heads)]
    walls = []
    for _ in range(repeat + 1):
        q, k, v = (x.clone().to(dev) for x in qkv)
        with torch_dcp.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                                        no_restore_buffers={q, k, v}, plan=plan):
            for x in (q, k, v):
                x.requires_grad_()
            dist.barrier()
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, is_causal=b.is_causal, enable_gqa=True).sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dist.barrier()
            walls.append(time.perf_counter() - t0)
    return min(walls[1:])


def check_group(model: CostModel, dev: torch.device, repeat: int = 2, seed: int = 0, out: Any = None,
                tokens: int = 8192, block: int = 256) -> dict[str, Any]:
    """``--check`` under ``torchrun``: dcp's and ring attention's plans of long-tail and corpus
    batches (``tokens``, causal and λ masks) for the whole group, made with ``model``, each run on the group
    (:func:`group_seconds`) beside the simulator's makespan under ``model``: measured /
    predicted per plan. Every rank calls it; rank 0 prints."""
    import torch.distributed as dist

    from ..sim.simulate import simulate

    world = dist.get_world_size()
    mesh = _group_mesh(dev)
    shape = _shape(dev)
    scale = _GPU_SCALE if dev.type == "cuda" else 1
    rows = []
    for i, (kind, mask) in enumerate((k, m) for k in ("longtail", "corpus") for m in ("causal", "lambda")):
        batch = _batch(kind, mask, tokens * scale, shape, seed + i)
        for planner in ("dcp", "ring"):
            plan = torch_dcp.plan(batch, world, planner=planner, block_size=block * min(scale, 4), cost_model=model,
                                  **({"head_parallel": 1} if planner == "dcp" else {}))
            plan = on_executor(plan)  # context_parallel runs it on torch_dcp's executor
            wall = group_seconds(plan, mesh, dev, repeat, seed + i)
            pred = simulate(plan, model).makespan_s
            rows.append({"batch": kind, "mask": mask, "planner": plan.planner, "measured_s": wall,
                         "predicted_s": pred, "ratio": wall / pred})
    inside = sum(CHECK_RANGE[0] <= r["ratio"] <= CHECK_RANGE[1] for r in rows)
    if dist.get_rank() == 0:
        p = (lambda line: print(line, file=out or sys.stdout, flush=True))
        p(f"group check of '{model.source or 'the model'}' on {world} ranks ({links_text(model, world)}): one forward + "
          "backward on the group / the simulator's makespan")
        p("| batch | mask | plan | measured ms | predicted ms | ratio |")
        p("|---|---|---|---|---|---|")
        for r in rows:
            p(f"| {r['batch']} | {r['mask']} | {r['planner']} | {r['measured_s'] * 1e3:.1f} | "
              f"{r['predicted_s'] * 1e3:.1f} | {r['ratio']:.2f} |")
        p(f"{inside} of {len(rows)} plans within {CHECK_RANGE[0]}-{CHECK_RANGE[1]}")
    return {"model": model.source, "world": world, "plans": rows, "inside": inside, "range": list(CHECK_RANGE)}


def links_text(model: CostModel, world: int) -> str:
    """The model's links in words, as a group of ``world`` ranks plans with them (the checks' headers)."""
    lk = model.links
    if lk is None:
        return "no measured links"
    if lk.world_size != world:
        return f"links measured on {lk.world_size} ranks: not used for {world}"
    text = f"{lk.backend} links {lk.latency * 1e6:.0f} µs, {lk.bandwidth / 1e9:.2f} GB/s"
    return text + (f", {lk.world_size} ranks on {lk.cores} cores" if lk.shares_cores else "")


def measure_shared_cores(model: CostModel, links: "torch_dcp.cost.Links", dev: torch.device, cores: int,
                         tokens: int = 8192, block: int = 256, repeat: int = 3, seed: int = 0,
                         out: Any = None) -> "torch_dcp.cost.Links":
    """Where the group's ranks share fewer cores than there are ranks (CPU ranks on one
    machine), the host costs of its transfers: every rank runs the forward and backward of a
    few plans (:data:`_SHARED_PLANS`, ``tokens`` per batch) through
    :func:`torch_dcp.context_parallel` on the default process group; each plan's wall time
    (the fastest of ``repeat``, between barriers) times ``cores``, less the ranks' busy time that
    ``model`` predicts, is fitted (non-negative least squares) as host seconds per byte and per
    transfer. Every rank must call it; returns ``links`` with ``cores`` and the fitted costs.
    """
    import dataclasses

    import torch.distributed as dist
    from scipy.optimize import nnls

    from ..sim.simulate import simulate

    world = dist.get_world_size()
    mesh = _group_mesh(dev)
    shape = _shape(dev)
    kernel_model = dataclasses.replace(model, links=None)
    rows, target = [], []
    for i, (kind, planner) in enumerate(_SHARED_PLANS):
        batch = _batch(kind, "causal", tokens, shape, seed + i)
        plan = torch_dcp.plan(batch, links.world_size, planner=planner, block_size=block, divisions=2,
                              cost_model=kernel_model, **({"head_parallel": 1} if planner == "dcp" else {}))
        plan = on_executor(plan)  # context_parallel runs it on torch_dcp's executor
        wall = group_seconds(plan, mesh, dev, repeat, seed + i)
        sim = simulate(plan, kernel_model)
        _, _, nb, _ = plan.transfers()
        busy = float(sim.forward.busy_s.sum() + sim.backward.busy_s.sum())
        rows.append((plan.planner, kind, float(nb.sum()), len(nb), busy, wall))
        target.append(wall * cores - busy)
    X = np.array([[r[2], r[3]] for r in rows])
    coef, _ = nnls(X, np.maximum(np.array(target), 0.0))
    fitted = dataclasses.replace(links, cores=cores, host_byte_seconds=float(coef[0]),
                                 host_message_seconds=float(coef[1]))
    if dist.get_rank() == 0:
        p = (lambda line: print(line, file=out or sys.stdout, flush=True))
        p(f"{world} ranks share {cores} cores: a transfer's host cost {coef[0] * 1e9:.2f} ns/byte + "
          f"{coef[1] * 1e6:.1f} µs each")
        p("| plan | batch | MB moved | transfers | wall ms | predicted ms | ratio |")
        p("|---|---|---|---|---|---|---|")
        for planner, kind, nbytes, msgs, busy, wall in rows:
            pred = fitted.shared_seconds(busy, nbytes, msgs)
            p(f"| {planner} | {kind} | {nbytes / 1e6:.1f} | {msgs} | {wall * 1e3:.1f} | {pred * 1e3:.1f} | "
              f"{wall / pred:.2f} |")
    return fitted


# ---------------------------------------------------------------------- the check
def check_cases(spec: str | None) -> list[tuple[str, str, int, "int | str", int]]:
    """``(batch, mask, tokens, W, block)`` of the check (``spec``: ``B:M:T:W:BS,...``; ``W`` ranks
    on one node, or ``NxR``: N nodes of R ranks).

    Raises:
        ValueError: a malformed case.
    """
    if spec:
        out = []
        for item in spec.split(","):
            parts = item.split(":")
            if len(parts) != 5 or parts[1] not in MASKS or not re.fullmatch(r"\d+(x\d+)?", parts[3]):
                raise ValueError(f"--cases: expected BATCH:MASK:TOKENS:W:BLOCK with a mask of {sorted(MASKS)} and W "
                                 f"a number of ranks or NODESxRANKS (e.g. 4x8), got {item!r}")
            world = parts[3] if "x" in parts[3] else int(parts[3])
            out.append((parts[0], parts[1], int(parts[2]), world, int(parts[4])))
        return out
    cases = []
    blocks = (128, 256, 512)
    for i, (kind, mask, world) in enumerate((k, m, w) for k in ("longtail", "corpus")
                                            for m in ("causal", "lambda", "shared_question") for w in (4, 8)):
        cases.append((kind, mask, (8192, 16384, 32768)[i % 3], world, blocks[i % 3]))
    return cases


def _replayed_times(plan: Plan, dev: torch.device, kernel: str, repeat: int, seed: int) -> np.ndarray:
    """Every rank's forward + backward through layer replay (:mod:`~torch_dcp.benchmarks.layers`):
    ``1 + repeat`` layers (at least 2), per rank the median layer of the calls that record nothing."""
    from .layers import bench_recorder, emulate_ranks, time_layers

    times = time_layers(emulate_ranks(plan, dev, kernel, seed=seed), 1 + max(1, repeat), bench_recorder(dev))
    if times.fallbacks:
        raise RuntimeError(f"layer replay failed on ranks {list(times.fallbacks)}: their times are eager ones")
    return times.steady()


def check(model: CostModel, dev: torch.device, cases: list, kernel: str = "auto", repeat: int = 2,
          seed: int = 0, out: Any = None, replay: bool = False) -> dict[str, Any]:
    """Every case's plan (dcp, planned with ``model``) measured rank by rank beside the
    simulator's busy time of each rank under ``model``: the busiest and the median rank's
    measured / predicted. ``replay``: each rank measured through layer replay (CUDA graphs on
    CUDA) instead of eagerly.

    Raises:
        RuntimeError: with ``replay``, a rank whose recording failed (it would be timed eagerly).
    """
    p = (lambda s: print(s, file=out or sys.stdout, flush=True))
    shape = _shape(dev)
    rows = []
    p(f"check of '{model.source or 'the model'}' on {device_name(dev)}: each rank's forward + backward measured "
      f"alone{' through layer replay' if replay else ''} / the simulator's busy time of that rank")
    p("| batch | mask | tokens | W | block | busiest rank: measured / predicted ms | ratio | median rank ratio |")
    p("|---|---|---|---|---|---|---|---|")
    for kind, mask, tokens, world, block in _progress(cases, "check"):
        batch = _batch(kind, mask, tokens, shape, seed)
        plan = _plan(batch, world, block, "dcp", model)
        meas = (_replayed_times(plan, dev, kernel, repeat, seed) if replay
                else measure_plan(plan, dev, kernel, repeat=repeat, seed=seed).total)
        sim = torch_dcp.sim.simulate(plan, model)
        pred = sim.forward.busy_s + sim.backward.busy_s
        ratio = meas / np.maximum(pred, 1e-12)
        busiest = int(np.argmax(meas))
        med = int(np.argsort(meas)[len(meas) // 2])
        rows.append({"batch": kind, "mask": mask, "tokens": tokens, "world": world, "block": block,
                     "divisions": plan.divisions, "measured_s": meas.tolist(), "predicted_s": pred.tolist(),
                     "busiest": float(ratio[busiest]), "median": float(ratio[med])})
        p(f"| {kind} | {mask} | {tokens} | {world} | {block} | {meas[busiest] * 1e3:.1f} / {pred[busiest] * 1e3:.1f} | "
          f"{ratio[busiest]:.2f} | {ratio[med]:.2f} |")
    lo, hi = CHECK_RANGE
    inside = sum(lo <= r["busiest"] <= hi and lo <= r["median"] <= hi for r in rows)
    p(f"{inside} of {len(rows)} cases with the busiest and the median rank within {lo}-{hi}")
    return {"model": model.source, "device": device_name(dev), "torch": torch.__version__, "cases": rows,
            "inside": inside, "range": list(CHECK_RANGE), "replay": replay}


# ---------------------------------------------------------------------- the command
def run(args: argparse.Namespace, out: Any = None) -> dict[str, Any]:
    """Run ``calibrate`` (or ``calibrate --check``) with parsed options; prints a table and a final
    JSON line, returns the JSON's dict."""
    import torch.distributed as dist

    out = out or sys.stdout
    p = (lambda s="": print(s, file=out, flush=True))
    dev = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if args.check:
        model = CostModel.load(args.cost, device=dev)
        if distributed:  # the group's own runs against the simulator's makespan
            dev = _start_group(dev)
            res = check_group(model, dev, args.repeat, args.seed, out)
            if dist.get_rank() == 0:
                p(json.dumps(res))
            dist.barrier()
            dist.destroy_process_group()
            return res
        res = check(model, dev, check_cases(args.cases), args.kernel, args.repeat, args.seed, out, args.replay)
        p(json.dumps(res))
        return res
    links = None
    if distributed:
        dev = _start_group(dev)
        links = measure_links(dev)
    if not distributed or dist.get_rank() == 0:  # rank 0 measures the executor alone; the others wait for it
        model, report, meta = calibrate(dev, args.kernel, args.size, args.repeat, args.seed)
    if links is not None:
        import dataclasses

        shared = [model.to_json() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, 0)
        cores = cpu_cores()
        if dev.type == "cpu" and cores < links.world_size:  # the ranks share the machine's cores
            links = measure_shared_cores(CostModel.from_json(shared[0]), links, dev, cores, seed=args.seed, out=out)
        if dist.get_rank() != 0:
            dist.barrier()
            dist.destroy_process_group()
            return {"links": links.__dict__}
        model = dataclasses.replace(model, links=links)
    path = Path(args.out) if args.out else cache_path(dev)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.to_json(**meta))
    p(f"calibrated {meta['plans']} plans on {meta['device']} (torch {meta['torch']}, {meta['threads']} threads) "
      f"in {meta['seconds']} s; residuals of the fit:")
    for line in report.lines():
        p(line)
    ex = model.executor
    p(f"per division: {ex.general.name} fixed {ex.general.forward.fixed * 1e6:.1f} / {ex.general.backward.fixed * 1e6:.1f} "
      f"µs (forward / backward), per call {ex.general.forward.call * 1e6:.1f} / {ex.general.backward.call * 1e6:.1f} µs")
    if links is not None:
        p(f"links ({links.backend}, {links.world_size} ranks): latency {links.latency * 1e6:.1f} µs, "
          f"bandwidth {links.bandwidth / 1e9:.2f} GB/s")
    p(f"wrote {path}" + ("" if args.out else " (the cache cost_model='auto' reads)"))
    res = {"path": str(path), "meta": meta, "residuals": report.terms,
           "links": links.__dict__ if links is not None else None}
    p(json.dumps(res))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return res


def main(argv: list[str] | None = None, out: Any = None) -> dict[str, Any]:
    """``run`` with its own parser (for scripts and tests)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv), out)


def check_status(res: dict[str, Any]) -> int:
    """The exit status of a check's result: 0 when every case (or the group's every plan) held."""
    rows = res.get("cases", res.get("plans", []))
    return 0 if res["inside"] == len(rows) else 1


if __name__ == "__main__":  # torchrun -m torch_dcp.benchmarks.calibrate
    result = main()
    sys.exit(check_status(result) if "inside" in result else 0)
