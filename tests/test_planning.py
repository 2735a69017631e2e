"""torch_dcp.data.PlanningLoader on real gloo process groups: plans made ahead in worker
processes, spread over the ranks and shared through the process group's Store."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_dcp
from torch_dcp import BatchSpec, Causal
from torch_dcp.data import (PlannedBatch, PlanningConfig, PlanningError, PlanningLoader, PlanningPool,
                            PlanningTimeoutError, planning_pool)
from reference import random_qkv, reference_with_grads
from spawn import run_ranks

STEPS = 8
KILL_STEP = 3
INVALID_STEP = 2
TIMEOUT = 6.0  # the loader's timeout in the fault tests


def _lens(step: int) -> list[int]:
    """A small batch per step, different every step (its first document's length names it)."""
    return [40 + step, 7 + 3 * (step % 4), 64, 5 + step % 3, 90 - 2 * step]


def _batch(step: int) -> BatchSpec:
    return BatchSpec(_lens(step), Causal(), n_heads=4, n_kv_heads=2, head_dim=8, dtype="float32")


def _source(n: int = STEPS, start: int = 0):
    for s in range(start, n):
        yield _batch(s), {"step": s}


class _StatefulSource:
    """A source with torchdata's state_dict / load_state_dict convention."""

    def __init__(self, n: int = STEPS):
        self.n, self.i = n, 0

    def __iter__(self):
        while self.i < self.n:
            self.i += 1
            yield _batch(self.i - 1), {"step": self.i - 1}

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def _config(world: int, **kw) -> PlanningConfig:
    return PlanningConfig(world, **{"planner": "dcp", "block_size": 16, "divisions": 2, **kw})


def _warm(world: int) -> None:
    torch_dcp.plan(_batch(0), world, planner="dcp", block_size=16)


def _pool(world: int, workers: int = 1):
    """A spawn pool whose workers have started and planned once (imports and Mt-KaHyPar's
    start-up paid: on 2 shared cores that takes seconds, longer than a fault test's timeout)."""
    pool = planning_pool(workers)
    for f in [pool.submit(_warm, world) for _ in range(workers)]:
        f.result(timeout=120)
    return pool


def _killing_plan(batch, topology, **kw):
    """torch_dcp.plan, except that the worker process planning step KILL_STEP is killed (SIGKILL)."""
    if int(batch.doc_lens[0]) == _lens(KILL_STEP)[0]:
        os.kill(os.getpid(), signal.SIGKILL)
    return torch_dcp.plan(batch, topology, **kw)


def _invalid_plan(batch, topology, **kw):
    """torch_dcp.plan, except that step INVALID_STEP's plan has rank 0's forward program cut short
    (its last instruction dropped), which validation must catch."""
    plan = torch_dcp.plan(batch, topology, **kw)
    if int(batch.doc_lens[0]) == _lens(INVALID_STEP)[0]:
        prog = plan.program(0, False)
        plan._programs[(0, False)] = dataclasses.replace(prog, instructions=prog.instructions[:-1])
    return plan


def _store_keys(loader: PlanningLoader, n: int) -> list[str]:
    return [loader._store.key(s, loader.config.digest(_batch(s))) for s in range(n)]


def _run_attention(pb: PlannedBatch, rank: int, mesh) -> None:
    """One SDPA forward + backward under the loader's plan and prebuilt device plan, exact."""
    batch = pb.batch
    q, k, v, go = random_qkv(batch, torch.float32, seed=pb.step)
    ref = reference_with_grads(batch, q, k, v, go)
    qb, kb, vb, gb = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, go))
    with torch_dcp.context_parallel(mesh, buffers=[qb, kb, vb, gb], buffer_seq_dims=[2, 2, 2, 2], plan=pb.plan,
                                    device_plan=pb.device_plan) as ctx:
        assert ctx.executor.device_plan is pb.device_plan  # not rebuilt at entry
        ql, kl, vl = (t.clone().requires_grad_(True) for t in (qb, kb, vb))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
        out.backward(gb)
        idx = torch.from_numpy(pb.plan.token_indices(rank))
        for what, got, want in (("out", out, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2])):
            err = (got[0].transpose(0, 1).double() - want[idx]).abs().max().item() if len(idx) else 0.0
            assert err <= 1e-5, f"step {pb.step} {what}: {err:.2e}"


