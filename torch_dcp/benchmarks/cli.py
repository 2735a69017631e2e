"""The benchmarks' command line, ``python -m torch_dcp.benchmarks COMMAND ...``: ``planners``,
``paper`` (:mod:`~torch_dcp.benchmarks.planners`, :mod:`~torch_dcp.benchmarks.sweeps`), ``compare``
(:mod:`~torch_dcp.benchmarks.compare`), ``why`` (:mod:`~torch_dcp.benchmarks.why`), ``balance``
(:mod:`~torch_dcp.benchmarks.balance`), ``readiness`` (:mod:`~torch_dcp.benchmarks.readiness`), ``routes``
(:mod:`~torch_dcp.benchmarks.routes`), ``pictures`` (:mod:`~torch_dcp.benchmarks.pictures`),
``kernels reduce|table|division|plan`` (:mod:`~torch_dcp.benchmarks.kernels`), ``ops``
(:mod:`~torch_dcp.benchmarks.ops`), ``step`` (:mod:`~torch_dcp.benchmarks.step`), ``loader``
(:mod:`~torch_dcp.benchmarks.loader`), ``scale`` (:mod:`~torch_dcp.benchmarks.scale`), ``main-job``
(:mod:`~torch_dcp.benchmarks.main_job`) and ``gpu-report`` (:mod:`~torch_dcp.benchmarks.gpu_report`)."""

from __future__ import annotations

import argparse
import json
import sys

from ..topology import TOPOLOGY_PRESETS, Topology
from . import (balance, calibrate, common, compare, gpu_report, kernels, loader, main_job, ops, pictures, planners,
               readiness, routes, scale, step, sweeps, why)
from .common import MASKS

_DIVISIONS_HELP = ("divisions T per rank (default: each planner's own: T = 4 on these batches, where dcp's time "
                   "objective may keep a node-first schedule at T = 6, as its default plan does)")

