"""What a planning worker process runs, and how the loader's workers are started.

:class:`PlanningConfig` is what a worker receives with each batch (pickled); :func:`plan_batch`
is what it runs; :func:`planning_pool` starts the workers ("spawn"). Kept apart from the loader
itself (:mod:`.planning`) so that the worker side reads on its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..api import plan as make_plan
from ..batch import BatchSpec
from ..plan import Plan, PlanError
from ..planners import get_planner
from ..topology import Topology
from ..workload import check_block_size
from .plan_store import encode_plan

__all__ = ["PlanningConfig", "PlanningPool", "plan_batch", "planning_pool"]


@dataclass(frozen=True)
class PlanningConfig:
    """How every batch of a :class:`PlanningLoader` is planned (sent to the worker processes).

    Args:
        topology: the DCP group's :class:`~torch_dcp.Topology`, or its world size (one node).
        planner: planner name (see :func:`torch_dcp.plan`).
        block_size: tokens per block.
        divisions: divisions per rank (``None``: ``min(4, tiles)``).
        options: planner keyword options (a dict, or ``(name, value)`` pairs), JSON-able values.
        validate: run :meth:`Plan.validate` in the worker; a plan that fails is an error of
            its step on every rank.
        compare: planners whose plan of the same batch the worker also makes, for their
            ``stats()`` only (e.g. ``("ring",)`` for logs); their plans are not shipped.
        plan_fn: a picklable top-level function with :func:`torch_dcp.plan`'s signature used
            instead of it (custom planners, fault tests); default :func:`torch_dcp.plan`.

    Raises:
        ValueError: an unknown planner or a bad block size.
    """

    topology: Topology | int
    planner: str = "dcp"
    block_size: int = 1024
    divisions: int | None = None
    options: Any = ()
    validate: bool = False
    compare: tuple[str, ...] = ()
    plan_fn: Callable[..., Plan] | None = None

    def __post_init__(self):
        object.__setattr__(self, "topology", Topology.coerce(self.topology))
        opts = self.options.items() if isinstance(self.options, dict) else self.options
        object.__setattr__(self, "options", tuple(sorted((str(k), v) for k, v in opts)))
        object.__setattr__(self, "compare", tuple(self.compare))
        for name in (self.planner, *self.compare):
            get_planner(name)
        check_block_size(self.block_size)

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (what the batch digest hashes besides the batch)."""
        fn = self.plan_fn
        return {"topology": self.topology.to_dict(), "planner": self.planner, "block_size": int(self.block_size),
                "divisions": self.divisions, "options": [list(kv) for kv in self.options],
                "validate": bool(self.validate), "compare": list(self.compare),
                "plan_fn": None if fn is None else f"{fn.__module__}.{fn.__qualname__}"}

    def digest(self, batch: BatchSpec) -> str:
        """SHA-256 (hex, 32 digits) of the batch and this configuration: part of the store key,
        so a plan can only ever be read for the batch it was made for."""
        text = json.dumps({"batch": batch.to_dict(), "config": self.describe()}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def plan_batch(batch: BatchSpec | dict, config: PlanningConfig) -> tuple[Plan, dict[str, Any]]:
    """Plan one batch as a planning worker does: the plan (validated when
    ``config.validate``) and its header: ``plan_seconds`` (placement and divisions, seconds),
    ``stats`` (:meth:`Plan.stats`), ``compare`` (``{planner: stats}`` of ``config.compare``).

    Raises:
        PlanError: the plan failed validation.
        Exception: whatever the planner raised.
    """
    spec = batch if isinstance(batch, BatchSpec) else BatchSpec.from_dict(batch)
    fn = config.plan_fn or make_plan
    plan = fn(spec, config.topology, planner=config.planner, block_size=config.block_size,
              divisions=config.divisions, **dict(config.options))
    if config.validate:
        plan.validate()
    compare = {}
    for name in config.compare:
        try:
            compare[name] = make_plan(spec, config.topology, planner=name, block_size=config.block_size,
                                      divisions=config.divisions).stats()
        except Exception as err:  # a log figure only: never fails the step
            compare[name] = {"error": f"{type(err).__name__}: {err}"}
    return plan, {"plan_seconds": plan.plan_seconds, "stats": plan.stats(), "compare": compare}


def failure_cause(err: Exception) -> str:
    """The cause, in words, of an exception raised by :func:`plan_batch`."""
    if isinstance(err, PlanError):
        return f"the plan failed validation: {err}"
    return f"the planner raised {type(err).__name__}: {err}"


def _worker_job(batch: dict, config: PlanningConfig) -> tuple[str, Any]:
    """What runs in a worker process: ``("plan", record bytes)`` or ``("error", cause)``."""
    try:
        plan, header = plan_batch(batch, config)
    except Exception as err:
        return "error", failure_cause(err)
    return "plan", encode_plan(plan.to_bytes(), header)


def _warm_up(config: PlanningConfig) -> None:
    """A tiny plan in a new worker: imports and the partitioner's start-up cost paid before step 0."""
    tiny = BatchSpec([2 * config.block_size, 1], n_heads=1, n_kv_heads=1, head_dim=8)
    topo = config.topology
    try:
        make_plan(tiny, topo, planner=config.planner, block_size=config.block_size)
    except Exception:  # warming up is best effort
        pass


def _watch_parent(parent: int) -> None:
    """In a worker: leave when the process that started it is gone (a rank killed without
    shutting its pool down would otherwise leave its workers blocked on their task queue, whose
    write end they hold themselves, forever)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="torch_dcp-parent-watch", daemon=True).start()


class PlanningPool(cf.ProcessPoolExecutor):
    """The planning workers' process pool ("spawn"), which knows whether a worker has warmed up.

    Args:
        workers: worker processes.
        config: each worker first makes one tiny plan of this configuration (imports and the
            partitioner's start-up paid before step 0; not waited for); ``None``: no warm-up.
    """

    def __init__(self, workers: int = 1, config: PlanningConfig | None = None):
        super().__init__(max_workers=int(workers), mp_context=multiprocessing.get_context("spawn"),
                         initializer=_watch_parent, initargs=(os.getpid(),))
        self._warmups = [] if config is None else [self.submit(_warm_up, config) for _ in range(int(workers))]

    def warm(self) -> bool:
        """Whether a worker can take a batch now (it has started and made its tiny plan; true
        without warm-up). A loader plans a step in line, in its own thread, while its pool is
        not warm: a spawned worker takes seconds to import torch, and step 0 would wait for it."""
        return not self._warmups or any(f.done() for f in self._warmups)


def planning_pool(workers: int = 1, config: PlanningConfig | None = None) -> PlanningPool:
    """A pool of ``workers`` planning processes, started with "spawn" (the parent has threads
    and torch: forking it is unsafe); with ``config``, each worker makes one tiny plan first
    (imports and the partitioner's start-up paid before step 0; not waited for). A worker
    leaves by itself within 0.5 s when its parent process is gone. Share the pool between
    loaders with ``PlanningLoader(..., pool=)``; shut it down yourself.
    """
    return PlanningPool(workers, config)
