"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` with torch_dcp as their context parallelism.

The switch a user writes::

    from accelerate import ParallelismConfig
    from torch_dcp.integrations.hf import DCPSFTTrainer          # or DCPTrainer

    model = AutoModelForCausalLM.from_config(config, attn_implementation="torch_dcp")
    args = SFTConfig(..., packing=True, parallelism_config=ParallelismConfig(cp_size=N))
    DCPSFTTrainer(model=model, args=args, train_dataset=ds, ...).train()

:class:`DCPTrainer` and :class:`DCPSFTTrainer` take exactly their bases' arguments. The DCP group
is the mesh's ``cp`` dimension: accelerate gives every rank of it the same micro-batch (as for
its own context parallelism) and shards the model over the data dimensions as it does (FSDP2 on
``dp_shard_cp`` where the user asks for FSDP -- on CPU ranks, where accelerate runs none, this
module applies FSDP2 itself -- else DDP over every rank). Each micro-batch --
TRL's padding-free rows (one ``[1, T]`` row, position ids restarting in every document) or a
padded batch of several sequences (each row's unpadded tokens one document) -- becomes one
global batch of documents (:func:`torch_dcp.integrations.hf.pack`) and runs inside
:func:`torch_dcp.context_parallel` on a plan of its documents. Each rank's loss is its tokens'
sum over the step's global label count (``num_items_in_batch``, counted from the pre-shifted
labels), so Trainer's gradient accumulation and loss scaling give the loss and gradients of one
process training the same batches with each document masked on its own.

What accelerate's own context parallelism does instead (``cp_backend="torch"``): it enters
PyTorch's ``context_parallel`` and hooks every attention module to drop its mask for
``is_causal=True``, so packed documents attend across their boundaries. Here accelerate sees the
``cp`` dimension only as one that receives the same batch (:class:`DCPParallelismConfig`): its
CP hooks, its refusal of CP without FSDP, and TRL's refusal of packing under CP do not apply.

Plans are made before the forward: Trainer fetches an optimizer step's micro-batches at once
(``get_batch_samples``), and every one of them is packed and planned there, with
:attr:`DCPTrainerMixin.dcp` (:class:`TrainerDCPConfig`: planner, block size, the cost model,
``"auto"`` by default). The plans' figures (bytes moved, against ring attention's plan of the
same batch; compute imbalance; planning seconds; ranks holding no tokens) go into Trainer's logs.
A rank the plan gives no tokens still runs the forward and the backward (on a placeholder token:
:meth:`~torch_dcp.integrations.hf.PackedBatch.model_inputs`) and every collective.

