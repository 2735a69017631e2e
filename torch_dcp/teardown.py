"""Ordered teardown of a job's process groups: :func:`shutdown` (``torch_dcp.shutdown()``).

The failure this guards against: a job trains correctly and then one rank dies at exit with
"terminate called without an active exception" (SIGABRT, exit code -6), so torchrun reports
the job failed. The abort happens in C++ teardown while the interpreter finalizes.
``torch.distributed.destroy_process_group()`` unregisters the groups and calls their backends'
``shutdown``, but the C++ objects (a gloo ``ProcessGroupGloo`` with its worker threads
``pt_gloo_runloop``, its gloo context and pairs, its device with the event-loop thread
``gloo_tcp_loop``) stay alive for as long as any Python object still refers to the group. What
is still alive when the interpreter finalizes gets torn down there, in whatever order
finalization frees it, while the interpreter is half gone. A native thread that then needs the
GIL (to free a tensor that Python owns, or to return from a call made with the GIL released)
is ended with ``pthread_exit``, and unwinding through C++ code that may not throw ends in
``std::terminate``. PyTorch's own reports describe the same mechanism for gloo groups that
are still alive at exit (pytorch/pytorch#179291, #190489).

On torch 2.13, a group outlives ``destroy_process_group()`` in a training job for reasons the
job cannot see. Each one was found with ``gc`` on the 3-rank context check and on the main
job:

* ``torch.distributed.nn.functional`` evaluates ``group=group.WORLD`` in the signatures of
  ten functions when it is first imported. That import is lazy (``DTensor.from_local``
  imports ``torch._dynamo``, which imports FSDP, ``_shard`` and ``torch.distributed.nn``), so
  in a job that has already initialised its process group, those defaults capture the default
  group and nothing ever releases it;
* DTensor's caches keep every ``DeviceMesh`` they have seen, and a mesh keeps its groups.
  These are the sharding-propagation caches (the Python one, which is per thread, and the C++
  fast path), the redistribute-planner cache, and the ``lru_cache`` functions of the DTensor
  modules (transform infos, mesh topologies);
* PyTorch's ``context_parallel`` keeps each SDPA wrapper it installed, with its mesh, in a
  registry after it restores the original function;
* torch_dcp's own cache of side groups (:mod:`torch_dcp.executor.groups`);
* the caller's objects: a ``DeviceMesh``, a model sharded with FSDP, a ``DCPContext`` (its
  executor's transport holds the group), a ``PlanningLoader`` whose ``batch_of`` is bound to
  them, ``P2POp`` objects (``group=None`` is resolved to the default group and stored), or
  the ``Work`` handles of point-to-point transfers (a gloo send or receive work keeps the gloo
  context, and its event-loop thread, alive). torch_dcp's transport keeps neither once a
  phase's wait returns.

:func:`shutdown` tears down in an order that leaves nothing behind. It runs a bounded barrier
(no rank closes its connections while a peer still talks to it), drops torch_dcp's
references, clears the caches and registries above, calls ``destroy_process_group()``, hands
back the captured defaults, runs a garbage collection, and then checks what is still alive
(:func:`leftovers`). Call it once every rank's work is done, after dropping your own meshes,
models, contexts and loaders. What it cannot free is returned, never ignored, so the caller
can leave the process without the interpreter's teardown (:func:`exit_process`) instead of
risking it.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import itertools
import os
import sys
import threading
import types
import weakref
from typing import Any, NoReturn

from .executor.transport import TransferError, TransferTimeoutError, as_timedelta, is_timeout

__all__ = ["shutdown", "leftovers", "native_threads", "exit_process", "GLOO_THREADS"]

#: names (Linux ``comm``) of the native threads a gloo process group runs: its worker threads
#: and its device's event loop; none of them is left once every gloo group has been freed
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def native_threads() -> list[str]:
    """The names of this process's native threads (Linux ``/proc/self/task/*/comm``; an empty
    list where that is not readable)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names


def leftovers(groups: "list[weakref.ref] | None" = None) -> list[str]:
    """What of ``torch.distributed`` would still be torn down by the interpreter's exit, one
    line each: process groups in ``groups`` (weak references) still alive, gloo threads still
    running (:data:`GLOO_THREADS`), and Python threads other than the calling one still
    running (a daemon thread blocked in a C++ call, e.g. a store wait, is ended at exit by
    ``pthread_exit``). Empty when nothing is left."""
    out = []
    for ref in groups or ():
        pg = ref()
        if pg is not None:
            try:
                name = pg.group_name
            except Exception:  # a backend that no longer answers
                name = "?"
            out.append(f"process group {name!r} still referenced ({sys.getrefcount(pg) - 2} Python reference(s))")
        del pg
    gloo = [n for n in native_threads() if n in GLOO_THREADS]
    if gloo:
        out.append(f"gloo threads still running: {', '.join(sorted(gloo))}")
    me = threading.current_thread()
    others = [t.name for t in threading.enumerate() if t is not me and t.is_alive()
              and t is not threading.main_thread()]
    if others:
        out.append(f"Python threads still running: {', '.join(others)}")
    return out


