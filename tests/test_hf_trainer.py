"""Hugging Face Trainer and TRL's SFTTrainer under torch_dcp: recipes/train_trl.py on gloo ranks
against one process running the same batches, the DCP path on one rank (CPU, and one CUDA GPU
under ``-m cuda``) against the same, and the integration's pieces on their own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from test_train import ROOT, _runs  # noqa: E402

RECIPE = ROOT / "recipes" / "train_trl.py"
REL = 1e-5
#: float32 against one process, per device: on CUDA the attention kernels of the two runs
#: (FlexAttention under torch_dcp, SDPA's memory-efficient kernel over the masked row) sum in
#: other orders than on CPU, where both are SDPA's
FLOAT32_REL = {"cpu": REL, "cuda": 1e-4}
#: what each logged figure measures: the training loss and the evaluation loss are one quantity
FIGURES = {"loss": "loss", "eval_loss": "loss", "grad_norm": "grad_norm"}


def _errors(mine: list[dict], theirs: list[dict]) -> dict[str, float]:
    """The largest relative difference of two runs' rows (the same steps: 3 optimizer steps, then
    the evaluation where there is one), per quantity of :data:`FIGURES`."""
    steps = [row["step"] for row in theirs]
    assert [row["step"] for row in mine] == steps and steps[:3] == [1, 2, 3], (mine, theirs)
    out: dict[str, float] = {}
    for a, b in zip(mine, theirs):
        for key, what in FIGURES.items():
            if key in b:
                out[what] = max(out.get(what, 0.0), abs(a[key] - b[key]) / abs(b[key]))
    return out


def _planned(dcp: list[dict], ref: list[dict]) -> list[dict]:
    """The DCP run's training rows, each with its plans' figures (the reference's have none)."""
    assert all("dcp_plan_seconds" not in row for row in ref)
    rows = [row for row in dcp if row["step"] != "eval"]
    for row in rows:
        assert row["dcp_plan_seconds"] > 0 and row["dcp_compute_imbalance"] >= 1.0, row
    return rows


# ranks, data shards, trainer, model: Llama (full causal) and Qwen2 (every layer a 96-token window),
# GQA 4/2, 3 optimizer steps of 2 accumulated micro-batches (the 2-rank SFT case on long rows is
# test_recipe_reference_flag's; 4 ranks as 2 x 2 with Trainer is -m slow: the SFT case covers the
# data shards, the 2-rank Trainer case the padded batches). The SFT cases pack rows smaller than
# the world's blocks (128 tokens): rows of 200 tokens on 3 ranks (2 blocks), 128 on 2 DCP ranks
# (1 block; planned by greedy, which keeps it whole, where dcp would halve it), 300 on 5 ranks (3
# blocks): in every step some rank holds no tokens, while documents longer than a block are split
# over ranks. The 3-rank case plans in a worker process per rank, the others in line; the 2 x 2
# SFT case shards the parameters with FSDP2 over the 4 ranks and saves (a checkpoint, save_model)
# and resumes; the others replicate them (DDP)
SHORT = {3: ["--max-doc-len", "200", "--max-length", "200"], 4: ["--max-doc-len", "128", "--max-length", "128"],
         5: ["--max-doc-len", "300", "--max-length", "300"]}
CASES = [(3, 1, "sft", "qwen2", SHORT[3], ["--plan-workers", "1", "--planner", "greedy"]),
         (4, 2, "sft", "qwen2", SHORT[4], ["--fsdp", "--save-steps", "2", "--resume-check", "--planner", "greedy"]),
         (5, 1, "sft", "qwen2", SHORT[5], []),
         (2, 1, "hf", "llama", [], []), pytest.param(4, 2, "hf", "qwen2", [], [], marks=pytest.mark.slow)]


@pytest.mark.parametrize("world,shards,trainer,model,shape,extra", CASES,
                         ids=["sft-qwen2-3x1-empty-worker", "sft-qwen2-2x2-empty-fsdp-save", "sft-qwen2-5x1-empty",
                              "hf-llama-2x1", "hf-qwen2-2x2"])
def test_trainer_matches_one_process(world, shards, trainer, model, shape, extra, tmp_path):
    """DCPSFTTrainer (bfd packing, padding-free rows) and DCPTrainer (padded batches of 4
    documents) on W gloo ranks, as W DCP ranks or 2 DCP ranks x 2 data shards (FSDP2 or DDP),
    plans made in line or in a planning process, ranks without tokens in the SFT cases: the
    logged losses and gradient norms of every step within 1e-5 relative of one process (the
    stock trainer, transformers' SDPA masking every document on its own) on the same batches,
    and so is the evaluation loss after training; the plans' figures are in the logs. With
    FSDP2, the model saved by ``save_model()`` reloads with plain ``from_pretrained`` and equals
    one process's trained model, and a run resumed from the step-2 checkpoint logs step 3 as the
    uninterrupted run did."""
    # evaluation too where the data shards see the one-process batches (padding-free rows with 2
    # shards: Trainer's own padding of the last evaluation step weighs it otherwise, DCP or not)
    args = ["--trainer", trainer, "--model", model, "--dp-shards", str(shards), "--device", "cpu", *shape]
    evaluate = shards == 1 or trainer == "hf"
    args += ["--eval"] if evaluate else []
    saving = "--save-steps" in extra
    out = ["--output-dir", str(tmp_path / "dcp")] if saving else []
    dcp, ref = _runs((args + extra + out, tmp_path / "dcp.jsonl", world),
                     (args + (["--output-dir", str(tmp_path / "ref")] if saving else []), tmp_path / "ref.jsonl", None),
                     recipe=RECIPE)
    resumed = [row for row in dcp if row.get("resumed")]
    dcp = [row for row in dcp if not row.get("resumed")]
    # evaluation: every rank evaluates each batch whole; one copy per DCP group is gathered
    assert len(ref) == 3 + evaluate and max(_errors(dcp, ref).values()) <= REL, _errors(dcp, ref)
    dcp = _planned(dcp, ref)
    for row in dcp:
        assert 0 <= row["dcp_bytes_vs_ring"] < 1.0 or shape  # documents kept whole move less than ring attention
    if shape:  # a rank held no tokens in some micro-batch of every step (unless dcp ran the step as
        # all-gather CP on its own runtime, which spreads every document over its CP group)
        assert all(row["dcp_empty_ranks"] > 0 or row["dcp_static_runtime"] == 1 for row in dcp), dcp
        assert any(row["dcp_empty_ranks"] > 0 for row in dcp) or "--planner" not in extra, dcp
    if saving:
        _check_saved(tmp_path, dcp, resumed)


ON_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                reason="needs a CUDA device (DCPSFTTrainer on one GPU)")]


