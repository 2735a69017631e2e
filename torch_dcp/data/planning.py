"""Plans made ahead, off the critical path: :class:`PlanningLoader`.

The DCP paper (Jiang et al., *DCP: Addressing Input Dynamism In Long-Context Training via
Dynamic Context Parallelism*, arXiv 2510.10620) hides planning: data-loader workers plan the
upcoming batches while the devices train, and the plans are shared through a key-value store.
:class:`PlanningLoader` does that for one DCP group:

* every rank iterates the same source of global batches (each item gives the batch's
  :class:`~torch_dcp.BatchSpec` and its tensors) ``lookahead`` items ahead of the training
  loop, in the loop's own thread (so a source may run collectives: every rank pulls items at
  the same points);
* step ``i`` is planned by rank ``i % W``'s worker processes (``ProcessPoolExecutor``,
  "spawn" start method; while a :class:`PlanningPool`'s workers are still starting, by that
  rank's own loader thread, so step 0 does not wait seconds for their imports), which return
  the plan's bytes (:meth:`Plan.to_bytes`), its ``stats()`` and its planning time; that rank
  publishes them in the ``torch.distributed`` Store under a key naming the step and the
  batch's digest (:mod:`.plan_store`), or an error record naming the cause;
* a daemon thread per rank fetches every step's record (bounded wait), checks it (the plan's
  checksums, its batch against the expected one), and builds this rank's
  :class:`~torch_dcp.executor.DevicePlan` (uploaded to ``device``), so the loop gets a
  :class:`PlannedBatch` with everything ready and waits only when planning falls behind.

Plans are a deterministic function of the batch and the :class:`PlanningConfig` (the planners
are deterministic for a fixed seed), so they do not depend on the number of workers or the
order they finish in, and a resumed loader (:meth:`PlanningLoader.state_dict`) makes the same
plans for the same steps.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import queue
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

import torch

from ..batch import BatchSpec
from ..executor.device_plan import DevicePlan
from ..executor.kernels import DivisionKernel, get_kernel
from ..executor.runtime import RUNTIME_EXECUTORS
from ..plan import Plan, PlanError, load_plan
from .plan_store import PlanningError, PlanningTimeoutError, PlanStore, decode_record, encode_error
from .plan_worker import PlanningConfig, PlanningPool, _worker_job, failure_cause, plan_batch, planning_pool

__all__ = ["PlanningConfig", "PlannedBatch", "PlanningLoader", "PlanningError", "PlanningTimeoutError", "plan_batch",
           "PlanningPool", "planning_pool"]

T = TypeVar("T")
_LOADERS = itertools.count()  # default namespaces: loaders made in the same order on every rank


@dataclass(frozen=True)
class PlannedBatch(Generic[T]):
    """One step as the training loop receives it from a :class:`PlanningLoader`.

    Attributes:
        step: index of the batch in the source (0-based, counting resumed steps).
        batch: the step's :class:`~torch_dcp.BatchSpec`.
        data: the item's tensors (whatever the source gave besides the batch).
        plan: the step's :class:`~torch_dcp.Plan` (the same digest on every rank).
        device_plan: this rank's :class:`~torch_dcp.executor.DevicePlan` of ``plan``, built
            and uploaded to the loader's device (None when the loader builds none); pass both
            to :func:`torch_dcp.context_parallel` (``plan=``, ``device_plan=``).
        planning_rank: the rank whose workers planned it.
        plan_seconds: the planner's own time for this batch (in the worker), seconds.
        wait_seconds: how long the training loop blocked in ``next()`` for it (0 when the plan
            was ready: planning hidden), seconds.
        store_seconds: this rank's store operations that moved this step's plan (set, get,
            add, delete), seconds.
        poll_seconds: this rank's ``check`` calls while waiting for this step's plan (or for
            room to publish it), seconds (the pauses between them excluded).
        build_seconds: this rank's device-plan build and upload, seconds.
        stats: :meth:`Plan.stats` of the plan (computed by the worker).
        compare: ``{planner: stats}`` of the configuration's comparison planners.
    """

    step: int
    batch: BatchSpec
    data: T
    plan: Plan
    device_plan: DevicePlan | None
    planning_rank: int
    plan_seconds: float
    wait_seconds: float
    store_seconds: float = 0.0
    poll_seconds: float = 0.0
    build_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    compare: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Step:
    step: int
    batch: BatchSpec
    data: Any
    digest: str
    planning_rank: int
    source_state: Any
    gate: tuple[int, str] | None  # the step whose record must be gone before this one is published
    result: cf.Future = field(default_factory=cf.Future)
    job: cf.Future | None = None


def _split_default(item: Any) -> tuple[BatchSpec, Any]:
    if isinstance(item, BatchSpec):
        return item, None
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], BatchSpec):
        return item
    raise TypeError(f"PlanningLoader: a source item must be a BatchSpec or a (BatchSpec, data) pair, got "
                    f"{type(item).__name__} (pass batch_of= to convert items)")


class PlanningLoader(Generic[T]):
    """Global batches with their plans made ahead, spread over the DCP group's ranks.

    Every rank of the DCP group makes one with the same arguments (but its own ``rank``) and
    iterates it in step: ``for pb in loader: ...`` gives :class:`PlannedBatch` objects.

    Args:
        source: an iterable of global batches, the same on every rank. Each item is a
            ``BatchSpec``, a ``(BatchSpec, data)`` pair, or anything ``batch_of`` turns into one.
        config: the :class:`PlanningConfig` (its topology's world size is the group's).
        batch_of: ``item -> (BatchSpec, data)`` for other items (e.g. document lengths and
            tensors).
        lookahead: steps planned ahead of the one the loop runs (default 2). 0 plans every
            step in line, in ``next()`` on every rank (no workers, no store).
        workers: planning processes of this rank (default 1).
        rank, world_size: this rank and the group's size (default: the default process
            group's, or 0 and 1).
        replica, replicas: this DCP group's index among the ``replicas`` groups that run the
            same plans (one per tensor- and pipeline-parallel coordinate of a mesh; default 0
            of 1). Only replica 0's ranks plan (step ``i`` on its rank ``i % W``); every rank of
            every replica reads each plan from the one store (same ``namespace``), so a step
            is planned once for all of them, not once per replica.
        store: a ``torch.distributed.Store`` shared by the group (default: the default process
            group's store; a ``HashStore`` on one rank).
        timeout: seconds any wait may block (the loop for its plan, a fetch from the store,
            the store having room, a worker's plan); default 600.
        device: where the device plans go (``torch.device``; default: none built unless
            ``device_plans``, then CPU). On CUDA they are uploaded from pinned memory.
        kernel: the executor kernel the device plans are built for (``"auto"`` chooses by
            ``device``, dtype and head_dim as the executor does).
        device_plans: build this rank's device plan of every step (default True).
        namespace: store key prefix, the same on every rank, unique per loader and DCP group
            (default ``torch_dcp/planning/<n>`` with ``n`` counting the loaders this process
            made, so ranks that make their loaders in the same order agree).
        pool: a ``concurrent.futures.Executor`` to plan in (shared between loaders; not shut
            down by :meth:`close`); default a "spawn" ``ProcessPoolExecutor`` of ``workers``.
        warmup: submit one tiny plan per worker at construction (imports and the
            partitioner's start-up before step 0).

    Raises:
        ValueError: bad ``lookahead``, ``workers``, ``timeout`` or ``rank``, or a topology for
            another world size.
        PlanningError (from ``next()``, on every rank, naming the step, its planning rank and
            the cause): the planner raised, the plan failed validation, a worker process died,
            the store failed, or the plan in the store is not the batch's;
            :class:`PlanningTimeoutError` when a plan did not arrive within ``timeout``.
        TypeError (from ``next()``): a source item that is not a batch (see ``batch_of``).
    """

    def __init__(self, source: Iterable[Any], config: PlanningConfig, *,
                 batch_of: Callable[[Any], tuple[BatchSpec, T]] | None = None, lookahead: int = 2, workers: int = 1,
                 rank: int | None = None, world_size: int | None = None, replica: int = 0, replicas: int = 1,
                 store: Any = None, timeout: float = 600.0,
                 device: torch.device | str | None = None, kernel: str | DivisionKernel = "auto",
                 device_plans: bool = True, namespace: str | None = None, pool: cf.Executor | None = None,
                 warmup: bool = True):
        import torch.distributed as dist

        for name, v, low in (("lookahead", lookahead, 0), ("workers", workers, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"PlanningLoader: {name} must be an integer >= {low}, got {v!r}")
        if not float(timeout) > 0:
            raise ValueError(f"PlanningLoader: timeout must be positive seconds, got {timeout!r}")
        if rank is None or world_size is None:
            on = dist.is_available() and dist.is_initialized()
            rank = (dist.get_rank() if on else 0) if rank is None else rank
            world_size = (dist.get_world_size() if on else 1) if world_size is None else world_size
        if not 0 <= int(rank) < int(world_size):
            raise ValueError(f"PlanningLoader: rank {rank} is outside [0, {world_size})")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 \
                or isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas:
            raise ValueError(f"PlanningLoader: replica must be an integer in [0, replicas) and replicas >= 1, got "
                             f"replica={replica!r}, replicas={replicas!r}")
        if config.topology.world_size != int(world_size):
            raise ValueError(f"PlanningLoader: the config's topology has {config.topology.world_size} ranks, the group "
                             f"{world_size}")
        self.source, self.config = source, config
        self.lookahead, self.workers, self.timeout = int(lookahead), int(workers), float(timeout)
        self.rank, self.world = int(rank), int(world_size)
        self.replica, self.replicas = replica, replicas
        self.device = torch.device(device) if device is not None else (torch.device("cpu") if device_plans else None)
        self.kernel, self.device_plans = kernel, bool(device_plans)
        self._split = batch_of or _split_default
        self._stateful = hasattr(source, "state_dict") and hasattr(source, "load_state_dict")
        self._it: Iterator[Any] | None = None
        self._skip = 0
        self._next_pull = self._next_yield = 0
        self._exhausted = False
        self._failed: PlanningError | None = None
        self._steps: dict[int, _Step] = {}
        self._digests: dict[int, str] = {}
        self._closed = False
        self._stop = threading.Event()
        self._closing = threading.Event()
        self._queue: queue.Queue[_Step | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._own_pool = False
        self._pool: cf.Executor | None = None
        self._store: PlanStore | None = None
        if self.lookahead == 0:
            return
        if store is None:
            shared = self.world * self.replicas > 1
            store = dist.distributed_c10d._get_default_store() if shared else dist.HashStore()
        ns = namespace if namespace is not None else f"torch_dcp/planning/{next(_LOADERS)}"
        self._store = PlanStore(store, ns, self.rank, self.world * self.replicas)
        if self.replica:  # replica 0's ranks plan; this one only reads
            return
        self._own_pool = pool is None
        self._pool = planning_pool(self.workers, config if warmup else None) if pool is None else pool

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> "PlanningLoader[T]":
        return self

    def __enter__(self) -> "PlanningLoader[T]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start(self) -> None:
        if self._it is not None:
            return
        if self._closed:
            raise RuntimeError("PlanningLoader: closed")
        self._it = iter(self.source)
        for _ in range(self._skip):  # resuming a source without state: skip the consumed items
            try:
                next(self._it)
            except StopIteration:
                self._exhausted = True
                break
        if self.lookahead:
            self._thread = threading.Thread(target=self._serve, name=f"torch_dcp-planning-rank{self.rank}", daemon=True)
            self._thread.start()

    def _source_state(self) -> Any:
        return self.source.state_dict() if self._stateful else None

    def _pull(self) -> tuple[BatchSpec, Any, Any] | None:
        state = self._source_state()
        try:
            item = next(self._it)  # type: ignore[arg-type]
        except StopIteration:
            self._exhausted = True
            return None
        batch, data = self._split(item)
        return batch, data, state

    def _fill(self) -> None:
        """Pull items until ``lookahead`` steps beyond the next one are in flight."""
        while not self._exhausted and self._next_pull <= self._next_yield + self.lookahead:
            got = self._pull()
            if got is None:
                return
            batch, data, state = got
            step = self._next_pull
            self._next_pull += 1
            digest = self.config.digest(batch)
            self._digests[step] = digest
            old = step - self.lookahead - 1
            gate = (old, self._digests.pop(old)) if old in self._digests else None
            st = _Step(step, batch, data, digest, step % self.world, state, gate)
            if self._plans(st) and self._pool_warm():  # else planned in line by the serving thread
                st.job = self._submit(batch)
            self._steps[step] = st
            self._queue.put(st)

    def _plans(self, st: _Step) -> bool:
        """Whether this rank plans and publishes step ``st`` (its planning rank, of replica 0)."""
        return st.planning_rank == self.rank and self.replica == 0

    def _pool_warm(self) -> bool:
        """Whether the workers can take a batch now: a :class:`PlanningPool` still starting (its
        workers importing torch) is not; any other executor is taken to be."""
        return not isinstance(self._pool, PlanningPool) or self._pool.warm()

    def _submit(self, batch: BatchSpec) -> cf.Future:
        try:
            return self._pool.submit(_worker_job, batch.to_dict(), self.config)  # type: ignore[union-attr]
        except Exception as err:  # a broken or shut-down pool: the step's error
            fut: cf.Future = cf.Future()
            fut.set_exception(err)
            return fut

    def __next__(self) -> PlannedBatch[T]:
        if self._failed is not None:
            raise self._failed
        if self.lookahead == 0:
            return self._next_inline()
        self._start()
        self._fill()
        st = self._steps.pop(self._next_yield, None)
        if st is None:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            res = st.result.result(timeout=self.timeout)
        except cf.TimeoutError:
            self._failed = PlanningTimeoutError(st.step, st.planning_rank, f"rank {self.rank} waited {self.timeout:g} s "
                                                "for its plan")
        except PlanningError as err:
            self._failed = err
        if self._failed is not None:
            raise self._failed
        self._next_yield += 1
        return PlannedBatch(st.step, st.batch, st.data, res["plan"], res["device_plan"], st.planning_rank,
                            res["plan_seconds"], time.perf_counter() - t0, res["store_seconds"],
                            res["poll_seconds"], res["build_seconds"], res["stats"], res["compare"])

    def _next_inline(self) -> PlannedBatch[T]:
        self._start()
        got = None if self._exhausted else self._pull()
        if got is None:
            raise StopIteration
        batch, data, _ = got
        step = self._next_yield
        t0 = time.perf_counter()
        try:
            plan, header = plan_batch(batch, self.config)
        except Exception as err:
            self._failed = PlanningError(step, self.rank, failure_cause(err))
        if self._failed is not None:
            raise self._failed
        dp, build = self._device_plan(plan)
        self._next_yield = self._next_pull = step + 1
        return PlannedBatch(step, batch, data, plan, dp, self.rank, header["plan_seconds"], time.perf_counter() - t0,
                            0.0, 0.0, build, header["stats"], header["compare"])

    # ------------------------------------------------------------------ the background thread
    def _serve(self) -> None:
        """Fetch (and, for this rank's steps, publish) every step in order."""
        while True:
            st = self._queue.get()
            if st is None:
                return
            try:
                st.result.set_result(self._deliver(st))
            except PlanningError as err:
                st.result.set_exception(err)
            except BaseException as err:  # noqa: BLE001 - delivered to the loop as the step's error
                st.result.set_exception(PlanningError(st.step, st.planning_rank, f"{type(err).__name__}: {err}"))

    def _stopped(self) -> bool:
        return self._stop.is_set()

    def _publish(self, st: _Step) -> None:
        ps = self._store
        assert ps is not None
        try:
            kind, payload = _worker_job(st.batch.to_dict(), self.config) if st.job is None else \
                st.job.result(timeout=self.timeout)
            record = payload if kind == "plan" else encode_error(payload)
        except cf.TimeoutError:
            record = encode_error(f"planning took longer than the loader's timeout ({self.timeout:g} s)")
        except BrokenProcessPool as err:
            record = encode_error(f"a planning worker process of rank {self.rank} died (BrokenProcessPool: {err})")
        except cf.CancelledError:
            record = encode_error("planning was cancelled (the loader was closed)")
        except BaseException as err:  # noqa: BLE001
            record = encode_error(f"planning failed: {type(err).__name__}: {err}")
        if st.gate is not None and not ps.wait_gone(*st.gate, time.monotonic() + self.timeout, self._stopped):
            if self._stopped():
                raise PlanningError(st.step, st.planning_rank, "the loader was closed")
            cause = (f"the store still held step {st.gate[0]}'s plan after {self.timeout:g} s: some rank did not read "
                     "it (slow, stuck or gone)")
            ps.publish(st.step, st.digest, encode_error(cause))  # tell the others now rather than at their timeout
            raise PlanningTimeoutError(st.step, st.planning_rank, cause)
        ps.publish(st.step, st.digest, record)

    def _deliver(self, st: _Step) -> dict[str, Any]:
        ps = self._store
        assert ps is not None
        if self._stopped():
            raise PlanningError(st.step, st.planning_rank, "the loader was closed")
        op0, poll0 = ps.op_seconds, ps.poll_seconds
        if self._plans(st):
            self._publish(st)
        try:
            arrived = ps.wait(st.step, st.digest, time.monotonic() + self.timeout, self._stopped)
        except RuntimeError as err:
            raise PlanningError(st.step, st.planning_rank, f"the store failed: {err}") from None
        if not arrived:
            if self._stopped():
                raise PlanningError(st.step, st.planning_rank, "the loader was closed")
            raise PlanningTimeoutError(st.step, st.planning_rank, f"its plan did not arrive in the store within "
                                       f"{self.timeout:g} s (rank {st.planning_rank} is slow, stuck or gone)")
        try:
            record = decode_record(ps.read(st.step, st.digest))
        except (ValueError, RuntimeError) as err:
            raise PlanningError(st.step, st.planning_rank, f"reading its plan from the store failed: {err}") from None
        store_seconds, poll_seconds = ps.op_seconds - op0, ps.poll_seconds - poll0
        if record.cause is not None:
            raise PlanningError(st.step, st.planning_rank, record.cause)
        try:
            plan = load_plan(record.plan_bytes)  # type: ignore[arg-type]
        except PlanError as err:
            raise PlanningError(st.step, st.planning_rank, f"the plan's bytes failed their checks: {err}") from None
        if plan.batch != st.batch or plan.world_size != self.world:
            raise PlanningError(st.step, st.planning_rank, "the plan in the store is for another batch or world size")
        plan.plan_seconds = float(record.header.get("plan_seconds", 0.0))
        dp, build = (None, 0.0) if self._closing.is_set() else self._device_plan(plan)
        return {"plan": plan, "device_plan": dp, "plan_seconds": plan.plan_seconds, "store_seconds": store_seconds,
                "poll_seconds": poll_seconds,
                "build_seconds": build, "stats": record.header.get("stats", {}),
                "compare": record.header.get("compare", {})}

    def _device_plan(self, plan: Plan) -> tuple[DevicePlan | None, float]:
        """This rank's device plan of ``plan``, uploaded to the loader's device, and the seconds it took."""
        own = plan.attention_part(self.rank)[0].placement.runtime in RUNTIME_EXECUTORS  # builds its own metadata
        if not self.device_plans or self.device is None or own:
            return None, 0.0
        t0 = time.perf_counter()
        b = plan.batch
        kern = get_kernel(self.kernel, device=self.device, dtype=getattr(torch, b.dtype), head_dim=b.head_dim)
        dp = DevicePlan(*plan.attention_part(self.rank), kern)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                dp.upload(self.device)
        else:
            dp.upload(self.device)
        return dp, time.perf_counter() - t0

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Where the loop is: the next step and, for a source with ``state_dict``, the source's
        state before that step's item (items read ahead are not counted as consumed).

        Returns ``{"version": 1, "step": int, "source": state or None}``.
        """
        st = self._steps.get(self._next_yield)
        src = st.source_state if st is not None else self._source_state()
        return {"version": 1, "step": self._next_yield, "source": src}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["step"]`` (before the first ``next()``): a source with
        ``load_state_dict`` gets its saved state; any other source is re-iterated from its
        start and the consumed items are skipped. Step numbers (and so each step's planning
        rank and store key) continue from the saved step, and the plans are the same.

        Raises:
            RuntimeError: iteration has already started.
            ValueError: not a state of this loader.
        """
        if self._it is not None:
            raise RuntimeError("PlanningLoader.load_state_dict: call it before the first next()")
        if not isinstance(state, dict) or state.get("version") != 1 or not isinstance(state.get("step"), int):
            raise ValueError(f"PlanningLoader.load_state_dict: not a PlanningLoader state: {state!r}")
        self._next_yield = self._next_pull = state["step"]
        if self._stateful and state.get("source") is not None:
            self.source.load_state_dict(state["source"])
            self._skip = 0
        else:
            self._skip = state["step"]

    # ------------------------------------------------------------------ shutdown
    def close(self, drain: float | None = None) -> None:
        """Stop: the background thread first finishes the steps already read ahead (publishing
        and reading their plans, so the store is left clean; at most ``drain`` seconds,
        default ``min(timeout, 30)``, none after an error), then the workers are terminated.
        Idempotent; the context manager calls it."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        if self._thread is not None:
            self._queue.put(None)
            limit = 0.0 if self._failed is not None else (min(self.timeout, 30.0) if drain is None else float(drain))
            self._thread.join(timeout=limit)
            self._stop.set()  # a thread still blocked in a store wait (daemon) leaves when it ends
            self._thread.join(timeout=0.5)
        for st in self._steps.values():
            if st.job is not None:
                st.job.cancel()
        self._steps.clear()
        if self._own_pool and self._pool is not None:
            procs = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for p in procs:  # a worker in the middle of a plan would otherwise hold up interpreter exit
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=5.0)
        self._pool = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            if not self._closed and self._own_pool:
                self.close(drain=0.0)
        except Exception:
            pass
