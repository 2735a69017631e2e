"""The process groups a DCP step talks on, created once per DCP group.

On a device backend (NCCL) the host must never wait for the GPU: transfers are waited on the
stream (``Work.wait()`` without a timeout), so a stalled peer is not caught by a host-side
timeout but by the process group's own (NCCL's watchdog aborts a collective or P2P operation
that runs longer than the group's timeout). :func:`transfer_group` gives the DCP transfers a
group of their own with the context's timeout, so that bound holds whatever timeout the user's
default group has. Checks that compare host data across ranks (the plan digests at context
entry) run on a CPU backend: the DCP group's own where it has one (gloo, the ``fake`` testing
backend, a ``"cpu:gloo,cuda:nccl"`` group), else a gloo side group (:func:`host_group`), so
they never read device memory nor queue behind the device's collectives.
"""

from __future__ import annotations

import datetime
from typing import Any

__all__ = ["transfer_group", "host_group", "has_cpu_backend", "cp_subgroups"]

# (member global ranks, kind, timeout seconds) -> process group; one per DCP group and use
_GROUPS: dict[tuple[tuple[int, ...], str, float | None], Any] = {}


def _members(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def has_cpu_backend(group: Any) -> bool:
    """Whether ``group`` (``None``: the default group) runs collectives on CPU tensors."""
    import torch.distributed as dist

    return any(part.strip().startswith("cpu:") for part in str(dist.get_backend_config(group)).split(","))


def _new_group(members: tuple[int, ...], backend: str | None, timeout: datetime.timedelta | None) -> Any:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"use_local_synchronization": True}
    if timeout is not None:
        kwargs["timeout"] = timeout
    return dist.new_group(list(members), backend=backend, **kwargs)


def transfer_group(group: Any, timeout: datetime.timedelta) -> Any:
    """A process group over the members of ``group`` for the DCP transfers on a device
    backend, with ``timeout`` as its own (NCCL's watchdog bound on every transfer), created on
    the first call (by every member at once: it is collective over the members) and reused
    after.

    Args:
        group: the DCP process group (``None``: the default group).
        timeout: the longest a transfer may take before the backend aborts it.
    """
    import torch.distributed as dist

    members = _members(group)
    key = (members, "transfer", timeout.total_seconds())
    if key not in _GROUPS:
        backend = dist.get_backend(group)
        _GROUPS[key] = _new_group(members, None if backend == "undefined" else backend, timeout)
    return _GROUPS[key]


def host_group(group: Any) -> Any:
    """``group`` itself where it has a CPU backend, else a gloo group over its members
    (created on the first call, collectively over the members, and reused after)."""
    if has_cpu_backend(group):
        return group
    members = _members(group)
    key = (members, "host", None)
    if key not in _GROUPS:
        _GROUPS[key] = _new_group(members, "gloo", None)
    return _GROUPS[key]


def cp_subgroups(group: Any, member_sets: "list[tuple[int, ...]]",
                 timeout: datetime.timedelta | None = None) -> dict[tuple[int, ...], Any]:
    """Process groups of this rank's static CP groups (``member_sets``: ranks of ``group``,
    ascending, each holding this rank; :func:`~torch_dcp.executor.allgather.collective_groups`),
    as Megatron creates its CP groups once for every size it may use. Each group is created by
    its members (collective over them), in the order given, which must be the same on every
    member; created on the first call and reused after, with ``timeout`` as their own (on a
    device backend, the bound on every collective: NCCL's watchdog).

    Returns:
        ``{members: process group}``.

    Raises:
        ValueError: a set of members that does not hold this rank or leaves the group.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    members = _members(group)
    out: dict[tuple[int, ...], Any] = {}
    for local in member_sets:
        local = tuple(int(r) for r in local)
        if rank not in local or min(local) < 0 or max(local) >= world or list(local) != sorted(set(local)):
            raise ValueError(f"CP group {list(local)}: expected distinct ascending ranks of the DCP group's {world} "
                             f"holding rank {rank}")
        key = (tuple(members[i] for i in local), "cp", None if timeout is None else timeout.total_seconds())
        if key not in _GROUPS:
            backend = dist.get_backend(group)
            _GROUPS[key] = _new_group(key[0], None if backend == "undefined" else backend, timeout)
        out[local] = _GROUPS[key]
    return out


def forget_groups() -> None:
    """Drop the cached groups (call before ``torch.distributed.destroy_process_group``, which
    destroys them)."""
    _GROUPS.clear()
