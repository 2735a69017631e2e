"""Train a small Llama-style decoder on real documents with dynamic context parallelism.

    torchrun --standalone --nproc-per-node 4 recipes/train_llama.py            # DCP (default)
    torchrun --standalone --nproc-per-node 4 recipes/train_llama.py --cp-impl torch   # PyTorch's CP
    python recipes/train_llama.py --cp-impl none                                # one process, no parallelism
    torchrun --standalone --nproc-per-node 4 recipes/train_llama.py --compare-precomputed 4   # loader vs precomputed plans

What happens every step:

* real documents (the Python standard library's sources, byte-level tokens; or ``--data``)
  are packed into one global batch of ``--tokens-per-step`` tokens, documents capped at
  ``--max-doc-len``: many short documents and a few long ones;
* every rank builds the same ``BatchSpec`` (document lengths + mask); a
  :class:`torch_dcp.data.PlanningLoader` plans it ``--plan-ahead`` steps ahead in worker
  processes (step ``i`` on rank ``i mod W``'s workers, shared through the process group's
  Store; every rank builds its device plan in the background), so the loop receives the step
  with its plan ready (``--plan-ahead 0``: every rank plans in line);
* ``torch_dcp.context_parallel(..., plan=, device_plan=)`` shards the token ids, labels and
  document-local position ids to this rank's planned tokens, and runs every
  ``F.scaled_dot_product_attention`` of the model under the plan, forward and backward;
* parameters are sharded with FSDP2 (``fully_shard``) over the same one-dimensional mesh:
  DCP unifies data and context parallelism in one dimension; with ``--tp N`` the mesh is
  ``(dcp, tp)``: attention and MLP are sharded by heads and hidden units with PyTorch's
  ``parallelize_module`` (Megatron-LM's column/row split), every TP rank runs the step's one
  plan over its own heads (``TensorParallelHeads``) through its DCP sub-group, the plan is
  made once per step for all TP ranks (``PlanningLoader(replica=, replicas=)``), and FSDP2
  shards over the ``dcp`` dimension;
* the loss is the sum of token losses divided by the global token count, so gradients do not
  depend on where tokens were placed.

The model code (``Attention.forward``) is plain PyTorch: it calls
``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_dcp
from torch_dcp.data import PlanningConfig, PlanningLoader, byte_tokenize, load_documents, pack_batches, planning_pool
from torch_dcp.executor.device_plan import host_to_device
from torch_dcp.tensor_parallel import TensorParallelHeads

MASKS = {
    "causal": lambda: torch_dcp.Causal(),
    "lambda": lambda: torch_dcp.Lambda(sink=64, window=512),
    "blockwise": lambda: torch_dcp.BlockwiseCausal(block=128, window_blocks=2, sink_blocks=1),
    "shared_question": lambda: torch_dcp.SharedQuestion(0.2, 4),
}


# ---------------------------------------------------------------------- model
@dataclass
class ModelArgs:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 352
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x: [1, H, S, D]`` at document-local ``positions: [1, S]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions[0].float()[:, None] * inv[None, :]  # [S, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x, positions, attn_mask=None):
        b, s, _ = x.shape
        a = self.a
        # heads from the projection's width: all of them, or this rank's under tensor parallelism
        # (wq, wk, wv sharded by heads); never -1, which a rank holding no tokens this step (s = 0)
        # cannot resolve
        q, k, v = (w(x) for w in (self.wq, self.wk, self.wv))
        q, k, v = (t.view(b, s, t.shape[-1] // a.head_dim, a.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = rope(q, positions, a.rope_theta), rope(k, positions, a.rope_theta)
        if attn_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # no context parallelism: an explicit packed-document mask
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, o.shape[1] * o.shape[3]))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, a.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x, positions, attn_mask=None):
        x = x + self.attention(self.attention_norm(x), positions, attn_mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, positions, attn_mask=None):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, positions, attn_mask)
        return self.output(self.norm(x))


def tensor_parallel(model: Transformer, mesh) -> None:
    """Shard every block over the TP ``mesh`` with PyTorch's ``parallelize_module``
    (Megatron-LM's split, Shoeybi et al., arXiv 1909.08053, §3): ``wq``, ``wk``, ``wv`` and the
    MLP's ``w1``, ``w3`` by output (heads, hidden units), ``wo`` and ``w2`` by input, so each
    TP rank attends over its own heads; embeddings, norms and the output stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"attention.wq": col, "attention.wk": col, "attention.wv": col, "attention.wo": row,
            "feed_forward.w1": col, "feed_forward.w3": col, "feed_forward.w2": row}
    for layer in model.layers:
        parallelize_module(layer, mesh, plan)


