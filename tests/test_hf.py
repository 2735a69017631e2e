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
SCALING = 0.3  # every attention module's scaling (transformers passes it): not the default 1/sqrt(16)


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
    config_cls, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                       "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                       "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    config = config_cls(**common)
    config._attn_implementation = attn
    torch.manual_seed(seed)
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


def _dcp_step(mesh, docs, planner, fsdp=False, kind="llama", autocast=False, scaling=None, checkpointing=False,
              **over):
    """The natural call under torch_dcp: (global loss, {name: full gradient})."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from torch_dcp.integrations import hf

    model = _model(kind, **over)
    if scaling is not None:
        _set_scaling(model, scaling)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
    group = mesh.get_group()
    dist.all_reduce(total, group=group)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        else:
            dist.all_reduce(g, group=group)
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


def _natural_call_cases(rank, world, mesh, ref):
    """The natural call with the greedy and ring planners (ring with gradient checkpointing; the
    recipe runs dcp with FSDP2)."""
    docs = _docs()
    for planner in ("greedy", "ring"):  # ring with transformers' gradient checkpointing
        loss, grads = _dcp_step(mesh, docs, planner, scaling=SCALING, checkpointing=planner == "ring")
        lr, gr = _rel(loss, ref[0]), _grad_rel(grads, ref[1])
        _report(rank, f"{world} {planner}", lr, gr)
        assert lr <= TOL and gr <= TOL, (planner, lr, gr)


def _recipe(rank, world, mesh, steps):
    """recipes/train_hf.py: a transformers Llama, FSDP2, the dcp planner, real documents (this
    package's sources: quicker to read than the standard library's; a 1536-token document in a
    2048-token batch, split over ranks), parity with one process."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import train_hf

    args = train_hf.parse(["--steps", str(steps), "--tokens-per-step", "2048", "--max-doc-len", "1536",
                           "--block-size", "128", "--dim", "64", "--ffn-hidden", "128", "--data", str(ROOT / "torch_dcp")])
    rows = train_hf.train(args, mesh, emit=lambda row: None)
    for r in rows:
        _report(rank, f"{world} recipe dcp fsdp2 step {r['step']}", r["loss_rel"], r["grad_rel"])
        assert r["loss_rel"] <= TOL and r["grad_rel"] <= TOL, r
    assert any(r["comm_bytes"] > 0 for r in rows)


def _two_ranks(rank, mesh, ref):
    """Ranks 0 and 1 of the three, on a mesh of their own."""
    _natural_call_cases(rank, 2, mesh, ref)
    _recipe(rank, 2, mesh, steps=2)
    # sliding-window layers (Mistral, window 128 < the longest documents): the Lambda mask
    docs = _docs()
    ref_w = _reference(docs, "mistral", sliding_window=128)
    loss, grads = _dcp_step(mesh, docs, "greedy", kind="mistral", sliding_window=128)
    lr, gr = _rel(loss, ref_w[0]), _grad_rel(grads, ref_w[1])
    _report(rank, "2 mistral window 128", lr, gr)
    assert lr <= TOL and gr <= TOL
    # a Gemma-style mix (Qwen2: layer 0 full, layer 1 sliding over 64 tokens), documents within the window
    short = _docs([40, 7, 64, 25, 60])
    mix = dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    ref_m = _reference(short, "qwen2", **mix)
    loss, grads = _dcp_step(mesh, short, "ring", kind="qwen2", **mix)
    lr, gr = _rel(loss, ref_m[0]), _grad_rel(grads, ref_m[1])
    _report(rank, "2 qwen2 full + sliding 64", lr, gr)
    assert lr <= TOL and gr <= TOL
    # autocast bf16: as close to fp32 as autocast SDPA without CP
    one = _reference(docs, autocast=True, scaling=SCALING)
    loss, grads = _dcp_step(mesh, docs, "ring", autocast=True, scaling=SCALING)
    d_dcp, d_sdpa = _grad_dist(grads, ref[1]), _grad_dist(one[1], ref[1])
    if rank == 0:
        print(f"[hf] autocast bf16 grad distance to fp32: torch_dcp {d_dcp:.3e}, SDPA without CP {d_sdpa:.3e} "
              f"(ratio {d_dcp / d_sdpa:.2f}); loss {loss:.6f} vs fp32 {ref[0]:.6f}", flush=True)
    assert d_dcp <= 1.5 * d_sdpa and _rel(loss, ref[0]) <= 1e-2
    # forgotten position ids (transformers then uses 0..S_local-1): refused on every rank (last on
    # this group: a rank whose tokens happen to have those positions waits in transfers and is told)
    from torch_dcp.executor import PeerRefusedError
    from torch_dcp.integrations import hf

    model = _model()
    packed = hf.pack(docs, model.config)
    with pytest.raises((ValueError, PeerRefusedError), match="position_ids are not"):
        with torch_dcp.context_parallel(mesh, buffers=packed.buffers, buffer_seq_dims=packed.buffer_seq_dims,
                                        no_restore_buffers=set(packed.buffers), batch=packed.batch, planner="ring"):
            model(**{k: v for k, v in packed.model_inputs().items() if k != "position_ids"})


