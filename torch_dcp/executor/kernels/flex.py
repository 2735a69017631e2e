"""FlexAttention kernel: one launch per division, any mask.

:class:`FlexKernel` runs a whole ``BlockwiseAttention`` instruction (all its groups) as one
``torch.nn.attention.flex_attention.flex_attention`` call (He et al., "FlexAttention",
arXiv 2412.05496):

* queries: the division's query blocks packed one after another, ``[1, H, N_q, D]``;
  keys/values: the distinct key/value blocks it reads, ``[1, H_kv, N_k, D]`` (GQA through
  ``enable_gqa``). Both are padded to a multiple of the flex block size (default 128 rows; the
  executor gathers the padding rows with the rest); padding rows see nothing and are seen by
  nothing.
* a ``BlockMask`` built on the host from the division's tile list when the device plan is
  built (both directions: the key/value blocks of every query tile and, for the backward, the
  query blocks of every key/value tile), uploaded with the plan (no dense mask evaluation, no
  device work per step):
  a flex tile is *present* if any of the division's tiles overlaps it and *full* if every
  pair in it belongs to a full tile of the division;
* a ``mask_mod`` evaluated in partial flex tiles on token codes (``document << 32 |
  document-local position``, one int64 per packed query and key): for the built-in masks
  (Causal, Full, Lambda, BlockwiseCausal) a closed form on the two codes -- two gathers per
  pair; for the others (SharedQuestion, Ranges, mixed masks) the key's code against the query's
  ``R`` key ranges (``BatchSpec.key_ranges``, as codes of its document). Where some
  (query block, key block) pair of one document has no tile in the division (it runs elsewhere),
  the pair's tile is looked up too (``[G, J]`` tile matrix: three more gathers), so a pair counts
  only where the plan runs its tile here.

The forward returns the partial output and its natural-log LSE (``-inf`` and output 0 for rows
that see no key).

Backward (exact gradients of the *global* attention), without recomputing the forward: flex's
own backward (the ``flex_attention_backward`` higher-order op, compiled on CUDA to its Triton
kernel) is called with the final LSE and ``O' = dO * delta / |dO|^2`` in place of the output
(:func:`~torch_dcp.executor.kernels.base.out_with_delta`; ``delta = rowsum(dO * O)`` of the final
output, which never travels): its softmax ``exp(S - LSE)`` is then the global one restricted to the
division's pairs and its ``rowsum(dO * O')`` the global ``delta``, so ``dS = P * (dO V^T - delta)``
is the FlashAttention-2 backward (Dao, 2023, Algorithm 2) of the global attention, as ring
attention calls it per step. The LSE gradient absorbs the rounding of ``O'`` to the input dtype.
The op takes the identity ``score_mod``'s forward and joint graphs, built once per dtype as
flex's own autograd builds them (torch 2.11 requires both; tested with 2.11 and 2.13, eager and
traced by ``torch.compile``), on the meta device whatever the inputs' device: the joint graph of
the identity returns the score's gradient as is, on any device, and tracing it runs the autograd
engine, which on CUDA tensors asks the driver for a context (so it could not be built for fake
CUDA tensors without a GPU). That op is internal to PyTorch: if its first call on a device type
fails (another torch version), the kernel warns once and falls back to the recomputing backward
below (``recompute=True``, the default: on CUDA the direct op runs PyTorch's dense
implementation, see Devices).

Recomputing backward: the partial forward is recomputed with autograd and back-propagated with
``grad_out = c * dO`` and ``grad_lse = c * (rowsum(dO * O_p) - delta)``, ``c = exp(LSE_p -
LSE)``, where ``LSE`` is the final LSE (``rowsum(grad_out * O_p) - c * delta`` in practice, with
``grad_out`` as rounded to the input dtype); on CPU, where FlexAttention's autograd has no
backward, through a dense differentiable stand-in that applies exactly the same block mask (full
/ partial tiles) and ``mask_mod``.

Devices:

* CUDA: ``torch.compile(flex_attention)`` (compiled once per process, dynamic shapes after the
  first recompile), inputs in their own dtype (bf16 stays bf16; partials are cast to the
  accumulation dtype for the merge); the backward op compiled the same way -- as far as Dynamo
  goes: it takes flex's backward op with pre-traced graphs only as compiled autograd passes them
  (from a dictionary), so the graph breaks at the op, which runs eagerly (PyTorch's dense
  implementation; seen on an H100 with torch 2.11). Passed that way, the op compiled to
  Inductor's Triton backward, whose gradients from these inputs were wrong (relative error ~1e2).
  The dense implementation holds float32 ``[H, N_q, N_k]`` scores: on an H200 (torch 2.11) a
  division of a 262,144-token λ batch asked for 102 GiB, and in a training step whose
  ``mask_mod`` Dynamo traced under ``vmap`` the op failed outright. So the CUDA backward
  recomputes by default: the compiled ``flex_attention`` under autograd runs Inductor's fused
  forward and backward templates (memory linear in the tokens), one extra forward per division.
* CPU: eager ``flex_attention`` for the forward (PyTorch's unfused implementation: it
  materialises the ``[H, N_q, N_k]`` scores); inputs are cast to the accumulation dtype.
  The backward recomputes by default: FlexAttention's autograd has no CPU backward, and the
  backward op's eager dense implementation (exact too, ``recompute=False``) is slower than the
  stand-in (the flex tests take about 1.4x as long with it). Meant for tests; use the ``"sdpa"``
  kernel for CPU runs.
* Fake tensors (``FakeTensorMode``, e.g. ``device="cuda"`` tensors on a machine without a GPU):
  shapes and dtypes only. Inductor (the default compiler) is skipped: its lowering of flex
  queries the real device, and the higher-order ops' fake implementations that eager flex runs
  give the outputs' shapes and dtypes the compiled kernels would. ``compile="aot_eager"`` (any
  ``torch.compile`` backend name) traces the forward, and the backward op up to flex's backward
  op (the graph breaks there, as on CUDA), with Dynamo and AOTAutograd instead, fake tensors too.
  The backward is flex's backward op (nothing recorded in the per-device fallback state: a fake
  call proves nothing about the kernel); the recomputing
  backward cannot run on fake CUDA tensors without a GPU: it needs the autograd engine, which
  asks the CUDA driver for a context.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
from typing import Callable, Iterator

import numpy as np
import torch

from ...masks import BlockwiseCausal, Causal, Full, Lambda
from ..division import Division
from ..triton_delta import flex_backward_inputs_triton
from ..reduce import triton_runs_on
from .base import KernelLayout, out_with_delta

__all__ = ["FlexKernel", "flex_available"]

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None
    flex_attention = None

try:  # torch >= 2.9: return_aux=AuxRequest(lse=True); older: return_lse=True
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

try:  # flex's backward as a higher-order op (internal to PyTorch; see the module docstring)
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph as _create_fw_bw_graph
    from torch._higher_order_ops.flex_attention import flex_attention_backward as _flex_backward_op
    from torch.nn.attention.flex_attention import _apply_kernel_options, _identity
except ImportError:  # pragma: no cover
    _flex_backward_op = None

try:
    from torch._dynamo.exc import FailOnRecompileLimitHit as _FailOnRecompileLimitHit
except ImportError:  # pragma: no cover
    class _FailOnRecompileLimitHit(Exception):
        pass

_USE_AUX = (flex_attention is not None and AuxRequest is not None
            and "return_aux" in inspect.signature(flex_attention).parameters)
#: compiled functions: "flex" / "backward" with Inductor, "flex:<backend>" / "backward:<backend>" else
_COMPILED: dict[str, Callable] = {}
_SCORE_GRAPHS: dict[torch.dtype, tuple[Callable, Callable]] = {}
#: per device type, whether the backward op ran there (absent: not tried yet in this process)
_DIRECT_BACKWARD: dict[str, bool] = {}
_LN2 = math.log(2.0)


def flex_available() -> bool:
    """Whether this torch has FlexAttention."""
    return flex_attention is not None


def _is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (``FakeTensorMode``: metadata only, no data or device)."""
    return torch._subclasses.fake_tensor.is_fake(t)