Refused at construction, naming the setting: a model whose ``attn_implementation`` is not
``"torch_dcp"``, attention dropout, logit soft-capping, layer types other than full and sliding
attention, accelerate's ``sp_size`` or ``tp_size`` beside ``cp_size``, a ``cp_size`` that does not
divide the world size. ``cp_size`` 1 (or no parallelism config) leaves the stock Trainer, unless
:attr:`TrainerDCPConfig.single_rank` asks for the DCP path on one process (torchrun with one
process: the plans, the executor and its kernels on that process's device, nothing to exchange).
Evaluation runs every batch whole on every rank (the backend is transformers' SDPA outside a
context) and keeps one copy of each batch's figures per DCP group, so its losses are one
process's.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import os
from typing import Any

import numpy as np
import torch
import transformers
from accelerate import ParallelismConfig

import torch_dcp
from torch_dcp.data.plan_store import decode_record
from torch_dcp.data.plan_worker import PlanningConfig, _worker_job, plan_batch, planning_pool
from torch_dcp.plan import load_plan
from torch_dcp.planners import Runtime

from . import hf, hf_saving

logger = transformers.utils.logging.get_logger(__name__)

__all__ = ["TrainerDCPConfig", "DCPParallelismConfig", "DCPTrainerMixin", "DCPTrainer", "DCPSFTTrainer",
           "micro_batch_documents"]

#: the key under which a prepared micro-batch carries its plan from ``get_batch_samples`` to the step
_KEY = "_torch_dcp"
#: the padding-free collator's keys that describe the packing (dropped: the plan carries the documents)
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
#: keys the micro-batch may carry that DCP rebuilds from the documents
_KNOWN_KEYS = {"input_ids", "labels", "shift_labels", "position_ids", "attention_mask", *_PACKING_KEYS}
#: what the model call gets of :meth:`~torch_dcp.integrations.hf.PackedBatch.model_inputs` (Trainer passes
#: ``num_items_in_batch`` itself)
_MODEL_KEYS = ("input_ids", "position_ids", "labels", "shift_labels", "attention_mask")


@dataclasses.dataclass
class TrainerDCPConfig:
    """How :class:`DCPTrainer` and :class:`DCPSFTTrainer` plan every micro-batch.

    Attributes:
        planner: :func:`torch_dcp.plan`'s planner (default ``"dcp"``).
        block_size: tokens per block.
        divisions: divisions per rank (``None``: the planner's default).
        cost_model: the model dcp times its candidates with (``"auto"``: this device's).
        compare: planners whose plans of the same batch are made for the logs (bytes against
            ring attention's); ``()`` for none.
        workers: planning processes per rank. 0 (default): every micro-batch of an optimizer
            step is planned in line when Trainer fetches them, before the first forward. N >= 1:
            they are submitted to N "spawn" processes there (:func:`torch_dcp.data.planning_pool`),
            so the later micro-batches are planned while the earlier ones train; a step waits
            only for a plan not made yet (at most ``timeout``).
        timeout: seconds any wait may block: inside the context, and for a plan.
        single_rank: with ``cp_size`` 1 in a run of one process under ``torch.distributed``
            (``torchrun --nproc-per-node 1``, ``accelerate launch`` with one process), train
            every micro-batch through torch_dcp all the same, on a DCP group of that one rank
            (planned, packed and run by torch_dcp's executor on the process's device, CUDA or
            CPU): a check of the DCP path on one device against the stock trainer; it
            parallelizes nothing. Read by ``train()``; refused there with more than one process
            (set ``cp_size``) or without a process group. Default off: ``cp_size`` 1 is the
            stock trainer.
    """

    planner: str = "dcp"
    block_size: int = 256
    divisions: int | None = None
    cost_model: str = "auto"
    compare: tuple[str, ...] = ("ring",)
    workers: int = 0
    timeout: float = 600.0
    single_rank: bool = False


class DCPParallelismConfig(ParallelismConfig):
    """accelerate's :class:`~accelerate.ParallelismConfig` with the ``cp`` dimension run by torch_dcp.

    The mesh keeps ``cp`` (its ranks receive the same batch; FSDP shards over ``dp_shard_cp``)
    but accelerate's own context parallelism is off: ``cp_enabled`` is False, so no PyTorch
    ``context_parallel``, no hooks dropping the attention mask, and no FSDP required for it.
    """

    _accelerate_sees_cp = False

    @classmethod
    def of(cls, pc: ParallelismConfig) -> "DCPParallelismConfig":
        """The same sizes and handlers as ``pc``."""
        if isinstance(pc, cls):
            return pc
        return cls(**{f.name: getattr(pc, f.name) for f in dataclasses.fields(pc) if f.init})

    @property
    def cp_enabled(self) -> bool:  # accelerate's CP backend: off unless a validation asks
        return self._accelerate_sees_cp and self.cp_size > 1

    def _with_cp(self, prop: property) -> Any:
        self._accelerate_sees_cp = True
        try:
            return prop.fget(self)
        finally:
            self._accelerate_sees_cp = False

    non_dp_dim_names = property(lambda self: self._with_cp(ParallelismConfig.non_dp_dim_names))
    dp_shard_cp_dim_names = property(lambda self: self._with_cp(ParallelismConfig.dp_shard_cp_dim_names))
    dp_cp_dim_names = property(lambda self: self._with_cp(ParallelismConfig.dp_cp_dim_names))

    def _validate_accelerator(self, accelerator: Any) -> None:
        from accelerate.utils import DistributedType

        _check_sizes(self, accelerator.num_processes)  # named, with what to set (accelerate's message is not)
        if accelerator.distributed_type == DistributedType.MULTI_CPU:
            # accelerate takes parallelism configs on devices only; on CPU ranks (gloo) the DCP
            # group and the data shards need nothing of it but a mesh of the world's size
            return
        self._accelerate_sees_cp = True
        try:
            super()._validate_accelerator(accelerator)
        finally:
            self._accelerate_sees_cp = False


# ------------------------------------------------------------------ micro-batches as documents
def micro_batch_documents(inputs: dict[str, Any]) -> dict[str, Any]:
    """The documents of one Trainer micro-batch, as :func:`~torch_dcp.integrations.hf.pack`'s arguments.

    Args:
        inputs: the collator's batch: ``input_ids`` ``[B, L]`` and ``labels`` ``[B, L]``
            (HF-style, unshifted, ``-100``: no loss); either padding-free (``B == 1`` with
            ``position_ids`` restarting at 0 in every document, TRL's ``padding_free`` /
            ``bfd`` packing) or rows with an ``attention_mask`` (each row's unpadded tokens
            one document; padding on either side) or without one (each row one document).

    Returns:
        ``{"input_ids": row, "position_ids": row, "labels": row}`` or ``{"documents": [...],
        "labels": [...]}``.

    Raises:
        ValueError: no ``input_ids`` or ``labels``, a tensor the plan cannot shard (any key
            but ids, labels, positions, the attention mask and the packing keys), a row whose
            attention mask is not one contiguous run, or an empty row.
    """
    extra = sorted(k for k, v in inputs.items() if k not in _KNOWN_KEYS and isinstance(v, torch.Tensor))
    if extra:
        raise ValueError(f"torch_dcp Trainer: the micro-batch carries {extra}, which context parallelism cannot "
                         "shard (it shards input_ids, labels and position_ids by the plan)")
    for key in ("input_ids", "labels"):
        if key not in inputs:
            raise ValueError(f"torch_dcp Trainer: the micro-batch has no {key!r} (a causal LM's batch: input_ids "
                             "and labels)")
    ids, labels = inputs["input_ids"], inputs["labels"]
    if ids.dim() != 2 or labels.shape != ids.shape:
        raise ValueError(f"torch_dcp Trainer: input_ids {list(ids.shape)} and labels {list(labels.shape)} must "
                         "both be [batch, length]")
    mask = inputs.get("attention_mask")
    if mask is None and "position_ids" in inputs and ids.shape[0] == 1:
        return {"input_ids": ids, "position_ids": inputs["position_ids"], "labels": labels}
    docs, labs = [], []
    for b in range(ids.shape[0]):
        keep = torch.ones(ids.shape[1], dtype=torch.bool) if mask is None else mask[b].detach().cpu().bool()
        idx = torch.nonzero(keep).flatten()
        if idx.numel() == 0:
            raise ValueError(f"torch_dcp Trainer: row {b} of the micro-batch has no tokens (attention_mask all 0)")
        if idx[-1] - idx[0] + 1 != idx.numel():
            raise ValueError(f"torch_dcp Trainer: row {b}'s attention_mask is not one contiguous run of tokens "
                             "(padding on the sides only)")
        sl = slice(int(idx[0]), int(idx[-1]) + 1)
        docs.append(ids[b, sl])
        labs.append(labels[b, sl])
    return {"documents": docs, "labels": labs}


@dataclasses.dataclass
class _Prepared:
    """A micro-batch packed, with its plan and the planner's header, or the planning worker's
    future of them."""

    packed: hf.PackedBatch
    plan: Any = None
    header: dict[str, Any] = dataclasses.field(default_factory=dict)
    future: cf.Future | None = None

    def resolve(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for a worker's plan.

        Raises:
            RuntimeError: the planner raised in the worker (its cause named).
            TimeoutError: no plan within ``timeout``.
        """
        if self.future is None:
            return
        try:
            kind, payload = self.future.result(timeout=timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"torch_dcp Trainer: no plan of the micro-batch from this rank's planning worker "
                               f"within {timeout:g} s (TrainerDCPConfig.timeout)") from None
        self.future = None
        if kind == "error":
            raise RuntimeError(f"torch_dcp Trainer: planning the micro-batch failed in the worker: {payload}")
        record = decode_record(payload)
        self.plan, self.header = load_plan(record.plan_bytes), record.header
        self.plan.plan_seconds = float(record.header.get("plan_seconds", 0.0))


# ------------------------------------------------------------------ the trainers
class DCPTrainerMixin:
    """What :class:`DCPTrainer` and :class:`DCPSFTTrainer` add to their Trainer base (see the
    module docstring). Set :attr:`dcp` (a :class:`TrainerDCPConfig`) on the class or the
    instance before ``train()`` to plan otherwise."""

    #: how every micro-batch is planned
    dcp: TrainerDCPConfig = TrainerDCPConfig()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        targs = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        pc = getattr(targs, "parallelism_config", None)
        if pc is None and int(os.environ.get("PARALLELISM_CONFIG_CP_SIZE", "1")) > 1:
            pc = ParallelismConfig()  # accelerate launch's settings, read from the environment
        self._dcp_size = 1
        self._dcp_pool: cf.ProcessPoolExecutor | None = None
        self._dcp_planning: PlanningConfig | None = None
        self._dcp_stats: list[dict[str, float]] = []
        self._dcp_evaluating = False
        self._dcp_fsdp = False  # whether this trainer sharded the model with FSDP2 itself (CPU ranks)
        self._dcp_single_mesh: Any = None  # the one-rank mesh of TrainerDCPConfig.single_rank, set by train()
        self.dcp = dataclasses.replace(self.dcp)  # this trainer's own copy of the class's settings
        if pc is not None and pc.cp_size > 1:
            _check_parallelism(pc)
            if targs is None:
                raise ValueError("torch_dcp Trainer: PARALLELISM_CONFIG_CP_SIZE asks for context parallelism but no "
                                 "TrainingArguments were given (args=...): torch_dcp runs the cp dimension through them")
            targs.parallelism_config = DCPParallelismConfig.of(pc)
            self._dcp_size = pc.cp_size
        super().__init__(*args, **kwargs)
        if self._dcp_size > 1:
            _check_model(self.model)
            self.gather_function = self._dcp_gather_for_metrics
            if _fsdp_asked(self.args) and not self.is_fsdp_enabled:  # CPU ranks: accelerate has no FSDP there
                _fully_shard(self.model, self.accelerator.torch_device_mesh["dp_shard_cp"])
                self._dcp_fsdp = True
                logger.info("torch_dcp Trainer: FSDP asked for on CPU ranks, where accelerate runs none: the model is "
                            "sharded with FSDP2 over the dp_shard_cp mesh (decoder layers, then the root)")

    # -- planning ahead: the optimizer step's micro-batches, before the first forward
    @property
    def dcp_mesh(self) -> Any:
        """The DCP group's one-dimensional mesh (accelerate's ``cp`` dimension; with
        :attr:`TrainerDCPConfig.single_rank`, this one process's)."""
        if self._dcp_single_mesh is not None:
            return self._dcp_single_mesh
        return self.accelerator.torch_device_mesh["cp"]

    @property
    def _dcp_on(self) -> bool:
        """Whether training runs through torch_dcp: ``cp_size > 1``, or ``single_rank``."""
        return self._dcp_size > 1 or self._dcp_single_mesh is not None

    def _dcp_prepare(self, inputs: dict[str, Any]) -> dict[str, Any]:
        packed = hf.pack(config=self.model.config, dtype=_attention_dtype(self), device=self.args.device,
                         **micro_batch_documents(inputs))
        planning = self._dcp_planning
        if self._dcp_pool is not None:
            prepared = _Prepared(packed, future=self._dcp_pool.submit(_worker_job, packed.batch.to_dict(), planning))
        else:
            prepared = _Prepared(packed, *plan_batch(packed.batch, planning))
        return {"input_ids": packed.input_ids, "labels": packed.labels, "shift_labels": packed.labels,
                "position_ids": packed.position_ids, _KEY: prepared}

    def train(self, *args: Any, **kwargs: Any) -> Any:
        if self._dcp_size == 1:
            self._dcp_single_mesh = _single_rank_mesh(self) if self.dcp.single_rank else None
        if self._dcp_on:  # how this run plans, from `dcp` as it stands now
            conf = self.dcp
            options = {"cost_model": conf.cost_model} if conf.planner == "dcp" else {}
            self._dcp_planning = PlanningConfig(self._dcp_size, conf.planner, conf.block_size, conf.divisions,
                                                options, compare=conf.compare)
            if conf.workers > 0:
                self._dcp_pool = planning_pool(conf.workers, self._dcp_planning)
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._dcp_pool is not None:
                self._dcp_pool.shutdown(wait=False, cancel_futures=True)
                self._dcp_pool = None

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        if not self._dcp_on:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        samples = []
        for _ in range(num_batches):
            try:
                samples.append(self._dcp_prepare(next(epoch_iterator)))
            except StopIteration:
                break
        return samples, self._get_num_items_in_batch(samples, device)

    def _prepare_context_parallel_inputs(self, model: Any, inputs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if not self._dcp_on:
            return super()._prepare_context_parallel_inputs(model, inputs)
        prepared = inputs.pop(_KEY, None)
        if prepared is None:  # evaluation: every rank runs the whole batch (transformers' SDPA outside a context)
            return contextlib.nullcontext, inputs
        prepared.resolve(self.dcp.timeout)
        self._dcp_stats.append(_plan_figures(prepared.header, prepared.plan))
        inputs.clear()  # filled on entry to the context, with this rank's share (_dcp_context)
        return functools.partial(self._dcp_context, prepared, inputs), inputs

    @contextlib.contextmanager
    def _dcp_context(self, prepared: _Prepared, inputs: dict[str, Any]) -> Any:
        """:func:`torch_dcp.context_parallel` on the micro-batch's plan; on entry ``inputs`` (the
        dict Trainer passes to the model) becomes this rank's model inputs
        (:meth:`~torch_dcp.integrations.hf.PackedBatch.model_inputs`: a placeholder token on a rank
        holding none)."""
        packed = prepared.packed
        with torch_dcp.context_parallel(self.dcp_mesh, buffers=packed.buffers, buffer_seq_dims=packed.buffer_seq_dims,
                                        no_restore_buffers=set(packed.buffers), plan=prepared.plan,
                                        timeout=self.dcp.timeout) as ctx:
            mine = packed.model_inputs()
            inputs.update({k: mine[k] for k in _MODEL_KEYS})
            yield ctx

    # -- evaluation: every rank of a DCP group runs each batch whole; one copy per group is kept
    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        self._dcp_evaluating = True
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self._dcp_evaluating = False

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        if self._dcp_on and self._dcp_evaluating:
            return None  # a whole batch's loss is its own mean (not a share of a global count)
        return super()._get_num_items_in_batch(batch_samples, device)

    def _dcp_gather_for_metrics(self, data: Any) -> Any:
        """accelerate's ``gather_for_metrics`` with one copy per DCP group: the ranks of a group
        evaluate the same batch, so the gathered list keeps rank ``dcp_rank == 0``'s entries
        (mesh order: data shards outer, ``cp`` inner), then drops the last batch's padding as
        accelerate does (its ``remainder`` counts the data shards only)."""
        from accelerate.utils import gather, recursively_apply

        world, cp = self.accelerator.num_processes, self._dcp_size
        state = self.accelerator.gradient_state

        def one_per_group(t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(world, -1, *t.shape[1:])[::cp].reshape(-1, *t.shape[1:])
            return t[: state.remainder] if state.end_of_dataloader and state.remainder > 0 else t

        return recursively_apply(one_per_group, gather(data))

    # -- saving and loading a model this trainer sharded (full state dicts, as accelerate's FSDP2 path)
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._dcp_fsdp:
            return super().save_model(output_dir, _internal_call)
        # every node's first rank writes with save_on_each_node: then every rank gets the full tensors
        state = hf_saving.full_model_state(self.model, every_rank=self.args.save_on_each_node)
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._dcp_fsdp:
            return super()._save_optimizer_and_scheduler(output_dir)
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        hf_saving.save_optimizer(self.model, self.optimizer, os.path.join(output_dir, OPTIMIZER_NAME),
                                 write=self.args.should_save and self.args.process_index == 0)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._dcp_fsdp:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        result = hf_saving.load_model(self.model, resume_from_checkpoint)
        self._issue_warnings_after_load(result)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._dcp_fsdp or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        optimizer, scheduler = os.path.join(checkpoint, OPTIMIZER_NAME), os.path.join(checkpoint, SCHEDULER_NAME)
        if _any_rank(os.path.isfile(optimizer) and os.path.isfile(scheduler)):  # rank 0 wrote them
            hf_saving.load_optimizer(self.model, self.optimizer, optimizer)
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        if not self._dcp_fsdp:
            return super()._load_best_model()
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self._dcp_stats:
            keys = self._dcp_stats[0].keys()
            logs.update({f"dcp_{k}": round(float(np.mean([s[k] for s in self._dcp_stats])), 4) for k in keys})
            self._dcp_stats.clear()
        super().log(logs, *args, **kwargs)


def _fully_shard(model: torch.nn.Module, mesh: Any) -> None:
    """FSDP2 over ``mesh`` (the data and DCP ranks), as accelerate's FSDP2 plugin shards on a
    device: every module of the model's ``_no_split_modules`` classes (its decoder layers), then
    the root. The model is marked prepared, so accelerate (which runs no FSDP on CPU ranks) does
    not wrap it in DDP as well."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model._is_accelerate_prepared = True


def _single_rank_mesh(trainer: Any) -> Any:
    """The one-dimensional ``cp`` mesh of this one process (:attr:`TrainerDCPConfig.single_rank`),
    on the device the trainer runs on, after the model's checks.

    Raises:
        ValueError: no process group is initialised, or more than one process runs.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size() if dist.is_initialized() else 0
    if world != 1:
        why = (f"but {world} processes run; set parallelism_config cp_size={world} (or a divisor of it) instead"
               if world else "but no process group is initialised; launch the one process with torchrun "
               "--nproc-per-node 1 (or accelerate launch)")
        raise ValueError(f"torch_dcp Trainer: TrainerDCPConfig.single_rank runs torch_dcp on one process, {why}")
    _check_model(trainer.model)
    return init_device_mesh(trainer.args.device.type, (1,), mesh_dim_names=("cp",))


def _fsdp_asked(args: Any) -> bool:
    """FSDP asked for: ``fsdp`` in the training arguments, or accelerate launch's
    ``distributed_type: FSDP`` (``ACCELERATE_USE_FSDP``), which accelerate ignores on CPU ranks."""
    return bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _any_rank(flag: bool) -> bool:
    """``flag`` of any rank (a collective on the default group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _plan_figures(header: dict[str, Any], plan: Any) -> dict[str, float]:
    stats = header["stats"]
    out = {"comm_bytes": float(stats["comm_bytes"]), "compute_imbalance": float(stats["compute_imbalance"]),
           "plan_seconds": float(header["plan_seconds"]),
           "empty_ranks": float(sum(plan.local_tokens(r) == 0 for r in range(plan.world_size))),
           # 1: the step ran as a static CP configuration on its own runtime (dcp's candidate)
           "static_runtime": float(plan.attention_part(0)[0].placement.runtime is not Runtime.EXECUTOR)}
    ring = header.get("compare", {}).get("ring", {})
    if ring.get("comm_bytes"):
        out["bytes_vs_ring"] = stats["comm_bytes"] / ring["comm_bytes"]
    return out


def _attention_dtype(trainer: Any) -> torch.dtype:
    if trainer.args.bf16:
        return torch.bfloat16
    if trainer.args.fp16:
        return torch.float16
    return next(trainer.model.parameters()).dtype


def _check_parallelism(pc: ParallelismConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if pc.sp_size and pc.sp_size > 1:
        raise ValueError(f"torch_dcp Trainer: parallelism_config.sp_size={pc.sp_size} (DeepSpeed sequence "
                         "parallelism) cannot run beside torch_dcp's context parallelism; set sp_size=1")
    if pc.tp_size and pc.tp_size > 1:
        raise ValueError(f"torch_dcp Trainer: parallelism_config.tp_size={pc.tp_size}: tensor parallelism beside "
                         "torch_dcp is not supported in the Trainer integration; set tp_size=1")
    if world % pc.cp_size:
        raise ValueError(f"torch_dcp Trainer: parallelism_config.cp_size={pc.cp_size} does not divide the world "
                         f"size {world}")
    _check_sizes(pc, world)


def _check_sizes(pc: ParallelismConfig, world: int) -> None:
    """Refuse a mesh that is not the world's size, saying which ``dp_shard_size`` would fill it.

    Raises:
        ValueError: ``dp_replicate_size x dp_shard_size x cp_size`` (and tp, sp) is not ``world``.
    """
    if pc.total_size == world:
        return
    rest = pc.total_size // pc.dp_shard_size  # every size but dp_shard
    what = (f"set dp_shard_size={world // rest} (the data shards beside cp_size={pc.cp_size}"
            + (f" and dp_replicate_size={pc.dp_replicate_size}" if pc.dp_replicate_size > 1 else "") + ")"
            if world % rest == 0 else f"run a multiple of {rest} processes")
    sizes = " x ".join(f"{k}={getattr(pc, k)}" for k in ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size",
                                                          "sp_size") if getattr(pc, k) > 1 or k == "dp_shard_size")
    raise ValueError(f"torch_dcp Trainer: parallelism_config {sizes} = {pc.total_size} ranks, but {world} processes "
                     f"run; {what}")


def _check_model(model: Any) -> None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl != hf.NAME:
        raise ValueError(f"torch_dcp Trainer: the model's attn_implementation is {impl!r}; load or build it with "
                         f"attn_implementation={hf.NAME!r} (import torch_dcp.integrations.hf registers it)")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(f"torch_dcp Trainer: config.attention_dropout={config.attention_dropout}: attention "
                         "dropout is not supported under torch_dcp; set it to 0")
    for key in ("attn_logit_softcapping", "attn_softcapping"):
        if getattr(config, key, None):
            raise ValueError(f"torch_dcp Trainer: config.{key}={getattr(config, key)}: logit soft-capping is not "
                             "supported under torch_dcp")
    other = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(f"torch_dcp Trainer: config.layer_types has {other}; torch_dcp runs full and sliding-window "
                         "attention layers only")


class DCPTrainer(DCPTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with torch_dcp as its context parallelism (module docstring);
    the same arguments as ``Trainer``."""


def _sft_trainer() -> type:
    from trl import SFTTrainer

    class DCPSFTTrainer(DCPTrainerMixin, SFTTrainer):
        """``trl.SFTTrainer`` with torch_dcp as its context parallelism (module docstring);
        the same arguments as ``SFTTrainer``. Packing (``bfd``) and padding-free rows are
        trained exactly: each document attends to itself only."""

    DCPSFTTrainer.__module__ = __name__
    DCPSFTTrainer.__qualname__ = "DCPSFTTrainer"
    return DCPSFTTrainer


def __getattr__(name: str) -> Any:  # DCPSFTTrainer imports trl on first use only
    if name == "DCPSFTTrainer":
        cls = _sft_trainer()
        globals()[name] = cls
        return cls
    raise AttributeError(name)

