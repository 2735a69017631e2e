"""Transports: how an executor's ``CommLaunch``/``CommWait`` move bytes between ranks.

A transport moves one contiguous ``uint8`` message per (phase, sender, receiver). ``wait``
is a generator: it yields while the messages are not there yet (only the in-process
transport ever does), so several ranks can run in one process.
"""

from __future__ import annotations

from typing import Any, Generator, Sequence

import torch

__all__ = ["Transport", "InProcessTransport", "Mailbox", "TorchDistributedTransport"]


class Transport:
    """Interface: ``launch`` posts sends and receives of a phase; ``wait`` completes them."""

    def launch(self, phase: int, sends: Sequence[tuple[int, torch.Tensor]],
               recvs: Sequence[tuple[int, int]]) -> Any:
        """Post ``sends`` (peer, uint8 message) and receives (peer, byte count); returns a handle."""
        raise NotImplementedError

    def wait(self, handle: Any) -> Generator[None, None, dict[int, torch.Tensor]]:
        """Complete a launch; returns ``{peer: uint8 message}`` of its receives."""
        raise NotImplementedError


class Mailbox:
    """Messages in flight between ranks running in one process."""

    def __init__(self):
        self.messages: dict[tuple[int, int, int], torch.Tensor] = {}
        self.events = 0

    def post(self, key: tuple[int, int, int], message: torch.Tensor) -> None:
        if key in self.messages:
            raise RuntimeError(f"two messages for (phase, src, dst) = {key}")
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
        for peer, msg in sends:
            self.mailbox.post((phase, self.rank, peer), msg.clone())
        return phase, list(recvs)

    def wait(self, handle):
        phase, recvs = handle
        out = {}
        for peer, nbytes in recvs:
            key = (phase, peer, self.rank)
            while key not in self.mailbox.messages:
                yield
            msg = self.mailbox.messages.pop(key)
            if msg.numel() != nbytes:
                raise RuntimeError(f"phase {phase}: rank {peer} sent {msg.numel()} bytes to rank {self.rank}, expected {nbytes}")
            out[peer] = msg
        self.mailbox.events += 1
        return out


class TorchDistributedTransport(Transport):
    """Point-to-point over ``torch.distributed`` with ``batch_isend_irecv``.

    Args:
        group: the DCP process group (plan rank ``r`` is group rank ``r``); ``None`` for the
            default group.
        device: device of the receive buffers (the tensors' device; CPU for gloo).
    """

    def __init__(self, group: Any = None, device: torch.device | str = "cpu"):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.device = torch.device(device)
        self.world_size = dist.get_world_size(group)

    def _global(self, rank: int) -> int:
        if self.group is None:
            return rank
        return self.dist.get_global_rank(self.group, rank)

    def launch(self, phase, sends, recvs):
        dist = self.dist
        ops = []
        bufs = {}
        keep = []  # send buffers must outlive the asynchronous sends
        for peer, nbytes in recvs:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            bufs[peer] = buf
            ops.append(dist.P2POp(dist.irecv, buf, self._global(peer), self.group, tag=phase))
        for peer, msg in sends:
            keep.append(msg.contiguous())
            ops.append(dist.P2POp(dist.isend, keep[-1], self._global(peer), self.group, tag=phase))
        reqs = dist.batch_isend_irecv(ops) if ops else []
        return reqs, bufs, keep

    def wait(self, handle):
        reqs, bufs, _keep = handle
        for req in reqs:
            req.wait()
        return bufs
        yield  # pragma: no cover - makes this a generator that never blocks the caller
