"""Transports: how an executor's ``CommLaunch``/``CommWait`` move bytes between ranks.

A message is a contiguous ``uint8`` tensor: one per (phase, sender, receiver, kind). Receives
land in tensors the executor provides (views of its work buffers, so most messages need no
copy on arrival). ``wait`` is a generator: it yields while the messages are not there yet (only
the in-process transport ever does), so several ranks can run in one process.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import Any, Callable, Generator, NamedTuple, Sequence

import torch

__all__ = ["Transport", "Collective", "InProcessTransport", "Mailbox", "TorchDistributedTransport", "TransferError",
           "TransferTimeoutError", "PeerRefusedError", "RefusalChannel", "as_timedelta", "is_timeout"]

#: messages of one (phase, peer) pair are told apart by their kind; tags stay below this
TAGS_PER_PHASE = 16

Message = tuple[int, int, torch.Tensor]  # (peer, kind tag, uint8 tensor)


def _tag(phase: int, kind_tag: int) -> int:
    """The point-to-point tag of a message: non-negative for every plan phase (the opening
    phase is ``-2``)."""
    return (phase + 2) * TAGS_PER_PHASE + kind_tag


class TransferError(RuntimeError):
    """A phase's transfers failed (e.g. a peer's connection closed: it crashed or gave up).
    ``phase``: the plan's communication phase (-1: the plan check at entry); ``peers``: the
    ranks concerned."""

    def __init__(self, message: str, phase: int, peers: list[int]):
        super().__init__(message)
        self.phase, self.peers = phase, peers


def located(err: "TransferError", where: str) -> "TransferError":
    """``err`` (same type, same attributes) with ``where`` this rank was in front of its message
    (the pass and the step of a plan)."""
    new = type(err)(f"{where}: {err}", err.phase, err.peers)
    vars(new).update(vars(err))  # a subclass's own attributes (PeerRefusedError.reason)
    return new


class TransferTimeoutError(TransferError, TimeoutError):
    """A rank waited longer than its timeout for peers' messages (a peer froze, failed before
    sending, or runs another plan); ``peers``: the ranks whose messages had not arrived."""


class PeerRefusedError(TransferError):
    """A peer refused an SDPA call of the step (posted on the :class:`RefusalChannel`) while
    this rank waited for transfers; ``peers``: ``[the refusing rank]``, ``reason``: its message."""

    def __init__(self, message: str, phase: int, peers: list[int], reason: str = ""):
        super().__init__(message, phase, peers)
        self.reason = reason


class RefusalChannel:
    """One context entry's refusals in a ``torch.distributed`` Store. The context counts its
    SDPA calls (:meth:`begin_call`, alike on every rank); a rank that refuses call ``i`` posts
    ``(i, rank, reason)`` before raising; a peer waiting for transfers polls the channel
    (:class:`TorchDistributedTransport`) and raises :class:`PeerRefusedError` for a refusal of
    a call it has reached and did not refuse itself (ranks that all refuse the same call stay
    in step and go on). Nothing is written unless a rank refuses; a poll is one store
    operation (more only after a refusal).

    Args:
        store: the process group's Store (shared by every rank of the group).
        key: the same on every rank of the group, different for every context entry.
        rank: this rank in the group.
    """

    def __init__(self, store: Any, key: str, rank: int):
        self.store, self.key, self.rank = store, key, rank
        self.call = 0  # SDPA calls begun in this entry
        self.refused: set[int] = set()  # calls this rank refused
        self.posted: list[tuple[int, int, str]] = []  # (call, rank, reason) read from the store
        self._read = 0

    def begin_call(self) -> None:
        """An SDPA call begins (before its checks)."""
        self.call += 1

    def post(self, reason: str, upcoming: bool = False) -> None:
        """Tell the peers this rank refused the current call (``upcoming``: the next one, which
        it will not begin). A failing store is ignored: the peers then see a timeout."""
        call = self.call + 1 if upcoming else self.call
        self.refused.add(call)
        try:
            n = self.store.add(f"{self.key}/n", 1)
            self.store.set(f"{self.key}/{n}", f"{call}:{self.rank}:{reason}")
        except Exception:  # pragma: no cover - the store is gone; the peers' waits stay bounded by their timeout
            pass

    def poll(self) -> "tuple[int, str] | None":
        """``(rank, reason)`` of a peer's refusal of a call this rank has begun and did not
        refuse, or ``None``."""
        n = self.store.add(f"{self.key}/n", 0)
        while self._read < n:
            self._read += 1
            call, rank, reason = self.store.get(f"{self.key}/{self._read}").decode("utf-8", "replace").split(":", 2)
            self.posted.append((int(call), int(rank), reason))
        for call, rank, reason in self.posted:
            if rank != self.rank and call <= self.call and call not in self.refused:
                return rank, reason
        return None


#: how often (seconds) a rank waiting for transfers looks for a peer's refusal
REFUSAL_POLL_S = 0.05


class _Waiter:
    """A daemon thread running the blocking waits handed to it, one at a time (one thread for
    every wait of the process: no thread started per wait). It holds nothing between waits."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="torch_dcp-waiter", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, done, failure = job
            job = None
            try:
                fn()
            except BaseException as err:  # handed to the waiting thread
                failure.append(err)
            done.set()
            fn = done = failure = None  # the transport and its group are not kept alive between waits

    def submit(self, fn: Any) -> tuple[threading.Event, list]:
        done, failure = threading.Event(), []
        self.jobs.put((fn, done, failure))
        return done, failure

    def close(self) -> None:
        """End the thread once its current wait (if any) returns."""
        self.jobs.put(None)


