"""What the planner, paper and picture benchmarks share: the masks by name, the benchmark
batches and their document-length sources, and the progress bar (stderr)."""

from __future__ import annotations

import sys

import numpy as np

from ..batch import BatchSpec
from ..masks import BlockwiseCausal, Causal, Lambda, SharedQuestion

__all__ = ["MASKS", "planner_batches", "paper_sources", "scaled_batch", "paper_batches", "bench_batch", "progress"]

MASKS = {
    "causal": Causal(),
    "lambda": Lambda(),
    "blockwise": BlockwiseCausal(),
    "shared_question": SharedQuestion(),
}


def planner_batches(total: int = 131072, seed: int = 0) -> dict[str, list[int]]:
    """Document lengths of the benchmark batches, ``{name: lengths}``."""
    from ..data import byte_tokenize, load_documents, long_tail_lengths, pack_batches

    docs = [byte_tokenize(t) for t in load_documents()]
    corpus = [len(d) for d in next(pack_batches(docs, total, total, seed=seed))]
    return {"corpus": corpus, "longtail": long_tail_lengths(total, seed=seed), "one": [total]}


def paper_sources(longalign: str | None = None, long_data_collections: str | None = None,
                  total: int = 131072, seed: int = 0) -> dict[str, list[int]]:
    """Document-length sources of the microbenchmark, ``{name: lengths}``: ``corpus`` (the
    embedded real corpus, shuffled), ``longtail`` (:func:`torch_dcp.data.long_tail_lengths`),
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


def bench_batch(lens: list[int], mask) -> BatchSpec:
    """The benchmarks' attention shape (DCP paper §7.1): GQA 8/2, head_dim 128, bf16."""
    return BatchSpec(lens, mask, n_heads=8, n_kv_heads=2, head_dim=128, dtype="bfloat16")


def progress(total: int, desc: str):
    """A tqdm progress bar on stderr (cleared when done)."""
    try:
        from tqdm import tqdm
    except ImportError as err:  # pragma: no cover - optional dependency
        raise ImportError("the paper benchmark's progress bar needs tqdm: pip install 'torch-dcp[benchmarks]'") from err

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
