"""Operations a rank's executor issues per division, forward and backward.

    python -m torch_dcp.benchmarks ops                                  # 3 ranks, 2 divisions, CPU
    python -m torch_dcp.benchmarks ops --ranks 32 --divisions 4 --tokens 131072 --device cuda

Every rank of a plan runs in this process (in-process transport). A ``TorchDispatchMode``
counts, per rank and pass, the aten operations the executor dispatches, split into

* ``ops``: operations that do work (a kernel launch on CUDA) outside the attention kernel
  call -- gathers, copies, writes, the merge;
* ``views`` and ``allocs``: views and ``empty`` allocations (no kernel), inside the kernel
  call too;
* ``kernel_calls`` / ``kernel_ops``: the attention kernel's calls and the operations that do
  work inside them;
* ``transport_ops``: the in-process transport's own copies (the emulated network; a real
  transport posts point-to-point transfers instead).

With ``--build-only``: host time to build every rank's device plan (one core), e.g. for the
paper batch (131,072 tokens, 4 x 8 ranks, B = 1024)::

    python -m torch_dcp.benchmarks ops --build-only --batch longtail --tokens 131072 --topology 4x8 \
        --block-size 1024 --divisions 4 --heads 8 --kv-heads 2 --head-dim 128 --dtype bfloat16 --kernel flex

The second call of a step is counted (the first one uploads the device plan). ``per_div`` is
``ops`` over the divisions the rank runs. On CUDA the profiler's kernel count of the whole step
is printed too (all ranks, everything included, the emulated network's copies as well).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_dcp
from torch_dcp.executor import InProcessTransport, Mailbox, get_kernel, make_executor

__all__ = ["count_ops", "device_plan_seconds", "per_division", "per_pass_and_division", "count_preset_cases",
           "write_preset", "PRESET_CASES", "PER_PASS_ROLES", "add_arguments", "run", "main"]

_ALLOCS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
#: metadata queries that reach the dispatcher under fake tensors (``Tensor.device``, symbolic sizes): no work
_METADATA = {"device", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous"}


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rank = 0
        self.where = "executor"  # or "kernel", "transport"
        self.counts: dict[tuple[int, str], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _METADATA:
            return func(*args, **(kwargs or {}))
        if self.where == "transport":
            cat = "transport_ops"
        elif func.is_view or name in ("view", "_unsafe_view", "alias", "as_strided"):
            cat = "views"
        elif name in _ALLOCS:
            cat = "allocs"
        else:
            cat = "kernel_ops" if self.where == "kernel" else "ops"
        key = (self.rank, cat)
        self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _flex_counted(counter: _Counter) -> Iterator[None]:
    """FlexAttention's compiled forward and backward (:mod:`torch_dcp.executor.kernels.flex`)
    counted as one kernel launch each, run with the counter popped (Dynamo does not trace a
    dispatch mode's rules)."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    from torch_dcp.executor.kernels import flex

    def counted(inner: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            key = (counter.rank, "kernel_ops" if counter.where == "kernel" else "ops")
            counter.counts[key] = counter.counts.get(key, 0) + 1
            with _pop_mode_temporarily():
                return inner(*args, **kwargs)

        run.counted_inner = inner
        return run

    saved = flex._compiled, flex.flex_attention, flex._backward_op
    # compiled from the uncounted functions: Dynamo cannot trace the counter's mode switch
    flex._compiled = lambda name, fn, backend: counted(saved[0](name, getattr(fn, "counted_inner", fn), backend))
    flex.flex_attention, flex._backward_op = counted(saved[1]), counted(saved[2])  # uncompiled (fake tensors)
    try:
        yield
    finally:
        flex._compiled, flex.flex_attention, flex._backward_op = saved


class _CountedKernel:
    """Delegates to a kernel, marking its calls for the counter."""

    def __init__(self, kernel: Any, counter: _Counter):
        self.kernel, self.counter = kernel, counter
        self.name = kernel.name

    def prepare(self, div):
        return self.kernel.prepare(div)

    def bind(self, arrays, static):
        return self.kernel.bind(arrays, static)

    def _call(self, fn, *args):
        c = self.counter
        c.counts[(c.rank, "kernel_calls")] = c.counts.get((c.rank, "kernel_calls"), 0) + 1
        c.where = "kernel"
        try:
            return fn(*args)
        finally:
            c.where = "executor"

    def forward(self, *args):
        return self._call(self.kernel.forward, *args)

    def backward(self, *args):
        return self._call(self.kernel.backward, *args)


class _CountedTransport(InProcessTransport):
    def __init__(self, mailbox: Mailbox, rank: int, counter: _Counter):
        super().__init__(mailbox, rank)
        self.counter = counter

    def launch(self, phase, sends, recvs):
        self.counter.where = "transport"
        try:
            return super().launch(phase, sends, recvs)
        finally:
            self.counter.where = "executor"

    def all_gather(self, phase, shard, out, members):
        return self._as_transport(super().all_gather, phase, shard, out, members)

    def reduce_scatter(self, phase, inp, out, members):
        return self._as_transport(super().reduce_scatter, phase, inp, out, members)

    def all_to_all(self, phase, inp, out, in_rows, out_rows, members, tag=0):
        return self._as_transport(super().all_to_all, phase, inp, out, in_rows, out_rows, members, tag)

    def _as_transport(self, fn, *args):
        self.counter.where = "transport"
        try:
            return fn(*args)
        finally:
            self.counter.where = "executor"

    def finish(self, collective):  # the point-to-point emulation's own copies and sums are NCCL's work
        return self._transport_steps(super().finish(collective))

    def wait(self, handle):
        return self._transport_steps(super().wait(handle))

    def _transport_steps(self, gen):
        # nested (finish waits through wait): each step restores where it was called from, so
        # that a collective's last work (a reduce-scatter's sum) stays the transport's
        while True:
            outer, self.counter.where = self.counter.where, "transport"
            try:
                next(gen)
            except StopIteration:
                return
            finally:
                self.counter.where = outer
            yield


def _tagged(gen, rank: int, counter: _Counter):
    while True:
        counter.rank = rank
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value
        yield


def _drive(gens: list, counter: _Counter, mailbox: Mailbox) -> list:
    from torch_dcp._interleave import interleave

    return interleave([_tagged(g, r, counter) for r, g in enumerate(gens)], lambda: mailbox.events)


def count_ops(plan: torch_dcp.Plan, device: str = "cpu", kernel: str | None = None, seed: int = 0,
              fake: bool = False) -> list[dict]:
    """Count the operations of every rank's second forward and backward call of ``plan``.

    Args:
        fake: run on fake tensors (``FakeTensorMode``; with ``device="cuda"`` under a CUDA
            build of torch without a GPU: the CUDA path's operators, the kernels' capability
            check told an H100, ``(9, 0)``).

    Returns one dict per (rank, pass): ``rank``, ``pass``, ``divisions``, ``ops``, ``per_div``,
    ``views``, ``allocs``, ``kernel_calls``, ``kernel_ops``, ``transport_ops``, and
    ``device_ops`` (``ops + kernel_ops``: every operation that does work on the device, the
    transport's left out) with ``device_per_div``.

    Raises:
        RuntimeError: ``fake`` with ``device="cuda"`` under a CPU build of torch.
    """
    if fake:
        from contextlib import ExitStack

        from torch._subclasses.fake_tensor import FakeTensorMode

        if device.startswith("cuda") and torch.version.cuda is None:
            raise RuntimeError("ops --fake --device cuda needs a CUDA build of torch (no GPU needed); this one is "
                               f"{torch.__version__}")
        from torch_dcp.executor.kernels.varlen import assume_cuda_capability

        device = "cuda:0" if device == "cuda" else device  # no driver to ask for the current device
        with ExitStack() as stack:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(assume_cuda_capability((9, 0)))
            return _count_ops(plan, device, kernel, seed)
    return _count_ops(plan, device, kernel, seed)


def _count_ops(plan: torch_dcp.Plan, device: str, kernel: str | None, seed: int) -> list[dict]:
    b = plan.batch
    dt = getattr(torch, b.dtype)
    g = torch.Generator().manual_seed(seed)
    T = b.total_tokens
    q, go = (torch.randn(T, b.n_heads, b.head_dim, generator=g).to(device, dt) for _ in range(2))
    k, v = (torch.randn(T, b.n_kv_heads, b.head_dim, generator=g).to(device, dt) for _ in range(2))
    counter = _Counter()
    mailbox = Mailbox()
    kern = _CountedKernel(get_kernel(kernel, device=device, dtype=dt, head_dim=b.head_dim), counter)
    ranks = range(plan.world_size)
    execs = [make_executor(plan, r, _CountedTransport(mailbox, r, counter), kernel=kern) for r in ranks]
    idx = [torch.from_numpy(plan.token_indices(r)).to(device) for r in ranks]
    local = [(q[i], k[i], v[i]) for i in idx]
    for e in execs:
        e.prepare(torch.device(device))
    rows = []
    for attempt in range(2):  # the first call warms up (and compiles, for compiled kernels)
        counter.counts.clear()
        # as the attention op runs them: the forward keeps what its backward reuses (head
        # parallelism's head-sharded tensors: only dO travels in again; nothing for the others)
        with _flex_counted(counter), counter:
            fwd = _drive([e.forward_steps(*x, keep=True) for e, x in zip(execs, local)], counter, mailbox)
        f_counts = dict(counter.counts)
        counter.counts.clear()
        # each rank's dO taken before counting (an indexing op of the harness, not the executor's)
        douts = [go[i] for i in idx]
        with _flex_counted(counter), counter:
            _drive([e.backward_steps(*x, o, lse, dout, state=state)
                    for e, x, (o, lse, state), dout in zip(execs, local, fwd, douts)], counter, mailbox)
        b_counts = dict(counter.counts)
    from torch_dcp.plan.heads import HeadParallelPlan

    outer, n = (plan.outer, plan.head_parallel) if isinstance(plan, HeadParallelPlan) else (plan, 1)
    for r in ranks:
        for name, counts, backward in (("forward", f_counts, False), ("backward", b_counts, True)):
            # the static runtimes: their own steps (the all-gather's one attention call per rank and pass)
            divs = 1 if outer.placement.runtime.gathers else len(outer.program(r // n, backward).divisions)
            row = {"rank": r, "pass": name, "divisions": divs}
            for cat in ("ops", "views", "allocs", "kernel_calls", "kernel_ops", "transport_ops"):
                row[cat] = counts.get((r, cat), 0)
            row["per_div"] = round(row["ops"] / max(1, divs), 2)
            row["device_ops"] = row["ops"] + row["kernel_ops"]
            row["device_per_div"] = round(row["device_ops"] / max(1, divs), 2)
            rows.append(row)
    return rows


def device_plan_seconds(plan: torch_dcp.Plan, kernel: str | None = None, device: str = "cpu",
                        repeat: int = 3) -> dict[str, Any]:
    """Host seconds to build each rank's :class:`~torch_dcp.executor.DevicePlan` (programs
    compiled beforehand, as the planner's output), best of ``repeat``, on one thread."""
    import numpy as np

    from torch_dcp.executor import DevicePlan

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kern = get_kernel(kernel, device=device, dtype=getattr(torch, plan.batch.dtype), head_dim=plan.batch.head_dim)
        secs, nbytes = [], []
        for r in range(plan.world_size):
            plan.program(r, False), plan.program(r, True)
            best = float("inf")
            for _ in range(repeat):
                dp = DevicePlan(plan, r, kern)
                best = min(best, dp.build_seconds)
            secs.append(best)
            nbytes.append(dp.nbytes)
    finally:
        torch.set_num_threads(threads)
    return {"kernel": kern.name, "ranks": plan.world_size, "build_ms_median": round(float(np.median(secs)) * 1e3, 3),
            "build_ms_max": round(max(secs) * 1e3, 3), "bytes_median": int(np.median(nbytes))}


def _plan(args: argparse.Namespace) -> torch_dcp.Plan:
    from .common import batch_lengths, topology_of

    lens = batch_lengths(args.batch, args.tokens, seed=args.seed,
                         max_doc_len=args.max_doc_len if args.batch == "corpus" else None)
    masks = {"causal": torch_dcp.Causal(), "lambda": torch_dcp.Lambda(sink=64, window=512),
             "blockwise": torch_dcp.BlockwiseCausal(block=128, window_blocks=2, sink_blocks=1),
             "shared_question": torch_dcp.SharedQuestion(0.2, 4)}
    batch = torch_dcp.BatchSpec(lens, masks[args.mask], n_heads=args.heads, n_kv_heads=args.kv_heads,
                                head_dim=args.head_dim, dtype=args.dtype)
    topo = topology_of(args.topology) if args.topology else args.ranks
    # the flat plan: one RankExecutor per rank; --fake counts a GPU's plan (without a GPU "auto" would
    # plan for this CPU): the a100 kernel model, which the documented counts were taken with
    cost = "a100" if getattr(args, "fake", False) else "auto"
    cp_size = getattr(args, "cp_size", None)
    if cp_size is not None:  # all-gather CP on torch_dcp's own runtime, CP groups of cp_size ranks
        import dataclasses

        from torch_dcp.api import divide
        from torch_dcp.planners import Runtime, plan_allgather

        topo = torch_dcp.Topology.coerce(topo)
        runtime = Runtime.DCP_NODE_ALLGATHER if getattr(args, "node_once", False) else Runtime.DCP_ALLGATHER
        n = getattr(args, "head_parallel", 1)
        if n > 1:  # inside head groups of n ranks (torch_dcp's head parallelism): Ulysses' shape at cp_size 1
            from torch_dcp.plan.heads import HeadLayout, HeadParallelPlan

            lay = HeadLayout.of(batch, n)
            outer_batch, outer_topo = lay.outer_batch(batch), lay.outer_topology(topo)
            placement = dataclasses.replace(plan_allgather(outer_batch, outer_topo, cp_size=cp_size), runtime=runtime)
            return HeadParallelPlan(divide(placement, outer_topo, 1), batch, topo, n)
        placement = dataclasses.replace(plan_allgather(batch, topo, cp_size=cp_size), runtime=runtime)
        return divide(placement, topo, 1)
    # dcp's own placements: the general executor's divisions (its static runtimes are counted apart)
    own = {"rivals": ("ring", "megatron", "allgather", "documents")} if args.planner == "dcp" else {}
    n = getattr(args, "head_parallel", 1)
    if n > 1:  # inside head groups of n ranks around dcp's own placement of the outer plan (the executor)
        from torch_dcp.plan.heads import HeadLayout, HeadParallelPlan

        topo = torch_dcp.Topology.coerce(topo)
        lay = HeadLayout.of(batch, n)
        outer = torch_dcp.plan(lay.outer_batch(batch), lay.outer_topology(topo), planner=args.planner,
                               block_size=args.block_size, divisions=args.divisions, head_parallel=1, cost_model=cost,
                               **({"rivals": ()} if args.planner == "dcp" else {}))
        return HeadParallelPlan(outer, batch, topo, n)
    return torch_dcp.plan(batch, topo, planner=args.planner, block_size=args.block_size, divisions=args.divisions,
                          head_parallel=1, cost_model=cost, **own)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m torch_dcp.benchmarks ops``."""
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--divisions", type=int, default=2)
    p.add_argument("--planner", default="dcp")
    p.add_argument("--cp-size", type=int, default=None,
                   help="count all-gather CP on torch_dcp's own runtime at this CP size instead of --planner's plan")
    p.add_argument("--node-once", action="store_true",
                   help="with --cp-size (whole nodes): the all-gather whose collectives cross each node once")
    p.add_argument("--batch", choices=["corpus", "longtail"], default="corpus")
    p.add_argument("--mask", choices=["causal", "lambda", "blockwise", "shared_question"], default="causal")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--max-doc-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kernel", default=None, help="reference, sdpa, flex (default: auto for the device)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topology", default=None, help="NODESxRANKS, e.g. 4x8 (default: one node)")
    p.add_argument("--build-only", action="store_true", help="only time building the device plans")
    p.add_argument("--fake", action="store_true",
                   help="fake tensors (with --device cuda: the CUDA path counted under a CUDA build, no GPU needed)")
    p.add_argument("--write-preset", default=None, metavar="FILE",
                   help="with --fake --device cuda: count the GPU executor preset's cases (every other option "
                        "ignored) and write the preset (torch_dcp/cost/presets/gpu_executor.json)")


#: the cases the GPU executor preset counts (torch_dcp/cost/presets/gpu_executor.json): kernel
#: role -> ``ops`` options (the paper's long-tail batch on 4 x 8 ranks, bf16, GQA 8/2, head_dim 128)
PRESET_CASES = {
    # dcp's executor, each kernel (the varlen call, FlexAttention): counted at these divisions and
    # at one (PER_PASS_ROLES), so operations per pass and per division come apart
    "fast": {"mask": "causal", "divisions": 6},
    "general": {"mask": "lambda", "divisions": 4},
    # torch_dcp's all-gather runtime (one call per rank and pass): alone (CP groups of one rank,
    # as the outer plan of Ulysses' shape) and gathering (CP groups of one node)
    "alone": {"mask": "causal", "divisions": 1, "cp_size": 1},
    "gathered": {"mask": "causal", "divisions": 1, "cp_size": 8},
    # torch_dcp's ring runtime (one attention call and one merge per step): per ring step, on a
    # ring of one node (as dcp's candidates run it: up to 8 ranks, HCP's ring across head groups)
    "ring": {"mask": "causal", "divisions": 8, "planner": "ring", "ranks": 8, "topology": "1x8"},
    # its all-gather crossing each node once (two attention calls and one merge per pass): CP
    # groups of two nodes
    "node": {"mask": "causal", "divisions": 1, "cp_size": 16, "node_once": True},
    # torch_dcp's head parallelism (its all-to-alls' own layouts, per pass): Ulysses' shape, 8-way
    # head groups around the all-gather runtime alone, its outer plan's own operations taken out
    "heads": {"mask": "causal", "divisions": 1, "cp_size": 1, "head_parallel": 8},
    # the same around torch_dcp's executor (dcp's own placement of the outer plan), which writes O
    # and the LSE straight into the state the forward keeps
    "heads_executor": {"mask": "causal", "divisions": 1, "head_parallel": 8},
}
#: the roles counted at one division too: their ``forward`` and ``backward`` are operations per
#: division past the first, ``forward_pass`` and ``backward_pass`` those of a pass whatever its
#: divisions (the inputs' copies into the buffers, the accumulators' zeros, ``delta``, the final
#: reductions and conversions), fitted per rank (:func:`per_pass_and_division`)
PER_PASS_ROLES = ("fast", "general")
_PRESET_BASE = {"ranks": 32, "topology": "4x8", "head_parallel": 1, "batch": "longtail", "tokens": 131072,
                "block_size": 1024, "heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16", "kernel": None,
                "device": "cuda", "fake": True, "planner": "dcp", "seed": 0, "max_doc_len": 4096}


def per_division(rows: list[dict]) -> dict[str, float]:
    """Device operations per division of each pass, over every rank (``count_ops`` rows)."""
    out = {}
    for name in ("forward", "backward"):
        sel = [r for r in rows if r["pass"] == name]
        out[name] = sum(r["device_ops"] for r in sel) / max(1, sum(max(1, r["divisions"]) for r in sel))
    return out


def per_pass_and_division(rows: list[dict], one: list[dict]) -> dict[str, float]:
    """Device operations per pass and per division of each pass, from ``count_ops`` rows of one
    plan at ``T`` divisions (``rows``) and at one (``one``): a rank's operations taken as ``a +
    b x d`` over its divisions ``d`` (at least 1), ``b`` from the mean operations and divisions
    per rank at the two counts, ``a`` the rest. Keys ``forward``, ``backward`` (``b``) and
    ``forward_pass``, ``backward_pass`` (``a``).

    Raises:
        ValueError: the two counts have the same mean divisions (``T`` left every rank one).
    """
    out = {}
    for name in ("forward", "backward"):
        means = []
        for rs in (rows, one):
            sel = [r for r in rs if r["pass"] == name]
            means.append((sum(r["device_ops"] for r in sel) / max(1, len(sel)),
                          sum(max(1, r["divisions"]) for r in sel) / max(1, len(sel))))
        (ops_t, div_t), (ops_1, div_1) = means
        if not div_t > div_1:
            raise ValueError(f"{name}: the plan has {div_t} divisions per rank, as at one division: nothing to fit")
        out[name] = (ops_t - ops_1) / (div_t - div_1)
        out[f"{name}_pass"] = ops_1 - out[name] * div_1
    return out


def count_preset_cases(roles: "list[str] | None" = None) -> dict[str, dict[str, Any]]:
    """:data:`PRESET_CASES` (all, or ``roles``) counted as the GPU executor preset counts them
    (fake CUDA tensors; a CUDA build of torch): role -> ``{mask, divisions, forward, backward}``
    (operations per division), with ``forward_pass`` and ``backward_pass`` (per pass) for
    :data:`PER_PASS_ROLES` (:func:`per_pass_and_division`)."""
    out = {}
    for role, case in PRESET_CASES.items():
        if roles is not None and role not in roles:
            continue
        args = argparse.Namespace(**{**_PRESET_BASE, **case})
        plan = _plan(args)
        rows = count_ops(plan, device="cuda", kernel=None, seed=0, fake=True)
        if role in PER_PASS_ROLES:
            one = count_ops(_plan(argparse.Namespace(**{**vars(args), "divisions": 1})), device="cuda", kernel=None,
                            seed=0, fake=True)
            counted = per_pass_and_division(rows, one)
        elif case.get("head_parallel", 1) > 1:  # the head-parallel layer's own: the whole less its outer plan's
            inner = per_division(count_ops(plan.outer, device="cuda", kernel=None, seed=0, fake=True))
            counted = {k: v - inner[k] for k, v in per_division(rows).items()}
        else:
            counted = per_division(rows)
        out[role] = {**case, **{k: round(v, 2) for k, v in counted.items()}}
    return out


def write_preset(path: str) -> dict[str, Any]:
    """Recount :data:`PRESET_CASES` and write the GPU executor preset to ``path``, keeping its
    (or the shipped preset's) seconds per operation, their source and the baselines' counts."""
    import datetime
    from pathlib import Path

    from torch_dcp.cost.model import GPU_EXECUTOR_PRESET

    src = Path(path) if Path(path).is_file() else GPU_EXECUTOR_PRESET
    d = json.loads(src.read_text())
    d.update(counted=count_preset_cases(), torch=torch.__version__,
             counted_on=datetime.date.today().isoformat())
    Path(path).write_text(json.dumps(d, indent=1, ensure_ascii=False) + "\n")
    return d


def run(args: argparse.Namespace, out=sys.stdout) -> list[dict]:
    """Run the benchmark with parsed options; prints JSON lines and a summary, returns the rows."""
    if args.write_preset:
        if not (args.fake and args.device == "cuda"):
            raise ValueError("--write-preset counts the CUDA path under fake tensors: pass --fake --device cuda")
        d = write_preset(args.write_preset)
        print(json.dumps(d["counted"]), file=out)
        print(f"wrote {args.write_preset}", file=out)
        return [d]
    plan = _plan(args)
    if args.build_only:
        row = device_plan_seconds(plan, args.kernel, args.device)
        print(json.dumps(row), file=out)
        return [row]
    rows = count_ops(plan, device=args.device, kernel=args.kernel, seed=args.seed, fake=args.fake)
    for row in rows:
        print(json.dumps(row), file=out)
    for name in ("forward", "backward"):
        sel = [r for r in rows if r["pass"] == name]
        worst = max(sel, key=lambda r: r["per_div"])
        n_div = max(1, sum(max(1, r["divisions"]) for r in sel))
        total = sum(r["ops"] for r in sel) / n_div
        dev = per_division(rows)[name]
        print(f"{name}: device ops per division, mean {dev:.2f} (executor {total:.2f} + kernel "
              f"{dev - total:.2f}); executor ops worst rank {worst['rank']} {worst['per_div']:.2f} "
              f"({worst['ops']} ops over {worst['divisions']} divisions; kernel calls {worst['kernel_calls']}, "
              f"views {worst['views']}, allocations {worst['allocs']})", file=out)
    if args.device.startswith("cuda") and not args.fake:
        print(json.dumps(cuda_launches(plan, args.kernel)), file=out)
    return rows


def cuda_launches(plan: torch_dcp.Plan, kernel: str | None = None) -> dict:
    """CUDA kernel launches of the second emulated step, all ranks, per rank and division."""
    from torch.profiler import ProfilerActivity, profile

    b = plan.batch
    dt = getattr(torch, b.dtype)
    T = b.total_tokens
    q, go = (torch.randn(T, b.n_heads, b.head_dim, device="cuda", dtype=dt) for _ in range(2))
    k, v = (torch.randn(T, b.n_kv_heads, b.head_dim, device="cuda", dtype=dt) for _ in range(2))
    kern = get_kernel(kernel, device="cuda", dtype=dt, head_dim=b.head_dim)
    torch_dcp.emulate(plan, q, k, v, go, kernel=kern)
    res = {}
    for name in ("forward", "backward"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if name == "forward":
                torch_dcp.emulate(plan, q, k, v, kernel=kern)
            else:
                torch_dcp.emulate(plan, q, k, v, go, kernel=kern)
            torch.cuda.synchronize()
        n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        res[name] = n
    divs = sum(max(1, len(plan.program(r).divisions)) for r in range(plan.world_size))
    # the backward emulation runs the forward too
    return {"cuda_kernels_forward_per_division": round(res["forward"] / divs, 2),
            "cuda_kernels_backward_per_division": round((res["backward"] - res["forward"]) / divs, 2),
            "note": "profiler kernel count of emulate(), all ranks, in-process transport copies included"}


def main(argv: list[str] | None = None, out=sys.stdout) -> list[dict]:
    """``run`` with its own parser (for scripts and tests)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv), out)