def _clear_torch_caches() -> None:
    """Drop the DTensor caches that keep ``DeviceMesh`` objects (and so their groups) alive:
    the sharding propagator's (the Python one, per thread: the calling thread's; the C++ fast
    path), the redistribute planner's, every ``functools.lru_cache`` of the DTensor and
    device-mesh modules (e.g. the transform infos and mesh topologies keyed by meshes), and
    the stale entries of PyTorch's context-parallel registry of SDPA wrappers. They are caches
    or records of what is gone: clearing them costs a recomputation, never a result. Each is
    looked up by name and skipped where this torch has no such cache."""
    import torch

    if "torch.distributed.tensor" not in sys.modules:
        return  # DTensor never imported: it cached nothing
    from torch.distributed.tensor import DTensor

    prop = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    clear = getattr(getattr(prop, "propagate_op_sharding", None), "cache_clear", None)
    if clear is not None:
        clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    clear = getattr(sys.modules.get("torch.distributed.tensor._redistribute"), "clear_redistribute_planner_cache", None)
    if clear is not None:
        clear()
    # PyTorch's context_parallel keeps every SDPA wrapper it installed (each closing over its
    # mesh) in a registry after restoring the original: entries whose wrapper is no longer
    # installed are dropped
    attention = sys.modules.get("torch.distributed.tensor.experimental._context_parallel._attention")
    replaced = getattr(attention, "_replaced_functions", None)
    if type(replaced) is dict:
        import torch.nn.functional as F

        for wrapper, entry in list(replaced.items()):
            if type(entry) is tuple and entry and getattr(F, entry[0], None) is not wrapper:
                del replaced[wrapper]
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name.startswith("torch.distributed.tensor") or name == "torch.distributed.device_mesh"):
            continue
        for obj in list(vars(mod).values()):
            _clear_lru(obj)
            if isinstance(obj, type) and obj.__module__ == name:
                for member in list(vars(obj).values()):
                    _clear_lru(getattr(member, "__func__", member))


_LRU = getattr(functools, "_lru_cache_wrapper", ())


def _clear_lru(obj: Any) -> None:
    """``obj.cache_clear()`` where ``obj`` is a ``functools.lru_cache`` wrapper."""
    if isinstance(obj, _LRU):
        obj.cache_clear()


def _release_captured(dist: Any) -> int:
    """Give back default arguments of ``torch.distributed`` functions that captured a process
    group no longer registered (``group=group.WORLD`` evaluated after ``init_process_group``,
    the group destroyed since): each becomes ``None``, what the same default is when the module
    is imported before any group exists (the default group, whichever it is when the function
    is called). Returns how many functions were changed."""
    world = getattr(dist.distributed_c10d, "_world", None)
    live = {id(pg) for pg in (getattr(world, "pg_map", None) or {})} if dist.is_initialized() else set()
    group_type = dist.ProcessGroup

    def stale(v: Any) -> bool:
        return isinstance(v, group_type) and id(v) not in live

    n = 0
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "torch.distributed" or mod_name.startswith("torch.distributed.")):
            continue
        for fn in list(vars(mod).values()):
            if type(fn) is not types.FunctionType:
                continue
            if fn.__defaults__ and any(stale(d) for d in fn.__defaults__):
                fn.__defaults__ = tuple(None if stale(d) else d for d in fn.__defaults__)
                n += 1
            if fn.__kwdefaults__ and any(stale(v) for v in fn.__kwdefaults__.values()):
                fn.__kwdefaults__ = {k: (None if stale(v) else v) for k, v in fn.__kwdefaults__.items()}
                n += 1
    return n