#: the process's waiter, and those a refusal left blocked on a wait that will not complete
#: (they end when it fails: at its timeout, or when the group is destroyed)
_waiter: _Waiter | None = None
_abandoned: list[_Waiter] = []


def stop_waiters(timeout: float = 5.0) -> None:
    """End the process's waiter threads (:func:`torch_dcp.shutdown` calls it after destroying
    the groups, which unblocks a waiter a refusal left waiting), joining them at most
    ``timeout`` seconds in all."""
    global _waiter
    if _waiter is not None:
        _abandoned.append(_waiter)
        _waiter.close()
        _waiter = None
    deadline = time.monotonic() + timeout
    while _abandoned:
        _abandoned[0].thread.join(max(0.0, deadline - time.monotonic()))
        if _abandoned[0].thread.is_alive():
            return
        _abandoned.pop(0)


def as_timedelta(timeout: "float | datetime.timedelta", what: str = "timeout") -> datetime.timedelta:
    """Seconds or a ``timedelta`` as a positive ``timedelta``.

    Raises:
        ValueError: not positive, or not a number / ``timedelta``.
    """
    if isinstance(timeout, datetime.timedelta):
        td = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        td = datetime.timedelta(seconds=float(timeout))
    else:
        raise ValueError(f"{what} must be seconds or a datetime.timedelta, got {timeout!r}")
    if td.total_seconds() <= 0:
        raise ValueError(f"{what} must be positive, got {td}")
    return td


