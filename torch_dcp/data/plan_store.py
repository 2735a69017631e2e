"""Plans shared through a ``torch.distributed`` Store: keys, records, bounded waits.

The DCP paper (Jiang et al., arXiv 2510.10620) plans upcoming batches in data-loader workers
and shares the plans through a key-value store (Redis in its code). Here the store is the one
every ``torch.distributed`` job already has (the ``TCPStore`` of torchrun, or any
``torch.distributed.Store``): step ``i`` is planned by one rank of the DCP group, which
publishes a record under a key naming the step and the batch's digest; every rank waits for
it (bounded), reads it once, and the rank whose read completes the count deletes it.

Keys (``ns`` is the loader's namespace)::

    {ns}/{step}/{digest}        the record: a plan (b"P" + header + Plan.to_bytes()) or an error (b"E" + JSON)
    {ns}/{step}/{digest}/read   how many ranks have read it (Store.add); the W-th read deletes both keys

Because every rank reads steps in order and the W-th reader deletes a step's keys before it
reads the next step, "step ``i`` is gone" implies every earlier step is gone; a publisher
waits (bounded) until step ``i - lookahead - 1`` is gone before it publishes step ``i``, so
the store holds at most ``lookahead + 1`` steps' records at any time.
"""

from __future__ import annotations

import datetime
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["PlanningError", "PlanningTimeoutError", "PlanStore", "PlanRecord", "encode_plan", "encode_error",
           "decode_record"]

_PLAN, _ERROR = b"P", b"E"


class PlanningError(RuntimeError):
    """A step's plan could not be made or delivered: the planner raised, the plan failed
    validation, a planning worker process died, the store failed, or the plan in the store
    does not belong to the batch.

    Attributes:
        step: the step (0-based index of the batch in the loader's source).
        planning_rank: the rank whose workers plan that step (``step % world_size``).
        cause: what went wrong, in words.
    """

    def __init__(self, step: int, planning_rank: int, cause: str):
        self.step, self.planning_rank, self.cause = int(step), int(planning_rank), str(cause)
        super().__init__(f"torch_dcp.data.PlanningLoader: step {self.step} (planned by rank {self.planning_rank}): "
                         f"{self.cause}")

    def __reduce__(self):  # picklable with its fields
        return type(self), (self.step, self.planning_rank, self.cause)


class PlanningTimeoutError(PlanningError):
    """A step's plan did not arrive within the loader's timeout (its planning rank is slow,
    stuck or gone, or a rank did not read an earlier step so the store had no room)."""


@dataclass(frozen=True)
class PlanRecord:
    """A decoded store record: the plan's bytes and the header the planning worker wrote
    (``plan_seconds``, ``stats``, ``compare``, ...), or an error ``cause``."""

    plan_bytes: bytes | None
    header: dict[str, Any] = field(default_factory=dict)
    cause: str | None = None


def encode_plan(plan_bytes: bytes, header: dict[str, Any]) -> bytes:
    """``b"P"`` + u32 little-endian header length + JSON header + ``plan_bytes``."""
    h = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    return _PLAN + struct.pack("<I", len(h)) + h + plan_bytes


def encode_error(cause: str) -> bytes:
    """``b"E"`` + JSON ``{"cause": ...}``."""
    return _ERROR + json.dumps({"cause": cause}).encode()


def decode_record(data: bytes) -> PlanRecord:
    """Inverse of :func:`encode_plan` / :func:`encode_error`.

    Raises:
        ValueError: not a record (wrong tag, truncated header, bad JSON).
    """
    tag = data[:1]
    if tag == _ERROR:
        return PlanRecord(None, cause=str(json.loads(data[1:].decode())["cause"]))
    if tag != _PLAN or len(data) < 5:
        raise ValueError(f"not a plan record (tag {tag!r}, {len(data)} bytes)")
    (n,) = struct.unpack("<I", data[1:5])
    if len(data) < 5 + n:
        raise ValueError(f"truncated plan record ({len(data)} bytes, header {n})")
    return PlanRecord(data[5 + n:], json.loads(data[5:5 + n].decode()))