def clip_grad_norm(parameters, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over parameters that live on several meshes (FSDP2's
    DCP mesh, FSDP2 x TP's 2-D one, none): each mesh's gradient norm, the total norm of those,
    every gradient scaled by ``max_norm / (total + 1e-6)`` when that is below 1. Returns the
    total norm (one host read, as ``clip_grad_norm_`` callers make to log it)."""
    from torch.nn.utils import get_total_norm

    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = [get_total_norm(grads) for grads in groups.values()]
    total = float(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]).norm())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for grads in groups.values():
            for g in grads:
                g.mul_(coef)
    return total


# ---------------------------------------------------------------------- data
def global_batch(docs: list[np.ndarray], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Token ids, next-token labels (-100 at each document's last token) and document-local
    positions of a packed batch, each ``[1, T]``: built on the host, one copy each to ``device``
    (pinned and non-blocking on CUDA: the host does not wait for the GPU)."""
    lens = [len(d) for d in docs]
    tokens = np.concatenate(docs).astype(np.int64)
    labels = np.full_like(tokens, -100)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    last = np.cumsum(lens) - 1
    keep = np.ones(len(tokens), bool)
    keep[last] = False
    labels[:-1][keep[:-1]] = tokens[1:][keep[:-1]]
    return (*(host_to_device(torch.from_numpy(a)[None], device) for a in (tokens, labels, positions)), lens)


def step_loss(model: nn.Module, tokens, labels, positions, n_tokens: int, attn_mask=None) -> torch.Tensor:
    """This rank's share of the global mean next-token loss: the sum over its tokens divided by
    ``n_tokens``, the global count of labels (known on the host: no read of the device)."""
    logits = model(tokens, positions, attn_mask)
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum / n_tokens


def dense_doc_mask(batch: torch_dcp.BatchSpec, device) -> torch.Tensor:
    """bool ``[T, T]``: the batch's masks inside each document (the no-parallelism reference)."""
    m = torch.zeros(batch.total_tokens, batch.total_tokens, dtype=torch.bool, device=device)
    cu = batch.cu_seqlens
    for d in range(batch.n_docs):
        a, b = int(cu[d]), int(cu[d + 1])
        m[a:b, a:b] = torch.from_numpy(batch.mask_of(d).dense(b - a))
    return m


# ---------------------------------------------------------------------- PyTorch CP on CPU
def register_torch_cp_cpu_handlers() -> None:
    """PyTorch's context parallel has no handler for the CPU flash op; add one that runs
    PyTorch's own ring attention with it (GQA heads expanded, their gradients summed)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten

    def handler(op_call, args, kwargs):
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        la, lk = info.local_args, info.local_kwargs
        group = info.compute_mesh.get_group()
        scale = lk.get("scale")
        if op_call is aten._scaled_dot_product_flash_attention_for_cpu.default:
            q, k, v = la[0], la[1], la[2]
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            out = cp._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu.default,
                                               query=q, key=k, value=v, is_causal=la[4], dropout_p=la[3], scale=scale)
            res = out[:2]
        else:
            grad_out, q, k, v, o, lse = la[:6]
            g = q.shape[1] // k.shape[1]
            kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            dq, dk, dv, *_ = cp._templated_ring_attention_backward(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=grad_out,
                grad_out_name="grad_out", query=q, key=kr, value=vr, out=o, logsumexp=lse, is_causal=la[7],
                dropout_p=la[6], scale=scale)
            b, h, s, d = dk.shape
            res = (dq, dk.view(b, h // g, g, s, d).sum(2), dv.view(b, h // g, g, s, d).sum(2))
        return tuple(DTensor.from_local(t, info.compute_mesh, [Shard(2)], run_check=False) for t in res)

    cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = handler
    cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = handler


def torch_ring_comm_bytes(total_tokens: int, world: int, a: ModelArgs, elem: int) -> int:
    """Bytes PyTorch's ring attention moves per attention layer, forward + backward: K and V
    (heads expanded) make ``W - 1`` hops forward; backward K, V and their fp32 gradients."""
    kv_token = 2 * a.n_heads * a.head_dim
    return int((world - 1) * total_tokens * kv_token * (2 * elem + 4))


# ---------------------------------------------------------------------- main
def _head_parallel(text: str) -> "int | str":
    """``--head-parallel``: ``auto`` or a positive integer."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {text!r}")
    return n


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="folder of text files or JSONL with a 'text' field (default: Python stdlib sources)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tokens-per-step", type=int, default=8192)
    p.add_argument("--max-doc-len", type=int, default=4096)
    p.add_argument("--cp-impl", choices=["torch_dcp", "torch", "none"], default="torch_dcp")
    p.add_argument("--planner", default="dcp", help="dcp (hypergraph), greedy, fcp, megatron, ring or allgather")
    p.add_argument("--head-parallel", type=_head_parallel, default=None, metavar="N|auto",
                   help="ranks of a head group trading heads by all-to-all (torch_dcp.plan's head_parallel; default: "
                        "auto for dcp, which keeps the fastest N on the simulator, 1 for the other planners)")
    p.add_argument("--cost-model", default="auto",
                   help="the cost model dcp times its candidates with: auto (default: this device's calibration, "
                        "else a shipped preset), a100, h100 or a JSON file (python -m torch_dcp.benchmarks calibrate)")
    p.add_argument("--mask", choices=sorted(MASKS), default="causal")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--divisions", type=int, default=2)
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=None,
                   help="layer replay: the first layer records this rank's attention device work (a CUDA graph), the others replay it (default: on for CUDA; no effect on CPU)")
    p.add_argument("--plan-ahead", type=int, default=2,
                   help="steps planned ahead by the PlanningLoader's worker processes, spread over the ranks "
                        "(0: every rank plans every step in line)")
    p.add_argument("--plan-workers", type=int, default=1, help="planning worker processes per rank")
    p.add_argument("--plan-timeout", type=float, default=600.0, help="seconds any wait for a plan may block")
    p.add_argument("--ring-stats", action=argparse.BooleanOptionalAction, default=None,
                   help="log the ring plan's figures of every batch beside the planner's (default: on with "
                        "--plan-ahead > 0, where the planning worker computes them off the critical path; off in line)")
    p.add_argument("--compare-precomputed", type=int, default=0, metavar="ROUNDS",
                   help="benchmark: ROUNDS rounds of --steps steps per mode of --compare-modes, alternating, each from the "
                        "same initial weights and batches; prints the mean step time per mode and the ratios")
    p.add_argument("--compare-modes", default="loader,precomputed",
                   help="modes for --compare-precomputed: loader (--plan-ahead steps ahead), precomputed (every "
                        "plan and device plan made before training), inline (planned in line on every rank)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn-hidden", type=int, default=352)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: consecutive ranks of a (dcp, tp) mesh split the heads and MLP; DCP "
                        "and FSDP2 run over the other dimension (--kv-heads must be divisible by it)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-json", default=None, help="also write one JSON line per step to this file (rank 0)")
    args = p.parse_args(argv)
    if args.plan_ahead < 0 or args.plan_workers < 1:
        p.error("--plan-ahead must be >= 0 and --plan-workers >= 1")
    if args.ring_stats is None:
        args.ring_stats = args.plan_ahead > 0
    return args