#: compiled variants of one function a process may hold before Dynamo's limit is hit. A division's
#: static layout (closed-form mask or ranges, tile check, GQA, head counts, dtype) picks a variant,
#: and a process that runs several masks (the suite, evaluation beside training) holds dozens;
#: Dynamo's default (``torch._dynamo.config.recompile_limit``, 8) would then run flex *uncompiled*:
#: dense scores in memory and a host synchronisation per call
RECOMPILE_LIMIT = 64


def _compiled(name: str, fn: Callable, backend: str) -> Callable:
    """``torch.compile(fn, backend=backend)``, compiled once per process (dynamic shapes after the
    first recompile), called with Dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT` (or the
    process's own, if higher) and hitting it an error rather than a silent uncompiled run.

    Raises (from the returned function):
        RuntimeError: the limit was hit; the message names the setting to raise."""
    key = name if backend == "inductor" else f"{name}:{backend}"
    if key not in _COMPILED:
        compiled = torch.compile(fn, backend=backend)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            cfg = torch._dynamo.config  # set and restored by hand: 8 us a call, config.patch 20 us
            saved = cfg.recompile_limit, cfg.fail_on_recompile_limit_hit
            limit = max(RECOMPILE_LIMIT, saved[0])
            cfg.recompile_limit = limit
            cfg.fail_on_recompile_limit_hit = not cfg.suppress_errors  # the two exclude each other
            try:
                return compiled(*args, **kwargs)
            except _FailOnRecompileLimitHit as e:
                raise RuntimeError(
                    f"torch.compile of {key} hit its recompile limit ({limit} variants in this process); torch_dcp "
                    "stops rather than run FlexAttention uncompiled (dense scores, a host synchronisation). Raise "
                    "torch._dynamo.config.recompile_limit; TORCH_LOGS=recompiles prints why each variant "
                    "recompiled") from e
            finally:
                cfg.recompile_limit, cfg.fail_on_recompile_limit_hit = saved

        _COMPILED[key] = call
    return _COMPILED[key]


