"""Fine-tune a transformers model with TRL's SFTTrainer (or Trainer) under torch_dcp, on real documents.

    torchrun --standalone --nproc-per-node 2 recipes/train_trl.py --reference     # DCP, then one process, compared
    torchrun --standalone --nproc-per-node 4 recipes/train_trl.py --dp-shards 2 --fsdp   # 2 DCP x 2 FSDP2 shards
    python recipes/train_trl.py                                                   # one process, transformers' SDPA

The model is a small transformers Llama or Qwen2 (``--model``; random init, no download; byte
tokens, vocabulary 256 and a pad token) built with ``attn_implementation="torch_dcp"``
(:mod:`torch_dcp.integrations.hf`). The documents are the main job's (the Python standard
library's sources, or ``--data``), capped at ``--max-doc-len`` tokens. With ``--trainer sft``
(default) :class:`~torch_dcp.integrations.hf.DCPSFTTrainer` packs them with TRL's ``bfd``
strategy into padding-free rows of ``--max-length`` tokens; with ``--trainer hf``
:class:`~torch_dcp.integrations.hf.DCPTrainer` trains padded batches of ``--batch-size``
documents each. The switch is ``parallelism_config=ParallelismConfig(cp_size=W / dp_shards,
dp_shard_size=dp_shards)`` and the DCP class in place of the stock one. Batches are taken in
order (``train_sampling_strategy="sequential"``) so that every run sees the same ones.

Under torchrun with one process (``--nproc-per-node 1``) the DCP trainer runs its path on that
one rank (``TrainerDCPConfig.single_rank``: planned and run by torch_dcp's executor, nothing to
exchange), the check of the path on one GPU. ``--device`` picks CUDA or CPU (default: CUDA where
there is one; CPU ranks talk over gloo, CUDA ranks over NCCL, one GPU each).

Without torchrun the recipe is one process: the stock ``SFTTrainer`` / ``Trainer`` with
transformers' ``"sdpa"`` (which masks every packed document on its own from the position ids)
on the same batches (``--batch-size`` x ``--dp-shards`` per micro-batch). ``--reference``
under torchrun runs that one process afterwards (rank 0, a subprocess) and prints, step by step,
the relative differences of the logged losses and gradient norms.

Saving: ``--output-dir DIR`` saves the trained model to ``DIR/final`` (``trainer.save_model()``:
with ``--fsdp`` the full parameters gathered from the shards), ``--save-steps N`` writes
checkpoints during training, and ``--resume-check`` then trains a fresh model resumed from the
first checkpoint to the end (its rows logged with ``"resumed": true``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

#: the pad token's id (after the 256 byte tokens)
PAD = 256


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=["sft", "hf"], default="sft",
                   help="sft: DCPSFTTrainer with bfd packing (default); hf: DCPTrainer on padded batches")
    p.add_argument("--model", choices=["llama", "qwen2"], default="llama",
                   help="llama (full causal) or qwen2 (every layer a sliding window of --window tokens)")
    p.add_argument("--window", type=int, default=96, help="qwen2's sliding window, tokens")
    p.add_argument("--data", default=None, help="folder of text files or JSONL with a 'text' field (default: stdlib)")
    p.add_argument("--docs", type=int, default=48, help="documents read")
    p.add_argument("--max-doc-len", type=int, default=320)
    p.add_argument("--max-length", type=int, default=768, help="sft: tokens per packed row")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per-device micro-batch (default: 1 packed row for sft, 4 documents for hf)")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--dp-shards", type=int, default=1, help="data shards beside the DCP group (torchrun)")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: FSDP2 over the data and DCP ranks (default: DDP)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--planner", default="dcp", help="dcp, greedy, fcp, megatron, ring or allgather")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--cost-model", default="auto", help="auto (default), a100, h100 or a JSON cost model")
    p.add_argument("--plan-workers", type=int, default=0,
                   help="planning processes per rank (0: plans made in line when Trainer fetches a step's batches)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where every process trains (auto: CUDA where available, else CPU)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                   help="bf16 mixed precision (default: off, float32 throughout; TRL's own default is on)")
    p.add_argument("--cross-document", action="store_true",
                   help="one process only: every packed row as one causal sequence (documents attend across their "
                        "boundaries), which is what accelerate's own context parallelism computes: its hooks drop "
                        "the attention mask and pass is_causal=True")
    p.add_argument("--eval", action="store_true",
                   help="after training, evaluate on the same documents (every rank runs each batch whole) and "
                        "log eval_loss")
    p.add_argument("--reference", action="store_true",
                   help="under torchrun: also run one process on the same batches and print the differences")
    p.add_argument("--output-dir", default=None,
                   help="Trainer's output folder (default: a temporary one); the trained model is saved to "
                        "OUTPUT_DIR/final with trainer.save_model() (reloads with from_pretrained)")
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N optimizer steps (0: none)")
    p.add_argument("--resume-check", action="store_true",
                   help="after training, a fresh model and trainer resume from the first checkpoint "
                        "(resume_from_checkpoint) and train to the end; their rows are logged with resumed: true")
    p.add_argument("--log-json", default=None, help="write the logged rows (one JSON per step) to this file")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 1 if args.trainer == "sft" else 4
    if min(args.steps, args.grad_accum, args.dp_shards, args.batch_size, args.docs) < 1:
        p.error("--steps, --grad-accum, --dp-shards, --batch-size and --docs must be positive")
    if args.resume_check and not 0 < args.save_steps < args.steps:
        p.error("--resume-check needs a checkpoint before the last step: 0 < --save-steps < --steps")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def tokenizer():
    """A byte-level tokenizer (256 byte tokens and a pad token) built in memory."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(256)} | {"<pad>": PAD}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")))
    tok.pad_token = tok.eos_token = "<pad>"
    return tok


