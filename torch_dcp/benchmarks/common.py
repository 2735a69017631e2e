"""What the benchmarks share: the masks by name, the benchmark batches and their
document-length sources, the progress bar (stderr); devices and timing (median seconds with the
device synchronised); and the dense references over a whole packed batch (one FlexAttention call
with a document ``BlockMask``, or SDPA with a dense boolean mask)."""

from __future__ import annotations

import math
import re
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..batch import BatchSpec
from ..topology import Topology
from ..masks import BlockwiseCausal, Causal, Lambda, SharedQuestion

__all__ = ["MASKS", "DTYPES", "planner_batches", "batch_lengths", "paper_sources", "scaled_batch", "paper_batches",
           "bench_batch", "progress", "pick_device", "sync", "time_median", "device_name", "kernel_name",
           "global_key_ranges", "dense_mask", "flex_mask_mod", "DenseAttention", "cluster_model", "cluster_cases",
           "rounded"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}

MASKS = {
    "causal": Causal(),
    "lambda": Lambda(),
    "blockwise": BlockwiseCausal(),
    "shared_question": SharedQuestion(),
}


def planner_batches(total: int = 131072, seed: int = 0) -> dict[str, list[int]]:
    """Document lengths of the benchmark batches, ``{name: lengths}``."""
    return {name: batch_lengths(name, total, seed) for name in ("corpus", "longtail", "one")}


def batch_lengths(kind: str, tokens: int, seed: int = 0, max_doc_len: int | None = None) -> list[int]:
    """Document lengths of one benchmark batch of ``tokens`` tokens: ``longtail``
    (:func:`torch_dcp.data.long_tail_lengths`, documents up to ``max_doc_len``, default
    32768), ``corpus`` (the embedded corpus packed, documents cut at
    ``max_doc_len``, default ``tokens``) or ``one`` (a single document).

    Raises:
        ValueError: an unknown kind.
    """
    from ..data import byte_tokenize, load_documents, long_tail_lengths, pack_batches

    if kind == "longtail":
        return long_tail_lengths(tokens, max_len=max_doc_len or 32768, seed=seed)
    if kind == "corpus":
        docs = [byte_tokenize(t) for t in load_documents()]
        return [len(d) for d in next(pack_batches(docs, tokens, max_doc_len or tokens, seed=seed))]
    if kind == "one":
        return [int(tokens)]
    raise ValueError(f"unknown batch {kind!r}; choose from corpus, longtail, one")


def paper_sources(longalign: str | None = None, long_data_collections: str | None = None,
                  total: int = 131072, seed: int = 0) -> dict[str, list[int]]:
    """Document-length sources of the microbenchmark, ``{name: lengths}``: ``corpus`` (the
    embedded corpus, the Python standard library's sources as byte tokens, shuffled),
    ``longtail`` (:func:`torch_dcp.data.long_tail_lengths`),
    and, when given, ``longalign`` / ``ldc``: lengths read from a local copy of LongAlign-10k /
    Long-Data-Collections (a dataset path, or a ``.json`` length list written by
    :func:`torch_dcp.data.save_lengths`)."""
    from ..data import (byte_tokenize, load_documents, load_lengths, long_data_collections_lengths,
                        long_tail_lengths, longalign_lengths)

    rng = np.random.default_rng(seed)
    corpus = [len(byte_tokenize(t)) for t in load_documents()]
    out = {"corpus": [corpus[i] for i in rng.permutation(len(corpus))],
           "longtail": long_tail_lengths(total * 4, seed=seed)}
    for name, path, loader in (("longalign", longalign, longalign_lengths),
                               ("ldc", long_data_collections, long_data_collections_lengths)):
        if path:
            lens = load_lengths(path) if str(path).endswith(".json") else loader(path)
            out[name] = [lens[i] for i in rng.permutation(len(lens))]
    return out


def scaled_batch(lengths: list[int], scale: float, total: int = 131072) -> list[int]:
    """Document lengths multiplied by ``scale`` (DCP paper §7.1 scales 0.5, 1, 2, 4), taken in
    order until they fill ``total`` tokens (the last one cut).

    Raises:
        ValueError: non-positive scale, or lengths that cannot fill ``total`` tokens.
    """
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    batch, used = [], 0
    for n in lengths:
        n = max(1, min(total - used, int(round(n * scale))))
        batch.append(n)
        used += n
        if used == total:
            return batch
    raise ValueError(f"the length source holds only {used} tokens at scale {scale}, fewer than {total}")