def _score_graphs(dtype: torch.dtype) -> tuple[Callable, Callable]:
    """``(forward graph, joint graph)`` of the identity ``score_mod`` for scores of ``dtype``, as
    flex's own autograd builds them (torch 2.11 needs both; later versions build the joint graph
    when given None). Built once per dtype, on the meta device: the graphs hold no device, and
    tracing the joint graph runs the autograd engine, which on CUDA tensors (fake ones too) asks
    the driver for a context."""
    if dtype not in _SCORE_GRAPHS:
        with torch.device("meta"):
            example = (torch.zeros((), dtype=dtype, requires_grad=True),
                       *(torch.zeros((), dtype=torch.int) for _ in range(4)))
            _SCORE_GRAPHS[dtype] = _create_fw_bw_graph(_identity, example, ())
    return _SCORE_GRAPHS[dtype]


def _backward_op(q, k, v, out, lse2, grad_out, grad_lse2, block_mask, scale, fw_graph, joint_graph):
    """flex's backward op with the identity score_mod (its graphs from :func:`_score_graphs`; LSE
    and its gradient in base 2, as the forward op returns it)."""
    options = _apply_kernel_options(q, k, v, True, None)
    return _flex_backward_op(q, k, v, out, lse2, grad_out, grad_lse2, fw_graph, joint_graph, block_mask.as_tuple(),
                             scale, options, (), ())[:3]


@contextlib.contextmanager
def _autograd_inside() -> Iterator[None]:
    """Autograd on, also inside a ``torch.library`` custom op's implementation (the
    ``torch_dcp::attention_backward`` op runs the executor with the autograd dispatch keys
    excluded, where ``torch.enable_grad`` alone records nothing): the recomputation below needs a
    graph."""
    with contextlib.ExitStack() as stack:
        for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                    torch._C.DispatchKey.AutogradNestedTensor):
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        with torch.enable_grad():
            yield


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _prefix2d(a: np.ndarray) -> np.ndarray:
    s = np.zeros((a.shape[0] + 1, a.shape[1] + 1), np.int64)
    s[1:, 1:] = a.astype(np.int64).cumsum(0).cumsum(1)
    return s