# ---------------------------------------------------------------------- plans equal the in-line ones
def _same_plans(rank, world, mesh, workers):
    store = dist.distributed_c10d._get_default_store()
    ref = [torch_dcp.plan(_batch(s), world, planner="dcp", block_size=16, divisions=2).digest() for s in range(STEPS)]
    seen = {"max": 0}
    with PlanningLoader(_source(), _config(world), workers=workers, timeout=60, store=store) as loader:
        keys = _store_keys(loader, STEPS)
        stop = threading.Event()

        def watch():  # the store never holds more than lookahead + 1 steps' plans
            while not stop.is_set():
                seen["max"] = max(seen["max"], sum(store.check([k]) for k in keys))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        got = []
        for pb in loader:
            got.append(pb.plan.digest())
            assert pb.step == len(got) - 1 and pb.data == {"step": pb.step}
            assert pb.planning_rank == pb.step % world and pb.plan_seconds > 0 and pb.wait_seconds >= 0
            assert pb.stats["comm_bytes"] == pb.plan.stats()["comm_bytes"]
            if pb.step in (0, STEPS - 1):
                _run_attention(pb, rank, mesh)
        stop.set()
        watcher.join()
    assert got == ref
    assert seen["max"] <= loader.lookahead + 1, seen
    dist.barrier()  # every rank has read every step: no key is left
    assert not any(store.check([k]) for k in keys + [k + "/read" for k in keys])
    # in line (lookahead 0): the same plans, no store
    with PlanningLoader(_source(), _config(world), lookahead=0) as inline:
        assert [pb.plan.digest() for pb in inline] == ref


