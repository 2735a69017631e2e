"""How many steps per second the planning loader sustains, against the rate it must keep up with.

    python -m torch_dcp.benchmarks loader                     # 131,072-token long-tail batches, 4 x 8 ranks, dcp, B=2048
    python -m torch_dcp.benchmarks loader --batch corpus --block-size 1024 --workers 2

Every rank of the DCP group is simulated in this process: one
:class:`~torch_dcp.data.PlanningLoader` per rank (``rank=r``, ``world_size=W``), each iterated
in its own thread as fast as it delivers, all sharing one ``HashStore`` and one pool of
``--workers`` planning processes on this machine (on a cluster every rank has its own
workers; here they share this machine's cores). Rank ``i mod W`` plans step ``i`` as in a
real job; every rank fetches, checks and decodes every plan; device plans are not built
(``--device-plans`` builds them, W per step on this one machine).

Printed (JSON): ``steps_per_s`` (steps delivered to every rank per second, after the first
``--warmup`` steps), ``plan_s_mean``/``plan_s_max`` (the planner's own time per step, in a
worker), the rate a W-rank job needs at a ``--step-seconds`` step (``required_steps_per_s`` =
1 / step seconds: each rank's workers must plan one step every ``W x step seconds``), and
``cluster_steps_per_s``: what W ranks with ``--workers`` workers each would sustain at this
machine's per-plan time (``W x workers / plan_s_mean``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", choices=["longtail", "corpus"], default="longtail", help="length source of the batches")
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--planner", default="dcp")
    p.add_argument("--mask", default="causal")
    p.add_argument("--block-size", type=int, default=2048)
    p.add_argument("--divisions", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps not counted in steps_per_s (pipeline fill)")
    p.add_argument("--workers", type=int, default=2, help="planning processes on this machine (all ranks share them)")
    p.add_argument("--lookahead", type=int, default=None, help="steps planned ahead (default: 2 x workers)")
    p.add_argument("--step-seconds", type=float, default=1.0, help="the training step the plans must keep up with")
    p.add_argument("--device-plans", action="store_true", help="also build every rank's device plan (CPU)")
    p.add_argument("--timeout", type=float, default=600.0)


def run(a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from ..batch import BatchSpec
    from ..data import PlanningConfig, PlanningLoader, planning_pool
    from ..topology import Topology
    from .common import MASKS, batch_lengths

    topo = Topology(n_nodes=a.nodes, ranks_per_node=a.ranks_per_node)
    w = topo.world_size
    config = PlanningConfig(topo, planner=a.planner, block_size=a.block_size, divisions=a.divisions)
    batches = [BatchSpec(batch_lengths(a.batch, a.tokens, seed=s), MASKS[a.mask]) for s in range(a.steps)]
    lookahead = a.lookahead if a.lookahead is not None else 2 * a.workers
    store = dist.HashStore()
    pool = planning_pool(a.workers, config)
    for f in [pool.submit(int) for _ in range(a.workers)]:  # workers started (their warm-up plan queued first)
        f.result()
    done: dict[int, list[float]] = {}
    plan_s: list[float] = []
    errors: list[BaseException] = []

    def rank_loop(r: int) -> None:
        try:
            with PlanningLoader(batches, config, rank=r, world_size=w, store=store, lookahead=lookahead,
                                namespace="bench", pool=pool, timeout=a.timeout,
                                device_plans=a.device_plans) as loader:
                stamps = []
                for pb in loader:
                    stamps.append(time.perf_counter())
                    if r == 0:
                        plan_s.append(pb.plan_seconds)
                done[r] = stamps
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.shutdown(cancel_futures=True)
    if errors:
        raise errors[0]
    # a step counts when every rank has it
    step_done = [max(done[r][s] for r in range(w)) for s in range(a.steps)]
    k = min(a.warmup, a.steps - 2)
    rate = (a.steps - 1 - k) / (step_done[-1] - step_done[k])
    mean = sum(plan_s) / len(plan_s)
    out = {"ranks": w, "topology": f"{a.nodes}x{a.ranks_per_node}", "tokens": a.tokens, "batch": a.batch,
           "planner": a.planner, "block_size": a.block_size, "workers": a.workers, "lookahead": lookahead,
           "steps": a.steps, "wall_s": round(step_done[-1] - t0, 2), "steps_per_s": round(rate, 3),
           "plan_s_mean": round(mean, 3), "plan_s_max": round(max(plan_s), 3),
           "required_steps_per_s": round(1.0 / a.step_seconds, 3),
           "per_rank_budget_s": round(w * a.step_seconds, 1),
           "cluster_steps_per_s": round(w * a.workers / mean, 1)}
    print(json.dumps(out), flush=True)
    print(f"loader: {rate:.2f} steps/s sustained on this machine ({a.workers} workers for all {w} ranks), "
          f"{out['required_steps_per_s']} needed at a {a.step_seconds:g} s step; planning {mean:.3f} s/step "
          f"(max {out['plan_s_max']:.3f}) against a budget of {out['per_rank_budget_s']:g} s per rank's step",
          flush=True)
    return out