class Job:
    """What every step shares: the model, its optimizer, the mesh, the batches."""

    def __init__(self, args: argparse.Namespace, device: torch.device, rank: int, world: int, distributed: bool):
        self.args, self.device, self.rank, self.world, self.distributed = args, device, rank, world, distributed
        # the (dcp, tp) mesh is dcp-major: the TP ranks of one DCP rank are consecutive (one node's GPUs)
        self.tp = args.tp
        self.dcp_size, (self.dcp_rank, self.tp_rank) = world // args.tp, divmod(rank, args.tp)
        self.heads = TensorParallelHeads(args.heads, args.kv_heads, args.tp)
        # the planning workers start first (spawn + imports take seconds), while the rest is set up
        ahead = args.cp_impl == "torch_dcp" and (args.plan_ahead > 0 or args.compare_precomputed) and self.tp_rank == 0
        self.pool = planning_pool(args.plan_workers, self.planning_config()) if ahead else None
        self.margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                               ffn_hidden=args.ffn_hidden)
        self.mesh = self.tp_mesh = None  # the DCP mesh (FSDP2 shards over it too), the TP mesh
        if distributed and args.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (self.dcp_size, args.tp), mesh_dim_names=("dcp", "tp"))
            self.mesh, self.tp_mesh = mesh["dcp"], mesh["tp"]
            mesh._flatten("dcp_tp")  # one all-reduce, not one per dimension, for a norm over both (grad clipping)
        elif distributed:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dcp",))
        self.build_model()
        self.docs = [byte_tokenize(t) for t in load_documents(args.data)]

    def build_model(self) -> None:
        """The same initial weights on every rank (and in every benchmark round), a fresh optimizer."""
        torch.manual_seed(self.args.seed)
        self.model = Transformer(self.margs).to(self.device)
        if self.tp_mesh is not None:
            tensor_parallel(self.model, self.tp_mesh)
        if self.distributed:
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.layers:
                fully_shard(layer, mesh=self.mesh)
            fully_shard(self.model, mesh=self.mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.args.lr, weight_decay=0.0)

    def batches(self):
        """The run's global batches (lists of documents), ``--steps`` of them."""
        a = self.args
        return itertools.islice(pack_batches(self.docs, a.tokens_per_step, a.max_doc_len, seed=a.seed), a.steps)

    def to_batch(self, docs: list[np.ndarray]) -> tuple[torch_dcp.BatchSpec, tuple]:
        """A global batch's BatchSpec and tensors (tokens, labels, positions, lengths)."""
        tokens, labels, positions, lens = global_batch(docs, self.device)
        m = self.margs
        spec = torch_dcp.BatchSpec(lens, MASKS[self.args.mask](), n_heads=self.heads.local_heads,
                                   n_kv_heads=self.heads.local_kv_heads, head_dim=m.head_dim, dtype="float32")
        return spec, (tokens, labels, positions, lens)

    def planning_config(self) -> PlanningConfig:
        a = self.args
        options = {"cost_model": a.cost_model} if a.planner == "dcp" else {}
        if a.head_parallel is not None:
            options["head_parallel"] = a.head_parallel
        return PlanningConfig(self.dcp_size, planner=a.planner, block_size=a.block_size, divisions=a.divisions,
                              options=options, compare=("ring",) if a.ring_stats else ())

    def loader(self, lookahead: int) -> PlanningLoader:
        a = self.args
        return PlanningLoader(self.batches(), self.planning_config(), batch_of=self.to_batch, lookahead=lookahead,
                              workers=a.plan_workers, rank=self.dcp_rank, world_size=self.dcp_size,
                              replica=self.tp_rank, replicas=self.tp, timeout=a.plan_timeout,
                              device=self.device, pool=self.pool)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def step(self, tokens, labels, positions, ctx, n_tokens: int, attn_mask=None) -> tuple[float, float]:
        """Forward, backward and optimizer step; returns (global mean loss, grad norm).
        ``n_tokens``: the global batch's count of labels (the same on every rank)."""
        with ctx:
            loss = step_loss(self.model, tokens, labels, positions, n_tokens, attn_mask)
            # FSDP2 averages gradients over the DCP mesh; each rank's loss already is its share
            # of the global mean, so scale by the DCP size to get the sum of the shares
            (loss * self.dcp_size).backward()
        grad_norm = clip_grad_norm(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if self.distributed:  # the TP ranks of a DCP rank hold the same loss
            dist.all_reduce(total, group=self.mesh.get_group())
        return total.item(), grad_norm

    def run_dcp(self, planned, emit) -> list[dict]:
        """Train on :class:`PlannedBatch` items (from a loader or precomputed); one row per step."""
        rows = []
        it = iter(planned)
        while True:
            t0 = time.perf_counter(), time.process_time()
            pb = next(it, None)
            if pb is None:
                return rows
            tokens, labels, positions, lens = pb.data
            s = pb.stats
            row = {"step": pb.step, "planner": s.get("planner"), "plan_ms": round(1000 * pb.plan_seconds, 2),
                   "plan_wait_ms": round(1000 * pb.wait_seconds, 2), "store_ms": round(1000 * pb.store_seconds, 3),
                   "poll_ms": round(1000 * pb.poll_seconds, 3),
                   "comm_bytes": s["comm_bytes"] * self.margs.n_layers,
                   "compute_imbalance": round(s["compute_imbalance"], 3), "head_parallel": s.get("head_parallel", 1),
                   "plan_heads": [pb.plan.batch.n_heads, pb.plan.batch.n_kv_heads],
                   "empty_ranks": sum(pb.plan.local_tokens(r) == 0 for r in range(pb.plan.world_size))}
            ring = pb.compare.get("ring")
            if ring and "comm_bytes" in ring:
                row.update(ring_comm_bytes=ring["comm_bytes"] * self.margs.n_layers,
                           ring_compute_imbalance=round(ring["compute_imbalance"], 3))
            ctx = torch_dcp.context_parallel(self.mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1],
                                             no_restore_buffers={tokens, labels, positions}, plan=pb.plan,
                                             device_plan=pb.device_plan, replay=self.args.replay)
            loss, grad_norm = self.step(tokens, labels, positions, ctx, sum(lens) - len(lens))
            rows.append(self._finish(row, loss, grad_norm, lens, t0, emit))

    def run_other(self, emit) -> list[dict]:
        """PyTorch's context parallelism (--cp-impl torch) or one process without (none)."""
        rows = []
        for step, docs in enumerate(self.batches()):
            t0 = time.perf_counter(), time.process_time()
            spec, (tokens, labels, positions, lens) = self.to_batch(docs)
            row: dict = {"step": step}
            attn_mask = None
            if self.args.cp_impl == "torch":
                from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

                pad = (-tokens.shape[1]) % (2 * self.world)
                tokens, labels, positions = (F.pad(t, (0, pad), value=v)
                                             for t, v in ((tokens, 0), (labels, -100), (positions, 0)))
                row.update(comm_bytes=torch_ring_comm_bytes(tokens.shape[1], self.world, self.margs, 4)
                           * self.margs.n_layers, padded=pad)
                ctx = torch_context_parallel(self.mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1],
                                             no_restore_buffers={tokens, labels, positions})
            else:
                attn_mask = dense_doc_mask(spec, self.device)
                ctx = nullcontext()
            loss, grad_norm = self.step(tokens, labels, positions, ctx, sum(lens) - len(lens), attn_mask)
            rows.append(self._finish(row, loss, grad_norm, lens, t0, emit))
        return rows

    @staticmethod
    def _finish(row: dict, loss: float, grad_norm: float, lens: list[int], t0: tuple[float, float], emit) -> dict:
        """The step's row: ``t0`` is its start, ``(time.perf_counter(), time.process_time())``;
        ``cpu_ms`` is this process's CPU time over the step (all its threads; not the planning
        workers, processes of their own)."""
        dt, cpu = time.perf_counter() - t0[0], time.process_time() - t0[1]
        row.update(loss=round(loss, 6), grad_norm=round(grad_norm, 6), docs=len(lens), longest=max(lens),
                   tokens_per_s=round(sum(lens) / dt, 1), step_s=round(dt, 4), cpu_ms=round(1000 * cpu, 1))
        emit(row)
        return row


