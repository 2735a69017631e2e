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
* on torch 2.11, a reference that nothing can release: its C++ ``OpSchema.__post_init__``
  (``torch._C._DTensor_OpSchema_post_init``) keeps one reference too many to a tuple of the
  ``OpStrategy`` arguments of a schema whose op has no ``RuntimeSchemaInfo`` (``aten.detach``,
  ``aten.alias``; measured: each ``OpSchema(aten.detach.default, (strategy,), {})`` leaves the
  strategy's reference count one higher after the schema is freed, under 2.11.0 and not under
  2.13.0). Sharding propagation builds such a schema for every DTensor ``detach`` it
  propagates, and ``torch.autograd.Function.apply`` detaches the DTensor arguments of
  ``torch_dcp::attention``; the tuple then keeps the strategy, its ``OpSpec``, the
  ``DTensorSpec``, the ``DeviceMesh`` and its groups (:func:`_release_stranded_specs`);
* torch_dcp's own cache of side groups (:mod:`torch_dcp.executor.groups`), and the transports
  of the contexts it ran (each holds its group);
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

A job that ends the way PyTorch documents, with ``dist.destroy_process_group()`` and no
:func:`shutdown`, is covered by :func:`release_at_exit`: ``torch_dcp.context_parallel``
registers it with ``atexit`` on its first entry. ``atexit`` handlers run after the main module
returns and non-daemon threads are joined, and before the interpreter finalizes (CPython's
``Py_FinalizeEx``), so what it frees is torn down while the interpreter is whole.
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
import warnings
import weakref
from typing import Any, NoReturn

from .executor.transport import TransferError, TransferTimeoutError, as_timedelta, is_timeout

__all__ = ["shutdown", "release_at_exit", "leftovers", "native_threads", "exit_process", "GLOO_THREADS"]

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


def _release_stranded_specs() -> int:
    """Release what DTensor sharding specs hold when nothing reachable refers to them: only
    tuples that the garbage collector sees no referrer of do (a C++ reference that is never
    released, as torch 2.11's ``OpSchema.__post_init__`` leaves one to the arguments of a
    ``detach`` or ``alias`` schema; module docstring). Such an ``OpStrategy`` has its strategy
    list emptied, such a ``DTensorSpec`` its mesh dropped; the tuples and the emptied objects
    stay, the ``OpSpec`` objects, ``DeviceMesh`` and process groups they held are freed. An
    object that anything the collector sees refers to (a live schema, a cache, a DTensor) is
    left alone; a spec held only by a strategy released in one round is released in the next.
    Returns how many objects were released."""
    total = 0
    for _ in range(4):
        n = _release_stranded_round()
        total += n
        if not n:
            break
    return total


def _release_stranded_round() -> int:
    """One round of :func:`_release_stranded_specs`."""
    release: dict[type, Any] = {}
    strategy_type = getattr(sys.modules.get("torch.distributed.tensor._op_schema"), "OpStrategy", None)
    if strategy_type is not None:
        release[strategy_type] = lambda x: setattr(x, "strategies", [])
    spec_type = getattr(sys.modules.get("torch.distributed.tensor._dtensor_spec"), "DTensorSpec", None)
    if spec_type is not None:  # object.__setattr__: DTensorSpec's own would rehash with mesh=None
        release[spec_type] = lambda x: object.__setattr__(x, "mesh", None)
    if not release:
        return 0  # DTensor never imported: no spec exists
    gc.collect()
    tuples = [o for o in gc.get_objects() if type(o) is tuple and any(type(x) in release for x in o)]
    if not tuples:
        return 0
    # one pass over the heap for all of them: a tuple that some tracked object refers to is reachable
    ids = {id(t) for t in tuples}
    referred = set()
    for holder in gc.get_referrers(*tuples):
        if holder is not tuples:
            referred.update(id(x) for x in gc.get_referents(holder) if id(x) in ids)
    stranded = [t for t in tuples if id(t) not in referred]
    del tuples
    found = {id(x): x for t in stranded for x in t if type(x) in release}
    if not found:
        return 0
    values = list(found.values())
    skip = {id(values), id(stranded), id(found), *(id(t) for t in stranded)}
    held = set()
    for holder in gc.get_referrers(*values):
        if id(holder) not in skip:
            held.update(id(x) for x in gc.get_referents(holder) if id(x) in found)
    n = 0
    for key, obj in found.items():
        if key not in held:
            release[type(obj)](obj)
            n += 1
    return n


def _release_destroyed_mesh_groups(dist: Any) -> int:
    """Drop, from every ``DeviceMesh`` still alive, the process groups that are no longer
    registered (``destroy_process_group()`` destroyed them): a mesh keeps its groups in
    ``_pg_registry`` (a dict the garbage collector does not see into), so a mesh the job still
    holds at exit would keep destroyed groups alive into the interpreter's finalization. A
    destroyed group cannot be used again, so the mesh loses nothing it could still use; groups
    still registered are left in place. Returns how many entries were dropped."""
    mod = sys.modules.get("torch.distributed.device_mesh")
    mesh_type = getattr(mod, "DeviceMesh", None)
    if mesh_type is None or not dist.is_available():
        return 0
    world = getattr(dist.distributed_c10d, "_world", None)
    live = {id(pg) for pg in (getattr(world, "pg_map", None) or {})} if dist.is_initialized() else set()
    n = 0
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), mesh_type)]:
        registry = vars(mesh).get("_pg_registry")
        if type(registry) is not dict:
            continue
        for name, pg in list(registry.items()):
            if isinstance(pg, dist.ProcessGroup) and id(pg) not in live:
                del registry[name]
                n += 1
    return n


