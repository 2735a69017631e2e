"""Pipeline parallelism beside DCP: every microbatch runs its own plan, at fixed shapes.

A pipeline schedule (``torch.distributed.pipelining``: GPipe, 1F1B, interleaved 1F1B, looped
BFS) runs the forward and the backward of a step's microbatches on each stage in its own
order, interleaved. Beside DCP every microbatch has its own plan (DCP paper, §6.2: the plan is
made per microbatch, pipeline parallelism across distant ranks), and every stage of a DCP rank
runs the same plans: the activations a stage hands to the next are those of its tokens of that
microbatch's plan.

:class:`MicrobatchPlans` holds one step's plans, in microbatch order, and binds a
``PipelineStage``'s chunk calls (``forward_one_chunk(i, ...)``, ``backward_one_chunk(i, ...)``)
to a :func:`torch_dcp.context_parallel` context of microbatch ``i``'s plan, so the attention
inside a chunk, forward or backward, runs the plan of the microbatch it is processing.

PyTorch's pipeline stages fix the shapes of the activations they exchange at their first step,
while a plan gives a rank a different number of tokens in every microbatch. So every rank's
tokens of a microbatch are padded to a fixed ``capacity`` (:meth:`MicrobatchPlans.pad`; labels
padded with the ignored index): the attention's padding rows output and receive zeros
(:class:`~torch_dcp.executor.padding.PaddedRows`), so with their labels ignored the losses and
gradients are exactly those of the unpadded tokens. A plan that puts more than ``capacity``
tokens on a rank is refused when it is added, naming both numbers.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from .context import DCPContext, context_parallel
from .executor.device_plan import DevicePlan
from .executor.padding import check_capacity
from .plan import Plan

__all__ = ["MicrobatchPlans"]


class MicrobatchPlans:
    """One step's plans, microbatch by microbatch, for pipeline stages (see the module).

    Args:
        mesh: the one-dimensional DCP mesh of this rank (the same on every stage of a DCP rank).
        capacity: tokens every rank's microbatch carries (its tokens of the plan, then padding).
        kernel, timeout, replay: as :func:`torch_dcp.context_parallel`'s, for every microbatch.

    Raises:
        ValueError: ``capacity`` not a positive integer.
    """

    def __init__(self, mesh: Any, capacity: int, *, kernel: Any = None, timeout: float = 600.0,
                 replay: Any = None):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"MicrobatchPlans: capacity must be a positive integer of tokens, got {capacity!r}")
        self.mesh, self.capacity = mesh, capacity
        self.kernel, self.timeout, self.replay = kernel, timeout, replay
        self._plans: list[tuple[Plan, DevicePlan | None]] = []
        self.contexts = 0

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Forget the plans (call before the next step's microbatches are added)."""
        self._plans.clear()

    def add(self, plan: Plan, device_plan: DevicePlan | None = None) -> int:
        """Append the next microbatch's plan (and this rank's device plan of it, if built ahead).

        Returns:
            The microbatch's index.

        Raises:
            ValueError: the plan puts more than ``capacity`` tokens on a rank.
        """
        check_capacity(plan, self.capacity, f"torch_dcp pipeline: microbatch {len(self._plans)}: the capacity every "
                       "pipeline stage's activations carry")
        self._plans.append((plan, device_plan))
        return len(self._plans) - 1

    def pad(self, tokens: torch.Tensor, fill: int | float) -> torch.Tensor:
        """A rank's tokens of a microbatch, ``[..., n]``, followed by ``fill`` up to ``[..., capacity]``.

        Raises:
            ValueError: more than ``capacity`` tokens.
        """
        n = tokens.shape[-1]
        if n > self.capacity:
            raise ValueError(f"torch_dcp pipeline: {n} tokens, more than the capacity of {self.capacity}")
        out = tokens.new_full((*tokens.shape[:-1], self.capacity), fill)
        out[..., :n] = tokens
        return out

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[DCPContext]:
        """A :func:`torch_dcp.context_parallel` context of microbatch ``index``'s plan, whose SDPA
        calls carry ``capacity`` tokens.

        Raises:
            IndexError: no plan was added for ``index`` (with the count added).
        """
        if not 0 <= index < len(self._plans):
            raise IndexError(f"torch_dcp pipeline: microbatch {index} has no plan ({len(self._plans)} added this "
                             "step)")
        plan, device_plan = self._plans[index]
        self.contexts += 1
        with context_parallel(self.mesh, plan=plan, device_plan=device_plan, kernel=self.kernel,
                              timeout=self.timeout, replay=self.replay, padded_tokens=self.capacity) as ctx:
            yield ctx

    def bind(self, stage: Any) -> None:
        """Run ``stage``'s ``forward_one_chunk(i, ...)`` and ``backward_one_chunk(i, ...)`` (a
        ``torch.distributed.pipelining`` stage's chunk calls, ``i`` the microbatch) inside
        :meth:`microbatch` ``(i)``. Binding a stage twice is an error.

        Raises:
            ValueError: ``stage`` is already bound (to this or another instance).
        """
        if getattr(stage, "_torch_dcp_plans", None) is not None:
            raise ValueError("MicrobatchPlans.bind: the stage is already bound")
        stage._torch_dcp_plans = self
        for name in ("forward_one_chunk", "backward_one_chunk"):
            setattr(stage, name, self._bound(getattr(stage, name)))

    def _bound(self, call: Any) -> Any:
        @functools.wraps(call)
        def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
            with self.microbatch(chunk):
                return call(chunk, *args, **kwargs)

        return run