def _refusal(rank, mesh, group_mesh):
    """Refusals on rank 1 of 3, every rank raising within 5 s (the contexts' timeout is 600 s),
    the peers naming rank 1 and its reason: a float64 query refused by the SDPA interception
    (on a group of its own), then attention dropout in training mode refused by the backend."""
    import torch.nn.functional as F

    from torch_dcp.integrations import hf

    batch = torch_dcp.BatchSpec(LENS, torch_dcp.Causal(), n_heads=4, n_kv_heads=2, head_dim=16, dtype="float32")
    with torch_dcp.context_parallel(group_mesh, batch=batch, planner="ring", timeout=600) as ctx:
        n = ctx.plan.local_tokens(rank)
        q, kv = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16)
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            F.scaled_dot_product_attention(q.double() if rank == 1 else q, kv, kv, is_causal=True, enable_gqa=True)
        _check_refused(rank, info.value, time.monotonic() - t0, "dtype torch.float64")
    model = _model(attention_dropout=0.1 if rank == 1 else 0.0)
    packed = hf.pack(_docs(), model.config)
    with pytest.raises(Exception) as info:
        with torch_dcp.context_parallel(mesh, buffers=packed.buffers, buffer_seq_dims=packed.buffer_seq_dims,
                                        no_restore_buffers=set(packed.buffers), batch=packed.batch, planner="ring",
                                        timeout=600):
            t0 = time.monotonic()
            model(**packed.model_inputs()).loss.backward()
    _check_refused(rank, info.value, time.monotonic() - t0, "dropout")


def _check_refused(rank, err, took, reason):
    from torch_dcp.executor import PeerRefusedError

    print(f"[hf] rank {rank}: refusal raised after {took:.2f} s: {type(err).__name__}: {err}", flush=True)
    assert took < 5.0 and reason in str(err), (took, err)
    if rank == 1:
        assert type(err) is ValueError, err
    else:
        assert isinstance(err, PeerRefusedError) and err.peers == [1] and "rank 1" in str(err), err
        assert reason in err.reason


def _empty_rank(rank, world, mesh):
    """A rank that holds no tokens (greedy keeps each of two short documents whole, on two of the
    three ranks) runs the forward and the backward with the others (a placeholder token through
    transformers' layers, every transfer and FSDP2 collective): Qwen2 with every layer a 64-token
    window, loss and gradients as one process's."""
    from torch_dcp.integrations import hf

    docs = _docs([100, 20])
    over = dict(use_sliding_window=True, sliding_window=64, max_window_layers=0)
    packed = hf.pack(docs, _model("qwen2", **over).config)
    plan = torch_dcp.plan(packed.batch, world, planner="greedy", block_size=128)
    assert sorted(plan.local_tokens(r) for r in range(world)) == [0, 20, 100]
    ref = _reference(docs, "qwen2", **over)
    loss, grads = _dcp_step(mesh, docs, "greedy", fsdp=True, kind="qwen2", **over)
    lr, gr = _rel(loss, ref[0]), _grad_rel(grads, ref[1])
    _report(rank, f"{world} qwen2 window 64, a rank without tokens, fsdp2", lr, gr)
    assert lr <= TOL and gr <= TOL, (lr, gr)


def _ranks(rank, world, mesh):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    pair = DeviceMesh("cpu", [0, 1])  # every rank takes part in creating its group
    spare = DeviceMesh.from_group(dist.new_group([0, 1, 2]), "cpu")  # for a refusal: left with transfers pending
    ref = _reference(_docs(), scaling=SCALING)
    _natural_call_cases(rank, world, mesh, ref)
    _recipe(rank, world, mesh, steps=1)
    _empty_rank(rank, world, mesh)
    if rank < 2:
        _two_ranks(rank, pair, ref)
    _refusal(rank, mesh, spare)  # last: a refusal leaves transfers pending on its group