#: weak references to the transports of the contexts torch_dcp ran (each holds its groups)
_TRANSPORTS: list[weakref.ref] = []
_EXIT_REGISTERED = False


def track_transport(transport: Any) -> None:
    """Remember ``transport`` (weakly), so that :func:`release_at_exit` drops its groups, and
    register :func:`release_at_exit` with ``atexit`` once (``torch_dcp.context_parallel`` calls
    it on entry)."""
    global _EXIT_REGISTERED
    _TRANSPORTS[:] = [r for r in _TRANSPORTS if r() is not None]
    _TRANSPORTS.append(weakref.ref(transport))
    if not _EXIT_REGISTERED:
        atexit.register(release_at_exit)
        _EXIT_REGISTERED = True


def release_at_exit() -> list[str]:
    """Release, at interpreter exit, what torch_dcp and the torch caches it used keep of
    process groups that ``dist.destroy_process_group()`` destroyed, so that a job ending the
    way PyTorch documents exits 0 (module docstring). Registered with ``atexit`` by
    ``torch_dcp.context_parallel``; it runs while the interpreter is whole. Groups that are
    still registered stay usable: nothing is destroyed here, and a job that never destroyed
    its groups keeps them (PyTorch then warns that ``destroy_process_group()`` was not called).

    In order: torch_dcp's waiter thread ended (at most 5 s); torch_dcp's cache of side groups
    dropped, and its contexts' transports' references to destroyed groups; then, only where
    a group or a gloo thread is still alive (not after :func:`shutdown`): the DTensor caches and
    registries of :func:`_clear_torch_caches` cleared; destroyed groups dropped from the meshes
    still alive (:func:`_release_destroyed_mesh_groups`) and from function defaults; garbage
    collections, which free the destroyed groups and join their threads now; and where one is
    still alive after those, the sharding specs torch 2.11 strands released
    (:func:`_release_stranded_specs`) and the collections repeated.

    Returns:
        :func:`leftovers` of the groups its transports held (empty when nothing is left).
        Inside an active ``torch_dcp.context_parallel`` it does nothing and returns ``[]``.
    """
    from . import attention_op, context

    if context._active is not None or attention_op._executor is not None:
        return []
    with warnings.catch_warnings():  # the heap walks touch deprecated objects (torch.distributed.reduce_op)
        warnings.simplefilter("ignore", FutureWarning)
        return _release_at_exit()


def _release_at_exit() -> list[str]:
    """:func:`release_at_exit`'s work."""
    from .executor import groups, transport

    import torch.distributed as dist

    if not dist.is_available():
        return []
    world = getattr(dist.distributed_c10d, "_world", None)
    live = {id(pg) for pg in (getattr(world, "pg_map", None) or {})} if dist.is_initialized() else set()
    refs = []
    for ref in _TRANSPORTS:
        t = ref()
        if t is None:
            continue
        for attr in ("group", "comm_group"):
            pg = getattr(t, attr, None)
            if isinstance(pg, dist.ProcessGroup):
                refs.append(weakref.ref(pg))
                if id(pg) not in live:
                    setattr(t, attr, None)
        t = pg = None
    _TRANSPORTS.clear()
    transport.stop_waiters()
    if not dist.is_initialized():
        groups.forget_groups()  # destroyed with the default group
    if not leftovers(refs):  # shutdown() ran, or nothing held a group: no heap walk
        return []
    _clear_torch_caches()
    _release_destroyed_mesh_groups(dist)
    _release_captured(dist)
    return _collect_then_release_stranded(refs)


def _collect(rounds: int = 3) -> None:
    """Garbage collections until one frees nothing (a collection can free what holds the next
    cycle: finalizers), at most ``rounds``."""
    for _ in range(rounds):
        if not gc.collect():
            break


def _collect_then_release_stranded(refs: list[weakref.ref]) -> list[str]:
    """Collect, and only where a group of ``refs`` (or a gloo thread) is still alive after
    that, release the specs torch 2.11 strands (:func:`_release_stranded_specs`, a walk over
    the heap: a few tenths of a second) and collect again. Returns :func:`leftovers`."""
    _collect()
    left = leftovers(refs)
    if left:
        _release_stranded_specs()
        _collect()
        left = leftovers(refs)
    return left


def shutdown(*, barrier: bool = True, timeout: "float | datetime.timedelta" = 60.0) -> list[str]:
    """Tear down every ``torch.distributed`` process group so that nothing of them is left for
    the interpreter's exit, where a gloo group's C++ teardown can abort (module docstring).
    Every rank calls it once its work is done, in place of ``dist.destroy_process_group()``,
    after dropping its own meshes, models, ``DCPContext`` objects and loaders.

    In order:

    1. with ``barrier=True``, a barrier of all ranks, through the default group's store, waited
       at most ``timeout``: no rank closes its connections while a peer still sends to it
       (pass ``barrier=False`` after a failure, when peers may never arrive);
    2. torch_dcp's own references dropped (its cache of side groups), the DTensor caches
       and PyTorch context-parallel records that keep device meshes (and their groups) alive
       cleared;
    3. ``torch.distributed.destroy_process_group()`` (every group), function defaults that
       captured a destroyed group given back, and a garbage collection, so the groups' C++
       objects are freed now, while the interpreter is whole, and their threads joined; where
       a group is still alive after that, the sharding specs torch 2.11 strands are released
       (:func:`_release_stranded_specs`) and the collection repeated;
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
    left = _collect_then_release_stranded(refs)
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
