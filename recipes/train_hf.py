"""Train a Hugging Face transformers Llama with FSDP2 under torch_dcp, on real documents.

    torchrun --standalone --nproc-per-node 2 recipes/train_hf.py                 # torch_dcp + FSDP2, parity printed
    python recipes/train_hf.py --cp-impl none                                     # one process, transformers' SDPA

The model is transformers' ``LlamaForCausalLM`` from a small ``LlamaConfig`` (random init, no
download; byte tokens, vocabulary 256), made with ``attn_implementation="torch_dcp"``
(:mod:`torch_dcp.integrations.hf`). The data is the main job's (``recipes/train_llama.py``): the
Python standard library's sources (or ``--data``), packed into global batches of
``--tokens-per-step`` tokens, documents capped at ``--max-doc-len``. Every step, every rank packs
the same global batch with :func:`torch_dcp.integrations.hf.pack` and runs the model's natural
call (ids, restarting position ids, pre-shifted labels, the global label count) inside
:func:`torch_dcp.context_parallel`; parameters are sharded with FSDP2 over the same mesh.

With ``--parity`` (the default under torchrun) every rank also runs one process's step on the
whole batch (transformers' ``"sdpa"`` with the document mask it builds from the position ids)
with the trained model's current weights, and prints the relative loss difference and the
largest relative gradient difference (over parameters, relative to each gradient's largest
magnitude) of the step. ``--cp-impl none`` trains that one-process model alone.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import time

import torch
import torch.distributed as dist

import torch_dcp
from torch_dcp.data import byte_tokenize, load_documents, pack_batches


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="folder of text files or JSONL with a 'text' field (default: stdlib)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--max-doc-len", type=int, default=2048)
    p.add_argument("--cp-impl", choices=["torch_dcp", "none"], default="torch_dcp")
    p.add_argument("--planner", default="dcp", help="dcp, greedy, fcp, megatron, ring or allgather")
    p.add_argument("--cost-model", default="auto",
                   help="the cost model dcp times its candidates with: auto (default), a100, h100 or a JSON file")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=None,
                   help="layer replay: the first layer records this rank's attention device work (a CUDA graph), the others replay it (default: on for CUDA; no effect on CPU)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn-hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parity", action=argparse.BooleanOptionalAction, default=None,
                   help="compare every step with one process on the whole batch (default: on with torch_dcp)")
    p.add_argument("--log-json", default=None, help="also write one JSON line per step to this file (rank 0)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.tokens_per_step < 2 or args.max_doc_len < 1:
        p.error("--steps, --tokens-per-step and --max-doc-len must be positive (--tokens-per-step at least 2)")
    if args.parity is None:
        args.parity = args.cp_impl == "torch_dcp"
    return args


@functools.lru_cache(maxsize=2)
def documents(data: str | None) -> list:
    """The run's documents as byte tokens (read once per process: scanning the standard library
    takes seconds)."""
    return [byte_tokenize(t) for t in load_documents(data)]


def build_model(args: argparse.Namespace, attn: str) -> torch.nn.Module:
    """The run's Llama (the same initial weights for every ``attn``)."""
    import transformers

    import torch_dcp.integrations.hf  # noqa: F401 - registers attn_implementation="torch_dcp"

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=args.dim, intermediate_size=args.ffn_hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_doc_len,
                                      tie_word_embeddings=False)
    config._attn_implementation = attn
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(config)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (FSDP2's sharded ones gathered: a collective)."""
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for n, p in model.named_parameters()}


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """``dst``'s parameters := ``src``'s whole parameters (gathered from FSDP2's shards)."""
    for (_, p), (_, q) in zip(src.named_parameters(), dst.named_parameters()):
        q.copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)


