"""The entry point from a batch to a plan."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from .batch import BatchSpec
from .plan import Plan
from .plan.heads import HeadLayout, HeadParallelPlan, head_parallel_sizes
from .planners import CANDIDATES, HEAD_PLANNERS, Placement, Routing, Runtime, get_planner
from .planners.dcp import DEFAULT_RIVALS, EPS_MEMORY
from .schedule import assign_divisions, mixes_nodes
from .topology import Topology
from .workload import check_block_size

if TYPE_CHECKING:  # pragma: no cover
    from .cost import CostModel

__all__ = ["plan", "divide", "auto_block_sizes", "DEFAULT_DIVISIONS", "DEFAULT_PLANNER", "AUTO_BLOCK_SIZES",
           "SPARSE_BLOCK_SIZE", "SPARSE_DENSITY"]

#: the planner of :func:`plan` and :func:`torch_dcp.context_parallel` when none is named, as every
#: integration's (the planning loader, torchtitan, the Hugging Face trainers, the main job)
DEFAULT_PLANNER = "dcp"

#: divisions per rank when ``divisions=None`` (the DCP paper's T = 4), fewer for batches with fewer tiles
DEFAULT_DIVISIONS = 4
#: share of every rank's local compute the alternative schedule of a timed plan runs last
#: (:func:`torch_dcp.schedule.assign_divisions`); 0.25 beat 0.1 on most batches where it wins
LOCAL_TAIL = 0.25
#: divisions the node-first alternative adds to the chosen plan's (when ``divisions`` is left to
#: ``plan``): on the paper's 8 causal batches over 4 x 8 A100s, node first was up to 19 % faster
#: at T = 6 than at T = 4 on dcp's chosen placement (never slower; one more simulation at T = 4
#: as well would cost some 5 % more planning time at 131K tokens / 32 ranks, for a few
#: blockwise batches where T = 4 wins)
NODE_FIRST_EXTRA_DIVISIONS = 2
#: plans on torch_dcp's executor after the fastest whose local tail is timed too: a placement
#: whose first schedule is slower can win with its tail (H100 4 x 8 shared-question, long-tail
#: batch at scale 2: the bytes objective's at N = 8, third by its first schedule, 2.39 -> 2.16
#: ms with its tail, 4 % faster than the fastest's schedules); the next two took every such win
#: on the paper's batches there; only those within :data:`TAIL_WITHIN` of the fastest time so far
#: (a local tail was at most 14 % faster than its plan's first schedule on the paper's batches)
TAIL_RUNNERS = 2
TAIL_WITHIN = 1.2
#: fewer divisions the chosen plan is also timed with (when ``divisions`` is left to ``plan``):
#: on a GPU every division costs the executor its fixed costs per launch
#: (:data:`~torch_dcp.cost.GPU_EXECUTOR`), more than the overlap buys where the attention is a
#: fraction of a millisecond (sparse masks on H100s)
FEWER_DIVISIONS = (1, 2)
#: dcp's own placements timed at every head parallelism N > 1 (the best by its estimate; the
#: rivals and the bytes objective's choice follow, as at N = 1, where all are timed): on the
#: paper's batches (4 x 8 and 1 x 8, A100 and H100, GQA 8/2 and 32/8, causal and lambda) the
#: fastest plan so found was within 1 % of timing them all, for about half the planning time
HEAD_PARALLEL_SHORTLIST = 8
#: candidates simulated, the best by :func:`torch_dcp.sim.estimate.estimate_seconds` (the rivals'
#: plans at N = 1, the bytes objective's and HCP's are simulated too, :func:`_rival`): on the
#: paper's 32 batches (4 x 8 and 1 x 8, A100 and H100, GQA 8/2 and 32/8, corpus and long-tail,
#: causal and lambda) the best of the four was within 0.3 % of simulating them all, of the
#: three within 3.0 % (``python -m torch_dcp.benchmarks scale --calibrate``); simulating the
#: rivals' plans at every N as well found the same plan on 59 paper batches (scales 0.5 to 4,
#: all four masks), for twice the simulations
SIMULATED = 4
#: the block sizes ``block_size="auto"`` plans with, the first kept on a tie
AUTO_BLOCK_SIZES = (1024, 2048, 512)
#: and, for a sparse mask, this one too: tiles that follow a sparse mask's structure waste less of
#: each block's edges (on the paper's blockwise batches, 4 x 8 A100s, the best of the four took
#: 0.72x the time of the best of the others, median; on causal batches 256-token blocks planned
#: 10-20 s and never won)
SPARSE_BLOCK_SIZE = 256
#: a mask is sparse where its visible (query, key) pairs are at most this fraction of the causal
#: mask's on the same documents
SPARSE_DENSITY = 0.5


#: outer plan parts (world size / N) up to which ``head_parallel="auto"`` runs dcp's full search
#: at every ``N``; above, only at the largest ``N`` (with the fewest-bytes plan at ``N = 1``):
#: at 1M tokens / 256 ranks no candidate at N = 1 came within its floor of the best at N = 8
#: (nor N = 4 within 25 %),
#: and the full search over 256 parts took most of a 67-s plan
#: (``python -m torch_dcp.benchmarks scale``)
FULL_SEARCH_PARTS = 32


def plan(
    batch: BatchSpec,
    topology: Topology | int,
    planner: str = DEFAULT_PLANNER,
    block_size: "int | str | Sequence[int]" = 1024,
    divisions: int | None = None,
    cost_model: "CostModel | str | None" = "auto",
    head_parallel: int | str | None = None,
    **options: Any,
) -> "Plan | HeadParallelPlan":
    """Plan one attention step of ``batch`` on ``topology``.

    Args:
        batch: documents, masks, heads, dtype of the global batch.
        topology: a :class:`Topology`, or a world size (all ranks on one node).
        planner: ``"dcp"`` (default, :data:`DEFAULT_PLANNER`), ``"greedy"``, ``"ring"``, ``"allgather"``, ``"megatron"``,
            ``"fcp"`` (see :mod:`torch_dcp.planners`), or a head-parallel baseline,
            ``"ulysses"`` or ``"hcp"`` (:data:`~torch_dcp.planners.HEAD_PLANNERS`).
        block_size: tokens per block ``B``, an integer in ``1 ..`` :data:`~torch_dcp.batch.MAX_TOKENS`
            (checked for every planner; ``ring`` and ``megatron`` cut chunks of ``L / 2W``
            instead); or, for a planner that offers candidates, several: a list or tuple of them, or
            ``"auto"`` (:func:`auto_block_sizes`), each planned and the fastest plan on the
            simulator kept (the first on a tie; planning times add up; the others' candidates
            listed with ``"(B=...)"``).
        divisions: ``T``, divisions per rank for compute/communication overlap (per
            scheduling round, for planners with rounds): an integer in ``1 .. n_tiles`` (the
            placement's number of tiles; 1 when it has none), or ``None`` (default) for
            ``min(4, n_tiles)`` (at least 1), so that tiny batches plan too (a timed plan may
            then keep a deeper node-first schedule or fewer divisions, and a timed candidate that
            moves no block runs in one, see ``cost_model``).
        cost_model: for planners that offer several candidates (``"dcp"`` with its default
            time objective: its placements, ring attention's and Megatron's plans, see
            :func:`~torch_dcp.planners.dcp.dcp_candidates`, for every head parallelism tried),
            the :class:`~torch_dcp.cost.CostModel` (or ``"auto"``, ``"a100"``, ``"h100"``, JSON
            cost-model paths) whose simulated forward + backward time picks the fastest
            (:func:`torch_dcp.sim.simulate.simulate`); default ``"auto"`` (``None`` too): this
            device's calibrated model, else a shipped preset (:mod:`torch_dcp.cost.auto`; it
            warns where the device was never calibrated). A model with measured links
            (``calibrate`` under ``torchrun``) plans with them in place of the topology's. The
            fastest placement is then also timed with :data:`FEWER_DIVISIONS` (when ``divisions`` is
            ``None``), with its last division running a local tail (:data:`LOCAL_TAIL` of
            every rank's local compute, the remote tiles in the divisions before:
            :func:`~torch_dcp.schedule.assign_divisions`) and, on several nodes, with its
            intra-node tiles first (``node_first``, at ``T +`` :data:`NODE_FIRST_EXTRA_DIVISIONS`
            when ``divisions`` is ``None``, else at ``T``), each kept if faster.
        head_parallel: ``N``, ranks of a head group trading heads by all-to-all
            (:mod:`torch_dcp.plan.heads`): ``N`` must divide ``n_heads`` and the ranks per
            node (or be a multiple of them dividing the world size), and ``N`` and
            ``n_kv_heads`` one the other. ``"auto"`` tries 1 and every valid ``N`` up to the ranks
            per node (head groups inside a node; where the world size over ``N`` exceeds
            :data:`FULL_SEARCH_PARTS`, only the largest ``N`` is searched in full, ``N = 1``
            offers its fewest-bytes plan and the others are skipped) and keeps
            the fastest on the simulator (with ``"dcp"``; at ``N > 1`` its
            :data:`HEAD_PARALLEL_SHORTLIST` best placements by estimate, unless ``shortlist``
            is given); ``None`` (default): ``"auto"`` for
            ``"dcp"`` with its time objective, else 1; not given for ``"ulysses"`` and
            ``"hcp"`` (their own ``N``).
        **options: planner-specific options (e.g. ``eps_compute`` for ``greedy``).

    Returns:
        The :class:`Plan`, or a :class:`~torch_dcp.plan.heads.HeadParallelPlan` where ``N > 1``;
        ``plan.cost_model`` names the model that timed the candidates (its ``source``; empty
        when there was one candidate); ``plan.plan_seconds`` holds the planning time (placement,
        divisions and, where candidates are timed, their simulation); ``plan.candidates`` the ``(planner label,
        simulated seconds)`` of every candidate (NaN for one not simulated because its floor,
        :func:`torch_dcp.sim.floors.floor_seconds`, or its forward plus its backward's floor, lies
        above a faster candidate's time; empty when the planner offers one). Labels of
        head-parallel candidates end in ``/hpN``, those of the winner's other schedules in a
        parenthesis (``"dcp (node first, T=6)"``, ``"dcp (local tail)"``).

    Raises:
        ValueError: unknown planner, a bad topology, a block size that is not an integer in
            ``1 .. MAX_TOKENS``, divisions that are not ``None`` or an integer in
            ``1 .. max(1, n_tiles)`` (the message names the value, the bound and the tiles),
            or a head parallelism that is not ``None``, ``"auto"`` or a valid ``N``.
    """
    topology = Topology.coerce(topology)
    if block_size == "auto" or isinstance(block_size, (tuple, list)):
        return _best_block_size(batch, topology, planner, block_size, divisions, cost_model, head_parallel, options)
    check_block_size(block_size)
    if divisions is not None and (isinstance(divisions, bool) or not isinstance(divisions, (int, np.integer))):
        raise ValueError(f"divisions must be an integer (or None for automatic), got {divisions!r}")
    if planner in HEAD_PLANNERS:
        if head_parallel is not None:
            raise ValueError(f"planner {planner!r} has its own head parallelism; got head_parallel={head_parallel!r}")
        inner, size_of = HEAD_PLANNERS[planner]
        sizes = [size_of(topology)]
        HeadLayout.of(batch, sizes[0]).check_topology(topology)
    else:
        inner = planner
        get_planner(planner)
        sizes = _head_sizes(batch, topology, planner, head_parallel, options)
    cm = None  # only a planner that offers candidates times them (several plans need one: see _head_sizes)
    if inner in CANDIDATES:  # with the model, on its measured links
        from .cost import CostModel

        cm = CostModel.load(cost_model)
        if cm.links is not None and cm.links.world_size == topology.world_size:
            topology = cm.links.apply(topology)
    t0 = time.perf_counter()
    with _collector_paused():
        plans: list[Plan | HeadParallelPlan] = []
        hopeless, statics = ({}, {}) if cm is None else _hopeless_searches(
            batch, topology, inner, sizes, block_size, divisions, planner, options, cm)
        for n in sizes:
            search = _search_at(n, sizes, topology, options)
            if search is not None:
                opts, relabel = search
                if n in statics:  # timed already: not made twice
                    opts = {**opts, "rivals": tuple(r for r in opts.get("rivals", DEFAULT_RIVALS) if r != "static")}
                if n in hopeless:
                    opts = {**opts, "search": False}
                plans += _plans_at(batch, topology, inner, n, block_size, divisions, planner, opts, relabel,
                                   hopeless.get(n)) + statics.get(n, [])
        if cm is not None and "ring" in options.get("rivals", DEFAULT_RIVALS) and any(
                _outer(p).placement.runtime is Runtime.DCP_RING for p in plans):
            from .sim.runtimes import ring_priced_as_executor

            if ring_priced_as_executor(cm):  # the same layout as the ring rival, priced the same: not timed twice
                plans = [p for p in plans if _outer(p).placement.runtime is not Runtime.DCP_RING] or plans
        timed: list[tuple[str, float]] = []
        if len(plans) > 1:
            chosen, timed = _fastest(plans, cm, SIMULATED, deeper=divisions is None)
            source = cm.source
        else:
            chosen, source = plans[0], ""
    chosen.plan_seconds = time.perf_counter() - t0
    if cm is None and cost_model not in (None, "auto"):  # named by the caller: simulate() times with it too
        from .cost import CostModel

        cm = CostModel.load(cost_model)
        source = cm.source
    chosen.cost_model = source
    if isinstance(chosen, HeadParallelPlan):  # serialised with the outer plan
        chosen.outer.cost_model = source
    chosen.cost_model_object = cm  # what simulate(plan) times with (torch_dcp.sim.simulate.model_of)
    chosen.candidates = timed
    looser = float(options.get("eps_memory", EPS_MEMORY)) > EPS_MEMORY
    if cm is not None and looser and options.get("objective", "time") == "time":
        chosen = _no_slower_than_tighter(chosen, batch, topology, planner, block_size, divisions, cm, head_parallel,
                                         options)
    return chosen


def auto_block_sizes(batch: BatchSpec) -> tuple[int, ...]:
    """The block sizes ``plan(block_size="auto")`` tries: :data:`AUTO_BLOCK_SIZES`, and
    :data:`SPARSE_BLOCK_SIZE` too where the mask is sparse (its visible pairs, counted on
    1024-token blocks, at most :data:`SPARSE_DENSITY` of the causal mask's on the same documents)."""
    from .workload import Workload

    lens = np.asarray(batch.doc_lens, np.float64)
    causal = float((lens * (lens + 1) / 2).sum())
    visible = float(Workload.uniform(batch, 1024).tile_pairs.sum())
    return AUTO_BLOCK_SIZES + ((SPARSE_BLOCK_SIZE,) if visible <= SPARSE_DENSITY * causal else ())


def _best_block_size(batch: BatchSpec, topology: Topology, planner: str, block_size: Any, divisions: int | None,
                     cost_model: Any, head_parallel: Any, options: dict[str, Any]) -> "Plan | HeadParallelPlan":
    """:func:`plan` at each of several block sizes (``"auto"``: :func:`auto_block_sizes`), the
    fastest on the simulator kept (the first on a tie)."""
    from .cost import CostModel
    from .sim.simulate import simulate

    sizes = auto_block_sizes(batch) if isinstance(block_size, str) else tuple(block_size)
    if not sizes:
        raise ValueError("block_size: an empty sequence of block sizes")
    for b in sizes:
        check_block_size(b)
    if planner not in CANDIDATES or options.get("objective", "time") != "time":
        raise ValueError(f"several block sizes ({block_size!r}) need a planner whose time objective times its "
                         f"candidates ({sorted(CANDIDATES)}), got planner {planner!r} with objective "
                         f"{options.get('objective', 'time')!r}")
    cm = CostModel.load(cost_model)
    best = None
    runs = []
    for b in sizes:
        p = plan(batch, topology, planner=planner, block_size=int(b), divisions=divisions, cost_model=cm,
                 head_parallel=head_parallel, **options)
        t = simulate(p, cm).makespan_s
        runs.append((int(b), p))
        if best is None or t < best[0]:
            best = (t, p)
    chosen = best[1]
    chosen.candidates = [(f"{label} (B={b})", t) for b, p in runs for label, t in p.candidates]
    chosen.plan_seconds = sum(p.plan_seconds for _, p in runs)
    return chosen


def _no_slower_than_tighter(chosen: "Plan | HeadParallelPlan", batch: BatchSpec, topology: Topology, planner: str,
                            block_size: int, divisions: int | None, cm: "CostModel", head_parallel: Any,
                            options: dict[str, Any]) -> "Plan | HeadParallelPlan":
    """A looser memory bound admits every plan the default bound does, but the search follows
    the bound it is given (candidates rebalanced to it, the fewest-bytes one under it): planned
    again at :data:`~torch_dcp.planners.dcp.EPS_MEMORY`, the faster of the two on the simulator is
    kept, so loosening the bound never gives a slower plan than the default. Planning times
    add up; the candidates of the tighter run are listed with ``"(eps_memory 0.1)"``. Only for the
    time objective (the bytes objective keeps the fewest-bytes plan under the bound it is given)."""
    from .sim.simulate import simulate

    tight = plan(batch, topology, planner=planner, block_size=block_size, divisions=divisions, cost_model=cm,
                 head_parallel=head_parallel, **{**options, "eps_memory": EPS_MEMORY})
    keep = tight if simulate(tight, cm).makespan_s < simulate(chosen, cm).makespan_s else chosen
    keep.candidates = list(chosen.candidates) + [(f"{label} (eps_memory {EPS_MEMORY:g})", t)
                                                 for label, t in tight.candidates]
    keep.plan_seconds = chosen.plan_seconds + tight.plan_seconds
    return keep


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while planning (as it was, after): the candidates'
    programs are some 10^5 short-lived objects, whose allocation sets off full collections over
    the whole heap (every module's objects, torch's included; about a tenth of the planning time
    at 131K tokens on 32 ranks), and planning leaves no reference cycles for them to find: all it
    drops is freed by reference counting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _fastest(plans: "list[Plan | HeadParallelPlan]", cm: "CostModel", simulated: int,
             deeper: bool = False) -> "tuple[Plan | HeadParallelPlan, list[tuple[str, float]]]":
    """The fastest of ``plans`` on the simulator, and ``(label, simulated seconds)`` of every
    candidate (NaN: not simulated). Every candidate is estimated
    (:func:`torch_dcp.sim.estimate.estimate_seconds`); the ``simulated`` best by estimate of those
    that are not rivals are simulated, and so are the rivals' plans and the bytes objective's
    (:func:`_rival`), so the plan returned is never slower than theirs; a candidate whose floor
    (:func:`torch_dcp.sim.floors.floor_seconds`) lies above a simulated time is skipped, since
    it cannot win, and so is the backward of one whose forward and backward floor do
    (:func:`torch_dcp.sim.simulate.simulate_within`). The winner is then also timed with other
    schedules of its placement (:func:`_reschedules`; ``deeper``: with more divisions too), or,
    where a static runtime's plan won, the fastest plan on torch_dcp's executor is."""
    from .sim.estimate import estimate_seconds
    from .sim.floors import floor_seconds
    from .sim.simulate import simulate_within

    chosen, best = plans[0], float("inf")

    def consider(p: "Plan | HeadParallelPlan", floor: float) -> float:
        nonlocal chosen, best
        run = simulate_within(p, cm, best) if floor < best else None
        t = run.makespan_s if run is not None else float("nan")
        if t < best:
            chosen, best = p, t
        return t

    floors = [floor_seconds(p, cm) for p in plans]
    estimates = [max(estimate_seconds(p, cm), f) for p, f in zip(plans, floors)]  # no run beats its floor
    times = [float("nan")] * len(plans)
    # best estimate first (a tie keeps the earlier); the protected ones after the shortlist
    order = sorted(range(len(plans)), key=estimates.__getitem__)
    widest = max(_head_parallel(p) for p in plans)
    own = 0  # the shortlist counts dcp's own placements: the rivals are simulated anyway
    for i in order:
        if _rival(plans[i], widest):
            times[i] = consider(plans[i], floors[i])
        elif own < simulated:
            own += 1
            times[i] = consider(plans[i], floors[i])
    timed = [(p.planner, t) for p, t in zip(plans, times)]
    # other schedules of the fastest plan on torch_dcp's executor (by simulated time, else by
    # estimate): a static runtime's plan may beat its first schedule but not its others
    on_executor = [i for i, p in enumerate(plans) if _outer(p).placement.runtime is Runtime.EXECUTOR]
    if on_executor:
        ranked = sorted(on_executor, key=lambda i: (times[i] if times[i] == times[i] else float("inf"), estimates[i]))
        base = plans[ranked[0]]
        for name, other in _reschedules(base, deeper):
            timed.append((f"{base.planner} ({name})", consider(other, floor_seconds(other, cm))))
        # the local tail of the next fastest simulated ones too (:data:`TAIL_RUNNERS`)
        for i in ranked[1:1 + TAIL_RUNNERS]:
            if not times[i] < TAIL_WITHIN * best:  # not simulated (NaN), or too slow to win
                continue
            tail = _local_tail(plans[i])
            if tail is not None:
                timed.append((f"{plans[i].planner} (runner-up, local tail)", consider(tail, floor_seconds(tail, cm))))
    return chosen, timed


def _outer(p: "Plan | HeadParallelPlan") -> Plan:
    return p.outer if isinstance(p, HeadParallelPlan) else p


def _head_parallel(p: "Plan | HeadParallelPlan") -> int:
    return p.head_parallel if isinstance(p, HeadParallelPlan) else 1


def _rival(p: "Plan | HeadParallelPlan", widest: int) -> bool:
    """Whether ``p`` is a rival's plan that :func:`_fastest` always simulates: at ``N = 1``
    every labelled one (``"dcp:ring"``, ``"dcp:allgather"``, ``"dcp:megatron"``,
    ``"dcp:documents"``, ``"dcp:bytes"``), all-gather CP on its runtime at every ``N``
    (``"dcp:allgather/cpC"``, a closed form), and at the widest head parallelism tried ring
    attention (HCP; Ulysses on one node) and whole documents per head group (Ulysses at that CP
    size with data parallelism across the groups). The rivals' plans at the other ``N`` compete
    by estimate like dcp's own."""
    n = _head_parallel(p)
    widest_rival = p.planner.startswith(("dcp:ring", "dcp:documents"))
    # all-gather CP's configurations, a closed form: simulated at every N (a placement run alone
    # competes by its estimate, which is its simulated time)
    static = _outer(p).placement.runtime.gathers and p.planner.startswith("dcp:allgather/cp")
    return ":" in p.planner and (n == 1 or static or (n == widest and widest_rival))


def _head_sizes(batch: BatchSpec, topology: Topology, planner: str, head_parallel: Any,
                options: dict[str, Any]) -> list[int]:
    """The head parallelisms ``plan`` tries (see its ``head_parallel``)."""
    if head_parallel is None:  # dcp's time objective chooses; a planner with one plan: no head parallelism
        head_parallel = "auto" if planner in CANDIDATES and options.get("objective", "time") == "time" else 1
    if head_parallel == "auto":
        if planner not in CANDIDATES:
            raise ValueError(f"head_parallel='auto' needs a planner that offers candidates ({sorted(CANDIDATES)}), "
                             f"got {planner!r}")
        # head groups inside a node: an all-to-all across nodes was never the fastest on the
        # paper's batches (N = 16, 32 on 4 x 8: 1.17-6.8x the best), and costs planning time
        return [1] + [n for n in head_parallel_sizes(batch, topology) if n <= topology.ranks_per_node]
    if isinstance(head_parallel, str):
        raise ValueError(f"head_parallel must be None, 'auto' or a positive integer, got {head_parallel!r}")
    layout = HeadLayout.of(batch, head_parallel)  # raises for a non-integer or a bad N
    layout.check_topology(topology)
    return [layout.size]


def _search_at(n: int, sizes: list[int], topology: Topology,
               options: dict[str, Any]) -> "tuple[dict[str, Any], str | None] | None":
    """The planner options for head parallelism ``n`` among the ``sizes`` tried, and a label
    for its placements (None: their own), or None to skip it. Every ``N`` gets the full search while its outer plan has at most
    :data:`FULL_SEARCH_PARTS` parts. Above that, only the largest ``N`` does; ``N = 1`` offers
    its fewest-bytes plan alone (labelled ``"dcp:bytes"``, always simulated, so the plan is
    never slower than it), and the other ``N`` are skipped."""
    if len(sizes) == 1 or topology.world_size // n <= FULL_SEARCH_PARTS or n == max(sizes):
        return options, None
    if n == 1:
        return {**options, "objective": "bytes"}, "dcp:bytes"
    return None


def _hopeless_searches(batch: BatchSpec, topology: Topology, planner: str, sizes: list[int], block_size: int,
                       divisions: int | None, label: str, options: dict[str, Any], cm: "CostModel"
                       ) -> "tuple[dict[int, int], dict[int, list[Plan | HeadParallelPlan]]]":
    """The head parallelisms ``N`` (among ``sizes``) at which no placement of dcp's own can win,
    each with the number of tiles of its blocks (what ``divisions`` is checked against), so
    :func:`plan` skips its search there (``search=False``: the rivals alone): where some
    static runtime's plan (all-gather CP as its authors run it, a candidate at any ``N``, its
    time in closed form) simulates faster than
    :func:`~torch_dcp.sim.floors.search_floor_seconds` of the ``N``'s blocks, which no placement
    of them on torch_dcp's executor beats. Also the static runtimes' plans made for it, by ``N``
    (the candidates :func:`plan` adds rather than making them again). Both empty unless
    ``planner`` is ``"dcp"`` with its time objective and the static rival."""
    from .sim.floors import search_floor_seconds
    from .sim.simulate import simulate_within
    from .workload import Workload

    if planner != "dcp" or options.get("objective", "time") != "time" or "static" not in options.get(
            "rivals", DEFAULT_RIVALS):
        return {}, {}
    best = float("inf")
    blocks, statics = {}, {}
    for n in sizes:
        search = _search_at(n, sizes, topology, options)
        if search is None or search[0].get("objective", "time") != "time":
            continue
        opts, relabel = search
        blocks[n] = Workload.uniform(HeadLayout.of(batch, n).outer_batch(batch), block_size)
        statics[n] = _plans_at(batch, topology, planner, n, block_size, divisions, label,
                               {**opts, "search": False, "rivals": ("static",)}, relabel, blocks[n].n_tiles)
        for p in statics[n]:
            if not _outer(p).placement.runtime.gathers:  # the ring's timeline: simulated later, if at all
                continue
            run = simulate_within(p, cm, best)
            if run is not None:
                best = min(best, run.makespan_s)
    hopeless = {}
    for n, wl in blocks.items():
        if search_floor_seconds(wl, topology.world_size // n, cm) >= best:
            hopeless[n] = wl.n_tiles
    return hopeless, statics


def _plans_at(batch: BatchSpec, topology: Topology, planner: str, n: int, block_size: int, divisions: int | None,
              label: str, options: dict[str, Any], relabel: str | None = None,
              n_tiles: int | None = None) -> "list[Plan | HeadParallelPlan]":
    """The divided candidates of ``planner`` with head parallelism ``n`` (wrapped when ``n > 1``;
    their placements labelled ``relabel`` where given); ``divisions`` is checked against
    ``n_tiles``, by default the tiles of the first placement (the planner's own)."""
    layout = HeadLayout.of(batch, n)
    ob, ot = layout.outer_batch(batch), layout.outer_topology(topology)
    offer = CANDIDATES.get(planner)
    if offer and n > 1 and "shortlist" not in options:
        options = {**options, "shortlist": HEAD_PARALLEL_SHORTLIST}
    if planner == "dcp" and n > 1 and "contiguous_ranks" not in options:
        options = {**options, "contiguous_ranks": True}  # no Mt-KaHyPar call per node (see dcp_candidates)
    placements = offer(ob, ot, block_size, **options) if offer else [get_planner(planner)(ob, ot, block_size, **options)]
    if not placements:  # a search skipped, and no rival within its bounds
        return []
    if relabel:
        placements = [dataclasses.replace(p, planner=relabel) for p in placements]
    if offer:  # a candidate that moves nothing runs alone: one attention call per rank and pass
        placements = [p.alone() or p for p in placements]
    n_tiles = placements[0].workload.n_tiles if n_tiles is None else n_tiles
    bound = max(1, n_tiles)  # a batch with no tiles still runs as one (empty) division
    auto = divisions is None
    if divisions is None:
        divisions = min(DEFAULT_DIVISIONS, bound)
    elif not 1 <= divisions <= bound:
        raise ValueError(f"divisions must lie in 1..{bound} (the number of tiles of the {planner} placement of this "
                         f"batch: {n_tiles}), got {divisions}")
    # a candidate that moves nothing runs in one division when the caller left them to us (the
    # divisions only overlap transfers with compute; each costs the executor its fixed costs)
    plans = [divide(p, ot, 1 if auto and offer and not _moves_blocks(p) else int(divisions)) for p in placements]
    if n == 1:
        return plans
    name = (lambda p: label) if label in HEAD_PLANNERS else (lambda p: f"{p.planner}/hp{n}")
    return [HeadParallelPlan(p, batch, topology, n, name(p)) for p in plans]


def _moves_blocks(p: Placement) -> bool:
    """Whether some tile of ``p`` runs away from its query's or its key/value block's home."""
    wl, home = p.workload, p.block_rank
    return bool(np.any(home[wl.tile_q] != p.tile_rank) or np.any(home[wl.tile_kv] != p.tile_rank))


def _routed(p: Plan, routing: Routing) -> Plan:
    """``p`` with the same placement and divisions on other routes."""
    return Plan(dataclasses.replace(p.placement, routing=routing), p.topology, p.tile_division, p.divisions)


def _reschedules(chosen: "Plan | HeadParallelPlan", deeper: bool) -> "list[tuple[str, Plan | HeadParallelPlan]]":
    """Other schedules of ``chosen``'s placement, ``(label, plan)``: if ``deeper`` (the caller
    left the divisions to :func:`plan`), fewer divisions (:data:`FEWER_DIVISIONS`: each division
    costs the executor its fixed costs, which can outweigh the overlap it buys); intra-node
    tiles first (on several nodes, where some rank has both intra- and inter-node tiles; at
    ``T +`` :data:`NODE_FIRST_EXTRA_DIVISIONS` if ``deeper`` and the placement has the tiles,
    else at its ``T``), then a local tail (:data:`LOCAL_TAIL`). Empty where the placement has no
    such variant (ring attention's own steps; node first and local tail need 3 divisions per
    round). On ``Routing.RAILS`` (dcp's default on several nodes), each of them and ``chosen``
    itself on ``Routing.NODE`` too, and the other way round, where nodes have several ranks (with
    one, e.g. a head-parallel plan's outer plan across nodes, the two route alike)."""
    outer = _outer(chosen)
    pl, topo = outer.placement, outer.topology
    per_round = _per_round(outer)
    if pl.routing is Routing.RING or pl.runtime is not Runtime.EXECUTOR:  # its own steps, or none
        return []
    variants: list[tuple[str, Plan]] = [(f"T={t}", divide(pl, topo, t)) for t in FEWER_DIVISIONS
                                        if deeper and t < per_round]
    if per_round >= 3:
        if mixes_nodes(pl, topo):
            t = per_round + NODE_FIRST_EXTRA_DIVISIONS
            t = t if deeper and t <= pl.workload.n_tiles else per_round
            variants.append((f"node first, T={t}", divide(pl, topo, t, node_first=True)))
        variants.append(("local tail", _local_tail(outer)))
    if pl.routing in (Routing.NODE, Routing.RAILS) and topo.ranks_per_node > 1:  # each on the other node-once routes
        other = Routing.NODE if pl.routing is Routing.RAILS else Routing.RAILS
        variants += [(f"{name}, {other.value}" if name else other.value, _routed(p, other))
                     for name, p in [("", outer), *variants]]
    if isinstance(chosen, HeadParallelPlan):
        return [(name, HeadParallelPlan(p, chosen.batch, chosen.topology, chosen.head_parallel, chosen.label,
                                        chosen.keep_sharded)) for name, p in variants]
    return variants


def _per_round(plan: Plan) -> int:
    """``plan``'s divisions per scheduling round (all of them without rounds)."""
    rounds = plan.placement.tile_round
    return plan.divisions // (1 if rounds is None or rounds.size == 0 else int(rounds.max()) + 1)


def _local_tail(p: "Plan | HeadParallelPlan") -> "Plan | HeadParallelPlan | None":
    """``p``'s placement divided as ``p`` with a local tail (:data:`LOCAL_TAIL`), wrapped as ``p``
    is; None where it has none (ring attention's own steps, a static runtime, fewer than 3
    divisions per round)."""
    outer = _outer(p)
    pl, per_round = outer.placement, _per_round(outer)
    if pl.routing is Routing.RING or pl.runtime is not Runtime.EXECUTOR or per_round < 3:
        return None
    tail = divide(pl, outer.topology, per_round, local_tail=LOCAL_TAIL)
    if isinstance(p, HeadParallelPlan):
        return HeadParallelPlan(tail, p.batch, p.topology, p.head_parallel, p.label, p.keep_sharded)
    return tail


def divide(placement: Placement, topology: Topology, divisions: int, local_tail: float = 0.0,
           node_first: bool = False) -> Plan:
    """The plan of ``placement`` with ``divisions`` per rank (ring attention: its own steps;
    ``local_tail`` and ``node_first``: see :func:`~torch_dcp.schedule.assign_divisions`), as
    :func:`plan` builds every candidate it times.

    Raises:
        ValueError: ``divisions`` is not a positive integer or ``local_tail`` lies outside ``[0, 1)``.
    """
    if placement.routing is Routing.RING:  # ring attention's own steps, whatever divisions asks
        tile_division, n_div = placement.ring_steps()
    else:
        tile_division = assign_divisions(placement, divisions, topology, local_tail, node_first)
        rounds = placement.tile_round
        n_div = divisions * (1 if rounds is None or rounds.size == 0 else int(rounds.max()) + 1)
    return Plan(placement, topology, tile_division, n_div)
