"""One step's attention, forward + backward: the executor against one dense kernel call over the
same packed batch.

On the GPU (H100 targets: executor <= 1.15 x flex for causal and λ, <= 1.3 x varlen flash for
causal; busiest rank of 32 <= 1.3 x dense / 32 x the plan's compute imbalance)::

    python -m torch_dcp.benchmarks step --device cuda --tokens 131072 --mask causal
    python -m torch_dcp.benchmarks step --device cuda --tokens 131072 --mask lambda
    python -m torch_dcp.benchmarks step --device cuda --tokens 131072 --mask causal --ranks 32
    python -m torch_dcp.benchmarks step --device cuda --tokens 131072 --mask lambda --ranks 32

On the CPU (small defaults, seconds)::

    python -m torch_dcp.benchmarks step --device cpu
    python -m torch_dcp.benchmarks step --device cpu --mask lambda --ranks 4

What is measured, all in one run on one batch (``--batch longtail`` by default:
:func:`torch_dcp.data.long_tail_lengths`), inputs ``q: [T, H, D]``, ``k, v: [T, H_kv, D]``:

* **executor, W = 1**: a plan for one rank (no communication), its
  :class:`~torch_dcp.executor.RankExecutor` called through ``forward`` and ``backward``. The plan,
  the device plan's build and its upload stay out of the timing (a first call uploads, then the
  calls are timed); the kernel is ``--kernel`` (passed through to
  :func:`~torch_dcp.executor.get_kernel`).
* **dense**: on CUDA one compiled ``flex_attention`` call with a document ``BlockMask`` built
  from the batch's own masks (:class:`~torch_dcp.benchmarks.common.DenseAttention`), forward and
  autograd backward; on the CPU, where eager FlexAttention has no backward, SDPA with a dense
  boolean ``[T, T]`` mask instead (said so in the output).
* **varlen flash** (CUDA, 16-bit, causal or full masks): ``aten._flash_attention_forward`` with
  the documents' ``cu_seqlens`` (GQA native) and ``aten._flash_attention_backward``. A λ (sink +
  window) or other sparse mask has no single varlen call: n/a.
* **busiest rank of W** (``--ranks W``, W > 1; ``NODESxRANKS`` topology with
  ``--ranks-per-node``, 4 x 8 for 32; the planner's flat plan, ``head_parallel=1``, whose
  ranks run the executor on their own tokens): every rank's executor runs in this process on the
  in-process transport; each rank's forward + backward is timed on its own (the device
  synchronised around every stretch a rank runs, waits not counted). The emulated network's
  copies (the in-process transport's send copy and receive copy) are timed apart and excluded:
  a real transport moves those bytes over the links while the rank computes. The busiest rank
  is compared to ``dense / W x compute imbalance`` (max over ranks of the planned attention
  FLOPs / mean).

Correctness is checked once: the executor's output and gradients against the dense call's
(max abs error printed; also for the W-rank emulation and the varlen call). Absolute times
mean something only on a GPU; the ratios are printed side by side. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch

import torch_dcp
from torch_dcp.executor import InProcessTransport, Mailbox, RankExecutor

from .measure import NetworkTimedTransport, batch_inputs, timed_stretches
from .common import (DTYPES, MASKS, DenseAttention, batch_lengths, device_name, pick_device, time_median,
                     varlen_calls, varlen_unavailable)

__all__ = ["add_arguments", "run", "main", "TARGETS"]

#: H100 targets: executor / flex (causal and λ), executor / varlen flash (causal),
#: busiest rank / (dense / W x compute imbalance)
TARGETS = {"exec_over_dense": 1.15, "exec_over_varlen": 1.3, "busiest_over_ideal": 1.3}

_CUDA_DEFAULTS = {"tokens": 131072, "heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16",
                  "block_size": 1024, "repeat": 5}
_CPU_DEFAULTS = {"tokens": 2048, "heads": 4, "kv_heads": 2, "head_dim": 32, "dtype": "float32",
                 "block_size": 256, "repeat": 2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m torch_dcp.benchmarks step``."""
    d = "(default {cuda} on CUDA, {cpu} on the CPU)"

    def both(key):
        return d.format(cuda=_CUDA_DEFAULTS[key], cpu=_CPU_DEFAULTS[key])

    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--tokens", type=int, default=None, help=f"tokens of the packed batch {both('tokens')}")
    p.add_argument("--batch", choices=["longtail", "corpus", "one"], default="longtail")
    p.add_argument("--max-doc-len", type=int, default=None, help="longest document (default 32768 for longtail)")
    p.add_argument("--mask", choices=sorted(MASKS), default="causal")
    p.add_argument("--block-size", type=int, default=None, help=f"token block size {both('block_size')}")
    p.add_argument("--divisions", type=int, default=None,
                   help="divisions per rank (default: torch_dcp.plan's, min(4, tiles))")
    p.add_argument("--heads", type=int, default=None, help=both("heads"))
    p.add_argument("--kv-heads", type=int, default=None, help=both("kv_heads"))
    p.add_argument("--head-dim", type=int, default=None, help=both("head_dim"))
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help=both("dtype"))
    p.add_argument("--kernel", default="auto", help="executor kernel name (torch_dcp.executor.get_kernel), default auto")
    p.add_argument("--planner", default="dcp")
    p.add_argument("--ranks", type=int, default=1,
                   help="also the busiest rank of a plan for this many ranks, all emulated here (default 1: only W=1)")
    p.add_argument("--ranks-per-node", type=int, default=8,
                   help="ranks per node of the --ranks topology (one node when --ranks is smaller)")
    p.add_argument("--repeat", type=int, default=None, help=f"timed runs, median {both('repeat')}")
    p.add_argument("--layers", type=int, default=None,
                   help="also one training step of this many layers on every rank of --ranks (W = 1 too), each rank "
                        "timed per layer, eagerly and through layer replay (torch_dcp.benchmarks.layers)")
    p.add_argument("--profile", action="store_true",
                   help="with --layers: torch.profiler's summary of one layer of the busiest rank, replayed and eager")
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                   help="with --layers: also the replayed step (CUDA graphs on CUDA, the eager recorder on the CPU) "
                        "beside the eager one (default); --no-replay: the eager step alone")
    p.add_argument("--seed", type=int, default=0)


