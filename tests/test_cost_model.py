"""The executor's cost model: the fit recovers known costs, ``auto`` resolves the variable, the
cache, device names and the fallback, the check's arithmetic, and ``calibrate`` at a tiny size."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

import torch_dcp
from torch_dcp import BatchSpec, Causal, Lambda, Topology
from torch_dcp.cost import CostModel, ExecutorCosts, KernelCosts, LaunchCosts, MemoryCosts, auto
from torch_dcp.cost.executor import KernelWork, launch_features
from torch_dcp.cost.fit import LaunchSample, MemorySample, PassSample, fit_executor


def _plan():
    batch = BatchSpec([700, 90, 1300, 400], Lambda(sink=16, window=256), n_heads=4, n_kv_heads=2, head_dim=32,
                      dtype="float32")
    return torch_dcp.plan(batch, Topology(n_nodes=1, ranks_per_node=4), planner="greedy", block_size=128)


def test_fit_recovers_known_costs():
    """Samples made from known costs (with 0.1 % noise) are fitted back within 10 %."""
    rng = np.random.default_rng(0)
    true = ExecutorCosts(KernelCosts("sdpa", LaunchCosts(50e-6, 80e-6, 1e-9, 2e-10, 4e-9, 2e-10, 3e-10, 40e-6),
                                     LaunchCosts(90e-6, 150e-6, 2e-9, 4e-10, 6e-9, 4e-10, 6e-10, 70e-6)),
                         copy=MemoryCosts(10e-6, 1e-9), merge=MemoryCosts(30e-6, 1e-9), sum=MemoryCosts(5e-6, 3e-10),
                         pack=MemoryCosts(20e-6, 2e-10), pass_fixed=(1e-4, 5e-4), pass_byte=2e-10)
    launches, memory, passes = [], [], []
    for _ in range(400):
        f = np.array([1, rng.integers(1, 30), rng.uniform(1e5, 1e7), rng.uniform(0, 1e7), rng.uniform(0, 1e6),
                      rng.uniform(1e6, 1e9), rng.uniform(0, 1e9), rng.integers(0, 30)])
        for bw in (False, True):
            t = f @ true.general.of(bw).vector() * rng.normal(1, 0.001)
            launches.append(LaunchSample("sdpa", bw, tuple(f), float(t)))
    for kind in ("copy", "merge", "sum", "pack"):
        for _ in range(100):
            n = rng.uniform(1e4, 1e7)
            memory.append(MemorySample(kind, False, n, float(getattr(true, kind).seconds(n)) * rng.normal(1, 0.001)))
    for _ in range(100):
        n, bw = rng.uniform(1e5, 1e7), bool(rng.integers(2))
        passes.append(PassSample(bw, n, float(true.pass_seconds(n, bw)) * rng.normal(1, 0.001)))
    got, report = fit_executor(launches, memory, passes, "sdpa")
    for bw in (False, True):
        a, b = got.general.of(bw).vector(), true.general.of(bw).vector()
        # the terms that scale (calls, bytes, mask, FLOPs); the fixed 50-90 µs hides under launches of
        # milliseconds, so it is held to the sums' error below
        assert np.allclose(a[1:], b[1:], rtol=0.1), (bw, a, b)
    for kind in ("copy", "merge", "sum", "pack"):
        assert getattr(got, kind).byte == pytest.approx(getattr(true, kind).byte, rel=0.1)
    assert got.pass_fixed == pytest.approx(true.pass_fixed, rel=0.1) and got.pass_byte == pytest.approx(2e-10, rel=0.1)
    assert all(abs(tot) < 0.02 for _, _, tot in report.terms.values())
    with pytest.raises(ValueError, match="no backward launch"):
        fit_executor([s for s in launches if not s.backward], memory, passes, "sdpa")


def test_launch_features_by_kernel_work():
    """A rectangle kernel computes every pair of its groups' keys; flex at least the visible
    pairs; varlen exactly them (FLOPs per pair: 4 x heads x head_dim forward)."""
    plan = _plan()
    wl, b = plan.workload, plan.batch
    tiles = np.arange(wl.n_tiles)
    cell = np.zeros(wl.n_tiles, np.int64)
    fpp = 4 * b.n_heads * b.head_dim
    vis = launch_features(wl, tiles, cell, 1, KernelWork.VISIBLE, False)[0]
    blk = launch_features(wl, tiles, cell, 1, KernelWork.BLOCKS, False)[0]
    rect = launch_features(wl, tiles, cell, 1, KernelWork.RECTANGLE, False)[0]
    assert vis[5] + vis[6] == pytest.approx(wl.tile_pairs.sum() * fpp)
    area = (wl.block_len[wl.tile_q] * wl.block_len[wl.tile_kv]).sum() * fpp
    assert rect[5] + rect[6] == pytest.approx(area) and vis[5] + vis[6] <= blk[5] + blk[6] <= area
    assert rect[1] == len(np.unique(wl.tile_q)) and vis[1] == blk[1] == 1 and rect[4] > 0 == vis[4]


def test_simulator_charges_the_executor_costs():
    """With executor costs, each rank's busy time is its pass costs plus its instructions',
    and a fixed cost per division adds exactly divisions x fixed per rank."""
    plan = _plan()
    base = CostModel.load(str(auto.PRESET_DIR / "cpu.json"))
    ex = base.executor
    bumped = base.with_executor(ExecutorCosts(
        KernelCosts("sdpa", LaunchCosts(**{**ex.general.forward.__dict__, "fixed": ex.general.forward.fixed + 1e-3}),
                    ex.general.backward), copy=ex.copy, merge=ex.merge, sum=ex.sum, pack=ex.pack,
        pass_fixed=ex.pass_fixed, pass_byte=ex.pass_byte))
    a, b = torch_dcp.sim.simulate(plan, base), torch_dcp.sim.simulate(plan, bumped)
    launches = np.array([sum(1 for ins in plan.program(r, False).instructions if type(ins).__name__ == "BlockwiseAttention")
                         for r in range(plan.world_size)])
    assert np.allclose(b.forward.busy_s - a.forward.busy_s, launches * 1e-3)
    assert np.allclose(a.backward.busy_s, b.backward.busy_s)
    assert (a.forward.busy_s > 0).all() and all(ev[0][0] == "pass" for ev in a.forward.events)


def test_auto_resolves_variable_cache_device_and_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv(auto.CACHE_VAR, str(tmp_path / "cache"))
    monkeypatch.delenv(auto.ENV_VAR, raising=False)
    with pytest.warns(RuntimeWarning, match="calibrate"):
        auto._seen.clear()
        fallback = CostModel.load("auto", device="cpu")
    assert "cpu preset" in fallback.source and fallback.executor is not None and fallback.executor.general.name == "sdpa"
    mine = CostModel(fallback.kernel, 1e10, 0.0, executor=fallback.executor, source="mine")
    path = auto.cache_path("cpu")
    path.parent.mkdir(parents=True)
    path.write_text(mine.to_json())
    assert CostModel.load("auto", device="cpu").source == "mine" and CostModel.load(None).source == "mine"
    other = tmp_path / "other.json"
    other.write_text(CostModel.h100().to_json())
    monkeypatch.setenv(auto.ENV_VAR, str(other))
    assert CostModel.load("auto").kernel == CostModel.h100().kernel
    monkeypatch.setenv(auto.ENV_VAR, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="TORCH_DCP_COST_MODEL"):
        CostModel.load("auto")
    monkeypatch.delenv(auto.ENV_VAR)
    monkeypatch.setattr(auto, "device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(auto, "_device", lambda device=None: torch.device("cuda"))
    gpu = auto.resolve()
    assert gpu.kernel == CostModel.h100().kernel and gpu.executor.fast.name == "varlen" and "h100 preset" in gpu.source
    assert gpu == CostModel.load("h100-executor")  # the name the benchmarks simulate an H100 cluster with
    monkeypatch.setattr(auto, "device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert auto.resolve() == CostModel.load("a100-executor") != CostModel.load("a100")
    with pytest.raises(ValueError, match="'h100-executor'"):
        CostModel.load("b200-executor")
    # a round trip keeps everything, links too
    linked = CostModel(gpu.kernel, executor=gpu.executor, links=torch_dcp.cost.Links(1e-5, 2e9, 4, "gloo"), source="x")
    assert CostModel.from_json(linked.to_json()) == linked


def test_plan_uses_the_models_links():
    """A model with measured links plans on them: dcp's candidates are timed with its latency and
    bandwidth, and the plan names the model."""
    batch = BatchSpec([3000, 700, 1200, 64], Causal(), n_heads=8, n_kv_heads=2, head_dim=64)
    cm = CostModel.h100().with_executor(None, "slow links")
    slow = torch_dcp.cost.Links(latency=1e-3, bandwidth=1e6, world_size=4)
    fast = torch_dcp.plan(batch, 4, planner="dcp", block_size=256, cost_model=cm, head_parallel=1)
    lossy = torch_dcp.plan(batch, 4, planner="dcp", block_size=256, head_parallel=1,
                           cost_model=CostModel(cm.kernel, cm.memory_bandwidth, links=slow, source="slow links"))
    assert lossy.topology.intra_bandwidth == 1e6 and fast.topology.intra_bandwidth != 1e6
    assert lossy.cost_model == "slow links"


def test_check_arithmetic_and_tiny_calibration(tmp_path):
    """``calibrate --size tiny`` runs on the CPU and writes a model that ``--check`` reads; the
    check's ratios are measured / predicted of the busiest and median rank."""
    from torch_dcp.benchmarks import calibrate

    out = tmp_path / "m.json"
    res = calibrate.main(["--device", "cpu", "--size", "tiny", "--repeat", "1", "--out", str(out)], out=open(tmp_path / "log", "w"))
    model = CostModel.load(str(out))
    assert model.executor.general.name == "sdpa" and res["meta"]["plans"] == 2 and "sdpa forward launches" in res["residuals"]
    chk = calibrate.main(["--check", "--device", "cpu", "--cost", str(out), "--repeat", "1",
                          "--cases", "longtail:causal:1024:2:128"], out=open(tmp_path / "log2", "w"))
    case = chk["cases"][0]
    meas, pred = np.array(case["measured_s"]), np.array(case["predicted_s"])
    b = int(np.argmax(meas))
    assert case["busiest"] == pytest.approx(meas[b] / pred[b]) and chk["inside"] in (0, 1)
    rep = calibrate.main(["--check", "--device", "cpu", "--cost", str(out), "--repeat", "1", "--replay",
                          "--cases", "longtail:lambda:1024:1x2:128"], out=open(tmp_path / "log3", "w"))
    assert rep["replay"] and not chk["replay"] and rep["cases"][0]["world"] == "1x2"
    assert len(rep["cases"][0]["measured_s"]) == 2 and min(rep["cases"][0]["measured_s"]) > 0
    with pytest.raises(ValueError, match="BATCH:MASK"):
        calibrate.check_cases("longtail:nomask:1:2:3")
    with pytest.raises(ValueError, match="NODESxRANKS"):
        calibrate.check_cases("longtail:causal:1:2y2:3")
    assert calibrate.check_cases("corpus:causal:8192:4x8:1024") == [("corpus", "causal", 8192, "4x8", 1024)]
    from torch_dcp.benchmarks.common import topology_of

    assert topology_of("4x8") == Topology(n_nodes=4, ranks_per_node=8) and topology_of(3).world_size == 3
    for bad in ("0x8", "4x", "x8", "four"):
        with pytest.raises(ValueError, match="NODESxRANKS"):
            topology_of(bad)
    assert json.loads(out.read_text())["meta"]["device"].startswith("cpu")


