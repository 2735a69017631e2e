"""torch_dcp.shutdown(): gloo ranks that exchanged messages through torch_dcp leave nothing of
their process groups for the interpreter's exit, and every rank's process exits 0.

The ranks are plain processes, started by this file run as a script. They do not use
``tests/spawn.py``, whose ranks leave with ``exit_process`` when the teardown reports
leftovers. Each rank runs ``torch_dcp.context_parallel`` forward and backward for two masks,
checked against the float64 reference, and a raw ``TorchDistributedTransport`` exchange with
every peer. It then drops its mesh and context and calls ``torch_dcp.shutdown()``. The
teardown must report nothing left: no process group still referenced, no gloo thread, no
other Python thread. The rank then leaves through the interpreter's ordinary exit, which is
where a surviving gloo group aborts. Every wait is bounded: the ranks' process-group and
shutdown timeouts, and the parent's deadline (it kills the ranks when the deadline passes).

The natural ending (no ``torch_dcp.shutdown()``): ranks written as a user's script, whose
mesh, context and outputs stay in module globals, end with ``dist.destroy_process_group()``
as PyTorch documents. ``torch_dcp.teardown.release_at_exit`` (registered by the context) must
leave no gloo thread for the interpreter's finalization, checked by an ``atexit`` handler that
runs after it, and every rank must exit 0.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORLD = 3
ROUNDS = 1  # launches of WORLD fresh processes (the abort this guards against happens at process exit; the
# main job's, the torchtitan recipe's and every spawned test's ranks exit the same way)
DEADLINE_S = 240.0  # all rounds together: a bound on a hang, not a speed target (a round takes 45 s on 2 loaded cores)


def _launch(mode: str, world: int, tmp: Path, deadline: float) -> list[tuple[int, str]]:
    """Start ``world`` ranks of this file in ``mode``; wait for them until ``deadline``
    (monotonic), killing them all when it passes. Returns (exit code, output) per rank."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, mode, str(rank), str(world), str(tmp)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail("ranks still running at the deadline (killed): a wait is not bounded\n" + "\n".join(outs))
    return results


def test_ranks_exit_0_after_p2p_through_torch_dcp_and_shutdown(tmp_path):
    deadline = time.monotonic() + DEADLINE_S
    for r in range(ROUNDS):
        run = tmp_path / f"round{r}"
        run.mkdir()
        results = _launch("p2p", WORLD, run, deadline)
        for rank, (code, out) in enumerate(results):
            assert code == 0, f"round {r} rank {rank}: exit code {code}\n{out}"
            assert "teardown clean" in out, f"round {r} rank {rank}:\n{out}"


NATURAL_ROUNDS = 2  # the abort was 1 run in 10 before release_at_exit; each round is WORLD fresh processes


def test_ranks_ending_with_destroy_process_group_exit_0(tmp_path):
    deadline = time.monotonic() + DEADLINE_S
    for r in range(NATURAL_ROUNDS):
        run = tmp_path / f"round{r}"
        run.mkdir()
        for rank, (code, out) in enumerate(_launch("natural", WORLD, run, deadline)):
            assert code == 0, f"round {r} rank {rank}: exit code {code}\n{out}"
            assert "exit clean" in out, f"round {r} rank {rank}:\n{out}"


def test_a_rank_late_for_the_teardown_gives_a_bounded_timeout(tmp_path):
    results = _launch("late", 2, tmp_path, time.monotonic() + DEADLINE_S)
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank}: exit code {code}\n{out}"
        assert "teardown clean" in out, f"rank {rank}:\n{out}"


