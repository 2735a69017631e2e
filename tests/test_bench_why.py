"""benchmarks why: dcp's own plans against all-gather CP, each time split into balanced compute,
imbalance and exposed communication."""

from __future__ import annotations

import json

import numpy as np
import pytest

from torch_dcp import BatchSpec, Causal, CostModel, Topology
from torch_dcp.benchmarks import cli
from torch_dcp.benchmarks.why import OWN_RIVALS, split_time, summarize, why_batch
from torch_dcp.planners.base import Runtime


def _batch(lens=(6000, 500, 3000, 2500, 200)):
    return BatchSpec(list(lens), Causal(), n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")


def test_the_split_adds_up_to_the_simulated_time():
    topo = Topology(n_nodes=2, ranks_per_node=2)
    cm = CostModel.load("h100")
    row = why_batch(_batch(), topo, cm, [1024])
    for name in ("dcp", "allgather"):
        parts = sum(row[f"{name}_{t}_ms"] for t in ("compute", "imbalance", "exposed"))
        assert parts == pytest.approx(row[f"{name}_time_ms"], rel=1e-9)
        assert row[f"{name}_compute_ms"] > 0 and row[f"{name}_imbalance_ms"] >= -1e-12
        assert row[f"{name}_exposed_ms"] >= -1e-12
    assert row["allgather_cp"] in (2, 4)
    assert row["allgather_exposed_ms"] > 0  # its collectives are not overlapped
    assert row["dcp_over_allgather"] == pytest.approx(row["dcp_time_ms"] / row["allgather_time_ms"])
    assert not row["dcp_plan"].startswith("dcp:allgather")  # the static runtimes are left out
    assert row["allgather_max_recv_gb"] > 0 and row["dcp_inter_node_gb"] >= 0 and row["dcp_max_recv_gb"] >= 0
    assert 0 <= row["dcp_node_once_gb"] <= row["dcp_inter_node_gb"] * (1 + 1e-12)


def test_node_routes_cross_each_node_once_and_direct_routes_pay_again():
    """The node-once floor of a placement: met by routes through one rank per node (``Routing.NODE``,
    every block into a node once, partial results summed in it), exceeded by direct routes (a block
    needed by n ranks of a node crosses n times), equal for the ring (each block into each node
    once around it); the direct placement routed again through the nodes moves its floor."""
    import dataclasses

    import torch_dcp
    from torch_dcp.api import divide
    from torch_dcp.planners.base import Routing
    from torch_dcp.sim.floors import node_once_bytes

    topo = Topology.preset("a100", n_nodes=2)
    for routes in (True, False):
        plan = torch_dcp.plan(_batch(), topo, planner="dcp", block_size=512, head_parallel=1, rivals=(),
                              node_routes=routes, cost_model="a100")
        inter = plan.stats()["inter_node_bytes"]
        assert plan.placement.routing in ((Routing.NODE, Routing.RAILS) if routes else (Routing.DIRECT,))
        if routes:
            assert node_once_bytes(plan) == inter > 0
        else:
            assert 0 < node_once_bytes(plan) < inter
            src, dst, nb, _ = plan.transfers()
            assert inter == pytest.approx(nb[topo.node_of(src) != topo.node_of(dst)].sum())
            routed = divide(dataclasses.replace(plan.placement, routing=Routing.NODE), topo, 2)
            assert routed.stats()["inter_node_bytes"] == node_once_bytes(plan) == node_once_bytes(routed)
    ring = torch_dcp.plan(_batch(), topo, planner="ring")
    assert node_once_bytes(ring) == ring.stats()["inter_node_bytes"] > 0


def test_split_time_takes_the_rank_that_finishes_last():
    import torch_dcp
    from torch_dcp.sim.simulate import simulate

    topo = Topology(n_nodes=1, ranks_per_node=4)
    plan = torch_dcp.plan(_batch(), topo, planner="ring")
    sim = simulate(plan, CostModel.load("h100"))
    s = split_time(sim)
    assert s["time"] == pytest.approx(sim.makespan_s)
    want = 0.0
    for res in (sim.forward, sim.backward):
        c = int(np.argmax(res.finish_s))
        want += res.busy_s[c]
    assert s["compute"] + s["imbalance"] == pytest.approx(want)


def test_summary_medians_over_the_batches_the_all_gather_wins():
    rows = [{"dcp_over_allgather": 1.2, **{f"dcp_{t}_ms": 2.0 for t in ("compute", "imbalance", "exposed", "time")},
             **{f"allgather_{t}_ms": 1.0 for t in ("compute", "imbalance", "exposed", "time")}},
            {"dcp_over_allgather": 0.8, **{f"dcp_{t}_ms": 0.0 for t in ("compute", "imbalance", "exposed", "time")},
             **{f"allgather_{t}_ms": 5.0 for t in ("compute", "imbalance", "exposed", "time")}}]
    s = summarize(rows)
    assert s["allgather_faster"] == 1 and s["median_gap_exposed_ms"] == 1.0 and s["median_gap_time_ms"] == 1.0
    assert summarize(rows[1:])["median_gap_time_ms"] is None


def test_cli_prints_json_lines(capsys):
    assert "static" not in OWN_RIVALS and Runtime.DCP_ALLGATHER.gathers
    rc = cli.main(["why", "--clusters", "h100x1", "--scales", "0.5", "--batches", "longtail", "--json",
                   "--block-sizes", "2048"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(lines) == 2 and lines[0]["allgather_cp"] == 8 and "summary" in lines[1]
    with pytest.raises(SystemExit):
        cli.main(["why", "--masks", "nope"])


def test_link_loads_conserve_bytes_and_spread_the_all_gather_over_every_rail():
    import torch_dcp
    from torch_dcp.api import divide
    from torch_dcp.planners import plan_allgather
    from torch_dcp.sim.floors import link_busy_seconds

    topo = Topology.preset("h100", n_nodes=2)
    batch = _batch()
    ag = divide(plan_allgather(batch, topo), topo, 1)
    busy = link_busy_seconds(ag)
    src, dst, nb, _ = ag.transfers()
    inter = topo.node_of(src) != topo.node_of(dst)
    for way in ("out", "in"):  # every byte on one port or rail at each end, the ring's hops over all rails
        assert busy[("rail", way)].sum() * topo.rail_bandwidth == pytest.approx(nb[inter].sum())
        assert busy[("port", way)].sum() * topo.intra_bandwidth == pytest.approx(nb[~inter].sum())
        rails = busy[("rail", way)]
        assert rails.min() == pytest.approx(rails.max())  # NCCL: a channel per NIC
    # a head-parallel plan: the outer plan's transfers on every inner index, and its all-to-alls
    hp = torch_dcp.plan(batch, topo, planner="dcp", block_size=1024, head_parallel=2, cost_model="h100")
    busy = link_busy_seconds(hp)
    a2a = sum(hp.all_to_all_bytes(bw).sum() for bw in (False, True))
    osrc, odst, onb, _ = hp.outer.transfers()
    total = sum(busy[("port", "in")] * topo.intra_bandwidth) + sum(busy[("rail", "in")] * topo.rail_bandwidth)
    assert total == pytest.approx(a2a + 2 * onb.sum())
    row = why_batch(batch, topo, CostModel.load("h100"), [1024])
    for name in ("dcp", "allgather"):
        for kind in ("rail", "port"):
            assert row[f"{name}_{kind}_ms"] >= 0 and row[f"{name}_{kind}_gb"] >= 0


def test_links_made_faster_shrink_the_waits_they_carry():
    """``--links``: each link class that many times faster, both plans made again on it; the
    all-gather's collectives wait on the links, so its time at its best CP size falls with them."""
    from torch_dcp.benchmarks.why import faster_links, parse_links

    assert parse_links("rail=8,nvlink=2.5") == {"rail": 8.0, "nvlink": 2.5}
    assert parse_links("") == {}
    for bad in ("rails=8", "rail=0", "rail=-1", "rail=x", "rail=inf", "rail=8,rail=4", "rail"):
        with pytest.raises(ValueError, match="--links"):
            parse_links(bad)
    topo = Topology(n_nodes=2, ranks_per_node=2)
    fast = faster_links(topo, {"rail": 1000.0, "nvlink": 1000.0})
    assert fast.inter_bandwidth == topo.inter_bandwidth * 1000 and fast.intra_bandwidth == topo.intra_bandwidth * 1000
    assert fast.inter_latency == topo.inter_latency and faster_links(topo, {}) == topo
    cm = CostModel.load("h100")
    base, quick = why_batch(_batch(), topo, cm, [1024]), why_batch(_batch(), fast, cm, [1024])
    assert quick["allgather_time_ms"] < base["allgather_time_ms"] - 0.5 * base["allgather_exposed_ms"]


def test_links_option_names_the_faster_links_and_rejects_bad_ones(capsys):
    with pytest.raises(SystemExit):
        cli.main(["why", "--clusters", "a100x2", "--links", "rail=fast"])
    assert "--links" in capsys.readouterr().err


def test_exposed_phases_split_the_exposed_term_by_where_the_waits_fall():
    """fill + between + drain is the critical rank's exposed time; the all-gather runtime's
    forward waits only before its one attention call (the all-gather: all fill) and its backward
    after it too (the reduce-scatter: drain); a plan with divisions waits between them."""
    import torch_dcp
    from torch_dcp.benchmarks.why import _allgather, exposed_phases
    from torch_dcp.sim.simulate import simulate

    topo = Topology(n_nodes=2, ranks_per_node=2)
    cm = CostModel.load("h100")
    _, _, ag = _allgather(_batch(), topo, cm)
    ph, sp = exposed_phases(ag), split_time(ag)
    assert sum(ph.values()) == pytest.approx(sp["exposed"], rel=1e-9)
    assert ph["between"] == pytest.approx(0.0, abs=1e-12)
    fwd = ag.forward
    c = int(np.argmax(fwd.finish_s))
    gather = next(e - s for kind, s, e in fwd.events[c] if kind == "all-gather")
    assert ph["fill"] >= gather > 0 and ph["drain"] > 0
    plan = torch_dcp.plan(_batch(), topo, planner="dcp", block_size=512, head_parallel=1, rivals=(), divisions=4,
                          cost_model=cm)
    sim = simulate(plan, cm)
    ph = exposed_phases(sim)
    assert sum(ph.values()) == pytest.approx(split_time(sim)["exposed"], rel=1e-9)
    assert all(v >= -1e-12 for v in ph.values())