def _filled(args: argparse.Namespace, dev: torch.device) -> argparse.Namespace:
    a = argparse.Namespace(**vars(args))
    for key, val in (_CUDA_DEFAULTS if dev.type == "cuda" else _CPU_DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, val)
    return a


def _topology(ranks: int, per_node: int) -> torch_dcp.Topology:
    if ranks < 1 or per_node < 1:
        raise ValueError(f"--ranks and --ranks-per-node must be positive, got {ranks}, {per_node}")
    if ranks <= per_node:
        return torch_dcp.Topology(n_nodes=1, ranks_per_node=ranks)
    if ranks % per_node:
        raise ValueError(f"--ranks {ranks} is not a whole number of nodes of {per_node} ranks")
    return torch_dcp.Topology(n_nodes=ranks // per_node, ranks_per_node=per_node)


def _name(kernel: Any) -> str:
    return getattr(kernel, "name", type(kernel).__name__)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------------- dense references
def _dense(batch, dev, q, k, v, go, repeat) -> dict[str, Any]:
    """One dense call, forward + autograd backward: seconds, results (global order) and name."""
    fn = DenseAttention(batch, dev)
    q4, k4, v4 = (DenseAttention.heads_first(t).requires_grad_() for t in (q, k, v))
    go4 = DenseAttention.heads_first(go)

    def step():
        o = fn(q4, k4, v4)
        return (o,) + torch.autograd.grad(o, (q4, k4, v4), go4)

    res = [t.detach()[0].transpose(0, 1) for t in step()]
    name = fn.name if fn.flex else fn.name + " (eager FlexAttention has no backward on the CPU)"
    return {"s": time_median(step, dev, repeat), "results": res, "name": name}


def _varlen(batch, dev, q, k, v, go, repeat) -> dict[str, Any]:
    """``aten._flash_attention_forward`` + ``_backward`` over the documents' ``cu_seqlens``."""
    _, step = varlen_calls(batch, dev, q, k, v, go)
    res = step()
    return {"s": time_median(step, dev, repeat), "results": res}


# ---------------------------------------------------------------------- executor, W = 1
def _one_rank(batch, args, dev, q, k, v, go) -> dict[str, Any]:
    plan = torch_dcp.plan(batch, 1, planner=args.planner, block_size=args.block_size, divisions=args.divisions)
    ex = RankExecutor(plan, 0, InProcessTransport(Mailbox(), 0), kernel=args.kernel)
    ex.prepare(dev)  # device plan built and uploaded here, off the timed calls
    idx = torch.from_numpy(plan.token_indices(0)).to(dev)
    lq, lk, lv, lgo = (t[idx] for t in (q, k, v, go))

    def step():
        o, lse = ex.forward(lq, lk, lv)
        return (o,) + ex.backward(lq, lk, lv, o, lse, lgo)

    local = step()
    res = []
    for t, like in zip(local, (q, q, k, v)):
        g = torch.empty_like(like)
        g[idx] = t
        res.append(g)
    return {"s": time_median(step, dev, args.repeat), "results": res, "kernel": _name(ex.kernel),
            "divisions": plan.divisions}


# ---------------------------------------------------------------------- W ranks, emulated
def _ranks(batch, args, dev, q, k, v, go) -> dict[str, Any]:
    """Every rank's forward + backward seconds (network copies excluded), median of
    ``args.repeat`` steps after a first one that uploads the device plans; the first step's
    output (global order) for the check."""
    from torch_dcp._interleave import interleave

    topo = _topology(args.ranks, args.ranks_per_node)
    plan = torch_dcp.plan(batch, topo, planner=args.planner, block_size=args.block_size, divisions=args.divisions,
                          head_parallel=1)  # the flat plan: each rank's executor on its own tokens
    W = plan.world_size
    mailbox = Mailbox()
    nets = [NetworkTimedTransport(mailbox, r, dev) for r in range(W)]
    b = plan.batch  # one kernel instance (and its caches) for all ranks
    kern = torch_dcp.executor.get_kernel(args.kernel, device=dev, dtype=getattr(torch, b.dtype), head_dim=b.head_dim)
    execs = [RankExecutor(plan, r, nets[r], kernel=kern) for r in range(W)]
    for e in execs:
        e.prepare(dev)
    idx = [torch.from_numpy(plan.token_indices(r)).to(dev) for r in range(W)]
    local = [(q[i], k[i], v[i], go[i]) for i in idx]
    runs, first = [], None
    for _ in range(1 + max(1, args.repeat)):
        busy = np.zeros(W)
        for n in nets:
            n.seconds = 0.0
        fwd = interleave([timed_stretches(e.forward_steps(*x[:3]), busy, r, dev) for r, (e, x) in enumerate(zip(execs, local))],
                         lambda: mailbox.events)
        interleave([timed_stretches(e.backward_steps(*x[:3], o, lse, x[3]), busy, r, dev)
                    for r, (e, x, (o, lse)) in enumerate(zip(execs, local, fwd))], lambda: mailbox.events)
        if first is None:
            first = fwd
        else:
            runs.append(busy - np.array([n.seconds for n in nets]))
    out = torch.empty_like(q)
    for i, (o, _) in zip(idx, first):
        out[i] = o
    flops = plan.placement.rank_flops()
    return {"seconds": np.median(runs, axis=0), "out": out, "imbalance": float(flops.max() / flops.mean()),
            "topology": f"{topo.n_nodes}x{topo.ranks_per_node}", "kernel": _name(kern)}


# ---------------------------------------------------------------------- L layers, eager and replayed
def _layered(batch, args, dev, inputs, dense_s, varlen_s, p) -> dict[str, Any]:
    """One step of ``args.layers`` layers on every rank of ``args.ranks``, each rank alone and
    timed per layer (:mod:`torch_dcp.benchmarks.layers`), eagerly and, unless ``--no-replay``,
    through layer replay; the figures of both, side by side."""
    from . import layers as lay

    if args.layers < 1 or (args.replay and args.layers < 2):
        raise ValueError(f"--layers must be at least 2 with replay (1 records, later ones replay), at least 1 with "
                         f"--no-replay; got {args.layers}")
    topo = _topology(args.ranks, args.ranks_per_node)
    plan = torch_dcp.plan(batch, topo, planner=args.planner, block_size=args.block_size, divisions=args.divisions,
                          head_parallel=1)
    W = plan.world_size
    kern = torch_dcp.executor.get_kernel(args.kernel, device=dev, dtype=getattr(torch, batch.dtype),
                                         head_dim=batch.head_dim)
    ranks = lay.emulate_ranks(plan, dev, kern, inputs=inputs)
    flops = plan.placement.rank_flops()
    imbalance = float(flops.max() / flops.mean())
    ideal = dense_s / W * imbalance
    eager = lay.time_layers(ranks, args.layers)
    e_busiest = eager.total.max(axis=1)
    e_steady = eager.steady()
    out: dict[str, Any] = {
        "layers": args.layers, "layers_ranks": W, "layers_topology": f"{topo.n_nodes}x{topo.ranks_per_node}",
        "layers_kernel": _name(kern), "layers_divisions": plan.divisions, "layers_imbalance": imbalance,
        "layers_ideal_s": ideal, "layers_varlen_ideal_s": varlen_s / W * imbalance if varlen_s else None,
        "eager_layer_busiest_s": e_busiest.tolist(), "eager_rank_layer_s": eager.total.tolist(),
        "eager_busiest_s": float(e_steady.max()), "eager_busiest_over_ideal": float(e_steady.max()) / ideal,
        "eager_peak_bytes": eager.peak_bytes, "replay": bool(args.replay),
    }
    p(f"{args.layers} layers on each of {W} ranks ({out['layers_topology']}, kernel {out['layers_kernel']}, "
      f"{plan.divisions} divisions), each rank alone, received bytes not copied; busiest rank per layer, ms "
      f"(ideal: dense / {W} x compute imbalance {imbalance:.3f} = {ideal * 1e3:.3f} ms):")
    if not args.replay:
        p("| layer | eager |\n|---|---|")
        for i, t in enumerate(e_busiest):
            p(f"| {i} | {t * 1e3:.3f} |")
        p(f"eager: busiest rank per layer {out['eager_busiest_s'] * 1e3:.3f} ms, "
          f"{out['eager_busiest_over_ideal']:.2f} x ideal")
        return out
    rec = lay.bench_recorder(dev)
    replay = lay.time_layers(ranks, args.layers, rec)
    r_busiest = replay.total.max(axis=1)
    later = float(replay.steady().max())  # the busiest rank's replayed layer
    capture = replay.recording()
    check = list(range(W)) if W <= 8 else sorted({0, int(np.argmax(eager.total.sum(0))), W - 1})
    busiest_rank = int(np.argmax(replay.steady()))
    out.update({
        "recorder": type(rec).__name__, "replay_layer_busiest_s": r_busiest.tolist(),
        "replay_rank_layer_s": replay.total.tolist(), "replay_busiest_s": later,
        "replay_busiest_over_ideal": later / ideal,
        "replay_busiest_over_varlen_ideal": later / out["layers_varlen_ideal_s"] if varlen_s else None,
        "replay_over_eager": later / out["eager_busiest_s"],
        "capture_s_max": float(capture.max()), "capture_s_median": float(np.median(capture)),
        "replay_peak_bytes": replay.peak_bytes,
        "replay_peak_over_eager": (replay.peak_bytes / eager.peak_bytes) if eager.peak_bytes else None,
        "replay_fallback_ranks": list(replay.fallbacks),
        "replay_err_ranks": check,
        "replay_sync_error": lay.replayed_layer_syncs(ranks, rec, busiest_rank),
    })
    err = lay.replay_error(ranks, rec, check)
    out.update({"replay_err_forward": err["forward"], "replay_err_backward": err["backward"],
                "eager_backward_spread": err["eager_backward_spread"],
                "replay_backward_over_spread": err["backward"] / max(err["eager_backward_spread"], 1e-30)})
    out["replay_sync_failures"] = int(out["replay_sync_error"] is not None) if dev.type == "cuda" else None
    out["replay_fallbacks"] = len(replay.fallbacks)
    if args.profile:  # where the busiest rank's replayed layer spends its time, beside its eager layer
        for name, r in (("replay", rec), ("eager", None)):
            prof = lay.profile_layer(ranks, busiest_rank, r)
            out.update({f"profile_{name}_wall_s": prof["wall_s"], f"profile_{name}_device_s": prof["device_s"],
                        f"profile_{name}_kernels_per_division": prof["per_division"], f"profile_{name}_top": prof["top"]})
            p(f"profile, rank {busiest_rank}, one {name} layer: {prof['wall_s'] * 1e3:.3f} ms wall, "
              f"{prof['device_s'] * 1e3:.3f} ms in {prof['kernels']} {'device kernels' if dev.type == 'cuda' else 'operators'} "
              f"({prof['per_division']:.1f} per "
              f"division and pass); the largest:")
            for kname, calls, sec in prof["top"]:
                p(f"    {sec * 1e3:8.3f} ms  {calls:4d} x  {kname}")
    p("| layer | eager | replay |\n|---|---|---|")
    last = len(r_busiest) - 1
    for i, (a_, b_) in enumerate(zip(e_busiest, r_busiest)):
        note = " (records the forward)" if i == 0 else " (records the backward)" if i == last else ""
        p(f"| {i}{note} | {a_ * 1e3:.3f} | {b_ * 1e3:.3f} |")
    p(f"replay ({out['recorder']}): busiest rank per replayed layer {later * 1e3:.3f} ms = {out['replay_busiest_over_ideal']:.2f} "
      f"x ideal (eager {out['eager_busiest_over_ideal']:.2f}); replay / eager {out['replay_over_eager']:.2f}; capture "
      f"(recording) per step, worst rank {out['capture_s_max'] * 1e3:.1f} ms (median {out['capture_s_median'] * 1e3:.1f} ms); "
      f"ranks that fell back to eager: {out['replay_fallback_ranks'] or 'none'}")
    if eager.peak_bytes:
        p(f"peak memory over the inputs: eager {eager.peak_bytes / 2**20:.1f} MiB, replay "
          f"{replay.peak_bytes / 2**20:.1f} MiB ({out['replay_peak_over_eager']:.2f} x)")
    p(f"check: replayed results vs eager, ranks {check}: max abs difference, forward {out['replay_err_forward']:.2e}, "
      f"backward {out['replay_err_backward']:.2e} (eager backward run again: {out['eager_backward_spread']:.2e}); a replayed layer "
      f"under sync debug 'error': {out['replay_sync_error'] or ('no synchronisation' if dev.type == 'cuda' else 'n/a on the CPU')}")
    return out


# ---------------------------------------------------------------------- the command
def run(args: argparse.Namespace, out: Any = None) -> dict[str, Any]:
    """Run the benchmark with parsed options; prints a table and a final JSON line to ``out``
    (default ``sys.stdout``), returns the JSON's dict.

    Raises:
        ValueError: a bad option (unknown kernel, a topology that does not divide ``--ranks``).
    """
    dev = pick_device(args.device)
    a = _filled(args, dev)
    lens = batch_lengths(a.batch, a.tokens, seed=a.seed, max_doc_len=a.max_doc_len)
    batch = torch_dcp.BatchSpec(lens, MASKS[a.mask], n_heads=a.heads, n_kv_heads=a.kv_heads, head_dim=a.head_dim,
                                dtype=a.dtype)
    q, k, v, go = batch_inputs(batch, dev, a.seed)

    out = out or sys.stdout

    def p(s=""):
        print(s, file=out, flush=True)

    p(f"step: {batch.total_tokens} tokens, {batch.n_docs} documents (longest {int(batch.doc_lens.max())}), "
      f"mask {a.mask}, {a.dtype}, GQA {a.heads}/{a.kv_heads}, head_dim {a.head_dim}, block {a.block_size}, "
      f"{a.divisions or 'auto'} divisions, planner {a.planner}; on {device_name(dev)}, torch {torch.__version__}; "
      f"forward + backward, median of {a.repeat}")
    ex = _one_rank(batch, a, dev, q, k, v, go)
    dense = _dense(batch, dev, q, k, v, go, a.repeat)
    why = varlen_unavailable(batch, dev)
    var = None if why else _varlen(batch, dev, q, k, v, go, a.repeat)
    errs = [_max_err(x, y) for x, y in zip(ex["results"], dense["results"])]
    res: dict[str, Any] = {
        "device": device_name(dev), "torch": torch.__version__, "tokens": batch.total_tokens, "docs": batch.n_docs,
        "max_doc": int(batch.doc_lens.max()), "mask": a.mask, "dtype": a.dtype, "heads": a.heads,
        "kv_heads": a.kv_heads, "head_dim": a.head_dim, "block_size": a.block_size, "divisions": ex["divisions"],
        "planner": a.planner, "kernel": ex["kernel"], "repeat": a.repeat,
        "exec_s": ex["s"], "dense_s": dense["s"], "dense": dense["name"], "exec_over_dense": ex["s"] / dense["s"],
        "varlen_s": var["s"] if var else None, "varlen": why or "aten._flash_attention_forward/_backward, cu_seqlens",
        "exec_over_varlen": ex["s"] / var["s"] if var else None,
        "err_out": errs[0], "err_dq": errs[1], "err_dk": errs[2], "err_dv": errs[3],
        "varlen_err_out": _max_err(var["results"][0], dense["results"][0]) if var else None,
        "targets": TARGETS,
    }
    p("| W=1, forward + backward | ms | executor / it | target (H100) |")
    p("|---|---|---|---|")
    p(f"| executor, kernel {ex['kernel']} | {ex['s'] * 1e3:.3f} | | |")
    p(f"| dense: {dense['name']} | {dense['s'] * 1e3:.3f} | {res['exec_over_dense']:.2f} | "
      f"<= {TARGETS['exec_over_dense']} |")
    if var:
        p(f"| varlen flash (cu_seqlens) | {var['s'] * 1e3:.3f} | {res['exec_over_varlen']:.2f} | "
          f"<= {TARGETS['exec_over_varlen']} |")
    else:
        p(f"| varlen flash | n/a: {why} | | |")
    p(f"check: executor vs dense, max abs error: out {errs[0]:.2e}, dq {errs[1]:.2e}, dk {errs[2]:.2e}, "
      f"dv {errs[3]:.2e}" + (f"; varlen vs dense out {res['varlen_err_out']:.2e}" if var else ""))
    if a.ranks > 1:
        rk = _ranks(batch, a, dev, q, k, v, go)
        sec = rk["seconds"]
        busiest = int(np.argmax(sec))
        ideal = dense["s"] / a.ranks * rk["imbalance"]
        res.update({"ranks": a.ranks, "topology": rk["topology"], "ranks_kernel": rk["kernel"],
                    "rank_s": sec.tolist(), "busiest_rank": busiest, "busiest_s": float(sec[busiest]),
                    "median_rank_s": float(np.median(sec)), "compute_imbalance": rk["imbalance"], "ideal_s": ideal,
                    "busiest_over_ideal": float(sec[busiest]) / ideal,
                    "busiest_over_varlen_ideal": (float(sec[busiest]) / (var["s"] / a.ranks * rk["imbalance"])
                                                  if var else None),
                    "ranks_err_out": _max_err(rk["out"], dense["results"][0]), "network_copies": "excluded"})
        p(f"W={a.ranks} ({rk['topology']}, planner {a.planner}, kernel {rk['kernel']}), each rank's forward + "
          f"backward alone, emulated network copies excluded:")
        p(f"  busiest rank {busiest}: {sec[busiest] * 1e3:.3f} ms (median rank {np.median(sec) * 1e3:.3f} ms); "
          f"dense / {a.ranks} x compute imbalance {rk['imbalance']:.3f} = {ideal * 1e3:.3f} ms; ratio "
          f"{res['busiest_over_ideal']:.2f} (target <= {TARGETS['busiest_over_ideal']})"
          + (f"; against varlen flash: {res['busiest_over_varlen_ideal']:.2f}" if var else ""))
        p(f"  check: emulated {a.ranks}-rank output vs dense, max abs error {res['ranks_err_out']:.2e}")
    if a.layers:
        res.update(_layered(batch, a, dev, (q, k, v, go), dense["s"], var["s"] if var else None, p))
    p(json.dumps(res))
    return res


def main(argv: list[str] | None = None, out: Any = None) -> dict[str, Any]:
    """``run`` with its own parser (for scripts and tests)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv), out)
