"""The user's path on CUDA without a GPU: ``context_parallel`` around a model's attention on
PyTorch's ``fake`` process-group backend, every tensor a fake ``cuda`` tensor
(``FakeTensorMode`` raises on any host read of device data, so the entry's plan check, the
buffers' sharding and every op of the step are shown not to read the device).

Needs a CUDA build of torch (no GPU, no driver); skipped on a CPU build. Each case runs in a
subprocess of its own (its own default process group). What fake mode cannot run without a
driver, and the nearest check here:

* the autograd engine: ``Tensor.backward`` on CUDA tensors asks the driver for the device's
  primary context (``hasPrimaryContext``), so the backward runs as autograd would call it, the
  ``torch_dcp::attention_backward`` op on the forward's saved outputs (the executor's own
  backward; the gradients through autograd are checked exact on gloo in ``test_context``);
* FSDP2: its forward creates CUDA streams (driver); ``test_context`` and ``test_torchtitan`` run
  FSDP2 with torch_dcp on gloo.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.fake_cuda,
              pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (no GPU needed)")]

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torch_dcp
    from torch_dcp import BatchSpec, Topology
    from torch_dcp.benchmarks.common import MASKS

    world, mask, kernel, dtype, hp = int(sys.argv[1]), sys.argv[2], sys.argv[3], getattr(torch, sys.argv[4]), sys.argv[5]
    compiled = len(sys.argv) > 6 and sys.argv[6] == "compile"
    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    mesh = DeviceMesh("cuda", list(range(world)))  # its rank table is host data: built outside fake mode
    lens = [3001, 700, 4999, 300, 1003, 17]
    H, H_KV, D, DIM, VOCAB = 8, 2, 64, 128, 97
    batch = BatchSpec(lens, MASKS[mask], n_heads=H, n_kv_heads=H_KV, head_dim=D, dtype=str(dtype).split(".")[1])
    topo = Topology(n_nodes=max(1, world // 4), ranks_per_node=min(world, 4))
    plan = torch_dcp.plan(batch, topo, planner="dcp", block_size=512, head_parallel=hp if hp == "auto" else int(hp),
                          cost_model="a100")  # a GPU's plan (without a GPU "auto" plans for this CPU)


    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.qkv = nn.Linear(DIM, (H + 2 * H_KV) * D, dtype=dtype)
            self.out = nn.Linear(H * D, VOCAB, dtype=dtype)

        def forward(self, ids):
            x = self.emb(ids).to(dtype)
            q, k, v = self.qkv(x).split([H * D, H_KV * D, H_KV * D], dim=-1)
            q, k, v = (t.unflatten(-1, (-1, D)).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.out(y.transpose(1, 2).flatten(2))


    with FakeTensorMode():
        with torch.device("cuda"):
            model = Attention()
        ids = torch.randint(0, VOCAB, (1, batch.total_tokens), device="cuda")
        labels = torch.randint(0, VOCAB, (1, batch.total_tokens), device="cuda")
        with torch_dcp.context_parallel(mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers=[ids, labels],
                                        plan=plan, kernel=kernel) as ctx:
            s = plan.local_tokens(world - 1)
            run = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
            logits = run(ids)  # the user's path: SDPA inside the context (traced whole when compiled)
            assert logits.device.type == "cuda" and logits.shape == (1, s, VOCAB), logits.shape
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            assert loss.device.type == "cuda"
            # the op's backward as autograd calls it (the engine itself needs a driver)
            q = torch.empty(1, H, s, D, device="cuda", dtype=dtype)
            k = torch.empty(1, H_KV, s, D, device="cuda", dtype=dtype)
            v = torch.empty(1, H_KV, s, D, device="cuda", dtype=dtype)
            out, lse, state = torch.ops.torch_dcp.attention(q, k, v, None, True, True)
            dq, dk, dv = torch.ops.torch_dcp.attention_backward(torch.empty_like(out), q, k, v, out, lse, state, None)
            for t, like in ((out, q), (dq, q), (dk, k), (dv, v)):
                assert t.device.type == "cuda" and t.dtype == dtype and t.shape == like.shape, (t.shape, like.shape)
    dist.destroy_process_group()
    print("OK", type(plan).__name__, getattr(plan, "head_parallel", 1))
    """
)


def _run(*args: str) -> str:
    res = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-3000:] + res.stderr[-6000:]
    return res.stdout