class PlanStore:
    """One rank's view of the plans in a ``torch.distributed.Store``.

    Args:
        store: any ``torch.distributed.Store`` shared by the DCP group's ranks (``TCPStore``,
            ``FileStore``, ``HashStore`` in one process, a ``PrefixStore``); a clone of it is
            used where the store supports ``clone()``, so blocking waits here never hold the
            connection the process group or the caller uses.
        namespace: key prefix, the same on every rank of the group, unique per loader.
        rank, world_size: this rank and the number of ranks that read every record (the DCP
            group's size, times the number of DCP groups sharing the plans).
        poll: the longest pause between two checks while waiting for a step to be gone, seconds.

    Attributes:
        op_seconds: seconds spent in the store operations that move plans (set, get, add,
            delete), this rank, so far.
        poll_seconds: seconds spent in ``check`` calls (before a wait, and while waiting for
            room to publish; not the pauses between them), this rank, so far.
    """

    def __init__(self, store: Any, namespace: str, rank: int, world_size: int, poll: float = 0.01):
        try:
            store = store.clone()
        except Exception:  # stores without clone(): share the caller's connection
            pass
        self.store, self.ns, self.rank, self.world = store, namespace.rstrip("/"), int(rank), int(world_size)
        self.poll = float(poll)
        self.op_seconds = 0.0
        self.poll_seconds = 0.0

    def key(self, step: int, digest: str) -> str:
        return f"{self.ns}/{int(step)}/{digest}"

    def _timed(self, fn: Callable, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.op_seconds += time.perf_counter() - t0

    def present(self, step: int, digest: str) -> bool:
        """Whether the step's record is in the store."""
        t0 = time.perf_counter()
        try:
            return bool(self.store.check([self.key(step, digest)]))
        finally:
            self.poll_seconds += time.perf_counter() - t0

    def wait_gone(self, step: int, digest: str, deadline: float, stopped: Callable[[], bool]) -> bool:
        """Wait until the step's record has been deleted (every rank read it); False when
        ``deadline`` (``time.monotonic()``) passed or ``stopped()`` first."""
        pause = 0.001
        while self.present(step, digest):
            if time.monotonic() >= deadline or stopped():
                return False
            time.sleep(pause)
            pause = min(self.poll, pause * 2)
        return True

    def publish(self, step: int, digest: str, record: bytes) -> None:
        """Put the step's record in the store (the planning rank, once)."""
        self._timed(self.store.set, self.key(step, digest), record)

    def wait(self, step: int, digest: str, deadline: float, stopped: Callable[[], bool]) -> bool:
        """Block until the step's record is in the store; False when ``deadline``
        (``time.monotonic()``) passed or ``stopped()`` was set before the wait began. One
        ``check``, then one blocking ``Store.wait`` for the rest of the time (on this object's
        own connection, the GIL released): a waiting rank costs no polling.

        Raises:
            RuntimeError: the store failed (other than by the wait timing out), e.g. its
                server is gone.
        """
        if self.present(step, digest):
            return True
        left = deadline - time.monotonic()
        if left <= 0 or stopped():
            return False
        try:
            self.store.wait([self.key(step, digest)], datetime.timedelta(seconds=left))
        except RuntimeError as err:  # DistStoreError (TCPStore, HashStore) or RuntimeError (FileStore)
            if "timeout" in str(err).lower() or "timed out" in str(err).lower():
                return False
            raise
        return True

    def read(self, step: int, digest: str) -> bytes:
        """Read the step's record (after :meth:`wait`) and count this rank's read; the rank
        whose read is the ``world_size``-th deletes the record and its counter."""
        key = self.key(step, digest)
        data = self._timed(self.store.get, key)
        if self.world > 1:
            n = self._timed(self.store.add, key + "/read", 1)
            if n < self.world:
                return data
            self._timed(self.store.delete_key, key + "/read")
        self._timed(self.store.delete_key, key)
        return data