# the CPU bf16 case is slow-marked: the CPU fp32 case runs the same one-rank path, the CUDA bf16 case the tolerance
@pytest.mark.parametrize("device,precision", [("cpu", "fp32"), pytest.param("cpu", "bf16", marks=pytest.mark.slow),
                                              pytest.param("cuda", "fp32", marks=ON_CUDA),
                                              pytest.param("cuda", "bf16", marks=ON_CUDA)],
                         ids=["cpu-fp32", "cpu-bf16", "cuda-fp32", "cuda-bf16"])
def test_one_rank_matches_one_process(device, precision, tmp_path):
    """DCPSFTTrainer on one process under torchrun (``TrainerDCPConfig.single_rank``: every
    micro-batch planned and run by torch_dcp's executor on the device; on CUDA through
    accelerate's CUDA path, NCCL with one rank, the model and batches on cuda:0) against the stock
    trainer in one process on the same device: Qwen2 (every layer a 96-token window), bfd packing,
    3 optimizer steps of 2 micro-batches, then the evaluation loss.

    float32: every logged loss, gradient norm and the evaluation loss within
    :data:`FLOAT32_REL` relative (1e-5 on CPU, 1e-4 on CUDA). bf16 (Trainer's ``bf16=True``,
    autocast): the two runs' kernels round differently (on CUDA, flash-attention per document
    against SDPA over the masked row), so no equality is asked; bf16 is held to what it costs one
    process instead: the DCP bf16 run's distance from the float32 reference within twice the
    reference's own bf16-vs-float32 distance (the largest over the steps, the losses pooled with
    the evaluation loss, since one step's distance can be near 0 by chance), and at least the
    float32 tolerance. One rank holds every token: nothing moves and no rank is empty."""
    args = ["--trainer", "sft", "--model", "qwen2", "--device", device, "--eval"]
    mixed = ["--bf16"] if precision == "bf16" else []
    runs = [(args + mixed, tmp_path / "dcp.jsonl", 1), (args, tmp_path / "fp32.jsonl", None)]
    runs += [(args + mixed, tmp_path / "ref.jsonl", None)] if mixed else []
    dcp, fp32, *ref = _runs(*runs, recipe=RECIPE)
    errors, spread = _errors(dcp, fp32), _errors(ref[0], fp32) if ref else {}  # spread: what bf16 costs one process
    allowed = {what: max(FLOAT32_REL[device], 2 * spread.get(what, 0.0)) for what in errors}
    assert len(fp32) == 4 and all(errors[k] <= allowed[k] for k in errors), (errors, allowed)
    for row in _planned(dcp, fp32):
        assert row["dcp_comm_bytes"] == 0 and row["dcp_empty_ranks"] == 0 and row["dcp_compute_imbalance"] == 1.0


