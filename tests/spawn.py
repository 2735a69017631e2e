"""Run a function on ``world`` gloo ranks in separate processes (CPU), with results in files.

The ranks are forked from multiprocessing's fork server, which imported torch, DTensor,
torch_dcp and the integrations' heavy modules once (:data:`PRELOAD`): a rank starts in
milliseconds instead of the seconds a fresh interpreter takes to import them on 2 cores. The
fork server has initialised no process group and started no thread pool, so a rank starts as
clean as a spawned one; it gets the test process's environment as it is at the call.

Each rank writes ``ok{rank}`` when ``fn(rank, world, mesh)`` returns and ``err{rank}`` (the
traceback) when it raises; :func:`run_ranks` asserts every rank finished cleanly, and that every
rank's process exited 0. A rank tears its groups down with :func:`torch_dcp.shutdown` (a store
barrier unless ``barrier=False``, torch_dcp's and DTensor's references dropped, every group
destroyed and freed while the interpreter is whole); what the teardown reports still alive
(:func:`torch_dcp.teardown.leftovers`) is written to ``left{rank}``. A forked rank then leaves
as multiprocessing's children do, without the interpreter's finalization: the exit through
it, where gloo's teardown would abort ("terminate called without an active exception") were a
group still alive, is tests/test_shutdown.py's, whose ranks are fresh interpreters. A failed
barrier (a peer that never reached its teardown) is an error of the rank. Inside ``fn``,
:func:`fresh_group` replaces the rank's process group with a new one (recovery after a fault).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(fn: Callable, world: int, tmp_path: Path, timeout: float = 300.0, dies: tuple[int, ...] = (),
              barrier: bool = True) -> None:
    """Run ``fn(rank, world, mesh)`` on every rank; fail (killing the ranks) after ``timeout`` s.
    Ranks in ``dies`` are expected to end their process abruptly (``os._exit(0)``) inside ``fn``.
    ``barrier=False`` for tests whose ranks do not all reach their teardown (a rank that dies, or
    one left behind on purpose): the teardown then skips its barrier. A rank process that exits
    non-zero (e.g. aborted by the interpreter's teardown) fails the run (``ctx.join`` raises)."""
    _forkserver()
    ctx = mp.start_processes(_entry, args=(fn, world, str(tmp_path), barrier, dict(os.environ)), nprocs=world,
                             join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"ranks still running after {timeout:g} s (killed): a wait is not bounded")
    for r in (r for r in range(world) if r not in dies):
        err = tmp_path / f"err{r}"
        assert not err.exists(), err.read_text()
        assert (tmp_path / f"ok{r}").exists(), f"rank {r} did not finish"


#: what the fork server imports once, so that a rank starts as a fork of it (milliseconds) rather
#: than a fresh interpreter importing torch, DTensor and torch_dcp (seconds on 2 cores); and what
#: the torchtitan and Hugging Face ranks import (Inductor, datasets, TensorBoard, transformers'
#: Llama; not torchtitan itself, whose CPU shims must come first). A module that is not installed
#: is skipped by the fork server.
PRELOAD = ["torch", "torch.distributed.tensor", "torch._dynamo", "torch_dcp", "spawn", "torch._inductor.compile_fx",
           "datasets", "torch.utils.tensorboard", "transformers.models.llama.modeling_llama"]


def _forkserver() -> None:
    """Start multiprocessing's fork server (once per test process) with :data:`PRELOAD` imported.
    Nothing in it has initialised a process group or started a thread pool: every rank forked
    from it starts as clean as a spawned one, with the test process's environment passed in."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when it starts


#: the run's folder, in a spawned rank: files there are a side channel between the ranks that
#: needs no process group (e.g. to order the ranks around a fault)
run_dir = ""


def _init(rank: int, world: int, name: str) -> object:
    """Init this rank's default gloo group (rendezvous file ``name`` in the run's folder) and
    return its one-dimensional CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{run_dir}/{name}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    return init_device_mesh("cpu", (world,))


def fresh_group(rank: int, world: int, name: str) -> object:
    """Inside ``fn``: destroy this rank's default group (whatever it left pending) and init a
    fresh one (rendezvous file ``name``, new for every call); returns its mesh. Every rank must
    call it."""
    dist.destroy_process_group()
    return _init(rank, world, name)


def _entry(rank: int, fn: Callable, world: int, tmp: str, barrier: bool, environ: dict) -> None:
    global run_dir
    os.environ.clear()
    os.environ.update(environ)  # the test's, not the fork server's (started by an earlier test)
    import torch_dcp

    torch.set_num_threads(1)  # world processes share 2 cores: more threads each only oversubscribe them
    run_dir = tmp
    try:
        fn(rank, world, _init(rank, world, "init"))  # the mesh is fn's: freed when fn returns
        open(f"{tmp}/ok{rank}", "w").close()
    except BaseException:
        with open(f"{tmp}/err{rank}", "w") as f:
            f.write(traceback.format_exc())
    left = []
    try:
        # barrier: no rank tears its group down while a peer still talks to it
        left = torch_dcp.shutdown(barrier=barrier, timeout=120.0)
    except Exception:
        with open(f"{tmp}/err{rank}", "a") as f:
            f.write(traceback.format_exc())
    if left:
        with open(f"{tmp}/left{rank}", "w") as f:
            f.write("\n".join(left) + "\n")
        torch_dcp.teardown.exit_process(0)