@pytest.mark.parametrize("world,hp", [(4, "1"), (4, "2"), (8, "auto")])
@pytest.mark.parametrize("kernel", ["auto", "varlen", "flex"])
def test_context_step_on_fake_cuda(world, hp, kernel):
    _run(str(world), "causal", kernel, "bfloat16", hp)


@pytest.mark.parametrize("mask", ["lambda", "shared_question"])
def test_context_masks_and_fp16_on_fake_cuda(mask):
    _run("4", mask, "auto", "float16", "1")


def test_compiled_model_on_fake_cuda():
    """``torch.compile(fullgraph=True)`` of the model inside the context: Dynamo traces the
    attention as one ``torch_dcp::attention`` call on fake CUDA tensors (no graph break: fullgraph
    raises on one). Dynamo's ``eager`` backend: AOTAutograd traces the joint graph with the
    autograd engine, which needs a driver (``aot_eager`` is checked on CPU in ``test_compile``)."""
    _run("4", "causal", "auto", "bfloat16", "2", "compile")


MAIN_JOB = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torch_dcp
    sys.path.insert(0, "recipes")
    from train_llama import MASKS, ModelArgs, Transformer, global_batch, step_loss

    world = int(sys.argv[1])
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
    mesh = DeviceMesh("cuda", list(range(world)))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n) for n in (900, 37, 2100, 401, 5)]
    margs = ModelArgs()
    with FakeTensorMode():
        with torch.device("cuda"):
            model = Transformer(margs)
        tokens, labels, positions, lens = global_batch(docs, torch.device("cuda"))
        spec = torch_dcp.BatchSpec(lens, MASKS["causal"](), n_heads=margs.n_heads, n_kv_heads=margs.n_kv_heads,
                                   head_dim=margs.head_dim, dtype="float32")
        with torch_dcp.context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1],
                                        no_restore_buffers=[tokens, labels, positions], batch=spec, planner="dcp",
                                        block_size=256) as ctx:
            loss = step_loss(model, tokens, labels, positions, sum(lens) - len(lens))
            assert loss.device.type == "cuda" and loss.shape == ()
    dist.destroy_process_group()
    print("OK")
    """
)


@pytest.mark.parametrize("world", [4, 8])
def test_main_job_step_forward_on_fake_cuda(world):
    """The main job's (``recipes/train_llama.py``) batch upload, context entry and loss on fake
    CUDA tensors: no host read (its backward and optimizer step need the autograd engine and
    FSDP2's streams, a driver: run on gloo by ``test_train``)."""
    res = subprocess.run([sys.executable, "-c", MAIN_JOB, str(world)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-3000:] + res.stderr[-6000:]


DROP_IN = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch_dcp import context_parallel

    world = 4
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
    mesh = DeviceMesh("cuda", list(range(world)))
    B, S, H, H_KV, D, DIM = 4, 2048, 8, 2, 64, 256
    with FakeTensorMode():
        with torch.device("cuda"):
            emb = torch.nn.Embedding(97, DIM, dtype=torch.bfloat16)
            wqkv = torch.nn.Linear(DIM, (H + 2 * H_KV) * D, dtype=torch.bfloat16)
            tokens = torch.randint(0, 97, (B, S))
            freqs = torch.randn(S, D // 2)
        for causal in (True, False):  # code written for PyTorch's context_parallel, the import changed
            with context_parallel(mesh, buffers=[tokens, freqs], buffer_seq_dims=[1, 0], cost_model="a100") as ctx:
                bsz, seqlen = tokens.shape
                assert bsz == 1 and seqlen == ctx.plan.local_tokens(1) and freqs.shape[0] == seqlen
                q, k, v = wqkv(emb(tokens)).split([H * D, H_KV * D, H_KV * D], -1)
                q, k, v = (t.view(bsz, seqlen, -1, D).transpose(1, 2) for t in (q, k, v))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                assert out.device.type == "cuda" and out.shape == (1, H, seqlen, D), out.shape
                assert ctx.plan.batch.n_heads == H and ctx.plan.batch.dtype == "bfloat16"
                assert ctx.plan.batch.is_causal == causal
    dist.destroy_process_group()
    print("OK")
    """
)


def test_pytorch_cp_code_on_fake_cuda():
    """Code written for PyTorch's ``context_parallel`` (``[B, S]`` token ids, a RoPE table with
    seq dim 0, no ``batch=``) on fake CUDA tensors, causal and not: the rows sharded, the heads
    learnt at the first SDPA call, the executor built for them, no host read."""
    res = subprocess.run([sys.executable, "-c", DROP_IN], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-3000:] + res.stderr[-6000:]