def paper_batches(scale: float, total: int = 131072, seed: int = 0,
                  sources: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """The microbenchmark's global batches at one length scale, ``{name: lengths}``."""
    sources = sources or paper_sources(total=total, seed=seed)
    return {name: scaled_batch(lens, scale, total) for name, lens in sources.items()}


def bench_batch(lens: list[int], mask, heads: tuple[int, int] = (8, 2)) -> BatchSpec:
    """The benchmarks' attention shape (DCP paper §7.1): GQA 8/2 (``heads``: query and
    key/value heads), head_dim 128, bf16."""
    return BatchSpec(lens, mask, n_heads=heads[0], n_kv_heads=heads[1], head_dim=128, dtype="bfloat16")


def cluster_model(cost: str, preset: str):
    """The cost model ``--cost`` names for a cluster of topology ``preset``: ``executor``, its
    ``<preset>-executor`` model; ``kernels``, its ``<preset>`` kernel table; else any name or file
    :meth:`~torch_dcp.CostModel.load` takes."""
    from ..cost import CostModel

    named = {"executor": f"{preset}-executor", "kernels": preset}
    return CostModel.load(named.get(cost, cost))


def cluster_cases(clusters: list[tuple[str, int]], masks: list[str], scales: list[float], cost: str,
                  heads: tuple[int, int], what: str, sources: dict[str, list[int]] | None = None,
                  total: int = 131072, label: str = "") -> Iterator[tuple[str, Topology, Any, Iterator[tuple]]]:
    """The paper's microbenchmark batches on every cluster (``compare``, ``why``): per cluster
    ``(name, topology, cost model, cases)`` with ``cases`` yielding ``(scale, batch name, mask,
    BatchSpec)``, a progress bar (``what``) advanced per case; ``label`` ends each cluster's
    name."""
    sources = sources or paper_sources(total=total)
    batches = [(s, name, lens) for s in scales for name, lens in paper_batches(s, total, sources=sources).items()]
    bar = progress(len(clusters) * len(batches) * len(masks), what)

    def cases(cluster: str) -> Iterator[tuple]:
        for scale, name, lens in batches:
            for mask in masks:
                bar.set_postfix_str(f"{cluster} {scale} {name} {mask}")
                yield scale, name, mask, bench_batch(lens, MASKS[mask], heads)
                bar.update()

    try:
        for preset, nodes in clusters:
            topology = Topology.preset(preset, n_nodes=nodes)
            cluster = f"{preset} {nodes}x{topology.ranks_per_node}{label}"
            yield cluster, topology, cluster_model(cost, preset), cases(cluster)
    finally:
        bar.close()


def rounded(x: Any) -> Any:
    """Floats rounded to 4 digits, in dicts and lists too (the JSON lines)."""
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def progress(total: int, desc: str):
    """A tqdm progress bar on stderr (cleared when done)."""
    try:
        from tqdm import tqdm
    except ImportError as err:  # pragma: no cover - optional dependency
        raise ImportError("the paper benchmark's progress bar needs tqdm: pip install 'torch-dcp[benchmarks]'") from err

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def topology_of(spec: "int | str") -> Topology:
    """A topology from the benchmarks' spelling: ``W`` (or ``"W"``) ranks on one node, or
    ``"NxR"``: ``N`` nodes of ``R`` ranks.

    Raises:
        ValueError: anything else.
    """
    text = str(spec).lower()
    m = re.fullmatch(r"(\d+)(?:x(\d+))?", text)
    if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
        raise ValueError(f"expected a number of ranks or NODESxRANKS (e.g. 4x8), got {spec!r}")
    if m.group(2) is None:
        return Topology(n_nodes=1, ranks_per_node=int(m.group(1)))
    return Topology(n_nodes=int(m.group(1)), ranks_per_node=int(m.group(2)))


# ---------------------------------------------------------------------- devices and timing
def pick_device(name: str | None) -> torch.device:
    """``"auto"``/None: CUDA when available, else CPU; otherwise the named device."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_median(fn: Callable[[], Any], device: torch.device, repeat: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs (after ``warmup``), the device
    synchronised before and after each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeat)):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def device_name(dev: torch.device) -> str:
    """The GPU's name on CUDA, else the device type."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return dev.type


def kernel_name(kernel: Any, device: torch.device) -> str:
    """The name of the executor kernel ``kernel`` resolves to on ``device``."""
    from ..executor.kernels import get_kernel

    k = get_kernel(kernel, device=device)
    return getattr(k, "name", type(k).__name__)


# ---------------------------------------------------------------------- dense references
def global_key_ranges(batch: BatchSpec) -> tuple[np.ndarray, np.ndarray]:
    """Key ranges of every token of the packed batch in global token positions: int64
    ``(starts, ends)``, ``[T, R]`` (``R`` the widest mask's ranges; empty ranges have
    ``start == end``). Token ``i`` sees key ``j`` when ``starts[i, r] <= j < ends[i, r]`` for
    some ``r``; the ranges never leave the token's document."""
    cu = batch.cu_seqlens
    doc = np.repeat(np.arange(batch.n_docs, dtype=np.int64), batch.doc_lens)
    pos = np.arange(batch.total_tokens, dtype=np.int64) - cu[doc]
    starts, ends = batch.key_ranges(doc, pos)
    return starts + cu[doc][:, None], ends + cu[doc][:, None]


def dense_mask(batch: BatchSpec, device: torch.device | str) -> torch.Tensor:
    """bool ``[T, T]`` on ``device``: ``[i, j]`` true when token ``i`` sees token ``j``
    (the batch's masks inside each document, nothing across documents)."""
    starts, ends = (torch.from_numpy(a).to(device) for a in global_key_ranges(batch))
    j = torch.arange(batch.total_tokens, device=device)[None, :]
    m = torch.zeros(batch.total_tokens, batch.total_tokens, dtype=torch.bool, device=device)
    for r in range(starts.shape[1]):
        m |= (j >= starts[:, r:r + 1]) & (j < ends[:, r:r + 1])
    return m


def flex_mask_mod(batch: BatchSpec, device: torch.device | str) -> Callable:
    """A FlexAttention ``mask_mod`` of the packed batch: each token's key ranges (see
    :func:`global_key_ranges`), looked up per query -- the document and its mask in one."""
    starts, ends = global_key_ranges(batch)
    cols = [(torch.from_numpy(starts[:, r].astype(np.int32)).to(device),
             torch.from_numpy(ends[:, r].astype(np.int32)).to(device)) for r in range(starts.shape[1])
            if (ends[:, r] > starts[:, r]).any()]

    def mask_mod(b, h, q_idx, kv_idx):
        s, e = cols[0]
        m = (kv_idx >= s[q_idx]) & (kv_idx < e[q_idx])
        for s, e in cols[1:]:
            m = m | ((kv_idx >= s[q_idx]) & (kv_idx < e[q_idx]))
        return m

    return mask_mod


class DenseAttention:
    """One dense attention call over a whole packed batch, the reference the executor is
    measured against: on CUDA a compiled ``flex_attention`` with a document ``BlockMask``
    built from the batch's masks (:func:`flex_mask_mod`); elsewhere (eager FlexAttention has
    no backward on the CPU) ``F.scaled_dot_product_attention`` with a dense boolean mask
    (:func:`dense_mask`). GQA native in both.

    Args:
        batch: the packed batch (document lengths and masks, heads, head_dim).
        device: where it runs.
        flex: force FlexAttention (True) or SDPA (False); default by device as above.

    Attributes:
        name: a description of the call, for printed output.

    Call it with ``q: [1, H, T, D]``, ``k, v: [1, H_kv, T, D]`` (global token order, heads
    first: :meth:`heads_first`); returns ``out: [1, H, T, D]`` (differentiable).
    """

    def __init__(self, batch: BatchSpec, device: torch.device | str, flex: bool | None = None):
        import torch.nn.functional as F

        self.device = torch.device(device)
        self.flex = self.device.type == "cuda" if flex is None else bool(flex)
        self.gqa = batch.n_kv_heads != batch.n_heads
        T = batch.total_tokens
        if self.flex:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            compiled = self.device.type == "cuda"
            # compiled, the block mask is built without materialising [T, T] (128 GiB at 131K tokens)
            build = torch.compile(create_block_mask) if compiled else create_block_mask
            self.block_mask = build(flex_mask_mod(batch, self.device), None, None, T, T, device=str(self.device))
            self._fn = torch.compile(flex_attention) if compiled else flex_attention
            self.name = f"{'compiled ' if compiled else ''}flex_attention, document BlockMask"
        else:
            self.mask = dense_mask(batch, self.device)
            self._fn = F.scaled_dot_product_attention
            self.name = "sdpa, dense boolean mask"

    @staticmethod
    def heads_first(t: torch.Tensor) -> torch.Tensor:
        """``[T, H, D]`` -> contiguous ``[1, H, T, D]``."""
        return t.transpose(0, 1).unsqueeze(0).contiguous()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.flex:
            return self._fn(q, k, v, block_mask=self.block_mask, enable_gqa=self.gqa)
        return self._fn(q, k, v, attn_mask=self.mask, enable_gqa=self.gqa)


def varlen_unavailable(batch: BatchSpec, dev: torch.device) -> str | None:
    """Why one varlen flash call cannot run this batch, or None when it can."""
    if dev.type != "cuda":
        return "flash varlen needs CUDA"
    if batch.dtype not in ("bfloat16", "float16"):
        return f"flash needs float16/bfloat16, not {batch.dtype}"
    kinds = {type(m).__name__ for m in batch.masks}
    if kinds not in ({"Causal"}, {"Full"}):
        return f"mask {'/'.join(sorted(kinds))}: no single varlen call (dense flex only)"
    return None


def varlen_calls(batch: BatchSpec, dev: torch.device, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 go: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """``(forward, forward_backward)``: one ``aten._flash_attention_forward`` over the documents'
    ``cu_seqlens`` (``q [T, H, D]``, ``k, v [T, H_kv, D]``, GQA native), and the same followed by
    ``aten._flash_attention_backward`` (returns ``(out, dq, dk, dv)``). See
    :func:`varlen_unavailable` for when it runs."""
    cu = torch.from_numpy(batch.cu_seqlens.astype(np.int32)).to(dev)
    m = int(batch.doc_lens.max())
    causal = batch.is_causal
    scale = 1.0 / math.sqrt(batch.head_dim)
    aten = torch.ops.aten

    def forward():
        return aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, causal, False, scale=scale)

    def forward_backward():
        out, lse, rng, unused, _ = forward()
        grads = aten._flash_attention_backward(go, q, k, v, out, lse, cu, cu, m, m, 0.0, causal, rng, unused,
                                               scale=scale)
        return (out,) + tuple(grads)

    return forward, forward_backward