def shutdown(*, barrier: bool = True, timeout: "float | datetime.timedelta" = 60.0) -> list[str]:
    """Tear down every ``torch.distributed`` process group so that nothing of them is left for
    the interpreter's exit, where a gloo group's C++ teardown can abort (module docstring).
    Every rank calls it once its work is done, in place of ``dist.destroy_process_group()``,
    after dropping its own meshes, models, ``DCPContext`` objects and loaders.

    In order:

    1. with ``barrier=True``, a barrier of all ranks, through the default group's store, waited
       at most ``timeout``: no rank closes its connections while a peer still sends to it
       (pass ``barrier=False`` after a failure, when peers may never arrive);
    2. torch_dcp's own references dropped (its cache of side groups), and the DTensor caches
       and PyTorch context-parallel records that keep device meshes (and their groups) alive
       cleared;
    3. ``torch.distributed.destroy_process_group()`` (every group), function defaults that
       captured a destroyed group given back, and a garbage collection, so the groups' C++
       objects are freed now, while the interpreter is whole, and their threads joined;
       torch_dcp's waiter threads (:class:`~torch_dcp.executor.TorchDistributedTransport`)
       ended, within 5 s.

    Without an initialised default group (e.g. after the caller destroyed it) steps 1 and the
    destroy are skipped; the rest, and the check, run.

    Args:
        barrier: synchronise the ranks before tearing down (the default).
        timeout: the longest the barrier waits (seconds or a ``timedelta``).

    Returns:
        :func:`leftovers`: what is still alive (empty when the teardown left nothing): process
        groups the caller still refers to, gloo threads, Python threads other than this one.
        A caller that cannot free them may end the process with :func:`exit_process`.

    Raises:
        RuntimeError: called inside ``torch_dcp.context_parallel`` (its executor is in use);
            nothing is torn down.
        ValueError: ``timeout`` is not a positive number of seconds or ``timedelta``.
        TransferTimeoutError: the barrier did not complete within ``timeout`` (a rank did not
            reach its teardown); raised after the teardown, which runs anyway.
        TransferError: the barrier failed otherwise (the store is unreachable: the process
            hosting it left); raised after the teardown.
    """
    from . import attention_op, context
    from .executor import groups, transport

    td = as_timedelta(timeout, "torch_dcp.shutdown: timeout")
    if context._active is not None or attention_op._executor is not None:
        raise RuntimeError("torch_dcp.shutdown: called inside torch_dcp.context_parallel; exit the context first")
    import torch.distributed as dist

    failure: TransferError | None = None
    refs: list[weakref.ref] = []
    if dist.is_available() and dist.is_initialized():
        refs = _group_refs(dist)
        rank = dist.get_rank()
        if barrier:
            failure = _barrier(dist, rank, dist.get_world_size(), td)
        groups.forget_groups()
        _clear_torch_caches()
        gc.collect()
        dist.destroy_process_group()
    else:
        groups.forget_groups()
        _clear_torch_caches()
    if dist.is_available():
        _release_captured(dist)
    transport.stop_waiters()  # after the destroy: a waiter left blocked by a peer's refusal is unblocked by it
    for _ in range(3):  # a collection can free what holds the next cycle (finalizers): until one frees nothing
        if not gc.collect():
            break
    left = leftovers(refs)
    if failure is not None:
        raise failure
    return left


def _group_refs(dist: Any) -> list[weakref.ref]:
    """Weak references to every registered process group (the default one at least), so that
    the check after the teardown sees which survived without keeping them alive itself."""
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    refs = []
    for pg in list(getattr(world, "pg_map", None) or {}) or [c10d._get_default_group()]:
        try:
            refs.append(weakref.ref(pg))
        except TypeError:  # pragma: no cover - a group type without weak references
            pass
    return refs


#: shutdown barriers this process has entered (their store keys are numbered by it: every rank
#: of a job calls :func:`shutdown` the same number of times)
_BARRIERS = itertools.count()


def _barrier(dist: Any, rank: int, world: int, timeout: datetime.timedelta) -> TransferError | None:
    """A barrier through the default group's store (not a collective: a collective that times
    out stays in gloo's queue, and destroying the group then waits for the group's own timeout,
    whereas a store wait leaves nothing behind), waited at most ``timeout``. Returns the error
    to raise after the teardown, or ``None``. Every rank adds itself to a counter; the last one
    in sets the release key the others wait for."""
    others = [r for r in range(world) if r != rank]
    key = f"torch_dcp/shutdown/{dist.distributed_c10d._get_default_group().group_name}/{next(_BARRIERS)}"
    try:
        store = dist.distributed_c10d._get_default_store()
        if store.add(f"{key}/arrived", 1) >= world:
            store.set(f"{key}/released", b"1")
        store.wait([f"{key}/released"], timeout)
    except (RuntimeError, ValueError) as err:  # a closed or timed-out store raises RuntimeError subclasses
        if is_timeout(err):
            return TransferTimeoutError(f"torch_dcp.shutdown: rank {rank}: the barrier before the teardown did not "
                                        f"complete within {timeout.total_seconds():g} s (a rank did not reach its "
                                        f"teardown): {err}", -1, others)
        return TransferError(f"torch_dcp.shutdown: rank {rank}: the barrier before the teardown failed (the store "
                             f"is unreachable: its host left): {err}", -1, others)
    return None


def exit_process(code: int = 0) -> NoReturn:
    """End the process now with exit status ``code``: flush ``sys.stdout``/``sys.stderr``, run
    the ``atexit`` handlers, then ``os._exit(code)``, which skips the interpreter's
    finalization (and with it the C++ teardown of anything :func:`shutdown` reported as left).
    For a job's last line, after its own results and errors have been reported: ``code`` is
    the status the job earned (0 only for a success), never replaced.

    Raises:
        ValueError: ``code`` is not an integer in 0..255.
    """
    if type(code) is not int or not 0 <= code <= 255:
        raise ValueError(f"torch_dcp.teardown.exit_process: code must be an integer in 0..255, got {code!r}")
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        run()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream: nothing left to flush
            pass
    os._exit(code)