def _check_saved(tmp_path, dcp, resumed):
    """The FSDP2 run's saved model (full parameters gathered from the shards) reloads with plain
    transformers and equals one process's (Adam amplifies float noise in near-zero gradients:
    1e-5 absolute after 3 steps of lr 1e-3); the checkpoint holds the optimizer and scheduler; the
    resumed run's step 3 is the uninterrupted run's."""
    import transformers

    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dcp" / "final").state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref" / "final").state_dict()
    assert saved.keys() == want.keys()
    for name, t in want.items():
        assert torch.allclose(saved[name], t, rtol=1e-4, atol=1e-5), (name, (saved[name] - t).abs().max())
    assert {"optimizer.pt", "scheduler.pt", "model.safetensors"} <= {p.name for p in (tmp_path / "dcp" /
                                                                                       "checkpoint-2").iterdir()}
    assert [row["step"] for row in resumed] == [3], resumed
    for key in ("loss", "grad_norm"):
        assert abs(resumed[0][key] - dcp[2][key]) <= 1e-6 * abs(dcp[2][key]), (key, resumed, dcp[2])


def test_recipe_reference_flag():
    """The recipe as docs/huggingface.md names it: 2 ranks, --reference prints the comparison (on
    CPU ranks wherever the suite runs: on one GPU, 2 NCCL ranks would share it, which NCCL refuses)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(RECIPE), "--reference", "--device", "cpu"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("summary:")][-1]
    loss_rel = float(line.split("loss rel <= ")[1].split(",")[0])
    grad_rel = float(line.split("grad_norm rel <= ")[1])
    assert loss_rel <= REL and grad_rel <= REL, line


def test_micro_batch_documents():
    """Padding-free rows keep their position ids; padded rows become one document each (padding
    on either side); what cannot be sharded is refused, naming it."""
    from torch_dcp.integrations.hf_trainer import micro_batch_documents

    ids = torch.arange(10)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])
    got = micro_batch_documents({"input_ids": ids, "labels": ids, "position_ids": pos,
                                 "cu_seq_lens_q": torch.tensor([0, 3, 5, 10]), "max_length_q": 5})
    assert got["position_ids"] is pos and got["input_ids"] is ids
    rows = torch.tensor([[1, 2, 3, 0], [0, 0, 4, 5], [6, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]])
    got = micro_batch_documents({"input_ids": rows, "labels": rows.masked_fill(mask == 0, -100),
                                 "attention_mask": mask})
    assert [d.tolist() for d in got["documents"]] == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert [x.tolist() for x in got["labels"]] == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="contiguous"):
        micro_batch_documents({"input_ids": rows, "labels": rows, "attention_mask": torch.tensor(
            [[1, 0, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])})
    with pytest.raises(ValueError, match="no tokens"):
        micro_batch_documents({"input_ids": rows, "labels": rows, "attention_mask": mask * 0})
    with pytest.raises(ValueError, match="token_type_ids"):
        micro_batch_documents({"input_ids": rows, "labels": rows, "token_type_ids": rows})
    with pytest.raises(ValueError, match="'labels'"):
        micro_batch_documents({"input_ids": rows})


def _model(**config):
    import transformers

    import torch_dcp.integrations.hf  # noqa: F401

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, **config)
    return transformers.LlamaForCausalLM(cfg)


def test_refusals_name_the_setting():
    """What torch_dcp cannot run is refused at start-up with the setting named."""
    from accelerate import ParallelismConfig

    from torch_dcp.integrations.hf_trainer import _check_model, _check_parallelism

    _check_model(_model(attn_implementation="torch_dcp"))
    for config, match in ((dict(attn_implementation="sdpa"), "attn_implementation is 'sdpa'"),
                          (dict(attn_implementation="torch_dcp", attention_dropout=0.1), "attention_dropout"),
                          (dict(attn_implementation="torch_dcp", layer_types=["chunked_attention"]),
                           "chunked_attention")):
        with pytest.raises(ValueError, match=match):
            _check_model(_model(**config))
    model = _model(attn_implementation="torch_dcp")
    model.config.attn_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-capping"):
        _check_model(model)
    with pytest.raises(ValueError, match="tp_size=2"):
        _check_parallelism(ParallelismConfig(cp_size=2, tp_size=2))
    os.environ["WORLD_SIZE"] = "4"
    try:
        with pytest.raises(ValueError, match="cp_size=3 does not divide the world size 4"):
            _check_parallelism(ParallelismConfig(cp_size=3))
        with pytest.raises(ValueError, match=r"^torch_dcp Trainer: .* = 2 ranks, but 4 processes run; "
                                             r"set dp_shard_size=2"):
            _check_parallelism(ParallelismConfig(cp_size=2))
        _check_parallelism(ParallelismConfig(cp_size=2, dp_shard_size=2))
    finally:
        del os.environ["WORLD_SIZE"]


def test_trainer_names_and_fsdp_request(monkeypatch):
    """The trainers and their configuration are reachable where the docs put them; FSDP is asked
    for by the training arguments or by accelerate launch's ``distributed_type: FSDP``."""
    import types

    from torch_dcp.integrations import hf, hf_trainer

    assert hf.TrainerDCPConfig is hf_trainer.TrainerDCPConfig and hf.DCPTrainer is hf_trainer.DCPTrainer
    assert hf.DCPSFTTrainer.__name__ == "DCPSFTTrainer"
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not hf_trainer._fsdp_asked(types.SimpleNamespace(fsdp=[]))
    assert hf_trainer._fsdp_asked(types.SimpleNamespace(fsdp=["full_shard"]))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert hf_trainer._fsdp_asked(types.SimpleNamespace(fsdp=[]))