def test_torchtitan_cost_model_key_is_checked():
    from torch_dcp.integrations.torchtitan_config import DCPConfig

    assert DCPConfig().cost_model == "auto" and DCPConfig(cost_model="h100").planner_options()["cost_model"] == "h100"
    with pytest.raises(ValueError, match="--dcp.cost-model"):
        DCPConfig(cost_model="no-such-model").validate()


def test_shared_cores_floor():
    """Links saying the ranks share fewer cores than there are ranks (gloo ranks on a CPU): each
    pass takes at least the ranks' busy time plus the transfers' host costs over the cores, for a
    flat plan and a head-parallel one (whose all-to-alls cost host time too); without shared cores
    the simulation is unchanged; the fields survive JSON, and a model written before them loads."""
    from torch_dcp.cost import Links
    from torch_dcp.sim.simulate import simulate

    batch = BatchSpec([3000, 700, 1200, 64], Causal(), n_heads=4, n_kv_heads=2, head_dim=32)
    base = CostModel.load(str(auto.PRESET_DIR / "cpu.json"))
    links = Links(1e-4, 1e9, 4, "gloo")
    own = dataclasses.replace(base, links=links)
    shared = dataclasses.replace(base, links=dataclasses.replace(links, cores=2, host_byte_seconds=1e-9,
                                                                 host_message_seconds=1e-4))
    plan = torch_dcp.plan(batch, 4, planner="ring", block_size=256)
    a, b = simulate(plan, own), simulate(plan, shared)
    _, _, nb, fwd = plan.transfers()
    for pa, pb, backward in ((a.forward, b.forward, False), (a.backward, b.backward, True)):
        mine = fwd != backward
        floor = (pb.busy_s.sum() + 1e-9 * nb[mine].sum() + 1e-4 * mine.sum()) / 2
        assert np.allclose(pa.busy_s, pb.busy_s) and pb.makespan_s == pytest.approx(max(pa.makespan_s, floor))
        assert np.allclose(pb.finish_s, pb.makespan_s) or pb.makespan_s == pa.makespan_s
    assert b.makespan_s > a.makespan_s  # 4 ranks on 2 cores: the floor binds here
    hp = torch_dcp.plan(batch, 4, planner="dcp", block_size=256, cost_model=base, head_parallel=2)
    ha, hb = simulate(hp, own), simulate(hp, shared)
    a2a = sum(float(hp.all_to_all_bytes(False, w).sum()) for w in ("in", "out"))
    assert a2a > 0 and hb.forward.makespan_s >= (hb.forward.busy_s.sum() + 1e-9 * a2a) / 2 - 1e-12
    assert hb.makespan_s >= ha.makespan_s
    assert CostModel.from_json(shared.to_json()) == shared
    old = json.loads(own.to_json())
    assert "cores" in old["links"]
    for key in ("cores", "host_byte_seconds", "host_message_seconds"):
        del old["links"][key]
    assert CostModel.from_json(json.dumps(old)).links == links and not links.shares_cores
    with pytest.raises(ValueError, match="cores and host costs"):
        Links(1e-4, 1e9, 4, cores=-1)