def test_hf_gloo(tmp_path):
    """On 3 gloo ranks, and on 2 of them: the natural call (restarting position ids, no
    attention_mask, attn_implementation="torch_dcp") with greedy and ring, the recipe (dcp,
    FSDP2) against one process; Mistral's sliding window and CPU autocast bf16 on 2 ranks; a
    refusal on one rank of 3 raised by all within 5 s (by the SDPA interception, and by the
    backend)."""
    run_ranks(_ranks, 3, tmp_path, timeout=300)


def test_pack_labels_positions_and_count():
    """pack: documents, a row with position ids and a row with cu_seqlens give the same batch;
    labels are shifted inside each document (-100 at its end and where the labels were -100)."""
    from torch_dcp.integrations import hf

    docs = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    p = hf.pack(docs, n_heads=4, n_kv_heads=2, head_dim=16)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert p.labels.tolist() == [[6, 7, -100, -100, 10, -100]]
    assert p.num_items_in_batch == 3 and p.batch.doc_lens.tolist() == [3, 1, 2]
    assert p.buffers[0] is p.input_ids and p.buffer_seq_dims == [1, 1, 1]
    inputs = p.model_inputs()
    assert inputs["labels"] is inputs["shift_labels"] is p.labels and inputs["num_items_in_batch"] == 3
    row = torch.cat(docs)
    for kw in (dict(position_ids=p.position_ids), dict(cu_seqlens=[0, 3, 4, 6])):
        q = hf.pack(input_ids=row[None], n_heads=4, n_kv_heads=2, head_dim=16, **kw)
        assert q.labels.tolist() == p.labels.tolist() and q.batch.doc_lens.tolist() == [3, 1, 2]
    # prompt tokens masked by the caller's labels
    q = hf.pack(docs, labels=[torch.tensor([-100, -100, 7]), torch.tensor([8]), torch.tensor([9, 10])],
                n_heads=4, head_dim=16)
    assert q.labels.tolist() == [[-100, 7, -100, -100, 10, -100]] and q.num_items_in_batch == 2
    for kwargs, msg in ((dict(documents=docs, input_ids=row), "exactly one of documents"),
                        (dict(input_ids=row), "exactly one of position_ids"),
                        (dict(input_ids=row, position_ids=[0, 1, 3, 0, 0, 1]), "rise by 1"),
                        (dict(input_ids=row, cu_seqlens=[0, 3, 5]), "cu_seqlens"),
                        (dict(documents=[[1, 2], []]), "non-empty"),
                        (dict(documents=docs, labels=[[1], [2], [3]]), "labels have 3 tokens")):
        with pytest.raises(ValueError, match=msg):
            hf.pack(**{"n_heads": 4, "head_dim": 16, **kwargs})
    with pytest.raises(ValueError, match="config"):
        hf.pack(docs)


def test_config_masks_and_fallback():
    """The mask of a config's layers; outside a context the backend is transformers' SDPA (its
    document mask from restarting position ids included)."""
    import transformers

    from torch_dcp.integrations import hf

    assert hf.batch_mask(transformers.MistralConfig(sliding_window=64)) == torch_dcp.Lambda(sink=0, window=64)
    assert hf.batch_mask(transformers.LlamaConfig()) == torch_dcp.Causal()
    mixed = transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16,
                                     max_window_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    assert set(mixed.layer_types) == {"sliding_attention", "full_attention"}
    assert hf.batch_mask(mixed) == torch_dcp.Causal()
    hf.pack([torch.arange(16), torch.arange(5)], mixed)  # no document longer than the window: exact
    with pytest.raises(ValueError, match="mixes sliding-window"):
        hf.pack([torch.arange(17)], mixed)
    assert hf.model_heads(mixed) == (4, 2, 16)
    docs = _docs([40, 7, 25])
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        want = _model(attn="sdpa")(ids, position_ids=pos).logits
        got = _model()(ids, position_ids=pos).logits
        whole = _model()(ids).logits  # one document: differs
    assert torch.equal(got, want) and not torch.allclose(whole, want)