__all__ = ["main", "parser"]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m torch_dcp.benchmarks``."""
    from . import __doc__ as doc

    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="python -m torch_dcp.benchmarks", description=doc, formatter_class=raw)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("planners", help="compare planners on the same batches", description=planners.__doc__,
                        formatter_class=raw)
    pp.add_argument("--planners", default="ring,ulysses,hcp,greedy,dcp")
    pp.add_argument("--heads", default="8/2", help="query/key-value heads, e.g. 32/8 (default: the paper's 8/2)")
    pp.add_argument("--masks", default=",".join(MASKS))
    pp.add_argument("--batches", default="corpus,longtail,one")
    pp.add_argument("--block-size", type=int, default=1024)
    pp.add_argument("--divisions", type=int, default=None,
                    help=_DIVISIONS_HELP)
    pp.add_argument("--nodes", type=int, default=4)
    pp.add_argument("--ranks-per-node", type=int, default=8)
    pp.set_defaults(run=_planners, error=pp.error)
    pp2 = sub.add_parser("paper", help="the DCP paper's microbenchmark, simulated, all planners side by side",
                         description=planners.__doc__, formatter_class=raw)
    pp2.add_argument("--planners", default="ring,allgather,megatron,ulysses,hcp,fcp,greedy,dcp")
    pp2.add_argument("--heads", default="8/2", help="query/key-value heads, e.g. 32/8 (default: the paper's 8/2)")
    pp2.add_argument("--nodes", type=int, default=4, help="nodes of the preset (1: one node of 8, beside 4 x 8)")
    pp2.add_argument("--topology", choices=sorted(TOPOLOGY_PRESETS), default="a100",
                     help="cluster preset (4 nodes x 8 GPUs): the paper's A100 cluster or DGX H100")
    pp2.add_argument("--masks", default=",".join(MASKS))
    pp2.add_argument("--scales", default="0.5,1,2,4")
    pp2.add_argument("--block-sizes", default="512,1024,2048,4096")
    pp2.add_argument("--divisions", type=int, default=None,
                     help=_DIVISIONS_HELP)
    pp2.add_argument("--cost", default="a100",
                     help="the simulated cluster's kernel model: a100 (default), h100 (kernels alone), a100-executor, h100-executor (with the executor's fixed costs per division), auto (this device's calibrated "
                          "model) or JSON cost tables / models (CostModel.to_json format), comma-separated, e.g. "
                          "one per head_dim")
    pp2.add_argument("--batches", default=None,
                     help="length sources to run (default: all): corpus, longtail, longalign, ldc")
    pp2.add_argument("--longalign", default=None, metavar="PATH",
                     help="LongAlign-10k's long.jsonl (or its folder, or a saved .json length list)")
    pp2.add_argument("--long-data-collections", default=None, metavar="PATH",
                     help="Long-Data-Collections folder (pretrain/, fine-tune/) or file, or a saved .json length list")
    pp2.add_argument("--sweep", choices=sweeps.SWEEPS, default=None,
                     help="instead of the timing table: traffic vs block size (fig. 17), vs mask sparsity "
                          "(fig. 19) or vs imbalance tolerance (fig. 20) on one batch")
    pp2.add_argument("--sweep-batch", default="longtail", help="length source of the sweep's batch")
    pp2.add_argument("--sweep-scale", type=float, default=1.0, help="length scale of the sweep's batch")
    pp2.set_defaults(run=_paper, error=pp2.error)
    cm_ = sub.add_parser("compare", help="dcp against every baseline as its authors run it, each static family at "
                         "its best CP size: per batch, the best baseline and dcp / best", description=compare.__doc__,
                         formatter_class=raw)
    cm_.add_argument("--clusters", default="a100x4,h100x4,h100x1,a100x1",
                     help="comma-separated PRESETxNODES (default: the paper benchmark's four clusters)")
    cm_.add_argument("--cost", default="executor",
                     help="executor (default: each cluster's <preset>-executor model), kernels (its <preset> model: "
                          "the kernels alone), or any model CostModel.load takes (a100, h100, a100-executor, "
                          "h100-executor, auto, JSON files)")
    cm_.add_argument("--json", action="store_true", help="JSON lines (one per batch, one summary per cluster)")
    cm_.add_argument("--jsonl", default=None, metavar="FILE", help="also write the JSON lines to FILE")
    cm_.add_argument("--heads", default="8/2", help="query/key-value heads (default: the paper's 8/2)")
    cm_.add_argument("--masks", default=",".join(MASKS))
    cm_.add_argument("--scales", default="0.5,1,2,4")
    cm_.add_argument("--block-sizes", default="auto",
                     help="dcp's block sizes, its best kept, the first on a tie (default auto: "
                          "torch_dcp.api.auto_block_sizes of each batch)")
    cm_.add_argument("--batches", default=None, help="length sources to run (default: corpus, longtail)")
    cm_.add_argument("--own", action="store_true",
                     help="dcp's own plans only: the static CP runtimes left out of its candidates")
    cm_.add_argument("--same-memory", action="store_true",
                     help="also dcp against each mask's tuned configuration given that configuration's memory (dcp "
                          "planned again where its CP groups hold more tokens than dcp allows)")
    cm_.set_defaults(run=_compare, error=cm_.error)
    wp = sub.add_parser("why", help="where dcp's own plans lose time to all-gather CP: compute, imbalance, exposed "
                        "communication and bytes, per batch", description=why.__doc__, formatter_class=raw)
    wp.add_argument("--clusters", default="a100x4,h100x4", help="comma-separated PRESETxNODES (default a100x4,h100x4)")
    wp.add_argument("--cost", default="kernels",
                    help="kernels (default: each cluster's kernel table alone), executor (its <preset>-executor "
                         "model), or any model CostModel.load takes")
    wp.add_argument("--json", action="store_true", help="JSON lines (one per batch, one summary per cluster)")
    wp.add_argument("--heads", default="8/2", help="query/key-value heads (default: the paper's 8/2)")
    wp.add_argument("--masks", default="causal")
    wp.add_argument("--scales", default="0.5,1,2,4")
    wp.add_argument("--block-sizes", default="1024,2048", help="dcp's block sizes, its best kept (default 1024,2048)")
    wp.add_argument("--batches", default=None, help="length sources to run (default: corpus, longtail)")
    wp.add_argument("--links", default="", help="what bounds the plans: link classes made faster, e.g. rail=8 or "
                    "rail=8,nvlink=8 (default: none)")
    wp.set_defaults(run=_why, error=wp.error)
    bp = sub.add_parser("balance", help="dcp's time objective against its compute-balanced plan, with floors",
                        description=balance.__doc__, formatter_class=raw)
    bp.add_argument("--topology", choices=sorted(TOPOLOGY_PRESETS), default="a100")
    bp.add_argument("--cost", default="a100", help="the simulated cluster's kernel model: a100 (default), h100 (kernels alone), a100-executor, h100-executor (with the executor's fixed costs per division), auto (this device's calibrated model) or JSON cost models")
    bp.add_argument("--masks", default="causal,lambda")
    bp.add_argument("--scales", default="0.5,1,2,4")
    bp.add_argument("--block-sizes", default="1024,2048")
    bp.set_defaults(run=_balance)
    rp = sub.add_parser("readiness", help="dcp's plans run in divisions against dataflow (tiles as inputs arrive)",
                        description=readiness.__doc__, formatter_class=raw)
    rp.add_argument("--topology", choices=sorted(TOPOLOGY_PRESETS), default="a100")
    rp.add_argument("--cost", default="a100", help="the simulated cluster's kernel model: a100 (default), h100 (kernels alone), a100-executor, h100-executor (with the executor's fixed costs per division), auto (this device's calibrated model) or JSON cost models")
    rp.add_argument("--masks", default=",".join(MASKS))
    rp.add_argument("--scales", default="0.5,1,2,4")
    rp.add_argument("--block-sizes", default="1024,2048")
    rp.add_argument("--all-candidates", action="store_true",
                    help="also run every placement dcp considers and print the best ratio any reaches (slow)")
    rp.set_defaults(run=_readiness, error=rp.error)
    np_ = sub.add_parser("routes", help="dcp's placement with node routes against direct routes: inter-node bytes",
                         description=routes.__doc__, formatter_class=raw)
    np_.add_argument("--topology", choices=sorted(TOPOLOGY_PRESETS), default="a100")
    np_.add_argument("--cost", default="a100", help="the simulated cluster's kernel model: a100 (default), h100 (kernels alone), a100-executor, h100-executor (with the executor's fixed costs per division), auto (this device's calibrated model) or JSON cost models")
    np_.add_argument("--batch", default="corpus", help="length source: corpus or longtail")
    np_.add_argument("--mask", choices=sorted(MASKS), default="causal")
    np_.add_argument("--scales", default="0.5,1,2,4")
    np_.add_argument("--block-sizes", default="1024,2048")
    np_.set_defaults(run=_routes, error=np_.error)
    pp3 = sub.add_parser("pictures", help="placement map, traffic matrix and simulated timeline of one plan (PNG)",
                         description=pictures.__doc__, formatter_class=raw)
    pp3.add_argument("--out", default=".")
    pp3.add_argument("--batch", choices=["corpus", "longtail", "one"], default="longtail")
    pp3.add_argument("--mask", choices=sorted(MASKS), default="lambda")
    pp3.add_argument("--planner", default="dcp")
    pp3.add_argument("--block-size", type=int, default=1024)
    pp3.set_defaults(run=_pictures)
    cp = sub.add_parser("calibrate", help="the cost model of this device, measured from the executor; --check",
                        description=calibrate.__doc__, formatter_class=raw)
    calibrate.add_arguments(cp)
    cp.set_defaults(run=_calibrate)
    kp = sub.add_parser("kernels", help="kernel micro-benchmarks: reduce, table, division, plan",
                        description=kernels.__doc__, formatter_class=raw)
    ksub = kp.add_subparsers(dest="kcmd", required=True)
    r = ksub.add_parser("reduce", help="fused vs per-block BlockwiseReduction")
    r.add_argument("--tokens", type=int, default=None, help="destination rows (default 131072 on CUDA, 16384 on CPU)")
    r.add_argument("--heads", type=int, default=8)
    r.add_argument("--head-dim", type=int, default=128)
    r.add_argument("--partials", type=int, default=8)
    r.add_argument("--block", type=int, default=512, help="rows per destination block")
    r.add_argument("--op", choices=("lse_merge", "sum"), default="lse_merge")
    r.add_argument("--dtype", choices=sorted(common.DTYPES), default="float32")
    r.add_argument("--device", default="auto")
    r.add_argument("--repeat", type=int, default=5)
    r.add_argument("--copy-mb", type=int, default=256, help="MiB copied to measure the bandwidth")
    r.set_defaults(run=_reduce)
    t = ksub.add_parser("table", help="TFLOP/s vs work per launch, CostModel JSON")
    t.add_argument("--out", required=True, help="output JSON; with several head dims, NAME.hdD.json each")
    t.add_argument("--tokens", type=_ints, default=None,
                   help="comma-separated equivalent tokens (default 512..16384 on CUDA, 128,256,512 on CPU)")
    t.add_argument("--head-dims", type=_ints, default=[128])
    t.add_argument("--heads", type=int, default=8)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--dtype", choices=sorted(common.DTYPES), default=None,
                   help="default bfloat16 on CUDA, float32 elsewhere")
    t.add_argument("--kernel", default="auto")
    t.add_argument("--device", default="auto")
    t.add_argument("--repeat", type=int, default=3)
    t.add_argument("--copy-mb", type=int, default=256)
    t.set_defaults(run=_table)
    dv = ksub.add_parser("division", help="one division's kernel vs the faster dense call (flex or varlen flash), TFLOP/s")
    dv.add_argument("--docs", type=_ints, default=None, help="causal document lengths (default 16384,16384 on CUDA, "
                    "1024,512 on CPU)")
    dv.add_argument("--block", type=int, default=None, help="block size (default 1024 on CUDA, 128 on CPU)")
    dv.add_argument("--head-dim", type=int, default=128)
    dv.add_argument("--dtype", choices=sorted(common.DTYPES), default=None)
    dv.add_argument("--kernel", default="auto")
    dv.add_argument("--device", default="auto")
    dv.add_argument("--repeat", type=int, default=3)
    dv.add_argument("--flex-recompute", action="store_true", help="with --kernel flex: recompute each division's "
                    "forward in the backward (default: flex's backward op with the final LSE)")
    dv.set_defaults(run=_division)
    pl = ksub.add_parser("plan", help="measured per-rank compute of a plan vs the simulator's prediction")
    pl.add_argument("--planner", default="dcp")
    pl.add_argument("--tokens", type=int, default=131072)
    pl.add_argument("--nodes", type=int, default=4)
    pl.add_argument("--ranks-per-node", type=int, default=8)
    pl.add_argument("--block", type=int, default=1024)
    pl.add_argument("--cost", default="auto",
                    help="auto (default: this device's calibrated model, else a preset), a100, h100 or a JSON table "
                         "or model (written by 'table' or 'calibrate')")
    pl.add_argument("--dtype", choices=sorted(common.DTYPES), default=None)
    pl.add_argument("--kernel", default="auto")
    pl.add_argument("--device", default="auto")
    pl.add_argument("--repeat", type=int, default=1)
    pl.set_defaults(run=_plan)
    op = sub.add_parser("ops", help="the executor's operations per division (and device-plan build time)",
                        description=ops.__doc__, formatter_class=raw)
    ops.add_arguments(op)
    op.set_defaults(run=lambda a: ops.run(a) and 0)
    st = sub.add_parser("step", help="forward + backward of the executor vs one dense flex / varlen flash call",
                        description=step.__doc__, formatter_class=raw)
    step.add_arguments(st)
    st.set_defaults(run=lambda a: step.run(a) and 0)
    lo = sub.add_parser("loader", help="steps/s the planning loader sustains (all ranks simulated here) vs the rate "
                        "a training job needs", description=loader.__doc__, formatter_class=raw)
    loader.add_arguments(lo)
    lo.set_defaults(run=lambda a: loader.run(a) and 0)
    sc = sub.add_parser("scale", help="dcp's default plan at 131K/32 up to 4M/1024 ranks: planning time, memory, "
                        "simulated time against the rivals", description=scale.__doc__, formatter_class=raw)
    scale.add_arguments(sc)
    sc.set_defaults(run=scale.run)
    mj = sub.add_parser("main-job", help="the main job against PyTorch's context_parallel, alternating runs: tokens/s "
                        "and CPU per step", description=main_job.__doc__, formatter_class=raw)
    main_job.add_arguments(mj)
    mj.set_defaults(run=_main_job)
    gr = sub.add_parser("gpu-report", help="the whole GPU report: every GPU figure and its target, each stage in "
                        "its own subprocess and time limit", description=gpu_report.__doc__, formatter_class=raw)
    gpu_report.add_arguments(gr)
    gr.set_defaults(run=_gpu_report, error=gr.error)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark command; returns the exit status."""
    args = parser().parse_args(argv)
    return args.run(args)