def is_timeout(err: BaseException) -> bool:
    """Whether a ``torch.distributed`` error reports an expired wait (its backends raise
    ``RuntimeError`` subclasses that say so only in the message)."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


class Collective(NamedTuple):
    """A posted collective (:meth:`Transport.all_gather`, :meth:`Transport.reduce_scatter`):
    the transport's handle, and what completes the result once the transfers are in
    (``None``: nothing)."""

    handle: Any
    finish: Callable[[], None] | None = None


def _member_index(rank: int, members: Sequence[int]) -> int:
    if rank not in members:
        raise ValueError(f"rank {rank} is not among the collective's ranks {list(members)}")
    return list(members).index(rank)


def _rows_of(t: torch.Tensor, i: int, rows: int) -> torch.Tensor:
    """Rows ``[i * rows, (i + 1) * rows)`` of contiguous ``t`` as one uint8 message."""
    return t[i * rows:(i + 1) * rows].reshape(-1).view(torch.uint8)


class Transport:
    """Interface: ``launch`` posts the sends and receives of a phase; ``wait`` completes them.

    The collectives (:meth:`all_gather`, :meth:`reduce_scatter`) run on a subset of the
    group's ranks; here they are point-to-point messages of one phase (every member sends
    its rows to every other member), a backend with collectives of its own runs those
    (:class:`TorchDistributedTransport`). :meth:`finish` completes them.
    """

    rank: int

    def launch(self, phase: int, sends: Sequence[Message], recvs: Sequence[Message]) -> Any:
        """Post ``sends`` and receives into the given tensors (both ``(peer, tag, uint8 tensor)``,
        the same order on both ends); returns a handle."""
        raise NotImplementedError

    def wait(self, handle: Any) -> Generator[None, None, None]:
        """Complete a launch: afterwards every receive tensor holds its message."""
        raise NotImplementedError

    def all_gather(self, phase: int, shard: torch.Tensor, out: torch.Tensor, members: Sequence[int]) -> Collective:
        """Post an all-gather on ``members`` (ranks of this transport's group, ascending, this
        rank among them): ``out`` (contiguous ``[len(members) * R, ...]``) receives member
        ``i``'s ``shard`` (contiguous ``[R, ...]``, the same shape and dtype on every member)
        at rows ``[i * R, (i + 1) * R)``, complete after :meth:`finish`."""
        me, rows = _member_index(self.rank, members), shard.shape[0]
        out[me * rows:(me + 1) * rows].copy_(shard)
        msg = shard.reshape(-1).view(torch.uint8)
        peers = [(i, p) for i, p in enumerate(members) if p != self.rank]
        return Collective(self.launch(phase, [(p, 0, msg) for _, p in peers],
                                      [(p, 0, _rows_of(out, i, rows)) for i, p in peers]))

    def reduce_scatter(self, phase: int, inp: torch.Tensor, out: torch.Tensor, members: Sequence[int]) -> Collective:
        """Post a reduce-scatter (sum) on ``members``: ``out`` (contiguous ``[R, ...]``)
        receives the sum over the members of their ``inp`` rows ``[i * R, (i + 1) * R)``
        (``inp``: contiguous ``[len(members) * R, ...]``), this rank being member ``i``,
        complete after :meth:`finish`. Here the terms are added in member order."""
        me, rows = _member_index(self.rank, members), out.shape[0]
        peers = [(i, p) for i, p in enumerate(members) if p != self.rank]
        slots = torch.empty((len(members),) + tuple(out.shape), dtype=out.dtype, device=out.device)
        handle = self.launch(phase, [(p, 1, _rows_of(inp, i, rows)) for i, p in peers],
                             [(p, 1, _rows_of(slots, i, 1)) for i, p in peers])

        def finish() -> None:
            slots[me].copy_(inp[me * rows:(me + 1) * rows])
            torch.sum(slots, 0, out=out)

        return Collective(handle, finish)

    def all_to_all(self, phase: int, inp: torch.Tensor, out: torch.Tensor, in_rows: Sequence[int],
                   out_rows: Sequence[int], members: Sequence[int], tag: int = 0) -> Collective:
        """Post an all-to-all on ``members``: ``inp`` (contiguous, ``in_rows[j]`` rows for member
        ``j``, in member order) is sent row range by row range, and ``out`` (contiguous,
        ``out_rows[j]`` rows from member ``j``) receives; this rank's own range is copied
        across, complete after :meth:`finish`. Here point-to-point messages of one phase (several
        all-to-alls of a phase told apart by ``tag``) and a local copy; a backend with
        collectives of its own runs one (:class:`TorchDistributedTransport`: NCCL copies the
        own range inside it)."""
        me = _member_index(self.rank, members)
        starts = [[0], [0]]
        for k, rows in enumerate((in_rows, out_rows)):
            for r in rows:
                starts[k].append(starts[k][-1] + int(r))
        src = [inp[starts[0][j]:starts[0][j + 1]] for j in range(len(members))]
        dst = [out[starts[1][j]:starts[1][j + 1]] for j in range(len(members))]
        dst[me].copy_(src[me])
        peers = [(j, p) for j, p in enumerate(members) if p != self.rank]
        return Collective(self.launch(phase, [(p, 2 + tag, src[j].reshape(-1).view(torch.uint8)) for j, p in peers],
                                      [(p, 2 + tag, dst[j].reshape(-1).view(torch.uint8)) for j, p in peers]))

    def finish(self, collective: Collective) -> Generator[None, None, None]:
        """Complete a collective (yields while its transfers are not there, as :meth:`wait`)."""
        yield from self.wait(collective.handle)
        if collective.finish is not None:
            collective.finish()


class Mailbox:
    """Messages in flight between ranks running in one process."""

    def __init__(self):
        self.messages: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self.events = 0

    def post(self, key: tuple[int, int, int, int], message: torch.Tensor) -> None:
        if key in self.messages:
            raise RuntimeError(f"two messages for (phase, tag, src, dst) = {key}")
        self.messages[key] = message
        self.events += 1


class InProcessTransport(Transport):
    """All ranks in one process (tests, debugging, single-device emulation).

    Args:
        mailbox: shared by the transports of all ranks.
        rank: this transport's rank.
    """

    def __init__(self, mailbox: Mailbox, rank: int):
        self.mailbox = mailbox
        self.rank = rank

    def launch(self, phase, sends, recvs):
        for peer, tag, msg in sends:
            self.mailbox.post((phase, tag, self.rank, peer), msg.clone())
        return phase, list(recvs)

    def wait(self, handle):
        phase, recvs = handle
        for peer, tag, buf in recvs:
            key = (phase, tag, peer, self.rank)
            while key not in self.mailbox.messages:
                yield
            msg = self.mailbox.messages.pop(key)
            if msg.numel() != buf.numel():
                raise RuntimeError(f"phase {phase}: rank {peer} sent {msg.numel()} bytes to rank {self.rank}, "
                                   f"expected {buf.numel()}")
            buf.copy_(msg)
        self.mailbox.events += 1


class TorchDistributedTransport(Transport):
    """Point-to-point over ``torch.distributed``: every phase's messages posted as one
    ``batch_isend_irecv``.

    Args:
        group: the DCP process group (plan rank ``r`` is group rank ``r``); ``None`` for the
            default group.
        device: the device of the messages (the tensors' device; CPU for gloo).
        timeout: on a CPU device, the longest ``wait`` blocks (seconds or a ``timedelta``);
            None: the process group's own timeout. Not used on another device (below).
        comm_group: the group the transfers are posted on (default: ``group``), with the
            same members; on a device backend, one whose own timeout bounds the transfers
            (:func:`~torch_dcp.executor.groups.transfer_group`).
        refusals: on a CPU device, a :class:`RefusalChannel` polled every
            :data:`REFUSAL_POLL_S` s while ``wait`` blocks (the transfers complete in a waiter
            thread): a peer's refusal raises :class:`PeerRefusedError` at once instead of a
            timeout later. The point-to-point state of the group is then undefined (transfers
            left pending); recover with a fresh group.
        subgroups: process groups of subsets of the group's ranks for :meth:`all_gather`
            and :meth:`reduce_scatter` (static CP groups smaller than the DCP group), by
            their members' ranks in ``group`` (ascending); created once, ahead, on every
            member (:func:`~torch_dcp.executor.groups.cp_subgroups`). A collective on all the
            group's ranks runs on ``comm_group``.

    On a CPU device ``wait`` blocks the host (gloo completes transfers on the host) and raises
    :class:`TransferTimeoutError` naming the phase and the peers whose messages had not arrived
    when the timeout expired. On a device (NCCL) ``wait`` is stream-ordered: ``Work.wait()``
    without a timeout makes the current stream wait for the transfers and returns at once, so
    the host goes on launching kernels (a wait given a timeout would block the host until the
    transfer completed); a stalled peer is then caught by the process group's timeout (NCCL's
    watchdog aborts the operation, and the process, after ``comm_group``'s timeout).
    """

    def __init__(self, group: Any = None, device: torch.device | str = "cpu",
                 timeout: "float | datetime.timedelta | None" = None, comm_group: Any = None,
                 refusals: RefusalChannel | None = None, subgroups: "dict[tuple[int, ...], Any] | None" = None):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.comm_group = group if comm_group is None else comm_group
        self.device = torch.device(device)
        self.timeout = None if timeout is None else as_timedelta(timeout)
        self.refusals = refusals
        self.subgroups = dict(subgroups or {})
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._global = {r: (r if group is None else dist.get_global_rank(group, r)) for r in range(self.world_size)}
        if comm_group is not None and sorted(dist.get_process_group_ranks(comm_group)) != sorted(self._global.values()):
            raise ValueError("TorchDistributedTransport: comm_group must have the same members as group")

    @property
    def host_waits(self) -> bool:
        """Whether ``wait`` blocks the host (a CPU device), bounded by ``timeout``."""
        return self.device.type == "cpu"

    def launch(self, phase, sends, recvs):
        dist = self.dist
        ops = [dist.P2POp(dist.irecv, buf, self._global[peer], self.comm_group, tag=_tag(phase, tag))
               for peer, tag, buf in recvs]
        ops += [dist.P2POp(dist.isend, msg, self._global[peer], self.comm_group, tag=_tag(phase, tag))
                for peer, tag, msg in sends]
        peers = [peer for peer, _, _ in recvs] + [peer for peer, _, _ in sends]
        try:
            reqs = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as err:
            raise self._explained(TransferError(f"rank {self.rank}: phase {phase}: posting the transfers with rank(s) "
                                                f"{sorted(set(peers))} failed: {err}", phase, sorted(set(peers)))) from None
        return phase, reqs, peers, [m for _, _, m in sends]  # send tensors must outlive the asynchronous sends

    def _collective_group(self, members: Sequence[int]) -> Any:
        members = tuple(int(m) for m in members)
        if members == tuple(range(self.world_size)):
            return self.comm_group
        try:
            return self.subgroups[members]
        except KeyError:
            raise ValueError(f"rank {self.rank}: no process group for the ranks {list(members)} of the DCP group; "
                             "create the static CP groups once, ahead, on every rank "
                             "(torch_dcp.executor.groups.cp_subgroups) and give them as subgroups") from None

    def _collective(self, phase: int, what: str, post: Any, members: Sequence[int], keep: list) -> Collective:
        group = self._collective_group(members)
        peers = [p for p in members if p != self.rank]
        try:
            work = post(group)
        except RuntimeError as err:
            raise self._explained(TransferError(f"rank {self.rank}: phase {phase}: posting the {what} with rank(s) "
                                                f"{peers} failed: {err}", phase, peers)) from None
        return Collective((phase, [work] if work is not None else [], peers, keep))

    def all_gather(self, phase, shard, out, members):
        """One ``all_gather_into_tensor`` on the members' process group (see
        :meth:`Transport.all_gather`)."""
        _member_index(self.rank, members)
        return self._collective(phase, "all-gather", lambda g: self.dist.all_gather_into_tensor(
            out, shard, group=g, async_op=True), members, [shard, out])

    def reduce_scatter(self, phase, inp, out, members):
        """One ``reduce_scatter_tensor`` (sum) on the members' process group (see
        :meth:`Transport.reduce_scatter`)."""
        _member_index(self.rank, members)
        return self._collective(phase, "reduce-scatter", lambda g: self.dist.reduce_scatter_tensor(
            out, inp, group=g, async_op=True), members, [inp, out])

    def all_to_all(self, phase, inp, out, in_rows, out_rows, members, tag=0):
        """One ``all_to_all_single`` on the members' process group (see
        :meth:`Transport.all_to_all`); where there is none (no head groups given at entry),
        point-to-point messages as there."""
        _member_index(self.rank, members)
        try:
            self._collective_group(members)
        except ValueError:
            return super().all_to_all(phase, inp, out, in_rows, out_rows, members, tag)
        return self._collective(phase, "all-to-all", lambda g: self.dist.all_to_all_single(
            out, inp, output_split_sizes=[int(r) for r in out_rows], input_split_sizes=[int(r) for r in in_rows],
            group=g, async_op=True), members, [inp, out])

    def wait(self, handle):
        phase, reqs, peers, _keep = handle
        if self.refusals is not None and self.host_waits and reqs:
            self._wait_watching(phase, reqs, peers)
        else:
            self._wait_all(phase, reqs, peers)
        return
        yield  # pragma: no cover - makes this a generator that never blocks the caller

    def _wait_watching(self, phase: int, reqs: list, peers: list[int]) -> None:
        """:meth:`_wait_all` in the waiter thread while this one polls the refusal channel."""
        global _waiter
        if _waiter is None:
            _waiter = _Waiter()
        done, failure = _waiter.submit(lambda: self._wait_all(phase, reqs, peers))
        while not done.wait(REFUSAL_POLL_S):
            refused = self.refusals.poll()
            if refused is not None:
                _waiter.close()  # left blocked until the wait's timeout, or until the group closes
                _abandoned.append(_waiter)
                _waiter = None
                raise self._refusal(phase, *refused)
        if failure:
            raise self._explained(failure[0]) if isinstance(failure[0], TransferError) else failure[0]

    def _refusal(self, phase: int, peer: int, reason: str) -> PeerRefusedError:
        return PeerRefusedError(f"rank {self.rank}: phase {phase}: rank {peer} refused the SDPA call, so its "
                                f"transfers will not come: {reason}", phase, [peer], reason)

    def _explained(self, err: TransferError) -> TransferError:
        """``err``, or the :class:`PeerRefusedError` behind it: a peer that refused the call and
        then closed its group fails this rank's transfers with a closed connection, sooner than
        a poll of the refusal channel sees the refusal it posted before leaving. One store read;
        a store that is gone leaves ``err`` as it is."""
        if self.refusals is None or not self.host_waits:
            return err
        try:
            refused = self.refusals.poll()
        except Exception:  # noqa: BLE001 -- the store went with the peer: the transfer's own error stands
            return err
        return err if refused is None else self._refusal(err.phase, *refused)

    def _wait_all(self, phase: int, reqs: list, peers: list[int]) -> None:
        for i, req in enumerate(reqs):
            try:
                if self.timeout is None or not self.host_waits:
                    req.wait()  # on a device: the stream waits, the host does not
                else:
                    req.wait(self.timeout)
            except RuntimeError as err:
                if self.timeout is None or not self.host_waits or not is_timeout(err):
                    raise TransferError(f"rank {self.rank}: phase {phase}: a transfer with rank {peers[i]} failed: "
                                        f"{err}", phase, [peers[i]]) from None
                # one work per operation where the backend keeps them apart (gloo); else all peers
                late = (sorted({peers[j] for j in range(i, len(reqs)) if not reqs[j].is_completed()}) or [peers[i]]) \
                    if len(reqs) == len(peers) else sorted(set(peers))
                raise TransferTimeoutError(
                    f"rank {self.rank}: phase {phase}: no message from rank(s) {late} within "
                    f"{self.timeout.total_seconds():g} s (a peer froze, failed before sending, or runs another "
                    "plan)", phase, late) from None