def one_process_step(model: torch.nn.Module, packed) -> tuple[float, dict[str, torch.Tensor]]:
    """The step without context parallelism (``model``: ``attn_implementation="sdpa"``, the
    whole batch): loss and gradients."""
    model.zero_grad(set_to_none=True)
    loss = model(**packed.model_inputs()).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def train(args: argparse.Namespace, mesh=None, emit=print) -> list[dict]:
    """Train ``args.steps`` steps (``mesh``: the one-dimensional DCP mesh, ``None`` for one
    process); returns one row per step (rank 0 emits them)."""
    from torch.distributed.fsdp import fully_shard

    from torch_dcp.integrations import hf

    rank = dist.get_rank(mesh.get_group()) if mesh is not None else 0
    world = mesh.size() if mesh is not None else 1
    cp = args.cp_impl == "torch_dcp"
    model = build_model(args, "torch_dcp" if cp else "sdpa")
    if mesh is not None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    ref = build_model(args, "sdpa") if cp and args.parity else None
    docs = documents(args.data)
    rows = []
    batches = pack_batches(docs, args.tokens_per_step, args.max_doc_len, seed=args.seed)
    for step, batch_docs in enumerate(itertools.islice(batches, args.steps)):
        t0 = time.perf_counter()
        packed = hf.pack(batch_docs, model.config, dtype="float32")
        row: dict = {"step": step}
        if ref is not None:  # before the context shards the buffers in place
            copy_weights(model, ref)
            row["ref_loss"], ref_grads = one_process_step(ref, packed)
        if cp:
            with torch_dcp.context_parallel(mesh, buffers=packed.buffers, buffer_seq_dims=packed.buffer_seq_dims,
                                            no_restore_buffers=set(packed.buffers), batch=packed.batch,
                                            planner=args.planner, block_size=args.block_size,
                                            replay=args.replay, cost_model=args.cost_model) as ctx:
                loss = model(**packed.model_inputs()).loss  # this rank's tokens' loss sum / the global label count
                (loss * world).backward()  # FSDP2 averages gradients over the mesh: the sum of the ranks' shares
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=mesh.get_group())
            row.update(comm_bytes=ctx.plan.stats()["comm_bytes"] * args.layers)
        else:
            loss = model(**packed.model_inputs()).loss
            loss.backward()
        if ref is not None:
            grads = full_grads(model)
            row["loss_rel"] = abs(loss.item() - row["ref_loss"]) / abs(row["ref_loss"])
            row["grad_rel"] = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        lens = packed.batch.doc_lens
        row.update(loss=round(loss.item(), 6), grad_norm=round(float(grad_norm), 6), docs=len(lens),
                   longest=int(lens.max()), tokens_per_s=round(int(lens.sum()) / dt, 1))
        if rank == 0:
            emit(row)
        rows.append(row)
    return rows


def main() -> None:
    args = parse()
    distributed = "RANK" in os.environ
    if args.cp_impl == "torch_dcp" and not distributed:
        raise SystemExit("--cp-impl torch_dcp runs under torchrun (--cp-impl none: one process)")
    if args.cp_impl == "none" and distributed:
        raise SystemExit("--cp-impl none runs in one process (no parallelism)")
    mesh = None
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dcp",))
    log = open(args.log_json, "w") if args.log_json and int(os.environ.get("RANK", 0)) == 0 else None
    if args.cp_impl == "torch_dcp" and args.planner == "dcp" and int(os.environ.get("RANK", 0)) == 0:
        print(f"cost model: {torch_dcp.CostModel.load(args.cost_model, device='cpu').source}", flush=True)

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()

    rows = train(args, mesh, emit)
    if rows and int(os.environ.get("RANK", 0)) == 0:
        line = f"summary: {len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}"
        if "loss_rel" in rows[0]:
            line += (f"; parity with one process: loss rel <= {max(r['loss_rel'] for r in rows):.1e}, "
                     f"gradients rel <= {max(r['grad_rel'] for r in rows):.1e}")
        print(line, flush=True)
    if log:
        log.close()
    if distributed:
        mesh = None
        left = torch_dcp.shutdown()
        if left:  # the run succeeded: leave with status 0 without the teardown that aborts
            torch_dcp.teardown.exit_process(0)


if __name__ == "__main__":
    main()
