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

* ``H100``: FlashAttention-3 figures as quoted in ``shared/DESIGN.md`` (Shah et al.,
  "FlashAttention-3", 2024): forward 660-700 TFLOP/s at >= 4K tokens per launch, 283 causal at
  1K; backward 460-585 at >= 4K, 208 at 1K. Points between are interpolated.
* ``A100``: approximate readings of the FlashAttention-2 paper's A100-80GB benchmark figures
  (Dao, "FlashAttention-2", 2023, figures 4-6, head_dim 128): forward about 150-225 TFLOP/s
  from 512 to 16K tokens, backward about 110-195.

A user loads their own table with :meth:`CostModel.from_json` (same keys as
:meth:`CostModel.to_json`; ``python -m torch_dcp.benchmarks kernels table`` measures one per
head_dim) and joins several with :meth:`CostModel.merge`: a launch uses the table measured for
the batch's head_dim and dtype, else the default one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

__all__ = ["CostModel", "KernelTable", "A100", "H100"]


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


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Times of instructions and transfers, in seconds (the module docstring has the model).

    An attention launch takes ``FLOPs / throughput(work per launch) + launch_overhead``; a
    reduction or copy ``bytes / memory_bandwidth``; a transfer ``latency + bytes /
    bandwidth`` of its link, from the :class:`~torch_dcp.Topology`. Build one with
    :meth:`a100` (FlashAttention-2 paper's A100-80GB figures, 1.6 TB/s), :meth:`h100`
    (FlashAttention-3 paper's H100 figures, 3.0 TB/s), :meth:`load` (``"a100"``, ``"h100"``
    or JSON table paths) or :meth:`from_json` (a table measured with ``python -m
    torch_dcp.benchmarks kernels table --out my_gpu.json``). Used by :func:`torch_dcp.simulate`
    and by :func:`torch_dcp.plan` (``cost_model=``) to time candidates.

    Attributes:
        kernel: the attention throughput table (the shipped ones: bf16, head_dim 128).
        memory_bandwidth: bytes/s of device memory (reductions, copies).
        launch_overhead: seconds added to every kernel launch.
        tables: optional tables measured for other shapes, ``((head_dim, dtype, table), ...)``;
            a launch uses the one matching the batch's head_dim and dtype, else ``kernel``
            (:meth:`table_for`). :meth:`merge` joins measured files (one per head_dim).
    """

    kernel: KernelTable = A100
    memory_bandwidth: float = 1.6e12
    launch_overhead: float = 5e-6
    tables: tuple[tuple[int, str, KernelTable], ...] = ()

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
        1.6 TB/s of memory bandwidth, 5 µs per launch."""
        return cls(A100, 1.6e12)

    @classmethod
    def h100(cls) -> "CostModel":
        """The H100 model: the FlashAttention-3 paper's throughputs (bf16, head_dim 128),
        3.0 TB/s of memory bandwidth, 5 µs per launch."""
        return cls(H100, 3.0e12)

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
    def load(cls, spec: str) -> "CostModel":
        """``"a100"``, ``"h100"``, or the paths of JSON cost tables, comma-separated (merged,
        e.g. one file measured per head_dim).

        Raises:
            ValueError: an unknown name or a missing or malformed file.
        """
        from pathlib import Path

        if spec in ("a100", "h100"):
            return getattr(cls, spec)()
        paths = [Path(x) for x in str(spec).split(",")]
        for path in paths:
            if not path.is_file():
                raise ValueError(f"cost model must be 'a100', 'h100' or JSON table files, got {spec!r}")
        return cls.merge(*(cls.from_json(path.read_text()) for path in paths))

    def to_json(self) -> str:
        d: dict[str, Any] = {"kernel": dataclasses.asdict(self.kernel), "memory_bandwidth": self.memory_bandwidth,
                             "launch_overhead": self.launch_overhead}
        if self.tables:
            d["tables"] = [{"head_dim": hd, "dtype": dt, "kernel": dataclasses.asdict(t)} for hd, dt, t in self.tables]
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        """Load a table measured on your own device (the format of :meth:`to_json`; a
        ``meta`` object with ``head_dim`` and ``dtype``, as ``benchmarks kernels table`` writes,
        also files the table under that shape in ``tables``).

        Raises:
            ValueError: malformed JSON or table.
        """
        def table(k: dict) -> KernelTable:
            return KernelTable(**{key: tuple(float(v) for v in vals) for key, vals in k.items()})

        try:
            d = json.loads(text)
            main = table(d["kernel"])
            tables = [(int(t["head_dim"]), str(t["dtype"]), table(t["kernel"])) for t in d.get("tables", [])]
            meta = d.get("meta") or {}
            if "head_dim" in meta and "dtype" in meta:
                tables.insert(0, (int(meta["head_dim"]), str(meta["dtype"]), main))
            return cls(main, float(d["memory_bandwidth"]), float(d.get("launch_overhead", 5e-6)), tuple(tables))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
            raise ValueError(f"CostModel.from_json: malformed cost table ({err})") from None
