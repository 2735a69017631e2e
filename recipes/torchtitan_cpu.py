"""Run torchtitan (0.3.0) on CPU with gloo: the CPU shims and the offline assets.

torchtitan targets accelerators. This script is a CPU stand-in for its CUDA assumptions, shared
by docs/torchtitan.md's CPU command and by ``tests/test_torchtitan.py``; nothing here is part of the
``torch_dcp`` package, and nothing in torchtitan's files is changed (the shims patch names in
memory, in the processes this script starts).

    python recipes/torchtitan_cpu.py --nproc 2 --steps 5                 # torch_dcp, dp2
    python recipes/torchtitan_cpu.py --nproc 2 --steps 5 --no-dcp        # the same run without CP
    python recipes/torchtitan_cpu.py --nproc 4 -- --dcp.planner greedy \
        --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2
    python recipes/torchtitan_cpu.py --device cuda --nproc 1 --steps 10  # on a GPU: the same assets, no shims

Everything after ``--`` goes to torchtitan (``--dcp.planner greedy``, ``--training.seq_len
512``, ...). The script writes the offline assets (a byte-level BPE tokenizer trained on the
Python standard library's sources, and those sources as a JSON-lines dataset in the layout of
torchtitan's ``c4_test``) under ``--assets`` and then starts ``--nproc`` ranks of
``torchtitan.train`` through ``torch.distributed.run``; every rank applies :func:`apply_cpu_shims`
before torchtitan is imported.

The shims, each with its reason:

1. device: torchtitan picks its device as ``torch._utils._get_available_device_type() or
   "cuda"`` and uses the matching ``torch.<device>`` module for ``set_device``, memory
   statistics and the device name. On a machine without an accelerator that is CUDA, which
   does not exist; the shim makes torchtitan see ``"cpu"`` and a small stand-in module
   (:class:`_CPUDeviceModule`) with the calls torchtitan makes (no-op memory statistics).
2. process group timeouts: after step 1 ``dist_utils.set_pg_timeouts`` calls
   ``barrier(device_ids=[device_module.current_device()])`` (a CUDA device index) and
   ``torch.distributed.set_timeout``, which this torch (2.13) does not have; the shim runs the
   same barrier without ``device_ids`` and sets the same timeouts with
   ``distributed_c10d._set_pg_timeout``.
3. ``ReduceOp.PREMUL_SUM`` on gloo: torchtitan sets FSDP2's gradient divide factor to 1
   (losses are already divided by the global token count); FSDP2 then reduces gradients with
   ``PREMUL_SUM``, which gloo does not implement. The shim makes FSDP2 use a plain ``SUM``
   (``set_force_sum_reduction_for_comms``) with the same factor 1: the same gradients.
4. FlexAttention on CPU (the run without CP only): torchtitan's llama3 attends with
   FlexAttention, which has no backward on CPU ("FlexAttention does not support backward on
   CPU"). The shim evaluates the very ``BlockMask`` torchtitan builds (its ``mask_mod``: causal
   within each packed document) densely and runs SDPA's math kernel with it, forward and
   backward; ``create_block_mask`` runs eagerly instead of compiled (inductor's compile on 2
   cores would dominate the test's time).
5. pipeline parallelism: torchtitan 0.3.0 hands its pipeline schedule pre-split microbatches as
   ``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, keywords of a later torch
   (pytorch/pytorch#188500), and fails here ("Expecting 2 arg_mbs but got 1"); the shim runs the
   same microbatches through ``step()``'s whole-batch form
   (:func:`torch_dcp.integrations.torchtitan.pipeline_step`, which the DCP trainer runs too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["apply_cpu_shims", "make_assets", "torchtitan_args", "main"]

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


# ---------------------------------------------------------------------------- assets
def make_assets(folder: str | os.PathLike, n_docs: int = 300, max_chars: int = 8000, vocab_size: int = 1024,
                seed: int = 0) -> tuple[Path, Path]:
    """Write the offline tokenizer and dataset torchtitan's debug model trains on.

    Args:
        folder: where to write ``tokenizer/`` (``tokenizer.json`` + ``tokenizer_config.json``, the
            files torchtitan's ``HuggingFaceTokenizer`` reads from ``--hf_assets_path``) and
            ``dataset/data.json`` (JSON lines with a ``text`` field, what torchtitan's ``c4_test``
            loader reads from ``--dataloader.dataset_path``).
        n_docs: documents (Python standard library sources in a seeded order).
        max_chars: each document cut to this many characters (a long tail of lengths remains).
        vocab_size: BPE vocabulary including the two special tokens (at most the debug model's
            2048).
        seed: the document order.

    Returns:
        ``(tokenizer_folder, dataset_folder)``. Existing, complete assets are reused.

    Raises:
        ValueError: ``vocab_size`` outside ``[260, 2048]`` or ``n_docs < 1``.
    """
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from torch_dcp.data.corpus import stdlib_text_files

    if not 260 <= vocab_size <= 2048:
        raise ValueError(f"make_assets: vocab_size must be in [260, 2048] (the debug model's vocabulary), got {vocab_size}")
    if n_docs < 1:
        raise ValueError(f"make_assets: n_docs must be positive, got {n_docs}")
    root = Path(folder)
    tok_dir, data_dir = root / "tokenizer", root / "dataset"
    done = root / "assets.json"
    spec = {"n_docs": n_docs, "max_chars": max_chars, "vocab_size": vocab_size, "seed": seed}
    if done.exists() and json.loads(done.read_text()) == spec:
        return tok_dir, data_dir
    files = stdlib_text_files()
    texts = []
    for i in np.random.default_rng(seed).permutation(len(files)):
        text = files[i].read_text(encoding="utf-8", errors="replace")[:max_chars]
        if text:
            texts.append(text)
        if len(texts) == n_docs:
            break
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "data.json", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    done.write_text(json.dumps(spec))
    return tok_dir, data_dir


# ---------------------------------------------------------------------------- shims
class _CPUDeviceModule:
    """The calls torchtitan makes on ``torch.<device>`` (shim 1), for the CPU."""

    @staticmethod
    def set_device(device) -> None:
        return None

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        class _Props:
            name = "cpu"
            total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

        return _Props()

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def is_available() -> bool:
        return True


_applied = False


def apply_cpu_shims() -> None:
    """Apply the five CPU shims of this module's docstring (idempotent). Call before anything
    imports torchtitan.

    Raises:
        RuntimeError: torchtitan was imported already (shim 1 would come too late), or an
            accelerator is present (run torchtitan as is there).
    """
    global _applied
    if _applied:
        return
    import torch
    import torch._utils as tu

    if "torchtitan" in sys.modules:
        raise RuntimeError("apply_cpu_shims: call it before torchtitan is imported")
    if tu._get_available_device_type() is not None:
        raise RuntimeError("apply_cpu_shims: an accelerator is present; the CPU shims are for CPU-only machines")

    # 1. device "cpu" and its stand-in module, while torchtitan.tools.utils reads them at import
    saved = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type=None: _CPUDeviceModule if device_type in (None, "cpu") else saved[1](device_type)
    try:
        import torchtitan.tools.utils  # noqa: F401  (binds device_type / device_module)
    finally:
        tu._get_available_device_type, tu._get_device_module = saved

    # 2. set_pg_timeouts: the same barrier without gloo-rejected device_ids, then the timeouts
    import torch.distributed.distributed_c10d as c10d
    import torchtitan.distributed.utils as dist_utils

    def set_pg_timeouts(timeout, parallel_dims):
        torch.distributed.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for group in groups:
            c10d._set_pg_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts

    # 3. FSDP2 gradient divide factor 1 reduces with PREMUL_SUM: reduce with SUM instead
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    original_disable = tt_fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model):
        original_disable(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division

    # 4. FlexAttention without a CPU backward: the same BlockMask, evaluated densely, with SDPA math
    import torchtitan.models.common.attention as tt_attn
    from torch.nn.attention.flex_attention import create_block_mask

    tt_attn._compiled_create_block_mask = create_block_mask
    tt_attn.FlexAttention._compiled_flex_attn = staticmethod(_dense_flex_attention)

    # 5. pipeline steps: torchtitan's pre-split keywords, which this torch's schedules lack, go the whole-batch way
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if "arg_mbs" not in inspect.signature(PipelineScheduleSingle.step).parameters:
        from torchtitan.trainer import Trainer

        from torch_dcp.integrations.torchtitan import pipeline_step

        def pp_forward_backward_step(self, *, input_dict_mbs, label_mbs, global_valid_tokens):
            return pipeline_step(self, input_dict_mbs, label_mbs, global_valid_tokens)

        Trainer.pp_forward_backward_step = pp_forward_backward_step
    _applied = True


def _dense_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                          return_aux=None, kernel_options=None):
    """``flex_attention`` (shim 4) for ``q: [B, H, L, D]``, ``k, v: [B, H_kv, L, D]`` with a
    ``block_mask``: its ``mask_mod`` evaluated on every (query, key) pair, then SDPA's math kernel
    (with a CPU backward). Returns ``(out [B, H, L, D], aux)`` with ``aux.lse`` when asked."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput

    if score_mod is not None or block_mask is None:
        raise NotImplementedError("CPU FlexAttention stand-in: only block_mask, no score_mod")
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    bi = torch.arange(b)[:, None, None, None]
    hi = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    qi = torch.arange(lq)[None, None, :, None]
    ki = torch.arange(lk)[None, None, None, :]
    mask = block_mask.mask_mod(bi, hi, qi, ki).expand(b, 1, lq, lk)
    if enable_gqa and k.shape[1] != h:
        k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    lse = None
    if return_aux is not None and return_aux.lse:
        s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        lse = s.masked_fill(~mask, float("-inf")).logsumexp(-1)
    return out, AuxOutput(lse=lse)


# ---------------------------------------------------------------------------- launcher
def torchtitan_args(tokenizer: Path, dataset: Path, dump: Path, steps: int, dcp: bool, seq_len: int = 1024,
                    local_batch_size: int = 2, seed: int = 0) -> list[str]:
    """torchtitan's arguments for a float32 CPU run of the debug model on the offline assets:
    ``llama3_debugmodel_dcp`` (torch_dcp) or torchtitan's own ``llama3_debugmodel_ce_loss`` (the
    same model and loss, no context parallelism). No checkpoints, no validation."""
    if dcp:
        head = ["--module", "torch_dcp.integrations.torchtitan", "--config", "llama3_debugmodel_dcp"]
    else:
        head = ["--module", "llama3", "--config", "llama3_debugmodel_ce_loss"]
    return head + [
        "--hf_assets_path", str(tokenizer), "--dataloader.dataset_path", str(dataset), "--dump_folder", str(dump),
        "--training.steps", str(steps), "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(local_batch_size), "--training.mixed_precision_param", "float32",
        "--training.disable_cuda_graphs", "--debug.seed", str(seed), "--checkpoint.no-enable",
        "--validator.no-enable", "--metrics.log_freq", "1", "--parallelism.spmd_backend", "partial_dtensor",
    ]


def _rank_main(argv: list[str], shims: bool = True) -> None:
    """One rank: the CPU shims (unless ``shims`` is False: ``--device cuda``, torchtitan's own
    CUDA path), then torchtitan's own entry point with ``argv``."""
    if shims:
        apply_cpu_shims()
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    sys.argv = ["torchtitan.train", *argv]
    from torchtitan.train import main as torchtitan_main

    # torchtitan's own ending: dist.destroy_process_group() when training succeeded (raises
    # otherwise); what still holds the destroyed groups (DTensor's caches, defaults captured at
    # import, meshes) is released at interpreter exit by torch_dcp (teardown.release_at_exit,
    # registered by its first context), while the interpreter is whole: no torch_dcp.shutdown()
    if "torch_dcp.integrations.torchtitan" not in argv:  # torchtitan alone (--no-dcp): the same release at exit
        import atexit

        from torch_dcp.teardown import release_at_exit

        atexit.register(release_at_exit)
    torchtitan_main()


def main(argv: list[str] | None = None) -> int:
    """Make the assets and run ``--nproc`` ranks; returns torchrun's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--rank", "--rank-cuda"):
        _rank_main(argv[1:], shims=argv[0] == "--rank")
        return 0
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo with the CPU shims; cuda: one GPU per rank (NCCL), no shims")
    p.add_argument("--nproc", type=int, default=2, help="ranks (gloo, one CPU thread each; one GPU each on cuda)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--local-batch-size", type=int, default=2)
    p.add_argument("--block-size", type=int, default=256, help="--dcp.block-size (small, so that documents split)")
    p.add_argument("--divisions", type=int, default=2, help="--dcp.divisions")
    p.add_argument("--no-dcp", action="store_true", help="torchtitan's own run, no context parallelism")
    p.add_argument("--assets", default="outputs/torchtitan_cpu_assets")
    p.add_argument("--dump", default="outputs/torchtitan_cpu")
    args = p.parse_args(argv)
    tok, data = make_assets(args.assets)
    tt = torchtitan_args(tok, data, Path(args.dump), args.steps, not args.no_dcp, args.seq_len, args.local_batch_size)
    if not args.no_dcp:
        tt += ["--dcp.block-size", str(args.block_size), "--dcp.divisions", str(args.divisions)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve()), "--rank-cuda" if args.device == "cuda" else "--rank", *tt, *extra]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