def main() -> None:
    args = parse()
    distributed = "RANK" in os.environ
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if args.tp < 1 or world % args.tp:
        raise SystemExit(f"--tp {args.tp} must be a positive divisor of the {world} rank(s)")
    try:
        TensorParallelHeads(args.heads, args.kv_heads, args.tp)
    except ValueError as err:
        raise SystemExit(f"--tp {args.tp} with --heads {args.heads} --kv-heads {args.kv_heads}: {err}") from None
    if args.kv_heads % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide --kv-heads {args.kv_heads} (this recipe shards wk and wv by heads)")
    if args.cp_impl == "none" and world != args.tp:
        raise SystemExit("--cp-impl none runs without data or context parallelism: one process, or --tp processes")
    if args.cp_impl == "torch" and args.tp > 1:
        raise SystemExit("--cp-impl torch runs without tensor parallelism (--tp 1)")
    if args.cp_impl == "torch" and args.mask != "causal":
        raise SystemExit("--cp-impl torch supports only --mask causal (over the whole packed sequence)")
    if args.compare_precomputed and (args.cp_impl != "torch_dcp" or not distributed):
        raise SystemExit("--compare-precomputed runs --cp-impl torch_dcp under torchrun")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    job = Job(args, device, rank, world, distributed)
    if distributed and args.cp_impl == "torch":
        register_torch_cp_cpu_handlers()
    n_params = sum(p.numel() for p in job.model.parameters())
    if rank == 0:
        plans = (f"plans {args.plan_ahead} steps ahead ({args.plan_workers} worker(s) per rank)" if args.plan_ahead
                 else "plans in line")
        print(f"torch_dcp train_llama: {world} rank(s) on {device.type}"
              + (f" ({job.dcp_size} DCP x {args.tp} TP)" if args.tp > 1 else "") + f", cp-impl={args.cp_impl}, "
              f"planner={args.planner}, mask={args.mask}, {n_params / 1e6:.2f}M parameters, "
              f"{len(job.docs)} documents, {args.tokens_per_step} tokens/step"
              + (f", {plans}" if args.cp_impl == "torch_dcp" else ""), flush=True)
        if args.cp_impl == "torch_dcp" and args.planner == "dcp":
            print(f"cost model: {torch_dcp.CostModel.load(args.cost_model, device=device).source}", flush=True)
        if args.cp_impl == "torch":
            print("note: PyTorch's context_parallel sees one causal sequence: it attends across document "
                  f"boundaries and pads to a multiple of 2 x {world} tokens (more work than DCP, different loss)",
                  flush=True)
    log = open(args.log_json, "w") if (args.log_json and rank == 0) else None

    def emit(row: dict) -> None:
        if rank == 0:
            print(json.dumps(row), flush=True)
            if log:
                log.write(json.dumps(row) + "\n")
                log.flush()

    if args.compare_precomputed:
        from loader_modes import compare_precomputed  # beside this script

        compare_precomputed(job, emit)
    else:
        t_start = time.perf_counter()
        if args.cp_impl == "torch_dcp":
            with job.loader(args.plan_ahead) as loader:
                summary = job.run_dcp(loader, emit)
        else:
            summary = job.run_other(emit)
        if rank == 0 and summary:
            first, last = summary[0]["loss"], summary[-1]["loss"]
            wall = time.perf_counter() - t_start
            line = (f"summary: {len(summary)} steps in {wall:.1f} s, loss {first:.3f} -> {last:.3f}, "
                    f"{sum(r['tokens_per_s'] for r in summary) / len(summary):.0f} tokens/s")
            if args.cp_impl == "torch_dcp":
                line += (f", planning {sum(r['plan_ms'] for r in summary) / len(summary):.1f} ms/step, loop waited "
                         f"{sum(r['plan_wait_ms'] for r in summary) / len(summary):.1f} ms/step for plans")
            ring_total = sum(r.get("ring_comm_bytes", 0) for r in summary)
            if ring_total:
                saved = 1 - sum(r["comm_bytes"] for r in summary) / ring_total
                line += f", {args.planner} moved {saved:.0%} fewer attention bytes than ring"
            print(line, flush=True)
    job.close()
    if log:
        log.close()
    if distributed:
        # the job (its FSDP model, its mesh) and the loader (which refers to the job) hold the
        # process groups: dropped first, so that the teardown frees the groups now rather than
        # leaving them to the interpreter's exit
        job = loader = None
        left = torch_dcp.shutdown()
        if left:  # the run succeeded: leave with status 0 without the teardown that aborts
            import sys

            print(f"rank {rank}: after torch_dcp.shutdown(): {'; '.join(left)}; leaving without the "
                  "interpreter's teardown", file=sys.stderr, flush=True)
            torch_dcp.teardown.exit_process(0)


if __name__ == "__main__":
    main()
