"""What torch_dcp's own executor costs, instruction by instruction: the terms a calibrated cost
model charges (NumPy only).

A rank's pass, as :class:`~torch_dcp.executor.RankExecutor` runs it, costs

* per pass: a fixed part and the bytes of its local rows (allocations, ``delta`` in the
  backward, the final conversions): ``pass_fixed + pass_byte x local bytes``;
* per ``BlockwiseCopy`` / ``BlockwiseReduction`` / ``CommLaunch`` (gathering the messages it
  sends): ``fixed + byte x bytes`` (:class:`MemoryCosts`);
* per ``BlockwiseAttention`` (a *division*): the executor's gathers and writes plus the launches
  of the kernel it chose there, charged by the work that kernel really performs
  (:class:`LaunchCosts`, :func:`launch_features`)::

      fixed + call x calls + byte x bytes + call_byte x call_bytes + mask x mask_elements
            + work FLOPs x flop + masked-work FLOPs x masked_flop + masked_call x masked calls

  where a ``flop`` of ``None`` charges the work at the throughput of the cost model's kernel
  table instead (the GPU presets: FlashAttention's published TFLOP/s by work per launch).

What a kernel really performs (:class:`KernelWork`):

* ``RECTANGLE`` (``sdpa``, ``reference``): one call per query block; each computes the whole
  rectangle of its query rows x the keys of its tiles, and where a tile is partial the call
  computes under a dense mask of the whole rectangle, evaluated from the key ranges in the partial
  tiles (``query rows x keys x key ranges`` elements there) -- except where the one partial tile
  is the block's own diagonal under a causal mask: that block runs as a causal call (no mask; the
  CPU kernel skips only its key splits of 512 above the diagonal) beside one unmasked call on the
  other keys;
* ``BLOCKS`` (``flex``): one launch; the visible pairs rounded up to the kernel's own
  128 x 128 blocks (a partial tile's mask boundary wastes about half a block per 128 rows);
* ``VISIBLE`` (``varlen``, ``flash_attn``): one launch over the visible pairs, per document.

The executor's automatic choice (:func:`torch_dcp.executor.get_kernel`) is followed: on a CPU
every division runs ``sdpa``; on CUDA a division whose documents all have causal or full masks
runs the fast varlen kernel, any other the general one (FlexAttention).

The form follows FlexSP's fitted ``(α1·s² + α2·s)/d + β1`` per micro-batch (Wang et al., ASPLOS
2025, §5.1) and DistCA's per-call floor, with terms for what this executor does per division.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import numpy as np

from ..masks import Causal, Full
from ..workload import BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR, Buf, Workload, item_token_bytes

__all__ = ["memory_kind", "KernelWork", "KERNEL_WORK", "LaunchCosts", "KernelCosts", "MemoryCosts", "ExecutorCosts",
           "LAUNCH_FEATURES", "launch_features", "cell_kernels", "least_launch_seconds"]

#: the key split of PyTorch's CPU flash attention (``kvSplitSize`` for 512 keys or more)
CPU_KV_SPLIT = 512
#: the side of FlexAttention's blocks (its default ``BLOCK_SIZE``), in tokens
FLEX_BLOCK = 128


class KernelWork(enum.Enum):
    """The work an attention kernel performs for the tiles it is given (module docstring)."""

    RECTANGLE = "rectangle"
    BLOCKS = "blocks"
    VISIBLE = "visible"


#: each kernel name's work (the registry's names, :data:`torch_dcp.executor.kernels.KERNEL_NAMES`)
KERNEL_WORK: dict[str, KernelWork] = {"sdpa": KernelWork.RECTANGLE, "reference": KernelWork.RECTANGLE,
                                      "flex": KernelWork.BLOCKS, "varlen": KernelWork.VISIBLE,
                                      "flash_attn": KernelWork.VISIBLE}

#: the features of a division's launch, in :meth:`LaunchCosts.vector` order
LAUNCH_FEATURES = ("launch", "calls", "bytes", "call_bytes", "mask", "work", "masked_work", "masked_calls")


@dataclasses.dataclass(frozen=True)
class LaunchCosts:
    """Seconds per unit of each launch feature (:data:`LAUNCH_FEATURES`), one kernel, one pass.

    Attributes:
        fixed: per division (the executor's gathers and writes as launches, host dispatch).
        call: per kernel call.
        byte: per byte the executor gathers and writes (query, key/value and output rows).
        call_byte: per byte a call copies for itself (GQA heads expanded, casts; ``RECTANGLE``).
        mask: per mask element x key range evaluated (``RECTANGLE``'s partial tiles).
        flop, masked_flop: per FLOP of the kernel's work on full / masked tiles; ``None``: at
            the throughput of the cost model's kernel table.
        masked_call: per call under a mask it builds (``RECTANGLE``'s partial groups).
    """

    fixed: float = 0.0
    call: float = 0.0
    byte: float = 0.0
    call_byte: float = 0.0
    mask: float = 0.0
    flop: float | None = None
    masked_flop: float | None = None
    masked_call: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not (np.isfinite(v) and v >= 0):
                raise ValueError(f"LaunchCosts.{f.name} must be a finite non-negative number of seconds, got {v!r}")

    @classmethod
    def from_vector(cls, c: np.ndarray) -> "LaunchCosts":
        """From coefficients in :data:`LAUNCH_FEATURES` order."""
        return cls(*(float(x) for x in c))

    def vector(self) -> np.ndarray:
        """float64 ``[len(LAUNCH_FEATURES)]`` (a ``None`` throughput as 0)."""
        return np.array([self.fixed, self.call, self.byte, self.call_byte, self.mask, self.flop or 0.0,
                         self.masked_flop or 0.0, self.masked_call])


@dataclasses.dataclass(frozen=True)
class KernelCosts:
    """One kernel's launch costs, forward and backward."""

    name: str
    forward: LaunchCosts
    backward: LaunchCosts

    def __post_init__(self):
        if self.name not in KERNEL_WORK:
            raise ValueError(f"KernelCosts: unknown kernel {self.name!r}; known: {sorted(KERNEL_WORK)}")

    @property
    def work(self) -> KernelWork:
        return KERNEL_WORK[self.name]

    def of(self, backward: bool) -> LaunchCosts:
        return self.backward if backward else self.forward


@dataclasses.dataclass(frozen=True)
class MemoryCosts:
    """A memory-bound instruction: ``fixed + byte x bytes`` seconds."""

    fixed: float = 0.0
    byte: float = 0.0

    def __post_init__(self):
        if not all(np.isfinite(v) and v >= 0 for v in (self.fixed, self.byte)):
            raise ValueError(f"MemoryCosts must be finite and non-negative, got {self}")

    def seconds(self, nbytes: Any) -> Any:
        nbytes = np.asarray(nbytes, float)
        return np.where(nbytes > 0, self.fixed + self.byte * nbytes, 0.0)


@dataclasses.dataclass(frozen=True)
class ExecutorCosts:
    """The executor's costs on one device (module docstring).

    Attributes:
        general: the kernel of every division on a CPU, of divisions the fast kernel cannot
            express on CUDA (FlexAttention).
        fast: on CUDA, the varlen kernel of divisions whose documents are all causal or full
            (``varlen`` or ``flash_attn``); None on a CPU.
        copy, merge, sum, pack: ``BlockwiseCopy``, ``BlockwiseReduction`` (an LSE merge of partial
            outputs; a sum of gradients), ``CommLaunch`` (:func:`memory_kind`).
        pass_fixed: seconds per pass, ``(forward, backward)``.
        pass_byte: seconds per byte of the rank's local rows in a pass.
        allgather: seconds per pass of torch_dcp's all-gather runtime's own device operations
            besides the attention kernel's work (:class:`~torch_dcp.executor.allgather.AllGatherExecutor`),
            ``(alone forward, alone backward, gathering forward, gathering backward)``: a rank
            that is its CP group alone, and one that gathers; None: charged as one division
            and one pass of the executor.
        ring: seconds per ring step with tiles, ``(forward, backward)``, of torch_dcp's ring
            runtime's own device operations (:class:`~torch_dcp.executor.ring.RingExecutor`:
            counted, on a GPU preset); None: each step charged as a division of the executor.
        te_allgather: seconds per pass, ``(forward, backward)``, of the device operations
            TransformerEngine's all-gather CP issues on a rank that gathers, the baseline's own
            (counted from its source; the preset's ``baselines`` names it), at the same cost
            per operation as torch_dcp's; None: the baseline is charged its kernels alone.
        node_allgather: seconds per pass, ``(forward, backward)``, of the node-once all-gather
            runtime's own device operations besides the attention kernels' work
            (:class:`~torch_dcp.executor.allgather_node.NodeAllGatherExecutor`, on a rank that
            gathers: counted, on a GPU preset); None: charged as two divisions and one pass of
            the executor.
        te_ring: seconds per ring step with tiles, ``(forward, backward)``, of the device
            operations TransformerEngine's ring (its P2P context parallelism) issues, the
            baseline's own (counted from its source, its one-off operations per pass spread over
            the steps; the preset's ``baselines`` names it), at the same cost per operation as
            torch_dcp's; None: the baseline is charged its kernels and its merges' bytes.
        te_a2a: seconds per pass of the device operations TransformerEngine's all-to-all context
            parallelism issues around its all-to-alls (the baselines' Ulysses and HCP; counted
            from its source, the preset's ``baselines`` names it), ``(forward, backward)`` with
            its one attention call (Ulysses: CP groups inside one head group, no ring) and
            ``(forward, backward)`` around a ring whose steps ``te_ring`` charges (HCP); None:
            the baseline is charged its kernels and its all-to-alls' bytes.
        heads: seconds per pass, ``(forward, backward)``, of the device operations torch_dcp's
            head parallelism issues around its all-to-alls (its layouts by head group,
            :class:`~torch_dcp.executor.heads.HeadParallelExecutor`), besides its outer plan's
            (counted, on a GPU preset, around a static runtime's outer plan); None: charged nothing.
        heads_executor: the same around an outer plan on torch_dcp's executor, which writes O and
            the LSE straight into the state the forward keeps (one copy fewer); None: ``heads``.
    """

    general: KernelCosts
    fast: KernelCosts | None = None
    copy: MemoryCosts = MemoryCosts()
    merge: MemoryCosts = MemoryCosts()
    sum: MemoryCosts = MemoryCosts()
    pack: MemoryCosts = MemoryCosts()
    pass_fixed: tuple[float, float] = (0.0, 0.0)
    pass_byte: float = 0.0
    allgather: tuple[float, float, float, float] | None = None
    te_allgather: tuple[float, float] | None = None
    ring: tuple[float, float] | None = None
    te_ring: tuple[float, float] | None = None
    node_allgather: tuple[float, float] | None = None
    te_a2a: tuple[float, float, float, float] | None = None
    heads: tuple[float, float] | None = None
    heads_executor: tuple[float, float] | None = None

    def kernels(self) -> tuple[KernelCosts, ...]:
        return (self.general,) if self.fast is None else (self.general, self.fast)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ExecutorCosts":
        """Raises: ValueError (through the constructors) on bad values; KeyError / TypeError on
        a malformed dict (:meth:`CostModel.from_json` turns them into ValueError)."""
        def kernel(k):
            return None if k is None else KernelCosts(k["name"], LaunchCosts(**k["forward"]),
                                                      LaunchCosts(**k["backward"]))

        return cls(kernel(d["general"]), kernel(d.get("fast")), MemoryCosts(**d["copy"]),
                   MemoryCosts(**d["merge"]), MemoryCosts(**d["sum"]), MemoryCosts(**d["pack"]),
                   tuple(float(x) for x in d["pass_fixed"]), float(d["pass_byte"]),
                   None if d.get("allgather") is None else tuple(float(x) for x in d["allgather"]),
                   None if d.get("te_allgather") is None else tuple(float(x) for x in d["te_allgather"]),
                   None if d.get("ring") is None else tuple(float(x) for x in d["ring"]),
                   None if d.get("te_ring") is None else tuple(float(x) for x in d["te_ring"]),
                   None if d.get("node_allgather") is None else tuple(float(x) for x in d["node_allgather"]),
                   None if d.get("te_a2a") is None else tuple(float(x) for x in d["te_a2a"]),
                   None if d.get("heads") is None else tuple(float(x) for x in d["heads"]),
                   None if d.get("heads_executor") is None else tuple(float(x) for x in d["heads_executor"]))

    def memory(self, kind: str) -> MemoryCosts | None:
        """The costs of a memory-bound instruction of ``kind`` (:func:`memory_kind`); None:
        free (``"alias"``)."""
        return None if kind == "alias" else getattr(self, kind)

    def pass_seconds(self, local_bytes: Any, backward: bool) -> Any:
        """The fixed costs of a pass of ranks holding ``local_bytes`` bytes of rows."""
        return self.pass_fixed[int(backward)] + self.pass_byte * np.asarray(local_bytes, float)


def memory_kind(ins: Any) -> str:
    """What a copy or reduction instruction is to the executor: ``"copy"``; ``"merge"`` (LSE
    merge of partial outputs); ``"sum"`` (of gradients); ``"alias"``: a sum of one partial per
    row into dQ, which the executor hands out as the result itself (no work)."""
    from ..plan import BlockwiseCopy, ReduceOp

    if isinstance(ins, BlockwiseCopy):
        return "copy"
    if ins.op is ReduceOp.LSE_MERGE:
        return "merge"
    if ins.src is Buf.DQ and len(ins.src_ptr) > 1 and bool(np.all(np.diff(ins.src_ptr) == 1)):
        return "alias"
    return "sum"


def cell_kernels(workload: Workload, tiles: np.ndarray, tile_cell: np.ndarray, n_cells: int,
                 costs: ExecutorCosts) -> np.ndarray:
    """Which kernel runs each cell (a rank's division) of ``tiles`` (``tile_cell``: the cell of
    each): bool ``[n_cells]``, True where the fast kernel does (CUDA: every document of its tiles
    causal or full), as the executor's automatic choice runs it."""
    if costs.fast is None or len(tiles) == 0:
        return np.zeros(n_cells, bool)
    b = workload.batch
    flash_ok = np.array([isinstance(m, (Causal, Full)) for m in b.masks], bool)
    tile_ok = flash_ok[b.doc_mask[workload.block_doc[workload.tile_q[tiles]]]]
    return np.bincount(np.asarray(tile_cell, np.int64), weights=~tile_ok, minlength=n_cells) == 0


def launch_features(workload: Workload, tiles: np.ndarray, tile_cell: np.ndarray, n_cells: int, work: KernelWork,
                    backward: bool) -> np.ndarray:
    """The :data:`LAUNCH_FEATURES` of ``n_cells`` launches: float64 ``[n_cells, len(LAUNCH_FEATURES)]``.

    Args:
        tiles: int ``[n]`` tile ids; ``tile_cell``: int ``[n]`` the launch (cell) of each; a
            tile in no cell is not passed.
        work: what the kernel performs (:class:`KernelWork`; :data:`_WORK_FEATURES` fills its
            columns).
        backward: the backward pass (its rows and FLOPs per pair).
    """
    out = np.zeros((n_cells, len(LAUNCH_FEATURES)))
    if len(tiles) == 0:
        return out
    t = _Tiles(workload, np.asarray(tiles, np.int64), np.asarray(tile_cell, np.int64), n_cells, backward)
    out[:, 0] = np.bincount(t.cell, minlength=n_cells) > 0
    out[:, 2] = t.row_bytes(t.q_rows, t.k_rows)
    _WORK_FEATURES[work](t, out)
    return out


class _Tiles:
    """The tiles of some launches, with what every kernel's features need: their rectangles,
    visible pairs, the distinct query blocks (groups) and key blocks of each launch."""

    def __init__(self, workload: Workload, tiles: np.ndarray, cell: np.ndarray, n_cells: int, backward: bool):
        b, nb = workload.batch, workload.n_blocks
        self.workload, self.cell, self.n_cells, self.backward = workload, cell, n_cells, backward
        self.blen = workload.block_len.astype(np.float64)
        self.tq, self.tk = workload.tile_q[tiles], workload.tile_kv[tiles]
        self.pairs = workload.tile_pairs[tiles].astype(np.float64)
        self.full = np.asarray(workload.tile_full, bool)[tiles]
        self.rect = self.blen[self.tq] * self.blen[self.tk]
        self.fpp = float((BWD_FLOPS_PER_PAIR if backward else FWD_FLOPS_PER_PAIR) * b.n_heads * b.head_dim)
        self.g_key, self.g_inv = np.unique(cell * nb + self.tq, return_inverse=True)
        self.g_cell = self.g_key // nb
        k_key = np.unique(cell * nb + self.tk)
        self.q_rows = np.bincount(self.g_cell, weights=self.blen[self.g_key % nb], minlength=n_cells)
        self.k_rows = np.bincount(k_key // nb, weights=self.blen[k_key % nb], minlength=n_cells)

    def row_bytes(self, q_rows: Any, k_rows: Any) -> Any:
        """Bytes the executor gathers and writes for ``q_rows`` query rows and ``k_rows``
        key/value rows: their Q and result (output or dQ) rows, their K/V (and dK/dV) rows."""
        itb, bw = item_token_bytes(self.workload.batch), self.backward
        res_row = itb[(True, Buf.DQ)] if bw else itb[(False, Buf.OPART)]
        kv_row = itb[(bw, Buf.KV)] + (itb[(True, Buf.DKV)] if bw else 0)
        return q_rows * (itb[(bw, Buf.Q)] + res_row) + k_rows * kv_row

    @property
    def copy_bytes(self) -> tuple[float, float]:
        """``(per key row, per query row)``: what a ``RECTANGLE`` call copies for itself (K and V
        with the query heads, GQA expanded; its Q rows)."""
        b = self.workload.batch
        acc = 8 if b.dtype == "float64" else 4
        return (2.0 * b.n_heads * b.head_dim * acc * (2 if self.backward else 1),
                b.n_heads * b.head_dim * acc * (3 if self.backward else 1))

    @functools.cached_property
    def causal_diagonal(self) -> np.ndarray:
        """bool ``[n]``: partial tiles on their query block's own diagonal under a causal mask."""
        b = self.workload.batch
        causal = np.array([isinstance(m, Causal) for m in b.masks], bool)
        return ~self.full & (self.tq == self.tk) & causal[b.doc_mask[self.workload.block_doc[self.tq]]]

    @functools.cached_property
    def tail_work(self) -> np.ndarray:
        """Pairs a causal diagonal tile costs run as a causal call of its own on the CPU: the CPU
        flash kernel skips key splits of 512 past the diagonal, so a causal block of n keys
        costs its whole square up to n = 512, 3/4 of it at 1024, half as n grows."""
        side = np.maximum(self.blen[self.tq], 1.0)
        return self.rect * (0.5 + 0.5 * np.minimum(1.0, CPU_KV_SPLIT / side))

    def one_launch_work(self, work: KernelWork) -> np.ndarray:
        """Pairs every tile costs a one-launch kernel: ``BLOCKS`` rounds a partial tile's pairs
        up to 128 x 128 blocks (about half a block per 128 rows at its mask boundary),
        ``VISIBLE`` computes the visible pairs."""
        if work is KernelWork.VISIBLE:
            return self.pairs
        edge = FLEX_BLOCK / 2.0 * (self.blen[self.tq] + self.blen[self.tk])
        return np.where(self.full, self.rect, np.minimum(self.rect, self.pairs + edge))

    def per_cell(self, weights: np.ndarray) -> np.ndarray:
        """Sums of per-tile ``weights`` by launch: ``[n_cells]``."""
        return np.bincount(self.cell, weights=weights, minlength=self.n_cells)

    def per_group(self, weights: np.ndarray) -> np.ndarray:
        """Sums of per-tile ``weights`` by group: ``[groups]``."""
        return np.bincount(self.g_inv, weights=weights, minlength=len(self.g_key))


def _rectangle_features(t: _Tiles, out: np.ndarray) -> None:
    """``KernelWork.RECTANGLE`` (module docstring): a call per group, whole rectangles, masks
    built in partial tiles, causal diagonal blocks as causal calls of their own."""
    b, partial, diag = t.workload.batch, ~t.full, t.causal_diagonal
    g_partial = t.per_group(partial)
    g_tail = (g_partial == 1) & (t.per_group(diag) == 1)  # the group's one partial tile is its causal diagonal
    tail = g_tail[t.g_inv]
    t_masked = (g_partial > 0)[t.g_inv] & ~tail
    g_rest = t.per_group(~diag) > 0  # a tail group's other keys: one more call
    out[:, 1] = np.bincount(t.g_cell, weights=1.0 + (g_tail & g_rest), minlength=t.n_cells)
    # each call copies its keys' K and V with the query heads (GQA expanded) and its own Q rows
    per_key, per_query = t.copy_bytes
    out[:, 3] = t.per_cell(t.blen[t.tk]) * per_key + t.q_rows * per_query
    out[:, 4] = t.per_cell(t.rect * (partial & t_masked)) * max(m.n_ranges for m in b.masks)
    done = np.where(tail & diag, t.tail_work, t.rect)
    out[:, 5] = t.per_cell(done * ~t_masked) * t.fpp
    out[:, 6] = t.per_cell(t.rect * t_masked) * t.fpp
    out[:, 7] = np.bincount(t.g_cell, weights=(g_partial > 0) & ~g_tail, minlength=t.n_cells)


def _blocks_features(t: _Tiles, out: np.ndarray) -> None:
    """``KernelWork.BLOCKS``: one launch; partial tiles' pairs rounded up to 128 x 128 blocks."""
    _one_launch(t, out, t.one_launch_work(KernelWork.BLOCKS))


def _visible_features(t: _Tiles, out: np.ndarray) -> None:
    """``KernelWork.VISIBLE``: one launch over the visible pairs."""
    _one_launch(t, out, t.one_launch_work(KernelWork.VISIBLE))


def _one_launch(t: _Tiles, out: np.ndarray, done: np.ndarray) -> None:
    out[:, 1] = out[:, 0]
    out[:, 5] = t.per_cell(done * t.full) * t.fpp
    out[:, 6] = t.per_cell(done * ~t.full) * t.fpp


#: each kernel work's columns of :func:`launch_features` (beyond the launch and the executor's bytes)
_WORK_FEATURES = {KernelWork.RECTANGLE: _rectangle_features, KernelWork.BLOCKS: _blocks_features,
                  KernelWork.VISIBLE: _visible_features}


def least_launch_seconds(workload: Workload, costs: ExecutorCosts, backward: bool, seconds_per_flop: float) -> float:
    """The least total seconds the attention launches of all of ``workload``'s tiles can cost in
    one pass, however the tiles are spread over ranks and divisions: a lower bound of the sum, over
    any placement's launches (cells), of what :meth:`torch_dcp.cost.CostModel.launch_seconds`
    charges them (seconds). Each tile is charged the cheapest work any of ``costs``' kernels could
    do it with (for ``RECTANGLE``: masked or not, a causal tail or not, whichever its launch makes
    it) with, for ``RECTANGLE``, the keys its call copies; each query and key block its rows gathered
    and written once (at the cheapest kernel's ``byte``); where one kernel runs every launch (a
    CPU) and it is ``RECTANGLE``, one call per query block and its query rows copied once. The
    per-launch, mask and masked-call terms are left out (none is negative): a launch's features
    only grow when its tiles are split over more launches.

    Args:
        seconds_per_flop: the work's cost per FLOP where a kernel's ``flop`` or ``masked_flop`` is
            None (charged at the kernel table's throughput): the table's best, ``1 / (TFLOP/s x
            1e12)``.
    """
    n = workload.n_tiles
    if n == 0:
        return 0.0
    t = _Tiles(workload, np.arange(n, dtype=np.int64), np.zeros(n, np.int64), 1, backward)  # one launch
    per_key, per_query = t.copy_bytes
    partial, diag = ~t.full, t.causal_diagonal
    cheapest = np.full(n, np.inf)
    kernels = costs.kernels()
    for kern in kernels:
        lc = kern.of(backward)
        flop = seconds_per_flop if lc.flop is None else lc.flop
        masked = seconds_per_flop if lc.masked_flop is None else lc.masked_flop
        if kern.work is KernelWork.RECTANGLE:
            work = np.where(diag, np.minimum(t.tail_work * flop, t.rect * masked),
                            np.where(partial, t.rect * masked, t.rect * min(flop, masked)))
            tile = work * t.fpp + lc.call_byte * t.blen[t.tk] * per_key
        else:
            tile = t.one_launch_work(kern.work) * t.fpp * np.where(t.full, flop, masked)
        cheapest = np.minimum(cheapest, tile)
    rows = float(t.row_bytes(t.q_rows[0], t.k_rows[0]))  # every query and key block's rows once
    seconds = float(cheapest.sum()) + min(k.of(backward).byte for k in kernels) * rows
    if len(kernels) == 1 and kernels[0].work is KernelWork.RECTANGLE:
        lc = kernels[0].of(backward)
        seconds += lc.call * len(t.g_key) + lc.call_byte * float(t.q_rows[0]) * per_query
    return seconds