def test_trainer_refuses_a_model_without_the_backend(tmp_path):
    """DCPTrainer with cp_size > 1 and a model on transformers' SDPA: refused, naming the backend."""
    import transformers
    from accelerate import ParallelismConfig

    from torch_dcp.integrations.hf import DCPTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                          parallelism_config=ParallelismConfig(cp_size=3))
    with pytest.raises(ValueError, match="cp_size=3 does not divide the world size 1"):
        DCPTrainer(model=_model(attn_implementation="sdpa"), args=args)


def test_single_rank_needs_one_process(tmp_path):
    """TrainerDCPConfig.single_rank without a process group (a plain process, not torchrun):
    refused when training starts, naming how to launch it."""
    import transformers

    from torch_dcp.integrations.hf import DCPTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = DCPTrainer(model=_model(attn_implementation="torch_dcp"), args=args)
    trainer.dcp.single_rank = True
    with pytest.raises(ValueError, match="single_rank .* no process group .* torchrun --nproc-per-node 1"):
        trainer.train()


def test_launcher_cp_size_needs_training_arguments(monkeypatch):
    """accelerate launch's PARALLELISM_CONFIG_CP_SIZE with no TrainingArguments: refused, named
    (it would otherwise fall to accelerate's own CP)."""
    from torch_dcp.integrations.hf import DCPTrainer

    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="PARALLELISM_CONFIG_CP_SIZE"):
        DCPTrainer(model=_model(attn_implementation="torch_dcp"))


def test_parallelism_config_keeps_the_cp_dimension_for_torch_dcp():
    """accelerate's CP backend is off (no hooks, no FSDP demanded) while the mesh keeps ``cp``:
    its ranks receive the same batch and FSDP shards over ``dp_shard_cp``."""
    from accelerate import ParallelismConfig

    from torch_dcp.integrations.hf_trainer import DCPParallelismConfig

    pc = DCPParallelismConfig.of(ParallelismConfig(cp_size=2, dp_shard_size=2))
    assert not pc.cp_enabled and pc.cp_size == 2
    assert pc.non_dp_dim_names == ["cp"] and pc.dp_shard_cp_dim_names == ["dp_shard", "cp"]
    assert pc._get_mesh() == (("dp_shard", "cp"), (2, 2))