def _spans(div: Division, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For every flex row (column) of the packed layout, the first and last group (key block)
    it holds: ``(g0, g1, j0, j1)``."""
    a = np.arange(-(-div.n_q // bs))
    b = np.arange(-(-div.n_k // bs))
    g0 = div.q_group[np.minimum(a * bs, div.n_q - 1)]
    g1 = div.q_group[np.minimum((a + 1) * bs, div.n_q) - 1]
    j0 = div.k_block[np.minimum(b * bs, div.n_k - 1)]
    j1 = div.k_block[np.minimum((b + 1) * bs, div.n_k) - 1]
    return g0, g1, j0, j1


def _rect_sums(s: np.ndarray, g0, g1, j0, j1) -> np.ndarray:
    """Sums over the ``[g0..g1] x [j0..j1]`` rectangles of the matrix with 2-D prefix sums ``s``."""
    return (s[g1[:, None] + 1, j1[None, :] + 1] - s[g0[:, None], j1[None, :] + 1]
            - s[g1[:, None] + 1, j0[None, :]] + s[g0[:, None], j0[None, :]])


def division_tiles(div: Division, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """Flex tiles of a division's packed layout: ``(full, partial)``, bool
    ``[ceil(N_q / bs), ceil(N_k / bs)]``, from the tile list (vectorised, no dense mask)."""
    nqt, nkt = -(-div.n_q // bs), -(-div.n_k // bs)
    g_lo, g_hi = div.q_ptr[:-1] // bs, (div.q_ptr[1:] - 1) // bs
    j_lo, j_hi = div.k_ptr[:-1] // bs, (div.k_ptr[1:] - 1) // bs
    tg, tj = div.tile_group, div.tile_key
    diff = np.zeros((nqt + 1, nkt + 1), np.int64)
    np.add.at(diff, (g_lo[tg], j_lo[tj]), 1)
    np.add.at(diff, (g_lo[tg], j_hi[tj] + 1), -1)
    np.add.at(diff, (g_hi[tg] + 1, j_lo[tj]), -1)
    np.add.at(diff, (g_hi[tg] + 1, j_hi[tj] + 1), 1)
    present = diff.cumsum(0).cumsum(1)[:nqt, :nkt] > 0
    # full: the flex tile lies inside real rows and keys, and every (group, key block) pair it
    # spans is a full tile of the division
    _, full_t = div.tile_matrix()
    g0, g1, j0, j1 = _spans(div, bs)
    cnt = _rect_sums(_prefix2d(full_t), g0, g1, j0, j1)
    area = (g1 - g0 + 1)[:, None] * (j1 - j0 + 1)[None, :]
    inside = ((np.arange(nqt) + 1) * bs <= div.n_q)[:, None] & ((np.arange(nkt) + 1) * bs <= div.n_k)[None, :]
    full = inside & (cnt == area) & present
    return full, present & ~full


def _tile_check_needed(div: Division) -> bool:
    """Whether some (group, key block) pair that the mask may see has no tile in the division
    (its tile runs elsewhere): only then must ``mask_mod`` look the pair's tile up. (The block
    mask alone would hide such pairs from the compiled kernel where no partial flex tile spans
    them, but ``mask_mod`` must be exact on every pair: eager FlexAttention evaluates it
    everywhere.)"""
    present, _ = div.tile_matrix()
    return bool((div.reachable() & ~present).any())


# ---------------------------------------------------------------------------------- mask_mod
# Token codes: ``document << 32 | document-local position`` (int64); padding keys -1 and
# padding queries -2 << 32 belong to no document. Closed forms of the built-in masks on two
# codes (one gather each per pair); other masks compare the key's code with the query's ranges.
_POS = 0xFFFFFFFF
_PAD_KEY = -1
_PAD_QUERY = -(2 << 32)


def _codes(doc: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return (doc.astype(np.int64) << 32) | pos.astype(np.int64)


def _same_doc(qc, kc):
    return (qc >> 32) == (kc >> 32)


def _causal_form(spec: Causal):
    return lambda qc, kc: _same_doc(qc, kc) & (kc <= qc)


def _full_form(spec: Full):
    return _same_doc


def _lambda_form(spec: Lambda):
    sink, window = int(spec.sink), int(spec.window)

    def seen(qc, kc):
        kp = kc & _POS
        return _same_doc(qc, kc) & (kc <= qc) & ((kp < sink) | (kp > (qc & _POS) - window))
    return seen


def _blockwise_form(spec: BlockwiseCausal):
    block, window, sink = int(spec.block), int(spec.window_blocks), int(spec.sink_blocks)

    def seen(qc, kc):
        kb = (kc & _POS) // block
        return _same_doc(qc, kc) & (kc <= qc) & ((kb < sink) | ((qc & _POS) // block - kb < window))
    return seen


_CLOSED_FORMS = {Causal: _causal_form, Full: _full_form, Lambda: _lambda_form, BlockwiseCausal: _blockwise_form}


def _pad(a: np.ndarray, n: int, fill: int) -> np.ndarray:
    out = np.full((n,) + a.shape[1:], fill, np.int64)
    out[:len(a)] = a
    return out


def _block_lists(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(num [1, 1, rows], indices [1, 1, rows, cols])`` int32: the columns set in each row of
    ``m``, in ascending order (the BlockMask index format)."""
    num = m.sum(axis=1).astype(np.int32)
    idx = np.argsort(~m, axis=1, kind="stable").astype(np.int32)
    return num[None, None], np.ascontiguousarray(idx)[None, None]


