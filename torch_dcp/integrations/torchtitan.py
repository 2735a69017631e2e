"""torchtitan (0.3.0) trains with torch_dcp: a config registry module.

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module torch_dcp.integrations.torchtitan --config llama3_8b_dcp --dcp.planner dcp

torchtitan's extension point is a config registry module: ``--module M --config F`` calls
``M.F()`` for the trainer ``Config``. This module registers

* :func:`llama3_debugmodel_dcp` and :func:`llama3_8b_dcp`: torchtitan's own ``llama3_debugmodel``
  and ``llama3_8b`` configs (every torchtitan key still applies) turned into
  :class:`DCPTrainer.Config` with a ``dcp: DCPConfig`` section (``--dcp.planner``,
  ``--dcp.block-size``, ``--dcp.divisions``, ``--dcp.cost-model``, ``--dcp.kernel``, ``--dcp.check-plan``,
  ``--dcp.timeout``, ``--dcp.plan-ahead``, ``--dcp.plan-workers``, ``--dcp.token-capacity``,
  ``--dcp.replay``);
* :class:`DCPTrainer`, torchtitan's ``Trainer`` with three hooks overridden:

  - ``batch_generator``: with ``--dcp.plan-ahead N > 0`` (default 2) torchtitan's microbatches
    go through a :class:`torch_dcp.data.PlanningLoader`: each is gathered over the DCP mesh
    when the loader reads it, ``N`` ahead, and planned by rank ``i mod W``'s worker processes
    (shared through the process group's store), so the hook below finds its plan and device
    plan ready; the checkpoint's dataloader state is the one before the first microbatch not
    yet trained on;

  - ``post_dataloading_process`` (once per microbatch; with ``--dcp.plan-ahead 0`` it does
    the gathering and planning itself, in line): all-gathers the microbatch's rows
    over the DCP mesh (torchtitan's data-parallel ``batch`` mesh: DCP unifies data and context
    parallelism in that one dimension), finds the documents of every row (a document starts
    where the loader's position id is 0, else after an EOS token, as torchtitan's
    block-causal mask has them; every row starts one), builds the :class:`~torch_dcp.BatchSpec`
    of the packed global batch, plans it, and keeps this rank's tokens, labels and positions
    (``plan.token_indices(rank)``), then hands them to torchtitan's own hook; in a step whose
    plan leaves some rank without tokens, every rank's tokens are padded to the plan's largest
    count (ignored labels; the attention's padding rows output and receive zeros), since
    torchtitan's attention cannot view zero rows as heads;
  - ``_forward_backward_body``: runs torchtitan's forward and backward inside
    :func:`torch_dcp.context_parallel` for the step's plan, so the model's inner attention,
    torchtitan's ``ScaledDotProductAttention`` wrapper, runs torch_dcp's executor forward and
    backward.

The loss is torchtitan's: the sum of this rank's token losses divided by the global count of
valid labels (torchtitan counts them before this hook, over all ranks' rows, ignored labels
excluded), and FSDP2 sums gradients over the mesh; so losses and gradients equal those of the
run without context parallelism. Parallelism is torchtitan's ``parallelize_llama`` (FSDP2 or
HSDP over the data-parallel dimensions, tensor parallelism with sequence parallelism,
activation checkpointing) with torchtitan's own context parallelism off. Beside tensor
parallelism (``--parallelism.tensor_parallel_degree``, the DCP paper's §6.2 layout) the DCP
group is the data-parallel mesh of each TP index: every TP rank runs the step's one plan,
made for its local heads (:class:`~torch_dcp.tensor_parallel.TensorParallelHeads`) and
planned once for all TP ranks, through its own DCP sub-group. Beside pipeline parallelism
(``--parallelism.pipeline_parallel_degree``; schedules :data:`PIPELINE_SCHEDULES`) every
microbatch has its own plan, read by every stage, and each stage's chunk calls run the plan of
the microbatch they process (:class:`torch_dcp.pipeline.MicrobatchPlans`); every rank's tokens
are padded to ``--dcp.token-capacity`` times the mean, the fixed shape pipeline stages exchange,
and the schedule runs through :func:`pipeline_step`. Refused at start-up, each with a message
naming the key: context and expert parallelism, other pipeline schedules, a tensor-parallel
degree that does not split the model's heads, the ``spmd_types``/``full_dtensor`` backends,
CUDA graphs, validation and the chunked loss (see :func:`check_config`).

``--compile.enable`` works as in torchtitan: each transformer block is compiled (``fullgraph=True``,
``--compile.backend``: inductor, aot_eager or eager) and the attention inside it is one opaque
``torch_dcp::attention`` op in the graph, which runs the step's plan when the graph runs; the
graphs do not depend on the plan (a rank's token count is a dynamic size after the first
recompilation), so the per-step plans do not recompile them. In compiled blocks a head-parallel
plan's backward moves Q, K, V, O and the LSE again instead of keeping them from the forward.

This module imports torchtitan (``pip install 'torch-dcp[torchtitan]'``); ``import torch_dcp``
does not import this module.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import config_registry as llama3_registry
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

import torch_dcp
from torch_dcp.data import PlanningConfig, PlanningLoader, packed_document_lengths
from torch_dcp.executor.padding import PLACEHOLDER_ROWS
from torch_dcp.pipeline import MicrobatchPlans
from torch_dcp.tensor_parallel import TensorParallelHeads

from .torchtitan_config import DCPConfig

__all__ = ["DCPConfig", "DCPTrainer", "DCPSelectiveAC", "check_config", "check_pipeline", "pipeline_step", "with_dcp",
           "llama3_debugmodel_dcp", "llama3_8b_dcp", "PIPELINE_SCHEDULES"]

def check_config(config: "DCPTrainer.Config") -> None:
    """Refuse, at start-up, what the DCP trainer does not support.

    Raises:
        ValueError: a bad ``--dcp.*`` key (:meth:`DCPConfig.validate`), or a torchtitan key set to
            a combination torch_dcp does not support, named in the message.
    """
    config.dcp.validate()
    par = config.parallelism
    degree = getattr(par, "expert_parallel_degree", 1)
    if degree > 1:
        raise ValueError(f"--parallelism.expert_parallel_degree {degree}: expert parallelism together with torch_dcp "
                         "is not supported; set it to 1 (DCP uses the data-parallel dimensions: "
                         "data_parallel_shard_degree / data_parallel_replicate_degree; tensor and pipeline parallelism "
                         "run beside it)")
    if par.pipeline_parallel_degree > 1:
        check_pipeline(par)
    tp = par.tensor_parallel_degree
    if tp > 1 and config.model_spec is not None:
        attn = config.model_spec.model.first_attention
        h, h_kv = attn.n_heads, attn.n_kv_heads or attn.n_heads
        try:
            TensorParallelHeads(h, h_kv, tp)
        except ValueError as err:
            raise ValueError(f"--parallelism.tensor_parallel_degree {tp} does not split the model's heads "
                             f"(model_spec n_heads={h}, n_kv_heads={h_kv}): {err}") from None
        if h_kv % tp:  # torchtitan's column-wise wk, wv shard whole KV heads
            raise ValueError(f"--parallelism.tensor_parallel_degree {tp} must divide the model's n_kv_heads={h_kv} "
                             f"(model_spec; torchtitan shards the key/value projections by heads, n_heads={h})")
    if par.context_parallel_degree > 1:
        raise ValueError(f"--parallelism.context_parallel_degree {par.context_parallel_degree}: torch_dcp replaces "
                         "torchtitan's context parallelism; set it to 1 (DCP spreads documents over the "
                         "data-parallel ranks)")
    if par.spmd_backend != "partial_dtensor":
        raise ValueError(f"--parallelism.spmd_backend {par.spmd_backend}: torch_dcp needs partial_dtensor (its ranks "
                         "hold different numbers of tokens each step, which the other backends type as even shards)")
    if not config.training.disable_cuda_graphs:
        raise ValueError("--training.disable_cuda_graphs must be set with torch_dcp: CUDA graphs need fixed shapes "
                         "and a rank's token count changes every step")
    if config.validator.enable:
        raise ValueError("--validator.enable is not supported with torch_dcp (validation would attend across "
                         "documents without a plan); turn it off")
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        raise ValueError("--loss: torchtitan's ChunkedLossWrapper needs a local sequence length divisible by its "
                         "num_chunks, and a DCP rank's token count changes every step; use CrossEntropyLoss")
    if config.model_spec is not None:
        for layer in config.model_spec.model.layers:
            inner = getattr(getattr(layer, "attention", None), "inner_attention", None)
            if inner is not None and not isinstance(inner, ScaledDotProductAttention.Config):
                raise ValueError(f"model_spec: torch_dcp runs the attention of torchtitan's ScaledDotProductAttention, "
                                 f"the model has {type(inner).__qualname__}; build the config with with_dcp()")


#: pipeline schedules whose chunk calls run one microbatch's forward or backward whole
PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS")


def check_pipeline(par: Any) -> None:
    """Refuse a pipeline-parallel setting the DCP trainer does not run, naming the key.

    Raises:
        ValueError: a schedule outside :data:`PIPELINE_SCHEDULES` (the zero-bubble ones split a
            backward into input and weight passes), a schedule CSV, or a torch whose pipeline
            schedules' ``step`` has no ``loss_kwargs`` (before 2.13: torchtitan's loss needs the
            step's global token count).
    """
    import inspect

    from torch.distributed.pipelining.schedules import get_schedule_class

    if par.pipeline_parallel_schedule_csv:
        raise ValueError("--parallelism.pipeline_parallel_schedule_csv: schedules from a CSV are not supported with "
                         f"torch_dcp; use one of {list(PIPELINE_SCHEDULES)}")
    if par.pipeline_parallel_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"--parallelism.pipeline_parallel_schedule {par.pipeline_parallel_schedule}: torch_dcp runs "
                         f"the schedules {list(PIPELINE_SCHEDULES)} (each chunk call one microbatch's whole forward or "
                         "backward)")
    step = get_schedule_class(par.pipeline_parallel_schedule).step
    if "loss_kwargs" not in inspect.signature(step).parameters:
        raise ValueError(f"--parallelism.pipeline_parallel_degree {par.pipeline_parallel_degree}: this torch "
                         f"({torch.__version__}) has no loss_kwargs in the pipeline schedules' step(), through which "
                         "torchtitan's loss gets the step's token count; pipeline parallelism with torch_dcp needs "
                         "torch >= 2.13")


class DCPTrainer(Trainer):
    """torchtitan's ``Trainer`` whose attention runs torch_dcp's per-step plans."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        dcp: DCPConfig = field(default_factory=DCPConfig)
        """torch_dcp: dynamic context parallelism over the data-parallel ranks."""

        def __post_init__(self):
            Trainer.Config.__post_init__(self)
            check_config(self)

    def __init__(self, config: Config):
        super().__init__(config)
        dims = self.parallel_dims
        if dims.dp_enabled:
            self.dcp_mesh = dims.get_mesh("batch")
        else:
            from torch.distributed.device_mesh import init_device_mesh

            # no data parallelism: every rank its own one-rank DCP group (beside TP or PP ranks)
            self.dcp_mesh = init_device_mesh(self.device.type, (dist.get_world_size(), 1),
                                             mesh_dim_names=("rest", "dcp"))["dcp"]
        self.dcp_topology = torch_dcp.Topology.from_mesh(self.dcp_mesh)
        attn = config.model_spec.model.first_attention
        # beside tensor parallelism every TP rank runs the step's one plan over its own heads,
        # through its own DCP sub-group (the ranks of its TP index); the plan is made once for all
        self._dcp_tp = (dims.get_mesh("tp").get_local_rank(), dims.tp) if dims.tp_enabled else (0, 1)
        # every (pipeline stage, TP index) of a DCP rank runs the same plans: one DCP group per
        # coordinate reads each plan from the store, replica 0's ranks make it
        pp = (dims.get_mesh("pp").get_local_rank(), dims.pp) if dims.pp_enabled else (0, 1)
        self._dcp_replica = (pp[0] * self._dcp_tp[1] + self._dcp_tp[0], pp[1] * self._dcp_tp[1])
        self._dcp_pipeline: MicrobatchPlans | None = None
        if dims.pp_enabled:  # every microbatch its own plan; stages exchange fixed shapes: pad to a capacity
            cfg = config.dcp
            mean = config.parallelism.pipeline_parallel_microbatch_size * config.training.seq_len
            self._dcp_pipeline = MicrobatchPlans(self.dcp_mesh, math.ceil(cfg.token_capacity * mean),
                                                 kernel=cfg.kernel, timeout=cfg.timeout,
                                                 replay=None if cfg.replay else False)
            stages = getattr(self.pp_schedule, "_stages", None) or [getattr(self.pp_schedule, "_stage")]
            for stage in stages:
                self._dcp_pipeline.bind(stage)
        split = TensorParallelHeads(attn.n_heads, attn.n_kv_heads or attn.n_heads, self._dcp_tp[1])
        self._dcp_heads = (split.local_heads, split.local_kv_heads,
                           attn.head_dim or config.model_spec.model.dim // attn.n_heads)
        self._dcp_layers = len(config.model_spec.model.layers)
        param = config.training.mixed_precision_param
        self._dcp_dtype = "bfloat16" if "bfloat16" in (param, config.training.dtype) else "float32"
        self._dcp_plan: torch_dcp.Plan | None = None
        self._dcp_device_plan = None
        self._dcp_loader: PlanningLoader | None = None
        logger.info(f"torch_dcp: {self.dcp_mesh.size()} rank(s) on the data-parallel mesh "
                    f"(x {self._dcp_tp[1]} tensor-parallel, {self._dcp_heads[0]}/{self._dcp_heads[1]} heads each), "
                    f"{self.dcp_topology.n_nodes} node(s); planner={config.dcp.planner} "
                    f"block_size={config.dcp.block_size} divisions={config.dcp.divisions} "
                    f"kernel={config.dcp.kernel} attention dtype={self._dcp_dtype} cost model: "
                    f"{torch_dcp.CostModel.load(config.dcp.cost_model).source if config.dcp.planner == 'dcp' else '-'}")

    # ------------------------------------------------------------------ the per-step plan
    def batch_generator(self, data_iterable):
        """torchtitan's batch generator; with ``--dcp.plan-ahead N > 0`` its microbatches go
        through a :class:`~torch_dcp.data.PlanningLoader`: each is gathered over the DCP mesh
        when the loader reads it (``N`` microbatches ahead, in this thread, so every rank
        gathers at the same points), planned by rank ``i mod W``'s worker processes and shared
        through the process group's store; the microbatch reaches
        :meth:`post_dataloading_process` with its plan and device plan ready. The checkpointed
        dataloader state is the state before the first microbatch not yet trained on."""
        from torchtitan.components.dataloader import DataloaderExhaustedError

        base = Trainer.batch_generator(self, data_iterable)
        cfg = self.config.dcp
        if cfg.plan_ahead == 0:
            yield from base
            return
        group = self.dcp_mesh.get_group()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        source = _GatheredSource(self, base)
        config = PlanningConfig(self.dcp_topology, planner=cfg.planner, block_size=cfg.block_size,
                                divisions=cfg.division_count(), options=cfg.planner_options(), validate=cfg.check_plan,
                                compare=("ring",))
        loader = PlanningLoader(source, config, lookahead=cfg.plan_ahead, workers=cfg.plan_workers, rank=rank,
                                world_size=world, replica=self._dcp_replica[0], replicas=self._dcp_replica[1],
                                timeout=cfg.timeout, device=self.device, kernel=cfg.kernel)
        states = getattr(getattr(self, "checkpointer", None), "states", None)
        if isinstance(states, dict) and states.get("dataloader") is self.dataloader:
            states["dataloader"] = _LoaderState(self.dataloader, loader)
        self._dcp_loader = loader
        with loader:
            for pb in loader:
                input_dict, labels = pb.data[0]
                yield {**input_dict, _PLANNED: pb}, labels
        raise DataloaderExhaustedError()

    def _dcp_gather(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        """All-gather a microbatch's rows over the DCP mesh and find its documents: the packed
        global batch's :class:`~torch_dcp.BatchSpec` and its tensors (tokens, labels,
        positions: ``[rows * world, L]``)."""
        extra = sorted(set(input_dict) - {"input", "positions", _PLANNED})
        if extra:
            raise ValueError(f"torch_dcp: the dataloader gives inputs {extra} besides 'input' and 'positions', which "
                             "torch_dcp cannot shard by token")
        tokens = input_dict["input"]
        positions = input_dict.get("positions")
        rows = [tokens, labels] + ([positions] if positions is not None else [])
        local = torch.stack([r.to(self.device, torch.int64) for r in rows])  # [2 or 3, rows, L]
        group = self.dcp_mesh.get_group()
        world = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=group)
        glob = torch.cat(parts, dim=1)  # [2 or 3, world * rows, L], rank-major
        g_tokens, g_labels = glob[0], glob[1]
        g_positions = glob[2] if positions is not None else None
        lens = packed_document_lengths(None if g_positions is None else g_positions.cpu().numpy(),
                                       g_tokens.cpu().numpy(), getattr(self.tokenizer, "eos_id", None))
        if g_positions is None:  # what the model uses without positions: 0..L-1 in every row
            g_positions = torch.arange(g_tokens.shape[1], device=g_tokens.device).expand_as(g_tokens)
        h, h_kv, d = self._dcp_heads
        batch = torch_dcp.BatchSpec(lens, torch_dcp.Causal(), n_heads=h, n_kv_heads=h_kv, head_dim=d,
                                    dtype=self._dcp_dtype)
        return batch, (g_tokens, g_labels, g_positions)

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        """Keep this rank's tokens, labels and positions of the microbatch's plan (made ahead by
        the loader, or here: gather the rows over the DCP mesh and plan in line); then
        torchtitan's own hook on them (inputs, labels, positions ``[1, S_local]``)."""
        planned = input_dict.pop(_PLANNED, None) if isinstance(input_dict, dict) else None
        cfg = self.config.dcp
        rank = dist.get_rank(self.dcp_mesh.get_group())
        if planned is not None:
            batch, plan = planned.batch, planned.plan
            g_tokens, g_labels, g_positions = planned.data[1]
            self._dcp_device_plan = planned.device_plan
            stats, ring = planned.stats, planned.compare.get("ring")
        else:
            batch, (g_tokens, g_labels, g_positions) = self._dcp_gather(input_dict, labels)
            plan = torch_dcp.plan(batch, self.dcp_topology, planner=cfg.planner, block_size=cfg.block_size,
                                  divisions=cfg.division_count(), **cfg.planner_options())
            if cfg.check_plan:
                plan.validate()
            self._dcp_device_plan = None
            stats, ring = None, None
        idx = torch.from_numpy(plan.token_indices(rank)).to(g_tokens.device)
        self._dcp_plan = plan
        if rank == 0 and self.metrics_processor.should_log(self.step):
            self._log_plan(plan, batch, stats, ring)
        tokens = input_dict["input"]
        local = (g_tokens.flatten()[idx], g_positions.flatten()[idx], g_labels.flatten()[idx])
        if self._dcp_pipeline is not None:  # the stage's fixed shape: padding with ignored labels
            self._dcp_pipeline.add(plan, self._dcp_device_plan)
            self._dcp_device_plan = None
            pad = self._dcp_pipeline.pad
            local = (pad(local[0], 0), pad(local[1], 0), pad(local[2], IGNORE_INDEX))
        else:
            local = self._dcp_pad_empty(plan, local)
        sharded = {"input": local[0][None].to(tokens.dtype), "positions": local[1][None]}
        return super().post_dataloading_process(sharded, local[2][None].to(labels.dtype))

    def _dcp_pad_empty(self, plan: torch_dcp.Plan, local: tuple) -> tuple:
        """This rank's ``(tokens, positions, labels)`` of ``plan``, each ``[n]``; a rank the plan
        gives no tokens gets one placeholder token instead (token 0, position 0, ignored label):
        torchtitan's attention views its projections as ``view(bs, seqlen, -1, head_dim)``,
        which no rows cannot resolve. The context runs the placeholder's attention on no rows
        (:class:`~torch_dcp.executor.padding.PlaceholderRows`: output and gradients zero) and
        its label is ignored, so losses and gradients are those of the step without it."""
        if len(local[0]):
            return local
        fill = [torch.full((PLACEHOLDER_ROWS,), value, dtype=t.dtype, device=t.device)
                for t, value in zip(local, (0, 0, IGNORE_INDEX))]
        return tuple(fill)

    def pp_forward_backward_step(self, *, input_dict_mbs: list[dict[str, torch.Tensor]],
                                 label_mbs: list[torch.Tensor], global_valid_tokens: torch.Tensor) -> torch.Tensor:
        """torchtitan's pipeline step (:func:`pipeline_step`), each microbatch with its plan."""
        self._dcp_pipeline.clear()
        return pipeline_step(self, input_dict_mbs, label_mbs, global_valid_tokens)

    def _log_plan(self, plan: torch_dcp.Plan, batch: torch_dcp.BatchSpec, s: dict | None = None,
                  ring: dict | None = None) -> None:
        """Rank 0's log line of a plan (``s``, ``ring``: its stats and the ring plan's, when the
        planning worker computed them; else computed here)."""
        s = s if s is not None else plan.stats()
        if not ring or "comm_bytes" not in ring:
            ring = torch_dcp.plan(batch, self.dcp_topology, planner="ring",
                                  divisions=self.config.dcp.division_count()).stats()
        n = self._dcp_layers
        mib = 1024 * 1024
        saved = 1 - s["comm_bytes"] / ring["comm_bytes"] if ring["comm_bytes"] else 0.0
        logger.info(f"torch_dcp step {self.step}: {batch.n_docs} docs (longest {int(batch.doc_lens.max())}) "
                    f"over {plan.world_size} ranks, planner {s['planner']}: comm {s['comm_bytes'] * n / mib:.2f} MiB "
                    f"vs ring {ring['comm_bytes'] * n / mib:.2f} MiB ({saved:.0%} less; {n} layers, fwd+bwd), "
                    f"compute imbalance {s['compute_imbalance']:.3f} (ring {ring['compute_imbalance']:.3f}), "
                    f"planning {1000 * s['plan_seconds']:.1f} ms")

    def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs):
        plan, self._dcp_plan = self._dcp_plan, None
        if plan is None:
            raise RuntimeError("torch_dcp: forward-backward without a plan (post_dataloading_process did not run)")
        cfg = self.config.dcp
        dp, self._dcp_device_plan = self._dcp_device_plan, None
        with torch_dcp.context_parallel(self.dcp_mesh, plan=plan, kernel=cfg.kernel, timeout=cfg.timeout,
                                        device_plan=dp, replay=None if cfg.replay else False):
            return Trainer._forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs)