def build_model(args: argparse.Namespace, attn: str) -> torch.nn.Module:
    """The run's model (the same initial weights for every ``attn``)."""
    import transformers

    import torch_dcp.integrations.hf  # noqa: F401 - registers attn_implementation="torch_dcp"

    common = dict(vocab_size=PAD + 1, hidden_size=args.dim, intermediate_size=2 * args.dim,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=max(args.max_doc_len, args.max_length), tie_word_embeddings=False,
                  pad_token_id=PAD, attention_dropout=0.0)
    if args.model == "llama":
        config = transformers.LlamaConfig(**common)
    else:
        config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=args.window,
                                          max_window_layers=0)
    config._attn_implementation = attn
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model


def dataset(args: argparse.Namespace):
    """The documents as a ``datasets.Dataset`` of token ids."""
    import datasets

    from torch_dcp.data import byte_tokenize, load_documents

    texts = load_documents(args.data, limit=args.docs)
    ids = [byte_tokenize(t)[: args.max_doc_len].tolist() for t in texts]
    return datasets.Dataset.from_dict({"input_ids": [x for x in ids if len(x) > 1]})


def pad_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded rows: ids, attention mask, labels (-100 on padding)."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def train(args: argparse.Namespace, distributed: bool) -> list[dict]:
    """Train ``args.steps`` optimizer steps; returns the logged rows (loss, grad_norm, DCP's plan
    figures), then, with ``--resume-check``, the rows of the run resumed from the first checkpoint."""
    out = args.output_dir or tempfile.mkdtemp(prefix="train_trl-")
    trainer = make_trainer(args, distributed, out)
    trainer.train()
    rows = [{k: v for k, v in row.items() if k != "epoch"} for row in trainer.state.log_history if "loss" in row]
    if args.eval:
        rows.append({"step": "eval", "eval_loss": trainer.evaluate()["eval_loss"]})
    if args.output_dir:
        trainer.save_model(os.path.join(out, "final"))
    if args.resume_check:
        resumed = make_trainer(args, distributed, out)
        resumed.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{args.save_steps}"))
        rows += [{**{k: v for k, v in row.items() if k != "epoch"}, "resumed": True}
                 for row in resumed.state.log_history if "loss" in row and row["step"] > args.save_steps]
    return rows