def _calibrate(args) -> int:
    res = calibrate.run(args)
    if args.check:  # the exit status says whether every case held
        return calibrate.check_status(res)
    return 0


def _main_job(args) -> int:
    try:
        main_job.run(args)
    except main_job.MainJobError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


def _gpu_report(args) -> int:
    try:
        return gpu_report.run(args)
    except gpu_report.NoCudaError as e:
        print(f"gpu-report: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        args.error(str(e))


def _heads(args) -> tuple[int, int]:
    """``--heads H/H_kv`` as two integers (exits with a usage error otherwise)."""
    try:
        h, hkv = (int(x) for x in args.heads.split("/"))
        if h < 1 or hkv < 1 or h % hkv:
            raise ValueError
    except ValueError:
        args.error(f"--heads must be H/H_kv with H_kv dividing H, e.g. 32/8; got {args.heads!r}")
    return h, hkv


def _planners(args) -> int:
    masks = args.masks.split(",")
    for m in masks:
        if m not in MASKS:
            args.error(f"unknown mask {m!r}; choose from {sorted(MASKS)}")
    planners.bench_planners(args.planners.split(","), masks, args.batches.split(","), args.block_size,
                            args.divisions, Topology(n_nodes=args.nodes, ranks_per_node=args.ranks_per_node),
                            heads=_heads(args))
    return 0


def _paper(args) -> int:
    for m in args.masks.split(","):
        if m not in MASKS:
            args.error(f"unknown mask {m!r}; choose from {sorted(MASKS)}")
    sources = common.paper_sources(args.longalign, args.long_data_collections)
    if args.batches:
        unknown = set(args.batches.split(",")) - set(sources)
        if unknown:
            args.error(f"unknown or unavailable length sources {sorted(unknown)}; have {sorted(sources)} "
                       "(longalign/ldc need --longalign/--long-data-collections)")
        sources = {k: v for k, v in sources.items() if k in args.batches.split(",")}
    block_sizes = [int(x) for x in args.block_sizes.split(",")]
    if args.sweep:
        sweeps.bench_sweep(args.sweep, Topology.preset(args.topology), args.masks.split(","), block_sizes, args.divisions,
                           args.sweep_batch, args.sweep_scale, sources=sources)
        return 0
    planners.bench_paper(args.planners.split(","), args.masks.split(","), [float(x) for x in args.scales.split(",")],
                         block_sizes, args.divisions, Topology.preset(args.topology, n_nodes=args.nodes), args.cost,
                         sources=sources, heads=_heads(args))
    return 0


def _clusters_masks_sources(args) -> tuple[list, dict]:
    """``compare``'s and ``why``'s clusters and length sources, masks checked (errors via the parser)."""
    for m in args.masks.split(","):
        if m not in MASKS:
            args.error(f"unknown mask {m!r}; choose from {sorted(MASKS)}")
    try:
        clusters = compare.parse_clusters(args.clusters)
    except ValueError as err:
        args.error(str(err))
    sources = common.paper_sources()
    if args.batches:
        unknown = set(args.batches.split(",")) - set(sources)
        if unknown:
            args.error(f"unknown length sources {sorted(unknown)}; have {sorted(sources)}")
        sources = {k: v for k, v in sources.items() if k in args.batches.split(",")}
    return clusters, sources


def _why(args) -> int:
    clusters, sources = _clusters_masks_sources(args)
    try:
        links = why.parse_links(args.links)
    except ValueError as err:
        args.error(str(err))
    why.bench_why(clusters, args.masks.split(","), [float(x) for x in args.scales.split(",")], _ints(args.block_sizes),
                  args.cost, _heads(args), args.json, sources=sources, links=links)
    return 0


def _compare(args) -> int:
    clusters, sources = _clusters_masks_sources(args)
    jsonl = open(args.jsonl, "w") if args.jsonl else None
    try:
        compare.bench_compare(clusters, args.masks.split(","), [float(x) for x in args.scales.split(",")],
                              None if args.block_sizes == "auto" else _ints(args.block_sizes), args.cost, _heads(args),
                              args.json, sources=sources, jsonl=jsonl,
                              own=args.own, same_memory=args.same_memory)
    finally:
        if jsonl is not None:
            jsonl.close()
    return 0


def _balance(args) -> int:
    for m in args.masks.split(","):
        if m not in MASKS:
            args.error(f"unknown mask {m!r}; choose from {sorted(MASKS)}")
    balance.bench_balance(Topology.preset(args.topology), args.cost, tuple(args.masks.split(",")),
                          tuple(float(x) for x in args.scales.split(",")), tuple(_ints(args.block_sizes)))
    return 0


def _readiness(args) -> int:
    masks = tuple(args.masks.split(","))
    for m in masks:
        if m not in MASKS:
            args.error(f"unknown mask {m!r}; choose from {sorted(MASKS)}")
    readiness.bench_readiness(Topology.preset(args.topology), args.cost, masks,
                              tuple(float(x) for x in args.scales.split(",")), tuple(_ints(args.block_sizes)),
                              all_candidates=args.all_candidates)
    return 0


def _routes(args) -> int:
    sources = common.paper_sources()
    if args.batch not in sources:
        args.error(f"unknown batch {args.batch!r}; choose from {sorted(sources)}")
    routes.bench_routes(Topology.preset(args.topology), args.cost, args.batch, args.mask,
                        tuple(float(x) for x in args.scales.split(",")), tuple(_ints(args.block_sizes)),
                        sources=sources)
    return 0


def _pictures(args) -> int:
    pictures.write_pictures(args.out, args.batch, args.mask, args.planner, args.block_size)
    return 0


def _reduce(a) -> int:
    dev = common.pick_device(a.device)
    tokens = a.tokens or (131072 if dev.type == "cuda" else 16384)
    res = kernels.bench_reduce(tokens, a.heads, a.head_dim, a.partials, a.block, a.op, a.dtype, str(dev), a.repeat,
                               a.copy_mb)
    print(json.dumps({k: v for k, v in res.items() if isinstance(v, (int, float, str))}))
    print(f"{a.op}: {a.partials} partials -> {tokens} tokens x {a.heads} heads x {a.head_dim}, {a.dtype}, "
          f"blocks of {a.block}, on {common.device_name(dev)}")
    print(f"  loop      {res['loop_s'] * 1e3:10.3f} ms")
    print(f"  fused     {res['fused_s'] * 1e3:10.3f} ms   speedup x{res['speedup']:.2f}   "
          f"max |fused - loop| {res['max_abs_diff']:.2e}")
    if res["triton_s"] == res["triton_s"]:  # not NaN: the Triton merge ran
        print(f"  triton    {res['triton_s'] * 1e3:10.3f} ms   speedup x{res['loop_s'] / res['triton_s']:.2f}   "
              f"max |triton - loop| {res['triton_max_abs_diff']:.2e}")
    else:
        print("  triton           n/a   (LSE merge of >= 2 partials on CUDA with Triton only)")
    print(f"  limit     {res['limit_s'] * 1e3:10.3f} ms   ({res['bytes'] / 1e9:.3f} GB read+written once at "
          f"{res['bandwidth'] / 1e9:.1f} GB/s plain-copy bandwidth); fused reaches {100 * res['of_limit']:.0f}% of it")
    if res["triton_s"] == res["triton_s"]:
        print(f"            triton takes x{res['triton_s'] / res['limit_s']:.2f} the limit "
              f"(reaches {100 * res['triton_of_limit']:.0f}% of it)")
    return 0


def _table(a) -> int:
    dev = common.pick_device(a.device)
    tokens = a.tokens or ([512, 1024, 2048, 4096, 8192, 16384] if dev.type == "cuda" else [128, 256, 512])
    for hd in a.head_dims:
        out = a.out if len(a.head_dims) == 1 else a.out.replace(".json", "") + f".hd{hd}.json"
        table = kernels.measure_table(tokens, hd, a.heads, a.kv_heads, a.dtype, a.kernel, str(dev), a.repeat,
                                      a.copy_mb, log=lambda s: print(s, flush=True))
        with open(out, "w") as f:
            json.dump(table, f, indent=1)
        print(f"head_dim {hd}: wrote {out} (memory bandwidth {table['memory_bandwidth'] / 1e9:.1f} GB/s, "
              f"launch overhead {table['launch_overhead'] * 1e6:.1f} us)")
    return 0


def _division(a) -> int:
    dev = common.pick_device(a.device)
    docs = a.docs or ([16384, 16384] if dev.type == "cuda" else [1024, 512])
    block = a.block or (1024 if dev.type == "cuda" else 128)
    res = kernels.bench_division(docs, block, 8, 2, a.head_dim, a.dtype, a.kernel, str(dev), a.repeat,
                                 a.flex_recompute)
    print(json.dumps({k: round(v, 6) for k, v in res.items()}))
    print(f"division of {len(docs)} causal documents {docs} in blocks of {block} "
          f"({res['useful_pairs'] ** 0.5:.0f}^2 useful pairs) on {common.device_name(dev)}, kernel "
          f"{common.kernel_name(a.kernel, dev)}: forward {res['division_fwd_tflops']:.3f} vs dense "
          f"{res['dense_fwd_tflops']:.3f} TFLOP/s ({100 * res['fwd_ratio']:.0f}%), backward "
          f"{res['division_bwd_tflops']:.3f} vs {res['dense_bwd_tflops']:.3f} ({100 * res['bwd_ratio']:.0f}%)")
    return 0


def _plan(a) -> int:
    dev = common.pick_device(a.device)
    res = kernels.bench_plan(a.planner, a.tokens, a.nodes, a.ranks_per_node, a.block, a.cost, a.dtype, a.kernel,
                             str(dev), a.repeat)
    print(json.dumps(res))
    print("| rank | fwd measured ms | fwd predicted ms | bwd measured ms | bwd predicted ms |")
    print("|---|---|---|---|---|")
    for r in range(res["world_size"]):
        print(f"| {r} | {res['fwd_measured_s'][r] * 1e3:.3f} | {res['fwd_predicted_s'][r] * 1e3:.3f} | "
              f"{res['bwd_measured_s'][r] * 1e3:.3f} | {res['bwd_predicted_s'][r] * 1e3:.3f} |")
    for pas in ("fwd", "bwd"):
        print(f"{pas}: measured / predicted per rank: median {res[f'{pas}_ratio_median']:.2f}, "
              f"range {res[f'{pas}_ratio_min']:.2f}-{res[f'{pas}_ratio_max']:.2f}; busiest rank "
              f"{res[f'{pas}_max_rank_ratio']:.2f}")
    return 0