def _shared_rank(rank, world, mesh):
    import torch.distributed as dist

    from torch_dcp.benchmarks import calibrate
    from torch_dcp.cost import Links

    model = CostModel.load(str(auto.PRESET_DIR / "cpu.json"))
    links = calibrate.measure_shared_cores(model, Links(1e-4, 1e9, world, "gloo"), torch.device("cpu"), cores=1,
                                           tokens=1024, block=128, repeat=1, out=open(os.devnull, "w"))
    assert links.cores == 1 and links.shares_cores and links.host_byte_seconds >= 0 and links.host_message_seconds >= 0
    assert links.latency == 1e-4 and links.world_size == world == dist.get_world_size()


def _group_check_rank(rank, world, mesh):
    from torch_dcp.benchmarks import calibrate

    model = CostModel.load(str(auto.PRESET_DIR / "cpu.json"))
    res = calibrate.check_group(model, torch.device("cpu"), repeat=1, out=open(os.devnull, "w"), tokens=1024,
                                block=128)
    assert res["world"] == world and len(res["plans"]) == 8
    for row in res["plans"]:
        assert row["ratio"] == pytest.approx(row["measured_s"] / row["predicted_s"]) and row["predicted_s"] > 0
    assert res["inside"] == sum(0.8 <= r["ratio"] <= 1.25 for r in res["plans"])


