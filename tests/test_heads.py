"""Head parallelism: layouts, the ulysses and hcp baselines, head-parallel dcp plans, their
all-to-all bytes, simulation and serialisation."""

import dataclasses

import numpy as np
import pytest

import torch_dcp
from torch_dcp.sim.runtimes import on_executor
from torch_dcp import BatchSpec, Causal, Lambda, Topology
from torch_dcp.cost import CostModel
from torch_dcp.plan import Plan, PlanError
from torch_dcp.plan.heads import HeadLayout, HeadParallelPlan, head_parallel_sizes
from torch_dcp.planners.base import Runtime
from torch_dcp.sim.floors import floor_seconds
from torch_dcp.sim.simulate import simulate


def _batch(h=8, hkv=2, mask=None, lens=(700, 57, 3000, 12, 420, 1500)):
    return BatchSpec(list(lens), mask or Causal(), n_heads=h, n_kv_heads=hkv, head_dim=64, dtype="bfloat16")


def test_layout_rules_and_errors():
    lay = HeadLayout(4, 8, 2)
    assert (lay.q_heads, lay.kv_heads, lay.kv_replicas) == (2, 1, 2)
    assert [lay.kv_head_slice(i) for i in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    assert [lay.q_head_slice(i) for i in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    # every query head's key/value head is the one its rank holds (GQA groups of H / H_kv)
    for i in range(4):
        for h in range(8)[lay.q_head_slice(i)]:
            assert h // (8 // 2) in range(2)[lay.kv_head_slice(i)]
    lay2 = HeadLayout(2, 8, 4)
    assert (lay2.kv_heads, lay2.kv_replicas, lay2.kv_head_slice(1)) == (2, 1, slice(2, 4))
    with pytest.raises(ValueError, match="must divide the batch's n_heads=8"):
        HeadLayout(3, 8, 2)
    with pytest.raises(ValueError, match="one must divide the other"):
        HeadLayout(4, 12, 6)
    with pytest.raises(ValueError, match="positive integer"):
        HeadLayout(0, 8, 2)
    with pytest.raises(ValueError, match="ranks per node"):
        HeadLayout(4, 8, 2).check_topology(Topology(n_nodes=3, ranks_per_node=2))
    assert head_parallel_sizes(_batch(), Topology(n_nodes=4, ranks_per_node=8)) == [2, 4, 8]
    assert head_parallel_sizes(_batch(32, 8), Topology(n_nodes=4, ranks_per_node=8)) == [2, 4, 8, 16, 32]
    assert not hasattr(torch_dcp.plan(_batch(), 4, planner="greedy", block_size=512), "head_parallel")  # N = 1
    assert not hasattr(torch_dcp.plan(_batch(), 4, planner="dcp", block_size=512, objective="bytes"), "head_parallel")
    auto = torch_dcp.plan(_batch(), 4, planner="dcp", block_size=512)  # dcp's time objective: auto
    assert any("/hp" in label for label, _ in auto.candidates) and any("/hp" not in label for label, _ in auto.candidates)


def test_outer_topology_gives_each_group_one_rank_share_of_the_network():
    for preset in ("a100", "h100"):
        topo = Topology.preset(preset)
        per_rank = topo.inter_bandwidth / topo.ranks_per_node
        for n in (2, 4, 8, 16):
            ot = HeadLayout(n, 16, 16).outer_topology(topo)
            assert ot.world_size == topo.world_size // n
            assert ot.rail_bandwidth == pytest.approx(per_rank)
            assert ot.intra_bandwidth == topo.intra_bandwidth
            # groups inside a node keep their node; a group of whole nodes is a node of its own
            assert ot.n_nodes == (topo.n_nodes if n <= 8 else topo.world_size // n)


def test_ranks_hold_contiguous_chunks_covering_every_token_once():
    b = _batch()
    p = torch_dcp.plan(b, Topology(n_nodes=2, ranks_per_node=4), planner="dcp", head_parallel=4, block_size=256)
    assert isinstance(p, HeadParallelPlan) and p.head_parallel == 4 and p.outer.world_size == 2
    p.validate()
    for g in range(2):
        group = p.group_tokens(g)
        parts = [p.token_indices(g * 4 + i) for i in range(4)]
        np.testing.assert_array_equal(np.concatenate(parts), group)
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert [p.local_tokens(g * 4 + i) for i in range(4)] == list(map(len, parts))
    with pytest.raises(ValueError, match="outside"):
        p.token_indices(8)


def test_all_to_all_bytes_by_hand():
    # one group of 2 ranks, 2 query heads, 2 KV heads (no replication), bf16 head_dim 64
    b = BatchSpec([10, 7], Causal(), n_heads=2, n_kv_heads=2, head_dim=64, dtype="bfloat16")
    p = torch_dcp.plan(b, 2, planner="greedy", head_parallel=2, divisions=1)  # torch_dcp's own head parallelism
    assert p.keep_sharded and p.outer.world_size == 1 and p.divisions == 1
    c = [p.local_tokens(0), p.local_tokens(1)]
    assert c == [9, 8]
    e = 2 * 64  # bytes per head per token
    # forward in: my chunk's Q, K, V of the peer's head; out: the peer's chunk of my head's O
    fin = p.all_to_all_bytes(False, "in")
    assert fin[0, 1] == c[0] * 3 * e and fin[1, 0] == c[1] * 3 * e and fin[0, 0] == 0
    fout = p.all_to_all_bytes(False, "out")
    assert fout[0, 1] == c[1] * (e + 4) and fout[1, 0] == c[0] * (e + 4)  # O and its float32 LSE
    # backward (head-sharded tensors kept): dO in; dQ, dK, dV out
    assert p.all_to_all_bytes(True, "in")[0, 1] == c[0] * e
    assert p.all_to_all_bytes(True, "out")[0, 1] == c[1] * 3 * e
    # without the forward's head-sharded tensors, Q, K, V, O, LSE (float32) and dO travel again
    assert torch_dcp.plan(b, 2, planner="ring", head_parallel=2).keep_sharded
    q = HeadParallelPlan(p.outer, b, p.topology, 2, keep_sharded=False)
    assert q.all_to_all_bytes(True, "in")[0, 1] == c[0] * (5 * e + 4)
    assert q.all_to_all_bytes(False, "out")[0, 1] == c[1] * (e + 4)
    with pytest.raises(ValueError, match="way"):
        p.all_to_all_bytes(True, "sideways")
    # TransformerEngine's Ulysses (its a2a CP, on its own ring runtime) as its source moves them: the
    # LSE stays head-sharded; the backward's all-to-all in carries O again with dO
    te = torch_dcp.plan(b, 2, planner="ulysses")
    assert te.outer.placement.runtime is Runtime.TE_RING and [te.local_tokens(0), te.local_tokens(1)] == c
    np.testing.assert_array_equal(te.all_to_all_bytes(False, "in"), fin)
    assert te.all_to_all_bytes(False, "out")[0, 1] == c[1] * e
    assert te.all_to_all_bytes(True, "in")[0, 1] == c[0] * 2 * e
    assert te.all_to_all_bytes(True, "out")[0, 1] == c[1] * 3 * e


def test_ulysses_simulates_as_all_to_all_plus_one_launch():
    b = _batch()
    cm = CostModel.h100()
    topo = Topology.preset("h100", n_nodes=1)
    p = torch_dcp.plan(b, topo, planner="ulysses")
    r = simulate(p, cm)
    inner = simulate(p.outer, cm)
    a2a = sum(p.all_to_all_seconds(bw) for bw in (False, True))
    assert r.makespan_s == pytest.approx(inner.makespan_s + a2a)
    assert inner.forward.exposed_comm_s.max() == 0  # one rank: no transfer in the outer plan
    assert len(r.forward.busy_s) == 8 and r.forward.events[3][0][0] == "all-to-all"
    assert floor_seconds(p, cm) <= r.makespan_s
    st = p.stats()
    assert st["head_parallel"] == 8 and st["inter_node_bytes"] == 0
    assert st["comm_bytes"] == int(sum(p.all_to_all_bytes(bw).sum() for bw in (False, True)))
    assert st["flops_fwd"] == pytest.approx(torch_dcp.plan(b, topo, planner="ring").stats()["flops_fwd"])
    # with the executor presets TransformerEngine's a2a pays its own counted operations per pass
    # (9 forward, 11 backward with its attention call; around HCP's ring, whose steps charge the
    # calls, 8 and 10), as torch_dcp's head parallelism pays its own
    from torch_dcp.cost.model import GPU_EXECUTOR
    from torch_dcp.sim.runtimes import all_to_all_ops_seconds

    ex = CostModel.load("h100-executor")
    fwd, bwd = (all_to_all_ops_seconds(p, ex, bw) for bw in (False, True))
    assert (fwd, bwd) == (GPU_EXECUTOR.te_a2a[0], GPU_EXECUTOR.te_a2a[1]) and bwd > fwd > 0
    assert simulate(p, ex).makespan_s == pytest.approx(simulate(p.outer, ex).makespan_s + a2a + fwd + bwd)
    assert floor_seconds(p, ex) <= simulate(p, ex).makespan_s
    hcp = torch_dcp.plan(b, Topology.preset("h100", n_nodes=2), planner="hcp")
    assert hcp.outer.world_size == 2 and all_to_all_ops_seconds(hcp, ex, True) == GPU_EXECUTOR.te_a2a[3]
    # torch_dcp's own head parallelism pays its own counted layouts: around torch_dcp's executor
    # (which writes O and the LSE into the kept state) the preset's heads_executor role, around a
    # static runtime (all-gather CP alone, Ulysses' shape) its heads role, one copy more forward
    own = torch_dcp.plan(b, topo, planner="greedy", head_parallel=8)
    assert [all_to_all_ops_seconds(own, ex, bw) for bw in (False, True)] == list(GPU_EXECUTOR.heads_executor)
    from torch_dcp.api import divide
    from torch_dcp.planners import plan_allgather

    lay = HeadLayout.of(b, 8)
    ob, ot = lay.outer_batch(b), lay.outer_topology(topo)
    alone = dataclasses.replace(plan_allgather(ob, ot, cp_size=1), runtime=Runtime.DCP_ALLGATHER)
    ulysses = HeadParallelPlan(divide(alone, ot, 1), b, topo, 8, "allgather/cp1/hp8")
    assert [all_to_all_ops_seconds(ulysses, ex, bw) for bw in (False, True)] == list(GPU_EXECUTOR.heads)
    assert GPU_EXECUTOR.heads[0] > GPU_EXECUTOR.heads_executor[0] > 0
    assert min(GPU_EXECUTOR.heads) > 0 and all_to_all_ops_seconds(p, cm, False) == 0.0


def test_baselines_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="must divide the batch's n_heads=8"):
        torch_dcp.plan(_batch(), Topology.preset("h100"), planner="ulysses")  # W = 32 > H = 8
    with pytest.raises(ValueError, match="its own head parallelism"):
        torch_dcp.plan(_batch(), 4, planner="hcp", head_parallel=2)
    with pytest.raises(ValueError, match="'auto' needs a planner"):
        torch_dcp.plan(_batch(), 4, planner="greedy", head_parallel="auto")
    with pytest.raises(ValueError, match="head_parallel must be"):
        torch_dcp.plan(_batch(), 4, planner="dcp", head_parallel="some")


def test_hcp_is_the_ring_over_nodes_for_a_node_of_heads():
    b = _batch(32, 8)
    topo = Topology.preset("a100")
    p = torch_dcp.plan(b, topo, planner="hcp")
    assert p.head_parallel == 8 and p.outer.world_size == 4 and p.outer.planner == "ring"
    assert p.outer.batch.n_heads == 4 and p.outer.batch.n_kv_heads == 1
    st = p.stats()
    # every inter-node byte is the outer ring's, once per inner index
    assert st["inter_node_bytes"] == p.outer.stats()["inter_node_bytes"] * 8


@pytest.mark.parametrize("mask", [Causal(), Lambda(sink=16, window=512)], ids=["causal", "lambda"])
def test_dcp_auto_is_never_slower_than_its_rivals(mask):
    """ring, allgather, Ulysses and HCP's plans (head-sharded tensors kept for the backward, as
    TransformerEngine keeps them) are among dcp's candidates: dcp is never slower than them as
    torch_dcp's executor runs them, and within 10 % of them as their own implementations run them
    (TransformerEngine's ring skips the executor's staging copies and merges a single step's
    output nowhere; its dK/dV travel in bfloat16)."""
    lens = [6000, 2500, 900, 300, 3000, 120, 1800]
    cm = CostModel.h100()
    for topo in (Topology.preset("h100", n_nodes=1), Topology.preset("h100", n_nodes=2)):
        b = BatchSpec(lens, mask, n_heads=16, n_kv_heads=4, head_dim=128)
        best = torch_dcp.plan(b, topo, planner="dcp", block_size=512, cost_model=cm, head_parallel="auto")
        t = simulate(best, cm).makespan_s
        labels = [lab for lab, _ in best.candidates]
        assert any("/hp" in lab for lab in labels) and any("/hp" not in lab for lab in labels)
        rivals = [torch_dcp.plan(b, topo, planner=name, block_size=512) for name in ("ring", "allgather")]
        rivals += [torch_dcp.plan(b, topo, planner=name) for name in ("ulysses", "hcp")]
        for r in rivals:
            assert t <= simulate(on_executor(r), cm).makespan_s * (1 + 1e-9), r.planner
            assert t <= simulate(r, cm).makespan_s * 1.10, r.planner


def test_serialisation_and_digest():
    b = _batch()
    p = torch_dcp.plan(b, Topology(n_nodes=2, ranks_per_node=4), planner="dcp", head_parallel=2, block_size=512)
    data = p.to_bytes()
    q = HeadParallelPlan.from_bytes(data)
    assert q.digest() == p.digest() and q.head_parallel == 2 and q.label == p.label
    assert q.keep_sharded == p.keep_sharded and q.batch == b
    np.testing.assert_array_equal(q.token_indices(5), p.token_indices(5))
    assert [lab for lab, _ in q.candidates] == [lab for lab, _ in p.candidates]
    bad = bytearray(data)
    bad[-3] ^= 1
    with pytest.raises(PlanError, match="checksum"):
        HeadParallelPlan.from_bytes(bytes(bad))
    with pytest.raises(PlanError, match="bad magic"):
        HeadParallelPlan.from_bytes(p.outer.to_bytes())
    assert torch_dcp.plan(b, Topology(n_nodes=2, ranks_per_node=4), planner="dcp", head_parallel=4,
                          block_size=512).digest() != p.digest()
    with pytest.raises(ValueError, match="outer plan's topology"):
        HeadParallelPlan(p.outer, b, Topology(n_nodes=1, ranks_per_node=8), 2)
    assert isinstance(p.outer, Plan)


def test_outer_batch_shares_the_tiles_of_its_batch_and_no_other_mask():
    # the needed tiles depend on documents, masks and blocks, not heads: the outer batch of a
    # head parallelism reuses them; the same lengths under another mask do not
    from torch_dcp.workload import Workload

    lens = [3000, 700, 2200, 90]
    batch = BatchSpec(lens, Lambda(64, 512), n_heads=8, n_kv_heads=2, head_dim=64)
    wl = Workload.uniform(batch, 256)
    outer = Workload.uniform(HeadLayout.of(batch, 4).outer_batch(batch), 256)
    assert outer.tile_q is wl.tile_q and outer.tile_pairs is wl.tile_pairs
    np.testing.assert_allclose(outer.tile_flops_fwd * 4, wl.tile_flops_fwd)
    causal = Workload.uniform(BatchSpec(lens, Causal(), n_heads=8, n_kv_heads=2, head_dim=64), 256)
    assert causal.n_tiles > wl.n_tiles  # the window leaves tiles out that causal needs
    fresh = Workload.from_spans(BatchSpec(lens, Causal(), n_heads=2, n_kv_heads=2, head_dim=64), causal.block_doc,
                                causal.block_start, causal.block_end)
    np.testing.assert_array_equal(fresh.tile_pairs, causal.tile_pairs)


def test_block_layouts_of_a_batch_share_its_key_ranges():
    """Every block layout of a batch (any spans, given in any order) counts its tiles from the
    batch's key ranges in token order, computed once: the same tiles as a count from scratch;
    another mask on the same documents gets its own."""
    from torch_dcp import workload

    lens = [1500, 700, 2200, 90]
    batch = BatchSpec(lens, Lambda(64, 512), n_heads=4, n_kv_heads=2, head_dim=32)
    rng = np.random.default_rng(0)
    doc, start, end = [], [], []
    for d, n in enumerate(lens):  # uneven spans per document
        cuts = np.unique(np.concatenate(([0, n], rng.integers(1, n, 3))))
        doc += [d] * (len(cuts) - 1)
        start += cuts[:-1].tolist()
        end += cuts[1:].tolist()
    order = rng.permutation(len(doc))
    layouts = [(doc, start, end), tuple(np.asarray(a)[order] for a in (doc, start, end))]

    def counted(b, spans):
        workload._TILES.clear()
        wl = workload.Workload.from_spans(b, *spans)
        return wl.tile_q, wl.tile_kv, wl.tile_pairs

    workload._KEY_RANGES.clear()
    shared = [counted(batch, spans) for spans in layouts] + [counted(batch, layouts[0])]
    assert len(workload._KEY_RANGES) == 1
    for spans, got in zip(layouts + layouts[:1], shared):
        workload._KEY_RANGES.clear()
        for a, b in zip(got, counted(batch, spans)):
            np.testing.assert_array_equal(a, b)
    causal = counted(BatchSpec(lens, Causal(), n_heads=4, n_kv_heads=2, head_dim=32), layouts[0])
    assert causal[2].sum() > shared[0][2].sum()  # the window hides pairs that causal sees


@pytest.mark.parametrize("kv_heads,n", [(2, 4), (4, 4), (8, 2)])  # replicated key/value heads, one each, several
def test_executor_results_are_contiguous_and_exact_through_the_all_to_alls(kv_heads, n):
    """The all-to-alls hand back contiguous tensors (a compiled graph views them as declared),
    with replicated key/value heads' gradients summed: exact against the dense reference."""
    import torch

    from torch_dcp.api import divide
    from torch_dcp.executor import InProcessTransport, Mailbox, make_executor
    from torch_dcp.planners import plan_allgather

    batch = BatchSpec([37, 5, 60, 22], Causal(), n_heads=8, n_kv_heads=kv_heads, head_dim=8, dtype="float64")
    topo = Topology(n_nodes=1, ranks_per_node=n)
    lay = HeadLayout.of(batch, n)
    ob, ot = lay.outer_batch(batch), lay.outer_topology(topo)
    plan = HeadParallelPlan(divide(plan_allgather(ob, ot, cp_size=1), ot, 1), batch, topo, n, f"hp{n}")
    from reference import assert_emulation_exact, random_qkv

    assert_emulation_exact(plan, batch)
    mailbox = Mailbox()
    execs = [make_executor(plan, r, InProcessTransport(mailbox, r)) for r in range(n)]
    q, k, v, go = random_qkv(batch, torch.float64, 1)
    idx = [torch.from_numpy(plan.token_indices(r)) for r in range(n)]
    steps = [e.forward_steps(q[i], k[i], v[i]) for e, i in zip(execs, idx)]
    outs = _drive_all(steps)
    for o, lse in outs:
        assert o.is_contiguous() and lse.is_contiguous()
    back = _drive_all([e.backward_steps(q[i], k[i], v[i], o, lse, go[i]) for e, i, (o, lse) in zip(execs, idx, outs)])
    for grads in back:
        assert all(g.is_contiguous() for g in grads)


def _drive_all(gens):
    """Run every rank's generator to its end, round robin (in-process messages)."""
    results, live = [None] * len(gens), dict(enumerate(gens))
    while live:
        for r, g in list(live.items()):
            try:
                next(g)
            except StopIteration as stop:
                results[r] = stop.value
                del live[r]
    return results


def test_transport_all_to_all_by_hand():
    """``Transport.all_to_all`` (head parallelism's exchanges; here point-to-point messages, NCCL's
    ``all_to_all_single`` on a device): member ``i``'s rows for ``j`` land in ``j``'s ``out`` at
    ``i``'s range, uneven ranges and empty ones included, two of a phase told apart by their tag;
    a rank outside the members is refused."""
    import torch

    from torch_dcp.executor import InProcessTransport, Mailbox

    members, box = [0, 2, 3], Mailbox()
    rows = {0: [2, 0, 3], 2: [1, 4, 0], 3: [2, 2, 2]}  # rows[i][j]: member i's rows for member j
    ts = {r: InProcessTransport(box, r) for r in members}
    inps = {r: [torch.arange(sum(rows[r]) * 2, dtype=torch.float64).view(-1, 2) + 100 * r + 1000 * x for x in (0, 1)]
            for r in members}
    outs, posted = {}, {}
    for i, r in enumerate(members):
        got = [rows[m][i] for m in members]
        outs[r] = [torch.full((sum(got), 2), -1.0, dtype=torch.float64) for _ in (0, 1)]
        posted[r] = [ts[r].all_to_all(7, inps[r][x], outs[r][x], rows[r], got, members, tag=x) for x in (0, 1)]
    for r in members:
        for c in posted[r]:
            for _ in ts[r].finish(c):
                pass
    for i, r in enumerate(members):
        for x in (0, 1):
            want = torch.cat([inps[m][x][sum(rows[m][:i]):sum(rows[m][:i + 1])] for m in members])
            assert torch.equal(outs[r][x], want)
    with pytest.raises(ValueError, match="not among"):
        ts[0].all_to_all(8, inps[0][0], outs[0][0], rows[0], rows[0], [2, 3])
