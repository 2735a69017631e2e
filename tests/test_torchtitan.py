"""torchtitan with torch_dcp against torchtitan without context parallelism (CPU, gloo).

Every rank process applies the CPU shims of ``recipes/torchtitan_cpu.py`` (listed with their
reasons there), imports torchtitan once, and trains the debug model twice from the same seed and
data: torchtitan's own ``llama3_debugmodel_ce_loss`` (FlexAttention with the packed-document
causal mask, no context parallelism) and ``llama3_debugmodel_dcp`` (the same model and loss, its
attention run by torch_dcp's plans over the data-parallel ranks). Losses of every step and the
full gradients of step 1 must agree to 1e-5 (float32). With ``--compile.enable`` (torchtitan's
per-block compile) the DCP run must match the uncompiled one the same way.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from spawn import run_ranks

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason="torchtitan is not installed (pip install -e '.[torchtitan]')")

BAD_CONFIGS = {  # torchtitan arguments -> what the start-up error must name
    "planner": (["--dcp.planner", "zigzag"], "--dcp.planner"),
    "block_size": (["--dcp.block-size", "0"], "--dcp.block-size"),
    "tp_heads": (["--parallelism.tensor_parallel_degree", "3"], "--parallelism.tensor_parallel_degree 3 does not "
                 "split the model's heads"),
    "pp_schedule": (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                     "ZBVZeroBubble"], "--parallelism.pipeline_parallel_schedule ZBVZeroBubble"),
    "ep": (["--parallelism.expert_parallel_degree", "2"], "--parallelism.expert_parallel_degree"),
    "token_capacity": (["--dcp.token-capacity", "0.5"], "--dcp.token-capacity"),
    "cp": (["--parallelism.context_parallel_degree", "2"], "--parallelism.context_parallel_degree"),
    "kernel": (["--dcp.kernel", "fast"], "--dcp.kernel"),
    "objective": (["--dcp.objective", "speed"], "--dcp.objective"),
    "head_parallel": (["--dcp.head-parallel", "two"], "--dcp.head-parallel"),
    "divisions": (["--dcp.divisions", "0"], "--dcp.divisions"),
}


def test_divisions_key_takes_default_or_a_positive_integer():
    # default: torch_dcp.plan's own choice (None), as the main job's loader passes it on
    from torch_dcp.integrations.torchtitan import DCPConfig

    assert DCPConfig().divisions == "default" and DCPConfig().division_count() is None
    assert DCPConfig(divisions="6").division_count() == 6 and DCPConfig(divisions=3).division_count() == 3
    DCPConfig(divisions="6").validate()
    for bad in ("0", "-2", "four", "", True, 2.5):
        with pytest.raises(ValueError, match="--dcp.divisions must be default or a positive integer"):
            DCPConfig(divisions=bad).validate()


_ASSETS: dict[str, tuple[Path, Path]] = {}


def _assets(tmp: Path) -> tuple[Path, Path]:
    """The tokenizer and dataset every run of this module reads (made once: training the
    tokenizer takes seconds); read-only to the runs."""
    if "made" not in _ASSETS:
        sys.path.insert(0, str(RECIPES))
        from torchtitan_cpu import make_assets

        _ASSETS["made"] = make_assets(tmp / "assets", n_docs=120, max_chars=6000, vocab_size=512)
    return _ASSETS["made"]


def _record(trainer) -> dict:
    """Wrap the trainer's logging, forward-backward and (DCP) data hook to record the global
    loss and grad norm of every step, step 1's full gradients (before clipping), the comm
    bytes of every DCP plan, and the frames Dynamo compiled by the end of every step."""
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor

    rec: dict = {"loss": [], "grad_norm": [], "grads": None, "comm_bytes": [], "digests": [], "plan_heads": [], "attention_calls": 0,
                 "compiled_frames": []}
    frames_before = counters["frames"]["ok"]
    log, fwd_bwd = trainer.metrics_processor.log, trainer.forward_backward_step

    def log_step(*args, **kwargs):
        rec["loss"].append(float(args[1]))
        rec["grad_norm"].append(float(args[3]))
        return log(*args, **kwargs)

    def forward_backward_step(**kwargs):
        loss = fwd_bwd(**kwargs)
        rec["compiled_frames"].append(counters["frames"]["ok"] - frames_before)
        if trainer.step == 1:
            rec["grads"] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                            for n, p in trainer.model_parts[0].named_parameters()}
        return loss

    trainer.metrics_processor.log = log_step
    trainer.forward_backward_step = forward_backward_step
    if hasattr(trainer, "dcp_mesh"):
        import torch_dcp

        from torch_dcp.executor.runtime import RUNTIME_EXECUTORS

        hook = trainer.post_dataloading_process

        def counted(forward):
            def count_forward(self, *args, **kwargs):  # executor forward passes (recomputations included),
                rec["attention_calls"] += 1  # head-parallel ones too (they run their outer plan's forward_steps)
                return forward(self, *args, **kwargs)
            return count_forward

        # torch_dcp's executor, or the static runtime the step's plan names
        for cls in {torch_dcp.RankExecutor, *RUNTIME_EXECUTORS.values()}:
            cls.forward_steps = counted(cls.forward_steps)

        def post_dataloading_process(*args, **kwargs):
            out = hook(*args, **kwargs)
            rec["comm_bytes"].append(trainer._dcp_plan.stats()["comm_bytes"])
            rec["digests"].append(trainer._dcp_plan.digest())
            rec["plan_heads"].append([trainer._dcp_plan.batch.n_heads, trainer._dcp_plan.batch.n_kv_heads])
            return out

        trainer.post_dataloading_process = post_dataloading_process
        if trainer._dcp_pipeline is not None:
            rec["pipeline"] = trainer._dcp_pipeline
    return rec


def _ranks(rank: int, world: int, mesh, tmp: str, runs: dict, bad: dict) -> None:
    # what torchrun would set (the process group itself is the harness's, which torchtitan reuses)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HOME=f"{tmp}/hf", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    sys.path.insert(0, str(RECIPES))
    from torchtitan_cpu import apply_cpu_shims

    apply_cpu_shims()
    from torchtitan.config import ConfigManager

    import torch_dcp

    results: dict = {"runs": {}, "bad": {}}
    forward_steps = torch_dcp.RankExecutor.forward_steps
    for name, args in runs.items():
        trainer = ConfigManager().parse_args(args).build()
        rec = _record(trainer)
        try:
            trainer.train()
        finally:
            trainer.close()
            torch_dcp.RankExecutor.forward_steps = forward_steps  # _record's count: this run's only
        pipeline = rec.pop("pipeline", None)
        rec["contexts"] = None if pipeline is None else pipeline.contexts
        results["runs"][name] = rec
    for name, args in bad.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                ConfigManager().parse_args(args)
                results["bad"][name] = "accepted"
            except SystemExit:
                results["bad"][name] = " ".join(re.sub(r"[│╭╮╰╯─]", " ", err.getvalue()).split())
    torch.save(results, f"{tmp}/results-{rank}.pt")


def _train(tmp_path: Path, world: int, steps: int, seq_len: int, local_batch: int, dcp_args: list[str],
           parallel_args: list[str], bad: dict | None = None, ref: bool = True,
           compile_backend: str | None = None, rank: int = 0) -> dict:
    """Train (every run from the same seed and data): ``ref`` (torchtitan without CP; with
    ``ref``), ``dcp``, and ``dcp_compiled`` (with ``compile_backend``: ``--compile.enable``);
    ``rank``'s records."""
    sys.path.insert(0, str(RECIPES))
    from torchtitan_cpu import torchtitan_args

    tok, data = _assets(tmp_path)
    common = dict(tokenizer=tok, dataset=data, steps=steps, seq_len=seq_len, local_batch_size=local_batch)
    runs = {
        "ref": torchtitan_args(dump=tmp_path / "ref", dcp=False, **common) + parallel_args,
        "dcp": torchtitan_args(dump=tmp_path / "dcp", dcp=True, **common) + parallel_args + dcp_args,
    }
    dcp_head = runs["dcp"][: len(runs["dcp"]) - len(dcp_args)]
    if compile_backend is not None:
        runs["dcp_compiled"] = (torchtitan_args(dump=tmp_path / "dcp_compiled", dcp=True, **common) + parallel_args
                                + dcp_args + ["--compile.enable", "--compile.backend", compile_backend])
    if not ref:
        del runs["ref"]
    bad_runs = {k: dcp_head + args for k, (args, _) in (bad or {}).items()}
    run_ranks(functools.partial(_ranks, tmp=str(tmp_path), runs=runs, bad=bad_runs), world, tmp_path, timeout=400)
    return torch.load(tmp_path / f"results-{rank}.pt")