def test_shutdown_refuses_inside_a_context_and_bad_timeouts(monkeypatch):
    import torch_dcp
    from torch_dcp import context

    with pytest.raises(ValueError, match="timeout"):
        torch_dcp.shutdown(timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        torch_dcp.shutdown(timeout="10")
    monkeypatch.setattr(context, "_active", object())
    with pytest.raises(RuntimeError, match="inside torch_dcp.context_parallel"):
        torch_dcp.shutdown()


def test_exit_process_checks_its_code():
    from torch_dcp.teardown import exit_process

    for bad in (-1, 256, 1.0, None, True):
        with pytest.raises(ValueError, match="code"):
            exit_process(bad)


# ------------------------------------------------------------------------------ the ranks
def _exchange(rank: int, world: int) -> None:
    """context_parallel forward and backward for two masks (exact against the reference),
    then one raw transport exchange with every peer."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import torch_dcp
    from reference import context_step_errors, random_qkv, reference_with_grads
    from torch_dcp.executor import TorchDistributedTransport

    mesh = init_device_mesh("cpu", (world,))
    for mask in (torch_dcp.Causal(), torch_dcp.Lambda(sink=3, window=9)):
        batch = torch_dcp.BatchSpec([1, 19, 45, 6, 33], mask, n_heads=4, n_kv_heads=2, head_dim=16, dtype="float32")
        q, k, v, go = random_qkv(batch, torch.float32, seed=3)
        ref = reference_with_grads(batch, q, k, v, go)
        errors = context_step_errors(mesh, batch, rank, q, k, v, go, ref, block_size=8, timeout=30)
        for what, err in errors.items():
            assert err <= 1e-5, f"{type(mask).__name__} {what}: error {err:.2e}"
    transport = TorchDistributedTransport(None, timeout=30)
    peers = [p for p in range(world) if p != rank]
    sends = [(p, 1, torch.full((1000 + 10 * p,), rank, dtype=torch.uint8)) for p in peers]
    recvs = [(p, 1, torch.empty(1000 + 10 * rank, dtype=torch.uint8)) for p in peers]
    for _ in transport.wait(transport.launch(0, sends, recvs)):
        pass
    assert all(bool((buf == p).all()) for p, _, buf in recvs)


def _teardown_clean(rank: int, left: list[str]) -> None:
    """What the teardown must leave: nothing, and no default argument holding a group."""
    import torch.distributed as dist

    from torch_dcp.teardown import GLOO_THREADS, native_threads

    assert left == [], f"rank {rank}: torch_dcp.shutdown() left {left}"
    assert not dist.is_initialized()
    assert not [n for n in native_threads() if n in GLOO_THREADS]
    fn = sys.modules.get("torch.distributed.nn.functional")
    if fn is not None:  # imported after init_process_group (by torch._dynamo): its defaults captured the group
        assert not any(isinstance(d, dist.ProcessGroup) for d in fn.all_reduce.__defaults__)
    print(f"rank {rank}: teardown clean", flush=True)


mesh = ctx = out = None  # the natural ranks' script globals: alive until the interpreter finalizes


def _natural_main(rank: int, world: int, tmp: str) -> None:
    """A user's script: context_parallel forward and backward, checked against the reference,
    the mesh, context and outputs kept in module globals, ``dist.destroy_process_group()`` at
    the end and no ``torch_dcp.shutdown()``."""
    global mesh, ctx, out
    import atexit

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import torch_dcp
    from reference import random_qkv, reference_with_grads
    from torch_dcp.teardown import GLOO_THREADS, native_threads

    def exit_check() -> None:  # registered before torch_dcp's release_at_exit, so it runs after it
        gloo = [n for n in native_threads() if n in GLOO_THREADS]
        print(f"rank {rank}: exit check: gloo threads {gloo}" if gloo else f"rank {rank}: exit clean", flush=True)

    atexit.register(exit_check)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    batch = torch_dcp.BatchSpec([1, 19, 45, 6, 33], torch_dcp.Causal(), n_heads=4, n_kv_heads=2, head_dim=16,
                                dtype="float32")
    q, k, v, go = random_qkv(batch, torch.float32, seed=3)
    ref = reference_with_grads(batch, q, k, v, go)
    qb, kb, vb, gb = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, go))
    with torch_dcp.context_parallel(mesh, buffers=[qb, kb, vb, gb], buffer_seq_dims=[2, 2, 2, 2], batch=batch,
                                    block_size=8, timeout=30) as ctx:
        ql, kl, vl = (t.clone().requires_grad_(True) for t in (qb, kb, vb))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
        out.backward(gb)
    idx = torch.from_numpy(ctx.plan.token_indices(rank))
    for what, got, want in (("out", out, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2])):
        err = (got.detach()[0].transpose(0, 1).double() - want[idx]).abs().max().item() if len(idx) else 0.0
        assert err <= 1e-5, f"{what}: error {err:.2e}"
    dist.destroy_process_group()


def _rank_main(mode: str, rank: int, world: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    import torch_dcp
    from torch_dcp.executor import TransferTimeoutError
    from torch_dcp.teardown import leftovers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    _exchange(rank, world)
    marker = Path(tmp) / "rank0_gave_up"
    if mode == "p2p":
        _teardown_clean(rank, torch_dcp.shutdown(timeout=30))
    elif rank == 0:  # "late": rank 1 reaches its teardown only after rank 0's barrier expired
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="did not complete within 2 s"):
            torch_dcp.shutdown(timeout=2)
        assert time.monotonic() - t0 < 45, "the barrier's timeout did not bound the teardown"
        _teardown_clean(rank, leftovers())
        marker.touch()
    else:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert time.monotonic() < deadline, "rank 0 never gave up its barrier"
            time.sleep(0.05)
        _teardown_clean(rank, torch_dcp.shutdown(barrier=False))


if __name__ == "__main__":
    if sys.argv[1] == "natural":
        _natural_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