def test_group_check_on_gloo(tmp_path):
    """``calibrate --check`` under torchrun: dcp's and ring's plans run on the group (2 gloo
    ranks) beside the simulator's makespan; the ratios are measured / predicted."""
    from spawn import run_ranks

    run_ranks(_group_check_rank, 2, tmp_path, timeout=240)


def test_measure_shared_cores_on_gloo(tmp_path):
    """calibrate's measurement where ranks share cores runs its plans through the executor on 2
    gloo ranks (one core said) and fits non-negative host costs of transfers."""
    from spawn import run_ranks

    run_ranks(_shared_rank, 2, tmp_path, timeout=240)


def test_gpu_executor_from_its_counted_preset(tmp_path):
    """``GPU_EXECUTOR``: each pass's device operations per division and per pass (counted on the
    executor) x the seconds per operation (measured), from the shipped preset; a file without
    them is refused; one without the per-pass counts charges none."""
    from torch_dcp.cost.model import GPU_EXECUTOR, GPU_EXECUTOR_PRESET, gpu_executor

    d = json.loads(GPU_EXECUTOR_PRESET.read_text())
    per_op, fast, general = d["seconds_per_op"], d["counted"]["fast"], d["counted"]["general"]
    assert GPU_EXECUTOR.fast.name == "varlen" and GPU_EXECUTOR.general.name == "flex"
    assert GPU_EXECUTOR.fast.forward.fixed == pytest.approx(fast["forward"] * per_op)
    assert GPU_EXECUTOR.general.backward.fixed == pytest.approx(general["backward"] * per_op)
    # a pass's own operations (counted with either kernel) once per pass, whatever its divisions
    for i, name in enumerate(("forward_pass", "backward_pass")):
        assert GPU_EXECUTOR.pass_fixed[i] == pytest.approx((fast[name] + general[name]) / 2 * per_op)
        assert GPU_EXECUTOR.pass_fixed[i] > 0  # a pass has operations of its own (inputs, zeros, final sums)
    assert "measured" in d["seconds_per_op_source"] and "ops --fake --device cuda --write-preset" in d["command"]
    d["seconds_per_op"] = 1e-6
    (tmp_path / "p.json").write_text(json.dumps(d))
    assert gpu_executor(tmp_path / "p.json").fast.forward.fixed == pytest.approx(fast["forward"] * 1e-6)
    for role in ("fast", "general"):
        for name in ("forward_pass", "backward_pass"):
            del d["counted"][role][name]
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert gpu_executor(tmp_path / "old.json").pass_fixed == (0.0, 0.0)
    (tmp_path / "bad.json").write_text(json.dumps({"counted": {}}))
    with pytest.raises(ValueError, match="not a GPU executor preset"):
        gpu_executor(tmp_path / "bad.json")
    assert "measured on an H200" in CostModel.load("h100-executor").source