def _check_parity(res: dict, steps: int, attention_calls: int = 6, microbatches: int = 1) -> tuple[float, float]:
    ref, dcp = res["runs"]["ref"], res["runs"]["dcp"]
    assert len(ref["loss"]) == len(dcp["loss"]) == steps
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(dcp["loss"], ref["loss"]))
    assert loss_rel <= 1e-5, (dcp["loss"], ref["loss"])
    assert ref["grads"].keys() == dcp["grads"].keys() and len(ref["grads"]) > 10
    grad_diff = max(float((dcp["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
    assert grad_diff <= 1e-5, grad_diff
    assert all(float(g.abs().max()) > 0 for g in dcp["grads"].values())
    assert len(dcp["comm_bytes"]) == steps * microbatches and sum(dcp["comm_bytes"]) > 0  # documents were split
    # one executor forward per layer (and microbatch) and step: selective AC saves the attention, never reruns it
    assert dcp["attention_calls"] == attention_calls * steps, dcp["attention_calls"]
    return loss_rel, grad_diff


def test_dcp_matches_no_cp_on_2_ranks_and_bad_configs_fail_at_start(tmp_path):
    """dp2 (FSDP over 2 ranks), 3 steps, planner dcp with 64-token blocks and its bytes objective
    (compute within 1.1 of the mean: documents are split; the time objective may keep these tiny
    batches whole, which the simulator finds faster); and every deliberately wrong config stops
    at start-up with a message naming its key."""
    res = _train(tmp_path, world=2, steps=3, seq_len=512, local_batch=2,
                 dcp_args=["--dcp.planner", "dcp", "--dcp.block-size", "64", "--dcp.divisions", "2",
                           "--dcp.objective", "bytes", "--dcp.check-plan"], parallel_args=[], bad=BAD_CONFIGS)
    loss_rel, grad_diff = _check_parity(res, 3)
    print(f"2 ranks: loss rel diff {loss_rel:.2e}, step-1 grad max abs diff {grad_diff:.2e}")
    for name, (_, key) in BAD_CONFIGS.items():
        assert key in res["bad"][name], (name, res["bad"][name])


# 37 s: the option's DCP path is the 2-rank test's; this adds torchtitan's own HSDP mesh
@pytest.mark.slow
def test_dcp_matches_no_cp_on_4_ranks_hsdp(tmp_path):
    """HSDP: 2 replicas x FSDP over 2 ranks; DCP over all 4 ranks (the flattened data-parallel
    mesh), 2 steps, planner ring with head parallelism 2 (HCP: all-to-all inside pairs of ranks,
    ring attention over the two pairs; every document split over both)."""
    res = _train(tmp_path, world=4, steps=2, seq_len=256, local_batch=1,
                 dcp_args=["--dcp.planner", "ring", "--dcp.divisions", "2", "--dcp.head-parallel", "2"],
                 parallel_args=["--parallelism.data_parallel_replicate_degree", "2",
                                "--parallelism.data_parallel_shard_degree", "2"])
    loss_rel, grad_diff = _check_parity(res, 2)
    print(f"4 ranks: loss rel diff {loss_rel:.2e}, step-1 grad max abs diff {grad_diff:.2e}")


# 28 s: the compiled SDPA inside the context is tests/test_compile.py's (15 s), the option's
# path the 2-rank test's
@pytest.mark.slow
def test_dcp_trains_with_compiled_blocks(tmp_path):
    """``--compile.enable --compile.backend aot_eager``: torchtitan compiles every transformer
    block (``fullgraph=True``, so the DCP attention is inside each block's graph), dp2, 3 steps
    with documents split (planner dcp, bytes objective, 64-token blocks): the losses and step 1's
    gradients equal the uncompiled DCP run's (which the tests above match with torchtitan without
    CP), selective AC still saves the attention (one executor forward per layer and step), and the
    plans of later steps recompile nothing (a rank's token count becomes a dynamic size at step 2)."""
    steps = 3
    res = _train(tmp_path, world=2, steps=steps, seq_len=256, local_batch=2, ref=False, compile_backend="aot_eager",
                 dcp_args=["--dcp.planner", "ring", "--dcp.divisions", "2"], parallel_args=[])
    eager, compiled = res["runs"]["dcp"], res["runs"]["dcp_compiled"]
    assert len(eager["loss"]) == len(compiled["loss"]) == steps
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(compiled["loss"], eager["loss"]))
    assert loss_rel <= 1e-5, (compiled["loss"], eager["loss"])
    grad_diff = max(float((compiled["grads"][n] - g).abs().max()) for n, g in eager["grads"].items())
    assert grad_diff <= 1e-5, grad_diff
    assert sum(compiled["comm_bytes"]) > 0  # documents really were split
    assert eager["attention_calls"] == compiled["attention_calls"] == 6 * steps, compiled["attention_calls"]
    assert eager["compiled_frames"] == [0] * steps
    frames = compiled["compiled_frames"]
    assert frames[0] > 0 and frames[-1] == frames[-2], frames  # compiled at step 1; nothing new at step 3
    print(f"compiled vs uncompiled DCP: losses {compiled['loss']} vs {eager['loss']} (rel diff {loss_rel:.1e}), "
          f"step-1 grad max abs diff {grad_diff:.1e}, frames compiled by step {frames}")


def test_dcp_beside_tensor_parallelism_matches_tp_without_cp(tmp_path):
    """4 ranks: 2 DCP (FSDP) x 2 TP (torchtitan's TP with its sequence parallelism), 2 steps
    (the second after an optimizer step), against torchtitan with the same TP and no CP: every
    TP rank runs the step's plan of its 8 local heads over its DCP sub-group."""
    res = _train(tmp_path, world=4, steps=2, seq_len=256, local_batch=2,
                 dcp_args=["--dcp.planner", "ring", "--dcp.divisions", "2"],
                 parallel_args=["--parallelism.data_parallel_shard_degree", "2",
                                "--parallelism.tensor_parallel_degree", "2"])
    loss_rel, grad_diff = _check_parity(res, 2)
    assert res["runs"]["dcp"]["plan_heads"] == [[8, 8]] * 2
    print(f"2 DCP x 2 TP: loss rel diff {loss_rel:.2e}, step-1 grad max abs diff {grad_diff:.2e}")


# the compiled DCP attention is test_dcp_trains_with_compiled_blocks's, TP beside DCP the test above's
@pytest.mark.slow
def test_dcp_beside_tensor_parallelism_with_compiled_blocks(tmp_path):
    """2 DCP x 2 TP with ``--compile.enable --compile.backend aot_eager``: the same losses and
    step-1 gradients as torchtitan with the same TP and no CP."""
    res = _train(tmp_path, world=4, steps=3, seq_len=256, local_batch=2, compile_backend="aot_eager",
                 dcp_args=["--dcp.planner", "ring", "--dcp.divisions", "2"],
                 parallel_args=["--parallelism.data_parallel_shard_degree", "2",
                                "--parallelism.tensor_parallel_degree", "2"])
    res["runs"]["dcp"] = res["runs"]["dcp_compiled"]
    loss_rel, grad_diff = _check_parity(res, 3)
    print(f"2 DCP x 2 TP, compiled: loss rel diff {loss_rel:.2e}, step-1 grad max abs diff {grad_diff:.2e}")


def test_dcp_beside_pipeline_parallelism_matches_pp_without_cp(tmp_path):
    """4 ranks: 2 DCP (FSDP) x 2 PP stages (1F1B, 2 microbatches of one row each), 3 steps,
    against torchtitan with the same pipeline and no CP, seen from the last stage (rank 2: its
    losses, its gradients): every microbatch runs its own plan on both stages, padded to the
    token capacity (1.25 x 256 tokens per rank)."""
    res = _train(tmp_path, world=4, steps=3, seq_len=256, local_batch=2, rank=2,
                 dcp_args=["--dcp.planner", "ring", "--dcp.divisions", "2"],
                 parallel_args=["--parallelism.data_parallel_shard_degree", "2",
                                "--parallelism.pipeline_parallel_degree", "2",
                                "--parallelism.pipeline_parallel_schedule", "1F1B",
                                "--parallelism.pipeline_parallel_microbatch_size", "1"])
    # the last stage: 3 of the debug model's 6 layers, 2 microbatches per step, each its own plan
    loss_rel, grad_diff = _check_parity(res, 3, attention_calls=3 * 2, microbatches=2)
    dcp = res["runs"]["dcp"]
    assert len(dcp["digests"]) == 3 * 2 and len(set(dcp["digests"])) > 1  # a plan per microbatch, not per step
    assert dcp["contexts"] == 3 * 2 * 2  # a forward and a backward chunk call per microbatch and step
    print(f"2 DCP x 2 PP (1F1B): loss rel diff {loss_rel:.2e}, step-1 grad max abs diff {grad_diff:.2e}")


# the compiled DCP attention is test_dcp_trains_with_compiled_blocks's, PP beside DCP the test above's
@pytest.mark.slow
def test_dcp_beside_pipeline_parallelism_with_compiled_blocks(tmp_path):
    """2 DCP x 2 PP (1F1B) with ``--compile.enable --compile.backend aot_eager``: the same losses
    and step-1 gradients of the last stage as torchtitan's pipeline without CP."""
    res = _train(tmp_path, world=4, steps=3, seq_len=256, local_batch=2, rank=2, compile_backend="aot_eager",
                 dcp_args=["--dcp.planner", "ring", "--dcp.divisions", "2"],
                 parallel_args=["--parallelism.data_parallel_shard_degree", "2",
                                "--parallelism.pipeline_parallel_degree", "2",
                                "--parallelism.pipeline_parallel_schedule", "1F1B",
                                "--parallelism.pipeline_parallel_microbatch_size", "1"])
    res["runs"]["dcp"] = res["runs"]["dcp_compiled"]
    loss_rel, grad_diff = _check_parity(res, 3, attention_calls=3 * 2, microbatches=2)
    print(f"2 DCP x 2 PP, compiled: loss rel diff {loss_rel:.2e}, step-1 grad max abs diff {grad_diff:.2e}")


# 8 ranks on 2 cores: minutes; the 4-rank tests above run each pair of dimensions
@pytest.mark.slow
def test_dcp_beside_tensor_and_pipeline_parallelism_on_8_ranks(tmp_path):
    """8 ranks: 2 DCP x 2 PP (interleaved 1F1B, 2 stages per rank) x 2 TP, 2 steps, against
    torchtitan with the same TP and pipeline and no CP, from the last stage's rank 6."""
    res = _train(tmp_path, world=8, steps=2, seq_len=256, local_batch=4, rank=6,
                 dcp_args=["--dcp.planner", "ring", "--dcp.divisions", "2"],
                 parallel_args=["--parallelism.data_parallel_shard_degree", "2",
                                "--parallelism.tensor_parallel_degree", "2",
                                "--parallelism.pipeline_parallel_degree", "2",
                                "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                "--parallelism.pipeline_parallel_microbatch_size", "1"])
    loss_rel, grad_diff = _check_parity(res, 2, attention_calls=3 * 4, microbatches=4)
    assert res["runs"]["dcp"]["plan_heads"][0] == [8, 8]
    print(f"2 DCP x 2 PP x 2 TP: loss rel diff {loss_rel:.2e}, step-1 grad max abs diff {grad_diff:.2e}")