class _FlexMeta:
    """A division's flex state on the device (built once per upload)."""

    def __init__(self, arrays: dict[str, torch.Tensor], static: tuple):
        self.n_q, self.n_k, self.nq_pad, self.nk_pad, self.bs, self.n_ranges, spec, tile_check = static
        a = arrays
        qcode, kcode = a["qcode"], a["kcode"]
        if spec is not None:  # ``seen(q_idx, kc)``: the pair's visibility from the two codes
            form = _CLOSED_FORMS[type(spec)](spec)

            def seen(q_idx, kc):
                return form(qcode[q_idx], kc)
        else:  # the query's key ranges, as codes of its document ([N_q_pad * R], row-major)
            starts, ends, R = a["starts"], a["ends"], self.n_ranges

            def seen(q_idx, kc):
                # tensor indices only: traced by torch.compile, the 0 of starts[q_idx, 0] became a
                # tensor made at trace time on the device (a real allocation even for fake tensors)
                row = q_idx * R
                hit = (kc >= starts[row]) & (kc < ends[row])
                for r in range(1, R):
                    hit = hit | ((kc >= starts[row + r]) & (kc < ends[row + r]))
                return hit

        if tile_check:
            tiles, qg, kb = a["tiles"], a["qg"], a["kb"]

        def mask_mod(b, h, q_idx, kv_idx):
            ok = seen(q_idx, kcode[kv_idx])
            if tile_check:
                ok = ok & tiles[qg[q_idx] + kb[kv_idx]]
            return ok

        self.mask_mod = mask_mod
        self.full, self.partial = a["full"], a["partial"]
        self.block_mask = BlockMask(
            seq_lengths=(self.nq_pad, self.nk_pad), kv_num_blocks=a["kv_num"], kv_indices=a["kv_idx"],
            full_kv_num_blocks=a["full_kv_num"], full_kv_indices=a["full_kv_idx"], q_num_blocks=a["q_num"],
            q_indices=a["q_idx"], full_q_num_blocks=a["full_q_num"], full_q_indices=a["full_q_idx"],
            BLOCK_SIZE=(self.bs, self.bs), mask_mod=mask_mod)
        self._dense: torch.Tensor | None = None

    def dense_visible(self) -> torch.Tensor:
        """bool ``[N_q_pad, N_k_pad]``: what flex sees (full tiles, or partial tiles where
        ``mask_mod`` holds); device ops only."""
        if self._dense is None:
            bs, dev = self.bs, self.full.device
            full = self.full.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
            part = self.partial.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
            qi = torch.arange(self.nq_pad, device=dev)[:, None]
            ki = torch.arange(self.nk_pad, device=dev)[None, :]
            zero = torch.zeros((), dtype=torch.long, device=dev)
            self._dense = full | (part & self.mask_mod(zero, zero, qi, ki))
        return self._dense


