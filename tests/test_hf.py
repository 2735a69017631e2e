"""Hugging Face transformers models under torch_dcp (torch_dcp.integrations.hf) on gloo ranks,
against one process running transformers' own SDPA with its document mask."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import torch_dcp  # noqa: E402
from spawn import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LENS = [300, 57, 700, 12, 420]
TOL = 1e-5


def _docs(lens=LENS, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _model(kind="llama", attn="torch_dcp", seed=0, **over):
    """A small random transformers model (no download), the same weights for a seed."""
    import transformers

    import torch_dcp.integrations.hf  # noqa: F401 - registers "torch_dcp"

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)
    common.update(over)
    config = (transformers.MistralConfig if kind == "mistral" else transformers.LlamaConfig)(**common)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    cls = transformers.MistralForCausalLM if kind == "mistral" else transformers.LlamaForCausalLM
    return cls(config)


def _reference(docs, kind="llama", autocast=False, scaling=None, **over):
    """One process, transformers' SDPA with the document-causal mask it builds from restarting
    position ids; labels shifted inside each document here. Returns (loss, {name: grad})."""
    model = _model(kind, "sdpa", **over)
    if scaling is not None:
        _set_scaling(model, scaling)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = model(ids, position_ids=pos, use_cache=False).logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _set_scaling(model, scaling):
    for layer in model.model.layers:
        layer.self_attn.scaling = scaling


def _dcp_step(mesh, docs, planner, fsdp=False, kind="llama", autocast=False, scaling=None, **over):
    """The natural call under torch_dcp: (global loss, {name: full gradient})."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from torch_dcp.integrations import hf

    model = _model(kind, **over)
    if scaling is not None:
        _set_scaling(model, scaling)
    world = mesh.size()
    if fsdp:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    packed = hf.pack(docs, model.config, dtype=torch.bfloat16 if autocast else torch.float32)
    with torch_dcp.context_parallel(mesh, buffers=packed.buffers, buffer_seq_dims=packed.buffer_seq_dims,
                                    no_restore_buffers=set(packed.buffers), batch=packed.batch, planner=planner,
                                    block_size=128):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = model(**packed.model_inputs()).loss
        (loss * world if fsdp else loss).backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        else:
            dist.all_reduce(g)
        grads[n] = g
    return total.item(), grads


def _rel(a, b):
    return abs(a - b) / abs(b)


def _grad_rel(got, want):
    """Largest relative (to the gradient's max) difference over parameters."""
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


def _grad_dist(got, want):
    num = sum(((got[n].float() - want[n].float()) ** 2).sum() for n in want)
    return (num / sum((want[n].float() ** 2).sum() for n in want)).sqrt().item()


def _report(rank, label, loss_rel, grad_rel):
    if rank == 0:
        print(f"[hf] W={label}: loss rel {loss_rel:.2e}, grad rel {grad_rel:.2e}", flush=True)


def _natural_call_cases(rank, world, mesh):
    docs = _docs()
    ref = _reference(docs)
    cases = [("dcp", False), ("greedy", False), ("ring", False), ("dcp", True)]
    for planner, fsdp in cases:
        loss, grads = _dcp_step(mesh, docs, planner, fsdp)
        lr, gr = _rel(loss, ref[0]), _grad_rel(grads, ref[1])
        _report(rank, f"{world} {planner}{' fsdp2' if fsdp else ''}", lr, gr)
        assert lr <= TOL and gr <= TOL, (planner, fsdp, lr, gr)
    # the module's scaling honoured
    ref_s = _reference(docs, scaling=0.3)
    loss, grads = _dcp_step(mesh, docs, "greedy", scaling=0.3)
    assert _rel(loss, ref_s[0]) <= TOL and _grad_rel(grads, ref_s[1]) <= TOL


def _two_ranks(rank, world, mesh):
    _natural_call_cases(rank, world, mesh)
    # sliding-window layers (Mistral, window 128 < the longest documents): the Lambda mask
    docs = _docs()
    ref = _reference(docs, "mistral", sliding_window=128)
    loss, grads = _dcp_step(mesh, docs, "dcp", kind="mistral", sliding_window=128)
    lr, gr = _rel(loss, ref[0]), _grad_rel(grads, ref[1])
    _report(rank, "2 mistral window 128", lr, gr)
    assert lr <= TOL and gr <= TOL
    # autocast bf16: as close to fp32 as autocast SDPA without CP
    fp32 = _reference(docs)
    one = _reference(docs, autocast=True)
    loss, grads = _dcp_step(mesh, docs, "dcp", autocast=True)
    d_dcp, d_sdpa = _grad_dist(grads, fp32[1]), _grad_dist(one[1], fp32[1])
    if rank == 0:
        print(f"[hf] autocast bf16 grad distance to fp32: torch_dcp {d_dcp:.3e}, SDPA without CP {d_sdpa:.3e} "
              f"(ratio {d_dcp / d_sdpa:.2f}); loss {loss:.6f} vs fp32 {fp32[0]:.6f}", flush=True)
    assert d_dcp <= 1.5 * d_sdpa and _rel(loss, fp32[0]) <= 1e-2


def _three_ranks(rank, world, mesh):
    _natural_call_cases(rank, world, mesh)
    # a refusal on rank 1 (attention dropout in training mode): every rank raises within 5 s
    from torch_dcp.executor import PeerRefusedError
    from torch_dcp.integrations import hf

    model = _model(attention_dropout=0.1 if rank == 1 else 0.0)
    packed = hf.pack(_docs(), model.config)
    t0 = None
    with pytest.raises((ValueError, PeerRefusedError)) as info:
        with torch_dcp.context_parallel(mesh, buffers=packed.buffers, buffer_seq_dims=packed.buffer_seq_dims,
                                        no_restore_buffers=set(packed.buffers), batch=packed.batch, planner="ring",
                                        timeout=600):
            t0 = time.monotonic()
            model(**packed.model_inputs()).loss.backward()
    took = time.monotonic() - t0
    print(f"[hf] rank {rank}: refusal raised after {took:.2f} s: {type(info.value).__name__}: {info.value}",
          flush=True)
    assert took < 5.0
    assert "dropout" in str(info.value)
    if rank == 1:
        assert type(info.value) is ValueError
    else:
        assert isinstance(info.value, PeerRefusedError) and info.value.peers == [1] and "rank 1" in str(info.value)


def test_hf_two_ranks(tmp_path):
    """W = 2: the natural call (restarting position ids, no attention_mask) with dcp, greedy,
    ring and FSDP2 + dcp, a custom scaling, Mistral's sliding window, CPU autocast bf16."""
    run_ranks(_two_ranks, 2, tmp_path, timeout=240)


def test_hf_three_ranks(tmp_path):
    """W = 3: the natural call with every planner and FSDP2; a refusal on one rank makes all raise."""
    run_ranks(_three_ranks, 3, tmp_path, timeout=240)
