"""Saving and loading a model that :mod:`torch_dcp.integrations.hf_trainer` sharded with FSDP2 itself.

On CPU ranks accelerate runs no FSDP, so where the user asks for it (``fsdp=True`` in the
training arguments, or accelerate's ``distributed_type: FSDP``) the trainer applies FSDP2 (the
model's parameters become ``DTensor`` shards) and Trainer's own saving, which writes
``model.state_dict()`` as it is, cannot run. These functions do what accelerate's FSDP2 path
does with a full state dict:

- :func:`full_model_state` gathers the full parameters from the shards (a collective: every
  rank calls it), to CPU on rank 0 only; Trainer's ``save_pretrained`` then writes them there, so
  a checkpoint or ``save_model()`` directory reloads with plain ``from_pretrained``;
- :func:`save_optimizer` writes the optimizer's full state (keyed by parameter names) from
  rank 0;
- :func:`load_model` and :func:`load_optimizer` read such files on rank 0 and broadcast them
  into every rank's shards (``resume_from_checkpoint``).

Every function here is a collective over the model's FSDP mesh: call it on every rank.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

__all__ = ["full_model_state", "save_optimizer", "load_model", "load_optimizer"]

#: the files transformers' save_pretrained writes (one safetensors file, or an index of several)
_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"


def full_model_state(model: torch.nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The model's full state dict, gathered from its FSDP2 shards (collective).

    Args:
        model: the FSDP2-sharded model (its root).
        every_rank: every rank gets the full tensors (e.g. ``save_on_each_node``); default:
            rank 0 only, on CPU, and ``{}`` elsewhere.

    Returns:
        ``{name: tensor}`` with the full (unsharded) shapes, on CPU.
    """
    opts = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    state = get_model_state_dict(model, options=opts)
    return {k: v.cpu() for k, v in state.items()} if every_rank else state


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, write: bool) -> None:
    """Write the optimizer's full state (parameters named, not numbered) to ``path`` (collective).

    Args:
        model: the FSDP2-sharded model the optimizer steps.
        optimizer: its optimizer (accelerate's wrapper or the optimizer itself).
        path: the file (Trainer's ``optimizer.pt``).
        write: whether this rank writes it (Trainer's ``should_save``; rank 0 holds the state).
    """
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, _inner(optimizer), options=opts)
    if write:
        torch.save(state, path)


def load_model(model: torch.nn.Module, checkpoint: str) -> Any:
    """Load ``checkpoint``'s weights (written by ``save_pretrained``) into the shards (collective).

    Rank 0 reads the safetensors file(s) and broadcasts the tensors; each rank keeps its shard.
    Keys the files lack (e.g. a tied ``lm_head.weight`` that save_pretrained leaves out) are
    reported, not refused, as Trainer's own loading does.

    Args:
        model: the FSDP2-sharded model (its root).
        checkpoint: a directory with ``model.safetensors`` or ``model.safetensors.index.json``.

    Returns:
        The ``(missing_keys, unexpected_keys)`` of :meth:`torch.nn.Module.load_state_dict`.

    Raises:
        FileNotFoundError: on rank 0, no safetensors weights in ``checkpoint`` (the other
            ranks then fail in the broadcast).
    """
    state: dict[str, torch.Tensor] = {}
    if _rank() == 0:
        state = _read_safetensors(checkpoint)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    return set_model_state_dict(model, state, options=opts)


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load :func:`save_optimizer`'s file into the optimizer's shards (collective): rank 0 reads
    it and broadcasts.

    Raises:
        FileNotFoundError: on rank 0, no file at ``path``.
    """
    state: dict[str, Any] = {}
    if _rank() == 0:
        state = torch.load(path, map_location="cpu", weights_only=True)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, _inner(optimizer), state, options=opts)


def _read_safetensors(checkpoint: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(checkpoint, _SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(checkpoint, _SAFE_WEIGHTS)):
        files = [_SAFE_WEIGHTS]
    else:
        raise FileNotFoundError(f"torch_dcp Trainer: no {_SAFE_WEIGHTS} or {_SAFE_INDEX} in {checkpoint} (a "
                                "checkpoint written by save_model or during training)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(checkpoint, name), device="cpu"))
    return state


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
