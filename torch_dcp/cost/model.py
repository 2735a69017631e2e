"""Cost model: how long the instructions of a plan take on a given cluster.

* Attention: a ``BlockwiseAttention`` instruction is one fused launch over its tiles. Its
  time is ``FLOPs / throughput(work) + launch_overhead``, where the throughput (TFLOP/s)
  is interpolated (log-linearly) from a table of measured figures indexed by the work per
  launch, expressed as the side ``sqrt(visible pairs)`` of the equivalent square attention,
  separately for forward and backward and for full and causal (masked) work. Efficiency
  falls with the work per launch, not with the block size as such.
* Reductions and copies are memory-bound: bytes read and written over the memory bandwidth.
* Transfers: latency + bytes / bandwidth of the link class (from the :class:`Topology`):
  a rank's own port inside a node, its rail between nodes.

Shipped tables (bf16, head_dim 128):

* ``H100``: FlashAttention-3's published figures (Shah et al., "FlashAttention-3", 2024,
  §4.1, figures 5-7): forward 660-700 TFLOP/s at >= 4K tokens per launch, 283 causal at
  1K; backward 460-585 at >= 4K, 208 at 1K. Points between are interpolated.
* ``A100``: approximate readings of the FlashAttention-2 paper's A100-80GB benchmark figures
  (Dao, "FlashAttention-2", 2023, figures 4-6, head_dim 128): forward about 150-225 TFLOP/s
  from 512 to 16K tokens, backward about 110-195.

The executor's own costs (:mod:`torch_dcp.cost.executor`): a model with ``executor`` set charges
every instruction as torch_dcp's executor runs it on the device it was measured on (a division's
launch by the work its kernel really performs, plus the executor's costs per division and per
pass); ``python -m torch_dcp.benchmarks calibrate`` measures one, and ``CostModel.load("auto")``
(:mod:`torch_dcp.cost.auto`) finds it. The ``h100`` and ``a100`` presets are the kernels alone
(the published tables the paper benchmark simulates with); ``"auto"`` on such a card adds the
executor's fixed costs per division and per pass (:data:`GPU_EXECUTOR`: the device operations
counted on today's executor, each charged the 13.2 µs measured on an H200 with layer replay;
``calibrate`` on the user's card replaces them).

A user loads their own table with :meth:`CostModel.from_json` (same keys as
:meth:`CostModel.to_json`; ``python -m torch_dcp.benchmarks kernels table`` measures one per
head_dim) and joins several with :meth:`CostModel.merge`: a launch uses the table measured for
the batch's head_dim and dtype, else the default one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from .executor import ExecutorCosts, KernelCosts, LaunchCosts

__all__ = ["CostModel", "KernelTable", "Links", "A100", "H100", "GPU_EXECUTOR", "GPU_EXECUTOR_PRESET",
           "gpu_executor"]


@dataclasses.dataclass(frozen=True)
class KernelTable:
    """Attention throughput (TFLOP/s) against work per launch (equivalent tokens).

    Attributes:
        tokens: increasing equivalent square sides (``sqrt(pairs)``) of the measured points.
        fwd_full, fwd_causal, bwd_full, bwd_causal: TFLOP/s at those points.
    """

    tokens: tuple[float, ...]
    fwd_full: tuple[float, ...]
    fwd_causal: tuple[float, ...]
    bwd_full: tuple[float, ...]
    bwd_causal: tuple[float, ...]

    def __post_init__(self):
        n = len(self.tokens)
        if n < 1 or any(len(getattr(self, f)) != n for f in ("fwd_full", "fwd_causal", "bwd_full", "bwd_causal")):
            raise ValueError("KernelTable: every column needs one value per token point")
        if list(self.tokens) != sorted(self.tokens) or min(self.tokens) <= 0:
            raise ValueError("KernelTable.tokens must be positive and increasing")
        for f in ("fwd_full", "fwd_causal", "bwd_full", "bwd_causal"):
            if min(getattr(self, f)) <= 0:
                raise ValueError(f"KernelTable.{f}: throughputs must be positive")

    def tflops(self, equivalent_tokens: float, backward: bool, causal: bool) -> float:
        """Interpolated TFLOP/s (clamped at the table's ends)."""
        return float(self.tflops_array(np.array([equivalent_tokens], float), backward, np.array([causal]))[0])

    def tflops_array(self, equivalent_tokens: np.ndarray, backward: bool, causal: np.ndarray) -> np.ndarray:
        """:meth:`tflops` of many launches at once: float64 ``[n]`` TFLOP/s for ``[n]``
        equivalent tokens and ``[n]`` booleans (masked work)."""
        x = np.log(np.maximum(np.asarray(self.tokens, float), 1e-9))
        at = np.log(np.maximum(np.asarray(equivalent_tokens, float), 1e-9))
        pass_ = "bwd" if backward else "fwd"
        full = np.interp(at, x, np.asarray(getattr(self, f"{pass_}_full"), float))
        masked = np.interp(at, x, np.asarray(getattr(self, f"{pass_}_causal"), float))
        return np.where(np.asarray(causal, bool), masked, full)


H100 = KernelTable(
    tokens=(512, 1024, 2048, 4096, 8192, 16384),
    fwd_full=(330, 420, 560, 660, 690, 700),
    fwd_causal=(200, 283, 420, 560, 640, 670),
    bwd_full=(240, 300, 400, 460, 540, 585),
    bwd_causal=(150, 208, 300, 420, 500, 560),
)

A100 = KernelTable(
    tokens=(512, 1024, 2048, 4096, 8192, 16384),
    fwd_full=(150, 180, 205, 215, 222, 225),
    fwd_causal=(100, 140, 175, 200, 212, 220),
    bwd_full=(110, 145, 170, 185, 192, 195),
    bwd_causal=(75, 110, 145, 170, 185, 192),
)


#: Where :data:`GPU_EXECUTOR` comes from: the executor's device operations per division and pass,
#: counted under fake CUDA tensors (``python -m torch_dcp.benchmarks ops --fake --device cuda
#: --write-preset FILE`` regenerates the counts; a test fails when today's executor drifts more
#: than 10 % from them), and the seconds per operation measured on an H200 with layer replay.
GPU_EXECUTOR_PRESET = Path(__file__).with_name("presets") / "gpu_executor.json"


def gpu_executor(path: "str | Path" = GPU_EXECUTOR_PRESET) -> ExecutorCosts:
    """The executor's fixed costs on a GPU from a counted preset (its JSON, see
    :data:`GPU_EXECUTOR_PRESET`): each pass's operations per division x the seconds per
    operation; the ``fast`` kernel (varlen) from the causal count, the ``general`` one
    (FlexAttention) from the λ count; the operations of a pass whatever its divisions (the
    counts' ``forward_pass`` and ``backward_pass``, where the preset has them: the mean of the
    two kernels' counts, one executor's) as ``pass_fixed``; the all-gather runtime's operations per pass (its
    ``alone`` and ``gathered`` counts, where the preset has them) likewise, the ring runtime's
    per step (``ring``), the node-once all-gather runtime's per pass (``node``), and those of
    head parallelism's own around its all-to-alls per pass (``heads``; ``heads_executor`` around
    an outer plan on torch_dcp's executor), and those of
    TransformerEngine's all-gather CP per pass (``baselines.te_allgather``), of its ring per
    step (``baselines.te_ring``) and of its all-to-all CP per pass (``baselines.te_a2a``),
    counted from its source.

    Raises:
        ValueError: a file without the counts or the seconds per operation.
    """
    d = json.loads(Path(path).read_text())
    try:
        per_op = float(d["seconds_per_op"])
        fast, general = d["counted"]["fast"], d["counted"]["general"]

        def costs(name: str, c: dict) -> KernelCosts:
            return KernelCosts(name, LaunchCosts(fixed=float(c["forward"]) * per_op),
                               LaunchCosts(fixed=float(c["backward"]) * per_op))

        counted = d["counted"]
        allgather = None
        if "alone" in counted and "gathered" in counted:  # torch_dcp's all-gather runtime, per pass
            allgather = tuple(float(counted[case][name]) * per_op for case in ("alone", "gathered")
                              for name in ("forward", "backward"))
        def baseline(name: str) -> tuple[float, float] | None:  # a baseline's own operations
            te = d.get("baselines", {}).get(name)
            return None if te is None else (float(te["forward"]) * per_op, float(te["backward"]) * per_op)

        te_allgather, te_ring = baseline("te_allgather"), baseline("te_ring")  # per pass; per step
        a2a = d.get("baselines", {}).get("te_a2a")  # per pass: with its attention call, and around a ring
        te_a2a = None if a2a is None else tuple(float(a2a[name]) * per_op for name in (
            "forward", "backward", "forward_around_ring", "backward_around_ring"))
        def both(case: str) -> tuple[float, float] | None:  # a runtime's count, seconds forward and backward
            c = counted.get(case)
            return None if c is None else (float(c["forward"]) * per_op, float(c["backward"]) * per_op)

        # a pass's own operations (inputs into the buffers, zeros, delta, final reductions):
        # counted with each kernel, charged once per pass whichever runs
        pass_fixed = tuple(0.5 * (float(fast.get(f"{name}_pass", 0.0)) + float(general.get(f"{name}_pass", 0.0)))
                           * per_op for name in ("forward", "backward"))
        # torch_dcp's ring runtime per step with tiles, its node-once all-gather per pass
        return ExecutorCosts(general=costs("flex", general), fast=costs("varlen", fast), pass_fixed=pass_fixed,
                             allgather=allgather,
                             te_allgather=te_allgather, ring=both("ring"), te_ring=te_ring,
                             node_allgather=both("node"), te_a2a=te_a2a, heads=both("heads"),
                             heads_executor=both("heads_executor"))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a GPU executor preset (counted.fast/general forward and backward, "
                         f"seconds_per_op): {e}") from e


#: The executor's fixed costs on a GPU until a card is calibrated (:func:`gpu_executor` of the
#: shipped preset): per division and per pass, forward and backward, the device operations
#: counted on today's executor x 13.2 µs per operation measured on an H200 with layer replay;
#: about 37 / 52 µs a causal (varlen) division, 32 / 40 µs a FlexAttention one, and 32 / 102 µs a
#: pass whatever its divisions.
GPU_EXECUTOR = gpu_executor()


@dataclasses.dataclass(frozen=True)
class Links:
    """Point-to-point and all-to-all links measured on a process group (``calibrate`` under
    ``torchrun``): latency in seconds and bandwidth in bytes/s, one value for every pair of
    ranks (a one-node group). :func:`torch_dcp.plan` plans with them in place of the
    :class:`~torch_dcp.Topology`'s own."""

    latency: float
    bandwidth: float
    world_size: int
    backend: str = ""
    #: cores the group's ranks share when fewer than its ranks (CPU ranks on one machine; 0: a
    #: device per rank). A pass then takes at least ``(sum of the ranks' busy time + the
    #: transfers' host costs) / cores`` (:meth:`shared_seconds`).
    cores: int = 0
    #: host seconds a transfer costs its sender and receiver together, per byte and per message
    #: (fitted by ``calibrate`` from the group's own runs where ``cores`` applies)
    host_byte_seconds: float = 0.0
    host_message_seconds: float = 0.0

    def __post_init__(self):
        if not (self.latency >= 0 and self.bandwidth > 0 and np.isfinite(self.latency + self.bandwidth)):
            raise ValueError(f"Links: latency must be >= 0 s and bandwidth > 0 bytes/s, got {self}")
        if self.cores < 0 or self.host_byte_seconds < 0 or self.host_message_seconds < 0:
            raise ValueError(f"Links: cores and host costs must be >= 0, got {self}")

    @property
    def shares_cores(self) -> bool:
        """The ranks share fewer cores than there are ranks."""
        return 0 < self.cores < self.world_size

    def shared_seconds(self, busy_s: float, nbytes: float, messages: int) -> float:
        """The least time a pass can take on shared cores: ``(busy_s + host costs of nbytes in
        messages transfers) / cores`` (0 where the ranks do not share cores)."""
        if not self.shares_cores:
            return 0.0
        return (busy_s + self.host_byte_seconds * nbytes + self.host_message_seconds * messages) / self.cores

    def apply(self, topology: Any) -> Any:
        """``topology`` with these links inside and between its nodes."""
        return dataclasses.replace(topology, intra_latency=self.latency, intra_bandwidth=self.bandwidth,
                                   inter_latency=self.latency,
                                   inter_bandwidth=self.bandwidth * topology.rails_per_node)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Times of instructions and transfers, in seconds (the module docstring has the model).

    An attention launch takes ``FLOPs / throughput(work per launch) + launch_overhead``; a
    reduction or copy ``bytes / memory_bandwidth``; a transfer ``latency + bytes /
    bandwidth`` of its link, from the :class:`~torch_dcp.Topology`. Build one with
    :meth:`a100` (FlashAttention-2 paper's A100-80GB figures, 1.6 TB/s), :meth:`h100`
    (FlashAttention-3 paper's H100 figures, 3.0 TB/s), :meth:`load` (``"a100"``, ``"h100"``
    or JSON table paths) or :meth:`from_json` (a table measured with ``python -m
    torch_dcp.benchmarks kernels table --out my_gpu.json``). Used by :func:`torch_dcp.sim.simulate`
    and by :func:`torch_dcp.plan` (``cost_model=``) to time candidates.

    Attributes:
        kernel: the attention throughput table (the shipped ones: bf16, head_dim 128).
        memory_bandwidth: bytes/s of device memory (reductions, copies).
        launch_overhead: seconds added to every kernel launch.
        tables: optional tables measured for other shapes, ``((head_dim, dtype, table), ...)``;
            a launch uses the one matching the batch's head_dim and dtype, else ``kernel``
            (:meth:`table_for`). :meth:`merge` joins measured files (one per head_dim).
        executor: the executor's own costs (:class:`~torch_dcp.cost.executor.ExecutorCosts`), or
            None: launches charged by the table and ``launch_overhead`` alone.
        links: links measured on a process group (:class:`Links`), or None.
        source: where the model comes from, for logs (``"h100 preset"``, a calibration's device).
    """

    kernel: KernelTable = A100
    memory_bandwidth: float = 1.6e12
    launch_overhead: float = 5e-6
    tables: tuple[tuple[int, str, KernelTable], ...] = ()
    executor: ExecutorCosts | None = None
    links: Links | None = None
    source: str = ""

    def table_for(self, head_dim: int | None = None, dtype: str | None = None) -> KernelTable:
        """The table measured for ``(head_dim, dtype)``; for ``dtype=None`` any dtype of that
        head_dim; ``kernel`` when none matches."""
        for hd, dt, table in self.tables:
            if hd == head_dim and (dtype is None or dt == dtype):
                return table
        return self.kernel

    @classmethod
    def merge(cls, *models: "CostModel") -> "CostModel":
        """One model holding the tables of several (e.g. a measured file per head_dim); the
        first model's ``kernel``, bandwidth and launch overhead are the defaults.

        Raises:
            ValueError: no model given.
        """
        if not models:
            raise ValueError("CostModel.merge needs at least one model")
        tables = tuple(t for m in models for t in m.tables)
        return dataclasses.replace(models[0], tables=tables)

    @classmethod
    def a100(cls) -> "CostModel":
        """The A100-80GB model: the FlashAttention-2 paper's throughputs (bf16, head_dim 128),
        1.6 TB/s of memory bandwidth, 5 µs per launch: the kernels alone (the paper's tables);
        ``with_executor(GPU_EXECUTOR)`` adds the executor's fixed costs (``"auto"`` on an A100)."""
        return cls(A100, 1.6e12, source="a100 preset")

    @classmethod
    def h100(cls) -> "CostModel":
        """The H100 model: the FlashAttention-3 paper's throughputs (bf16, head_dim 128),
        3.0 TB/s of memory bandwidth, 5 µs per launch: the kernels alone (the paper's tables);
        ``with_executor(GPU_EXECUTOR)`` adds the executor's fixed costs (``"auto"`` on an H100 or
        H200)."""
        return cls(H100, 3.0e12, source="h100 preset")

    def with_executor(self, executor: ExecutorCosts | None, source: str | None = None) -> "CostModel":
        """This model with the executor's costs ``executor`` (and ``source`` for logs)."""
        return dataclasses.replace(self, executor=executor, source=self.source if source is None else source)

    def attention_seconds(self, pairs: float, flops: float, backward: bool, causal: bool,
                          head_dim: int | None = None, dtype: str | None = None) -> float:
        """One fused launch doing ``flops`` over ``pairs`` visible (query, key) pairs x heads;
        ``causal`` for any masked (causal or partial) work, with the table of ``head_dim`` and
        ``dtype`` (:meth:`table_for`)."""
        if flops <= 0:
            return 0.0
        tf = self.table_for(head_dim, dtype).tflops(float(np.sqrt(pairs)), backward, causal)
        return flops / (tf * 1e12) + self.launch_overhead

    def attention_seconds_array(self, pairs: np.ndarray, flops: np.ndarray, backward: bool, causal: np.ndarray,
                                head_dim: int | None = None, dtype: str | None = None) -> np.ndarray:
        """:meth:`attention_seconds` of many launches at once (the same operations element by
        element): float64 ``[n]`` seconds for ``[n]`` pairs, FLOPs and causal flags."""
        flops = np.asarray(flops, float)
        tf = self.table_for(head_dim, dtype).tflops_array(np.sqrt(np.asarray(pairs, float)), backward, causal)
        return np.where(flops > 0, flops / (tf * 1e12) + self.launch_overhead, 0.0)

    def launch_seconds(self, workload: Any, tiles: np.ndarray, tile_cell: np.ndarray, n_cells: int,
                       backward: bool) -> np.ndarray:
        """Seconds of ``n_cells`` attention launches (a rank's division each): ``tiles`` (int
        tile ids) with ``tile_cell`` (the launch of each). Without :attr:`executor`, each launch
        is :meth:`attention_seconds_array` of its visible pairs; with it, the executor's costs of
        the kernel its automatic choice runs there (:mod:`torch_dcp.cost.executor`): float64
        ``[n_cells]``."""
        from ..workload import BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR
        from .executor import cell_kernels, launch_features

        b = workload.batch
        tiles = np.asarray(tiles, np.int64)
        cell = np.asarray(tile_cell, np.int64)
        if self.executor is None:
            pairs = np.bincount(cell, weights=workload.tile_pairs[tiles], minlength=n_cells) * b.n_heads
            flops_of = workload.tile_flops_bwd if backward else workload.tile_flops_fwd
            flops = np.bincount(cell, weights=flops_of[tiles], minlength=n_cells)
            masked = np.bincount(cell, weights=~np.asarray(workload.tile_full, bool)[tiles], minlength=n_cells) > 0
            return self.attention_seconds_array(pairs, flops, backward, masked, b.head_dim, b.dtype)
        ex = self.executor
        fast = cell_kernels(workload, tiles, cell, n_cells, ex)
        seconds = np.zeros(n_cells)
        fpp = float((BWD_FLOPS_PER_PAIR if backward else FWD_FLOPS_PER_PAIR) * b.head_dim)
        for kern, cells in ((ex.general, ~fast), (ex.fast, fast)):
            if kern is None or not cells.any():
                continue
            keep = cells[cell]
            f = launch_features(workload, tiles[keep], cell[keep], n_cells, kern.work, backward)
            lc = kern.of(backward)
            sec = f @ lc.vector()
            if lc.flop is None or lc.masked_flop is None:  # the work at the table's throughput
                work = np.where(lc.flop is None, f[:, 5], 0.0) + np.where(lc.masked_flop is None, f[:, 6], 0.0)
                tf = self.table_for(b.head_dim, b.dtype).tflops_array(np.sqrt(work / fpp), backward, f[:, 6] > 0)
                sec = sec + np.where(work > 0, work / (tf * 1e12) + self.launch_overhead, 0.0)
            seconds = np.where(cells, sec, seconds)
        return seconds

    def least_launch_seconds(self, workload: Any, backward: bool) -> float:
        """The least total seconds the attention launches of all of ``workload``'s tiles can cost
        in one pass, however they are spread over ranks and divisions: a lower bound of the sum of
        :meth:`launch_seconds` over any placement's launches. Without :attr:`executor`, every FLOP
        at the kernel table's best throughput; with it,
        :func:`torch_dcp.cost.executor.least_launch_seconds`."""
        from .executor import least_launch_seconds

        b = workload.batch
        table = self.table_for(b.head_dim, b.dtype)
        best = max(table.bwd_full + table.bwd_causal) if backward else max(table.fwd_full + table.fwd_causal)
        per_flop = 1.0 / (best * 1e12)
        if self.executor is None:
            return float((workload.tile_flops_bwd if backward else workload.tile_flops_fwd).sum()) * per_flop
        return least_launch_seconds(workload, self.executor, backward, per_flop)

    def memory_seconds(self, nbytes: float) -> float:
        """A memory-bound pass that reads and writes ``nbytes`` in total."""
        return nbytes / self.memory_bandwidth + (self.launch_overhead if nbytes > 0 else 0.0)

    def memory_seconds_array(self, nbytes: np.ndarray) -> np.ndarray:
        """:meth:`memory_seconds` of many passes at once (the same operations element by
        element): float64 ``[n]`` seconds for ``[n]`` byte counts."""
        nbytes = np.asarray(nbytes, float)
        return nbytes / self.memory_bandwidth + np.where(nbytes > 0, self.launch_overhead, 0.0)

    @staticmethod
    def transfer_seconds(nbytes: float, topology: Any, inter_node: bool) -> float:
        """Latency + bytes over the link's bandwidth: a rank's NVLink/NVSwitch port inside a
        node, its rail (:attr:`Topology.rail_bandwidth`) between nodes (the simulator queues
        the transfers that use one port or rail at once)."""
        if inter_node:
            return topology.inter_latency + nbytes / topology.rail_bandwidth
        return topology.intra_latency + nbytes / topology.intra_bandwidth

    @classmethod
    def load(cls, spec: "str | CostModel | None" = "auto", device: Any = None) -> "CostModel":
        """``"auto"`` (the model of this device: :func:`torch_dcp.cost.auto.resolve`), ``"a100"``,
        ``"h100"`` (the kernels alone), ``"a100-executor"``, ``"h100-executor"`` (the same with the
        executor's fixed costs, :data:`GPU_EXECUTOR`: what ``"auto"`` gives on that card), or the
        paths of JSON cost models, comma-separated (merged, e.g. one table file measured per
        head_dim); a :class:`CostModel` as is; ``None`` as ``"auto"``.

        Args:
            device: for ``"auto"``: the device planned for (default: CUDA where available, else
                the CPU).

        Raises:
            ValueError: an unknown name or a missing or malformed file.
        """
        from pathlib import Path

        if isinstance(spec, CostModel):
            return spec
        if spec is None or spec == "auto":
            from .auto import resolve

            return resolve(device)
        if spec in ("a100", "h100"):
            return getattr(cls, spec)()
        if spec in ("a100-executor", "h100-executor"):
            name = spec.split("-")[0]
            return getattr(cls, name)().with_executor(
                GPU_EXECUTOR, f"{name} preset with the executor's counted operations per division and pass "
                "(13.2 µs each, measured on an H200 with layer replay)")
        paths = [Path(x) for x in str(spec).split(",")]
        for path in paths:
            if not path.is_file():
                raise ValueError(f"cost model must be 'auto', 'a100', 'h100', 'a100-executor', 'h100-executor' or "
                                 f"JSON cost model files, got {spec!r}")
        models = [cls.from_json(path.read_text()) for path in paths]
        return dataclasses.replace(cls.merge(*models), source=models[0].source or str(paths[0]))

    @classmethod
    def from_source(cls, source: str) -> "CostModel":
        """The model whose :attr:`source` is ``source`` (what ``plan.cost_model`` records):
        a shipped preset's (``"a100 preset"``, ``"h100 preset with the executor's kernel counts
        from an H200 (5 µs each, assumed)"``, ...) or its name, a JSON file's path, or the model
        ``"auto"`` resolves to on this machine (:func:`torch_dcp.cost.auto.resolve`).

        Raises:
            ValueError: no model on this machine has that source (pass the model itself).
        """
        names = ("a100", "h100", "a100-executor", "h100-executor")
        for name in names:
            if cls.load(name).source == source or source == name:
                return cls.load(name)
        from pathlib import Path

        if Path(source).is_file():
            return cls.load(source)
        from .auto import resolve

        auto = resolve()
        if auto.source == source:
            return auto
        raise ValueError(f"no cost model with source {source!r} on this machine (presets: {', '.join(names)}; "
                         f"'auto' gives {auto.source!r}): pass the model the plan was made with")

    def to_json(self, **meta: Any) -> str:
        """The model as JSON (:meth:`from_json` reads it back); ``meta`` is stored beside it."""
        d: dict[str, Any] = {"kernel": dataclasses.asdict(self.kernel), "memory_bandwidth": self.memory_bandwidth,
                             "launch_overhead": self.launch_overhead}
        if self.tables:
            d["tables"] = [{"head_dim": hd, "dtype": dt, "kernel": dataclasses.asdict(t)} for hd, dt, t in self.tables]
        if self.executor is not None:
            d["executor"] = self.executor.to_dict()
        if self.links is not None:
            d["links"] = dataclasses.asdict(self.links)
        if self.source:
            d["source"] = self.source
        if meta:
            d["meta"] = meta
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        """Load a table or model measured on your own device (the format of :meth:`to_json`; a
        ``meta`` object with ``head_dim`` and ``dtype``, as ``benchmarks kernels table`` writes,
        also files the table under that shape in ``tables``).

        Raises:
            ValueError: malformed JSON, table or executor costs.
        """
        def table(k: dict) -> KernelTable:
            return KernelTable(**{key: tuple(float(v) for v in vals) for key, vals in k.items()})

        try:
            d = json.loads(text)
            main = table(d["kernel"])
            tables = [(int(t["head_dim"]), str(t["dtype"]), table(t["kernel"])) for t in d.get("tables", [])]
            meta = d.get("meta") or {}
            if "head_dim" in meta and "dtype" in meta and "executor" not in d:
                tables.insert(0, (int(meta["head_dim"]), str(meta["dtype"]), main))
            executor = ExecutorCosts.from_dict(d["executor"]) if d.get("executor") else None
            links = Links(**d["links"]) if d.get("links") else None
            return cls(main, float(d["memory_bandwidth"]), float(d.get("launch_overhead", 5e-6)), tuple(tables),
                       executor, links, str(d.get("source", "")))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
            raise ValueError(f"CostModel.from_json: malformed cost model ({type(err).__name__}: {err})") from None