# 4 ranks with one worker each: the main job's default, run by tests/test_train.py (causal-loader)
@pytest.mark.parametrize("world,workers", [(2, 3), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_plans_through_the_loader_equal_plans_made_in_line(world, workers, tmp_path):
    t0 = time.monotonic()
    run_ranks(functools.partial(_same_plans, workers=workers), world, tmp_path, timeout=120)
    print(f"world {world}, {workers} workers: {time.monotonic() - t0:.1f} s")


# ---------------------------------------------------------------------- resume
def _resume(rank, world, mesh):
    ref = [torch_dcp.plan(_batch(s), world, planner="dcp", block_size=16, divisions=2).digest() for s in range(STEPS)]
    pool = _pool(world)
    for make in (_source, _StatefulSource):
        first = PlanningLoader(make(), _config(world), pool=pool, timeout=60)
        got = [next(first).plan.digest() for _ in range(3)]
        state = first.state_dict()
        assert state["step"] == 3
        first.close()
        again = PlanningLoader(make(), _config(world), pool=pool, timeout=60)
        again.load_state_dict(state)
        with again:
            rest = [(pb.step, pb.data["step"], pb.plan.digest()) for pb in again]
        assert [s for s, _, _ in rest] == list(range(3, STEPS)) and [d for _, d, _ in rest] == list(range(3, STEPS))
        assert got + [d for _, _, d in rest] == ref, make
    pool.shutdown()


def test_resume_from_a_state_dict_gives_the_same_steps_and_plans(tmp_path):
    run_ranks(_resume, 2, tmp_path, timeout=120)


# ---------------------------------------------------------------------- faults
def _fault(rank, world, mesh, plan_fn, bad_step, match):
    cfg = _config(world, plan_fn=plan_fn, validate=True)
    pool = _pool(world)
    loader = PlanningLoader(_source(), cfg, timeout=TIMEOUT, pool=pool)
    t0 = None
    with pytest.raises(PlanningError, match=match) as err:
        for pb in loader:
            t0 = time.monotonic()  # from the end of the last good step
            assert pb.step < bad_step
    waited = time.monotonic() - t0
    assert err.value.step == bad_step and err.value.planning_rank == bad_step % world
    assert f"step {bad_step} " in str(err.value)
    assert waited < TIMEOUT, f"rank {rank} waited {waited:.1f} s for the error"
    with pytest.raises(PlanningError):  # it stays failed
        next(loader)
    t1 = time.monotonic()
    loader.close()
    pool.shutdown(cancel_futures=True)
    assert time.monotonic() - t1 < 6.0


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 2 ranks cover the path
def test_a_planning_worker_killed_mid_plan_raises_on_every_rank(world, tmp_path):
    t0 = time.monotonic()
    run_ranks(functools.partial(_fault, plan_fn=_killing_plan, bad_step=KILL_STEP, match=r"died \(BrokenProcessPool"),
              world, tmp_path, timeout=90)
    print(f"{time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 2 ranks cover the path
def test_a_plan_that_fails_validation_raises_on_every_rank(world, tmp_path):
    run_ranks(functools.partial(_fault, plan_fn=_invalid_plan, bad_step=INVALID_STEP, match="failed validation"),
              world, tmp_path, timeout=90)


def _silent_rank(rank, world, mesh):
    """Rank 1 never iterates (it never publishes step 1): rank 0 gets a PlanningTimeoutError
    naming step 1 and rank 1 within the timeout."""
    pool = _pool(world)  # warm before the timed part: spawning and imports are not the fault under test
    loader = PlanningLoader(_source(), _config(world), timeout=3.0, pool=pool)
    if rank == 1:
        time.sleep(5.0)
        loader.close()
        pool.shutdown()
        return
    assert next(loader).step == 0
    t0 = time.monotonic()
    with pytest.raises(PlanningTimeoutError, match=r"step 1 \(planned by rank 1\)") as err:
        next(loader)
    assert err.value.step == 1 and err.value.planning_rank == 1
    assert time.monotonic() - t0 < 3.0 + 2.0
    loader.close()
    pool.shutdown(cancel_futures=True)


def test_a_rank_that_never_publishes_gives_a_timeout_naming_step_and_rank(tmp_path):
    run_ranks(_silent_rank, 2, tmp_path, timeout=60)


# ---------------------------------------------------------------------- replicas (tensor parallelism)
class _CountingPool(cf.ThreadPoolExecutor):
    """Plans in a thread of this rank and counts the steps it was given."""

    submitted = 0

    def submit(self, *args, **kwargs):
        type(self).submitted += 1
        return super().submit(*args, **kwargs)


def _replicas(rank, world, mesh):
    """2 DCP ranks x 2 TP ranks: the loaders of both TP indices read every step's one plan."""
    dcp_rank, tp = divmod(rank, 2)
    store = dist.distributed_c10d._get_default_store()
    ref = [torch_dcp.plan(_batch(s), 2, planner="dcp", block_size=16, divisions=2).digest() for s in range(STEPS)]
    with _CountingPool(1) as pool, PlanningLoader(_source(), _config(2), rank=dcp_rank, world_size=2, replica=tp,
                                                  replicas=2, pool=pool, timeout=60, store=store) as loader:
        keys = _store_keys(loader, STEPS)
        got = [pb.plan.digest() for pb in loader]
    assert got == ref
    planned = torch.tensor([_CountingPool.submitted])
    assert planned.item() == (sum(1 for s in range(STEPS) if s % 2 == dcp_rank) if tp == 0 else 0)
    dist.all_reduce(planned)
    assert planned.item() == STEPS  # every step planned once, not once per TP index
    dist.barrier()  # every rank of both replicas read every step: no key is left
    assert not any(store.check([k]) for k in keys + [k + "/read" for k in keys])


def test_replicas_share_one_plan_per_step(tmp_path):
    run_ranks(_replicas, 4, tmp_path, timeout=120)
    with pytest.raises(ValueError, match="replica must be an integer"):
        PlanningLoader([], _config(1), lookahead=0, replica=2, replicas=2)


# ---------------------------------------------------------------------- one process
def test_loader_arguments_and_items():
    with pytest.raises(ValueError, match="lookahead"):
        PlanningLoader([], _config(1), lookahead=-1)
    with pytest.raises(ValueError, match="topology has 2 ranks"):
        PlanningLoader([], _config(2), rank=0, world_size=1)
    with pytest.raises(ValueError, match="planner"):
        PlanningConfig(2, planner="nope")
    inline = PlanningLoader([(_batch(0), None), 3], _config(1), lookahead=0)
    assert next(inline).step == 0
    with pytest.raises(TypeError, match="batch_of"):
        next(inline)
    assert _config(2).digest(_batch(0)) != _config(2, block_size=32).digest(_batch(0))
    assert _config(2).digest(_batch(0)) != _config(2).digest(_batch(1))


class _StartingPool(PlanningPool):
    """A pool that counts the batches submitted to it; ``cold`` keeps it starting for ever."""

    def __init__(self, cold: bool):
        super().__init__(1)
        self.jobs = 0
        if cold:
            self._warmups = [cf.Future()]  # a warm-up that never ends: its workers never ready

    def submit(self, fn, *args, **kwargs):
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("cold", [True, False])
def test_a_pool_still_starting_leaves_the_steps_to_the_loaders_thread(cold):
    """While the pool's workers start (importing torch takes seconds), the loader's own thread plans
    each step (step 0 does not wait for them): the same plans; once warm, the workers plan."""
    ref = [torch_dcp.plan(_batch(s), 1, planner="dcp", block_size=16, divisions=2).digest() for s in range(4)]
    pool = _StartingPool(cold)
    try:
        assert pool.warm() is not cold
        with PlanningLoader(_source(4), _config(1), pool=pool, timeout=60) as loader:
            assert [pb.plan.digest() for pb in loader] == ref
        assert pool.jobs == (0 if cold else 4)
    finally:
        pool.shutdown(cancel_futures=True)


def test_a_planning_pool_warms_up_within_a_bounded_time():
    pool = planning_pool(1, _config(1))
    try:
        assert isinstance(pool, PlanningPool)
        cf.wait(pool._warmups, timeout=120)
        assert pool.warm()
    finally:
        pool.shutdown(cancel_futures=True)