def pipeline_step(trainer: Trainer, input_dict_mbs: list[dict[str, torch.Tensor]], label_mbs: list[torch.Tensor],
                  global_valid_tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``pp_forward_backward_step`` through the pipeline schedule's whole-batch ``step()``.

    torchtitan 0.3.0 hands the schedule pre-split microbatches as ``step(arg_mbs=...,
    kwarg_mbs=..., target_mbs=...)``, keywords that only later torch versions accept
    (pytorch/pytorch#188500); torch 2.13's ``step()`` takes them for model keywords and fails
    ("Expecting 2 arg_mbs but got 1"). This runs the same microbatches (each through
    ``trainer.post_dataloading_process``) as one batch concatenated on the batch dimension, which
    ``step()`` splits back into the same microbatches, and passes the global token count with
    ``loss_kwargs``.

    Returns:
        The sum of the microbatches' losses on the last stage, else ``tensor([-1.0])``.

    Raises:
        ValueError: a model keyword that is not a tensor (``step()`` splits tensors; the
            ``attention_masks`` of torchtitan's FlexAttention are rebuilt for the whole batch
            from its ``positions``, as torchtitan builds them).
    """
    args, targets, kwargs = [], [], []
    for input_dict, labels in zip(input_dict_mbs, label_mbs, strict=True):
        inputs, labels, extra = trainer.post_dataloading_process(input_dict, labels)
        args.append(inputs)
        targets.append(labels)
        kwargs.append(extra)
    whole = {}
    for key, value in kwargs[0].items():
        if isinstance(value, torch.Tensor):
            whole[key] = torch.cat([kw[key] for kw in kwargs])
        elif key != "attention_masks":
            raise ValueError(f"pipeline_step: model keyword {key!r} is a {type(value).__name__}, not a tensor")
    if "attention_masks" in kwargs[0]:  # the whole batch's masks, as torchtitan builds a microbatch's
        whole["attention_masks"] = trainer.model_parts[0].get_attention_masks(positions=whole["positions"])
    with trainer.train_context():
        losses: list | None = [] if trainer.pp_has_last_stage else None
        trainer.pp_schedule.step(*((torch.cat(args),) if trainer.pp_has_first_stage else ()),
                                 target=torch.cat(targets) if trainer.pp_has_last_stage else None, losses=losses,
                                 loss_kwargs={"global_valid_tokens": global_valid_tokens}, return_outputs=False,
                                 **whole)
    if trainer.pp_has_last_stage:
        return torch.sum(torch.stack(losses)).to(trainer.device)
    return torch.tensor([-1.0], device=trainer.device)


_PLANNED = "_torch_dcp_planned"  # the input_dict key carrying a PlannedBatch from batch_generator to the hook


class _GatheredSource:
    """The loader's source: torchtitan's microbatches, each gathered over the DCP mesh, as
    ``(BatchSpec, ((input_dict, labels), (tokens, labels, positions)))``; its state is the
    dataloader's (so the loader saves the state before the first microbatch not trained on)."""

    def __init__(self, trainer: "DCPTrainer", base: Any):
        self.trainer, self.base = trainer, base

    def __iter__(self):
        from torchtitan.components.dataloader import DataloaderExhaustedError

        while True:
            try:
                input_dict, labels = next(self.base)
            except (StopIteration, DataloaderExhaustedError):
                return
            batch, glob = self.trainer._dcp_gather(input_dict, labels)
            yield batch, ((input_dict, labels), glob)

    def state_dict(self) -> Any:
        return self.trainer.dataloader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.trainer.dataloader.load_state_dict(state)


class _LoaderState:
    """Stands for the dataloader in torchtitan's checkpoint while microbatches are read ahead:
    saves the dataloader's state as of the first microbatch not yet trained on."""

    def __init__(self, dataloader: Any, loader: PlanningLoader):
        self.dataloader, self.loader = dataloader, loader

    def state_dict(self) -> Any:
        state = self.loader.state_dict()["source"]
        return state if state is not None else self.dataloader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.dataloader.load_state_dict(state)


class DCPSelectiveAC(SelectiveAC):
    """torchtitan's per-op selective activation checkpointing that also saves the outputs of
    ``torch_dcp::attention`` (as torchtitan saves those of the SDPA ops): recomputing it in the
    backward would run the plan's forward transfers a second time."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return SelectiveAC.get_save_ops(self) | {torch.ops.torch_dcp.attention.default}


# ---------------------------------------------------------------------- registered configs
def with_dcp(base: Trainer.Config, dcp: DCPConfig | None = None) -> DCPTrainer.Config:
    """torchtitan's trainer config ``base`` as a :class:`DCPTrainer.Config`: every key kept, except
    that every layer's inner attention becomes torchtitan's ``ScaledDotProductAttention`` (which
    torch_dcp runs), a ``ChunkedLossWrapper`` becomes its inner loss (plain cross entropy, the
    same sum over tokens), torchtitan's ``SelectiveAC`` becomes :class:`DCPSelectiveAC`, the
    backend ``partial_dtensor``, CUDA graphs off and validation off.

    Raises:
        ValueError: ``base`` has no model spec, or what :func:`check_config` refuses.
    """
    if base.model_spec is None:
        raise ValueError("with_dcp: the base config has no model_spec")
    for layer in base.model_spec.model.layers:
        if getattr(layer, "attention", None) is not None:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    loss = base.loss
    if isinstance(loss, ChunkedLossWrapper.Config):
        loss = loss.loss_fn
    if loss is None:
        loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(base.model_spec))
    base.parallelism.spmd_backend = "partial_dtensor"
    base.training.disable_cuda_graphs = True
    base.validator.enable = False
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    values.update(loss=loss, dcp=dcp if dcp is not None else DCPConfig())
    ac = base.activation_checkpoint
    if type(ac) is SelectiveAC.Config:
        values["activation_checkpoint"] = DCPSelectiveAC.Config(
            **{f.name: getattr(ac, f.name) for f in dataclasses.fields(ac) if f.init})
    return DCPTrainer.Config(**values)


def llama3_debugmodel_dcp() -> DCPTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` (6 layers, dim 256, 16 heads) with torch_dcp."""
    return with_dcp(llama3_registry.llama3_debugmodel())


def llama3_8b_dcp() -> DCPTrainer.Config:
    """torchtitan's ``llama3_8b`` (32 layers, dim 4096, GQA 32/8 heads) with torch_dcp."""
    return with_dcp(llama3_registry.llama3_8b())