class FlexKernel:
    """FlexAttention over whole divisions (see the module docstring); the division protocol of
    :class:`~torch_dcp.executor.kernels.base.DivisionKernel`.

    Args:
        block_size: flex tile size in rows (``BLOCK_SIZE`` of the ``BlockMask``; default 128).
        compile: use ``torch.compile(flex_attention)`` (and the backward op compiled): True for
            Inductor, a ``torch.compile`` backend name (e.g. ``"aot_eager"``: traced, run
            eagerly; fake tensors too) for that backend, False for eager flex; default: Inductor on
            CUDA only (the compiled CPU kernel returns no LSE). Inductor is skipped for fake
            tensors (see the module docstring).
        recompute: recompute each division's forward in the backward instead of calling flex's
            backward op with the final LSE (see the module docstring); default True: that op
            runs PyTorch's dense implementation (``[H, N_q, N_k]`` scores in memory) on every
            device, also under ``torch.compile`` with torch 2.11 (fake tensors: the op, whose
            shapes are the same; recomputing traces autograd, which asks the driver). False: the
            op, for tests and small divisions.

    Raises:
        RuntimeError: this torch has no FlexAttention.
        ValueError: ``block_size`` not positive.
    """

    name = "flex"

    def __init__(self, block_size: int = 128, compile: bool | str | None = None, recompute: bool | None = None):
        if flex_attention is None:
            raise RuntimeError("FlexKernel needs torch.nn.attention.flex_attention (torch >= 2.5)")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = int(block_size)
        self.compile = compile
        self.recompute = recompute

    # ------------------------------------------------------------------ host side
    def prepare(self, div: Division) -> KernelLayout:
        """Block mask (both directions) and ``mask_mod`` tables of ``div`` (NumPy)."""
        bs = self.block_size
        full, partial = division_tiles(div, bs)
        nq_pad, nk_pad = _round_up(div.n_q, bs), _round_up(div.n_k, bs)
        spec = div.mask if type(div.mask) in _CLOSED_FORMS else None
        arrays = {"full": full, "partial": partial,
                  "qcode": _pad(_codes(div.q_doc, div.q_pos), nq_pad, _PAD_QUERY),
                  "kcode": _pad(_codes(div.k_doc, div.k_pos), nk_pad, _PAD_KEY)}
        if spec is None:  # ranges as codes of the query's document; padding queries: empty ranges
            base = div.q_doc.astype(np.int64)[:, None] << 32
            arrays["starts"] = _pad(base + div.key_starts, nq_pad, 0).reshape(-1)  # [N_q_pad * R]
            arrays["ends"] = _pad(base + div.key_ends, nq_pad, 0).reshape(-1)
        tile_check = _tile_check_needed(div)
        if tile_check:
            G, J = div.n_groups, div.n_key_blocks
            present, _ = div.tile_matrix()
            tm = np.zeros((G + 1, J + 1), bool)  # row G / column J: padding, sees nothing
            tm[:G, :J] = present
            arrays.update(tiles=tm.reshape(-1), qg=_pad(div.q_group * (J + 1), nq_pad, G * (J + 1)),
                          kb=_pad(div.k_block, nk_pad, J))
        for name, m in (("", partial), ("full_", full)):
            arrays[f"{name}kv_num"], arrays[f"{name}kv_idx"] = _block_lists(m)
            arrays[f"{name}q_num"], arrays[f"{name}q_idx"] = _block_lists(np.ascontiguousarray(m.T))
        static = (div.n_q, div.n_k, nq_pad, nk_pad, bs, div.key_starts.shape[1], spec, tile_check)
        return KernelLayout(nq_pad, nk_pad, arrays, static)

    def bind(self, arrays: dict[str, torch.Tensor], static: tuple) -> _FlexMeta:
        return _FlexMeta(arrays, static)

    # ------------------------------------------------------------------ device side
    def _backend(self, t: torch.Tensor) -> str | None:
        """The ``torch.compile`` backend for inputs like ``t``, or None: eager."""
        c = self.compile if self.compile is not None else t.device.type == "cuda"
        if c is False:
            return None
        backend = "inductor" if c is True else str(c)
        return None if backend == "inductor" and _is_fake(t) else backend  # Inductor needs a real device

    def _flex(self, q4, k4, v4, meta: _FlexMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """flex_attention with the LSE (natural log), either API spelling."""
        backend = self._backend(q4)
        fn = _compiled("flex", flex_attention, backend) if backend is not None else flex_attention
        kw = dict(block_mask=meta.block_mask, scale=scale, enable_gqa=q4.shape[1] != k4.shape[1])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")
            if _USE_AUX:
                out, aux = fn(q4, k4, v4, return_aux=AuxRequest(lse=True), **kw)
                return out, aux.lse
            out, lse = fn(q4, k4, v4, return_lse=True, **kw)
            return out, lse

    @staticmethod
    def _dense(q4, k4, v4, meta: _FlexMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable stand-in for flex on devices where flex has no backward: the same
        visible pairs (block mask + mask_mod), dense math."""
        g = q4.shape[1] // k4.shape[1]
        k4, v4 = k4.repeat_interleave(g, 1), v4.repeat_interleave(g, 1)
        vis = meta.dense_visible()
        empty = ~vis.any(-1)  # [N_q]
        s = torch.einsum("bhqd,bhkd->bhqk", q4, k4) * scale
        s = s.masked_fill(~vis, -math.inf).masked_fill(empty[:, None], 0.0)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bhqk,bhkd->bhqd", p, v4)
        out = torch.where(empty[:, None], torch.zeros_like(out), out)
        lse = torch.where(empty, torch.full_like(lse, -math.inf), lse)
        return out, lse

    @staticmethod
    def _heads_first(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).transpose(0, 1).unsqueeze(0)

    def _in_dtype(self, t: torch.Tensor, acc: torch.dtype) -> torch.dtype:
        return t.dtype if t.device.type == "cuda" else acc

    def forward(self, q, k, v, meta: _FlexMeta, scale, acc_dtype):
        """Partial output ``[n_q, H, D]`` and LSE ``[n_q, H]`` of the division's queries."""
        dt = self._in_dtype(q, acc_dtype)
        q4, k4, v4 = (self._heads_first(t, dt) for t in (q, k, v))
        with torch.no_grad():
            out, lse = self._flex(q4, k4, v4, meta, scale)
        # in flex's dtypes: the executor converts as it writes them
        return out[0, :, :meta.n_q].transpose(0, 1), lse[0, :, :meta.n_q].transpose(0, 1)

    def backward(self, q, k, v, do, lse, delta, meta: _FlexMeta, scale, acc_dtype):
        """``(dq [n_q, H, D], dk [n_k, H_kv, D], dv [n_k, H_kv, D])`` of the division's pairs,
        given the final LSE and ``delta = rowsum(dO * O)`` (packed like ``q``)."""
        dev = q.device.type
        # fake tensors: the op (same shapes); recomputing traces autograd, which needs a driver
        recompute = self.recompute if self.recompute is not None else not _is_fake(q)
        if recompute or _flex_backward_op is None or not _DIRECT_BACKWARD.get(dev, True):
            return self._backward_recompute(q, k, v, do, lse, delta, meta, scale, acc_dtype)
        if dev in _DIRECT_BACKWARD or _is_fake(q):  # fake: no fallback (it needs real CUDA), nothing learnt
            return self._backward_direct(q, k, v, do, lse, delta, meta, scale, acc_dtype)
        try:  # first call on this device type: the op is internal to PyTorch and may differ
            grads = self._backward_direct(q, k, v, do, lse, delta, meta, scale, acc_dtype)
        except Exception as e:  # noqa: BLE001 - any failure of the internal op: fall back, say why
            _DIRECT_BACKWARD[dev] = False
            warnings.warn(f"FlexKernel: flex's backward op failed on {dev} ({type(e).__name__}: {e}); the backward "
                          "recomputes each division's forward instead", RuntimeWarning, stacklevel=2)
            return self._backward_recompute(q, k, v, do, lse, delta, meta, scale, acc_dtype)
        _DIRECT_BACKWARD[dev] = True
        return grads

    def _backward_direct(self, q, k, v, do, lse, delta, meta: _FlexMeta, scale, acc_dtype):
        """flex's backward op with the final LSE and ``O' = dO * delta / |dO|^2`` (module docstring)."""
        acc = acc_dtype
        dt = self._in_dtype(q, acc)
        stat = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        q4, k4, v4, do4 = (self._heads_first(t, dt) for t in (q, k, v, do))
        if stat == torch.float32 and triton_runs_on(q):  # one launch
            o, lse2, glse2 = flex_backward_inputs_triton(do, delta, lse, dt)
            o4, lse2, glse2 = self._heads_first(o, dt), lse2.unsqueeze(0), glse2.unsqueeze(0)
        else:
            o4 = self._heads_first(out_with_delta(do, delta, acc, dt), dt)
            lse4 = lse.to(stat).transpose(0, 1).unsqueeze(0)  # [1, H, N_q_pad]
            lse4 = torch.where(torch.isfinite(lse4), lse4, torch.zeros_like(lse4))  # rows that see nothing: P = 0
            # the op forms delta as rowsum(dO * O'); its LSE gradient removes what rounding O' added
            glse = (do4.to(acc) * o4.to(acc)).sum(-1) - delta.to(acc).transpose(0, 1).unsqueeze(0)
            lse2, glse2 = lse4 / _LN2, (glse * _LN2).to(stat)
        backend = self._backend(q4)
        fn = _compiled("backward", _backward_op, backend) if backend is not None else _backward_op
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention.*")
            dq, dk, dv = fn(q4, k4, v4, o4, lse2, do4, glse2, meta.block_mask, scale, *_score_graphs(q4.dtype))
        return dq[0, :, :meta.n_q].transpose(0, 1), dk[0, :, :meta.n_k].transpose(0, 1), dv[0, :, :meta.n_k].transpose(0, 1)

    def _backward_recompute(self, q, k, v, do, lse, delta, meta: _FlexMeta, scale, acc_dtype):
        """Recompute the division's forward with autograd and back-propagate (module docstring)."""
        acc = acc_dtype
        dt = self._in_dtype(q, acc)
        q4, k4, v4 = (self._heads_first(t, dt) for t in (q, k, v))
        do4 = self._heads_first(do, acc)
        lse_f = lse.to(acc).transpose(0, 1).unsqueeze(0)  # [1, H, N_q_pad]
        delta4 = delta.to(acc).transpose(0, 1).unsqueeze(0)
        flex_bwd = q4.device.type not in ("cpu", "mps")  # FlexAttention has no backward there
        with _autograd_inside():
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q4, k4, v4))
            if flex_bwd:
                out_p, lse_p = self._flex(qg, kg, vg, meta, scale)
            else:
                out_p, lse_p = self._dense(qg, kg, vg, meta, scale)
            lp = lse_p.detach().to(acc)
            c = torch.where(torch.isfinite(lp), torch.exp(lp - torch.where(torch.isfinite(lse_f), lse_f, lp)),
                            torch.zeros_like(lp))
            grad_out = (c.unsqueeze(-1) * do4).to(out_p.dtype)
            # with the rounded grad_out, so that flex's own rowsum(grad_out * O_p) cancels exactly
            grad_lse = (grad_out.to(acc) * out_p.detach().to(acc)).sum(-1) - c * delta4
            torch.autograd.backward((out_p, lse_p), (grad_out, grad_lse.to(lse_p.dtype)))
        dq = qg.grad[0, :, :meta.n_q].transpose(0, 1).to(acc)
        dk = kg.grad[0, :, :meta.n_k].transpose(0, 1).to(acc)
        dv = vg.grad[0, :, :meta.n_k].transpose(0, 1).to(acc)
        return dq, dk, dv