def make_trainer(args: argparse.Namespace, distributed: bool, out: str):
    """The run's trainer (a fresh model), writing to ``out``."""
    import transformers

    world = int(os.environ.get("WORLD_SIZE", "1"))
    save = dict(save_strategy="steps", save_steps=args.save_steps) if args.save_steps else dict(save_strategy="no")
    common = dict(output_dir=out, max_steps=args.steps, gradient_accumulation_steps=args.grad_accum,
                  learning_rate=args.lr, logging_steps=1, report_to="none", **save, seed=args.seed,
                  use_cpu=args.device == "cpu", disable_tqdm=True, bf16=args.bf16,
                  train_sampling_strategy="sequential",
                  per_device_train_batch_size=args.batch_size * (1 if distributed else args.dp_shards))
    if distributed:
        from accelerate import ParallelismConfig

        if world % args.dp_shards:
            raise SystemExit(f"--dp-shards {args.dp_shards} does not divide the {world} ranks")
        common["parallelism_config"] = ParallelismConfig(cp_size=world // args.dp_shards,
                                                         dp_shard_size=args.dp_shards)
        if args.fsdp:
            common.update(fsdp=True, fsdp_config={"version": 2})
    model = build_model(args, "torch_dcp" if distributed else "sdpa")
    if args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        from torch_dcp.integrations.hf import DCPSFTTrainer

        cls = DCPSFTTrainer if distributed else SFTTrainer
        targs = SFTConfig(**common, packing=True, packing_strategy="bfd", max_length=args.max_length)
        trainer = cls(model=model, args=targs, train_dataset=dataset(args), processing_class=tokenizer(),
                      eval_dataset=dataset(args) if args.eval else None)
    else:
        from torch_dcp.integrations.hf import DCPTrainer

        cls = DCPTrainer if distributed else transformers.Trainer
        targs = transformers.TrainingArguments(**common, remove_unused_columns=False)
        trainer = cls(model=model, args=targs, train_dataset=dataset(args), data_collator=pad_collate,
                      eval_dataset=dataset(args) if args.eval else None)
    if args.cross_document:  # an all-ones mask: transformers then builds no document mask from the positions
        collate = trainer.data_collator
        trainer.data_collator = lambda rows: (lambda b: {**b, "attention_mask": torch.ones_like(b["input_ids"])})(
            collate(rows))
    if distributed:
        trainer.dcp.planner = args.planner
        trainer.dcp.block_size = args.block_size
        trainer.dcp.cost_model = args.cost_model
        trainer.dcp.workers = args.plan_workers
        trainer.dcp.single_rank = world == 1  # one process: the DCP path on one rank
    return trainer


def reference_rows(argv: list[str]) -> list[dict]:
    """The one-process run of the same arguments (a subprocess without torchrun's variables)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU")}
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        cmd = [sys.executable, os.path.abspath(__file__), *[a for a in argv if a != "--reference"],
               "--log-json", f.name]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        return [json.loads(line) for line in open(f.name)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    distributed = "RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    if args.reference and (args.output_dir or args.resume_check):
        raise SystemExit("--reference compares the training steps only; run it without --output-dir and --resume-check")
    if args.reference and not distributed:
        raise SystemExit("--reference runs under torchrun (without it the recipe is the one-process reference)")
    if args.cross_document and (distributed or args.trainer != "sft"):
        raise SystemExit("--cross-document is a one-process run of --trainer sft (no torchrun)")
    rows = train(args, distributed)
    if rank == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.log_json:
            with open(args.log_json, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    if args.reference and rank == 0:
        ref = reference_rows(argv)
        if len(ref) != len(rows):
            raise SystemExit(f"the reference logged {len(ref)} steps, torch_dcp {len(rows)}")
        worst = {"loss": 0.0, "grad_norm": 0.0}
        if args.eval:
            mine, theirs = rows.pop()["eval_loss"], ref.pop()["eval_loss"]
            print(json.dumps({"eval_loss": mine, "ref_eval_loss": theirs}), flush=True)
            worst["eval_loss"] = abs(mine - theirs) / abs(theirs)
        for mine, theirs in zip(rows, ref):
            for k in ("loss", "grad_norm"):
                worst[k] = max(worst[k], abs(mine[k] - theirs[k]) / abs(theirs[k]))
            print(json.dumps({"step": mine["step"], "loss": mine["loss"], "ref_loss": theirs["loss"],
                              "grad_norm": mine["grad_norm"], "ref_grad_norm": theirs["grad_norm"]}), flush=True)
        print(f"summary: {len(rows)} steps; against one process: "
              + ", ".join(f"{k} rel <= {v:.1e}" for k, v in worst.items()), flush=True)
    if distributed:
        import torch_dcp

        torch_dcp.shutdown()


if __name__ == "__main__":
    main()
