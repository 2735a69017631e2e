"""Real documents for examples and benchmarks.

By default the corpus is the Python standard library's source files on this machine: real
text with the long-tailed length distribution of real corpora (many short files, a few very
long ones), available offline everywhere Python is.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

__all__ = ["stdlib_text_files", "load_documents", "byte_tokenize", "pack_batches", "packed_document_lengths"]


def stdlib_text_files(limit: int | None = None) -> list[Path]:
    """The standard library's ``*.py`` files, sorted by path (deterministic)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, subfolders, names in os.walk(root):  # site-packages pruned, not walked (it may hold 100k files)
        subfolders[:] = [d for d in subfolders if d != "site-packages"]
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    files = sorted(p for p in found if p.is_file())
    return files[:limit] if limit else files


def load_documents(path: str | os.PathLike | None = None, limit: int | None = None) -> list[str]:
    """Documents as strings.

    Args:
        path: ``None`` for the standard library sources; a folder (every ``*.txt``, ``*.md``,
            ``*.py`` file under it, sorted); or a JSONL file with a ``text`` field per line.
        limit: at most this many documents.

    Raises:
        ValueError: the path does not exist, holds no documents, or a JSONL line has no
            ``text`` string.
    """
    if path is None:
        files = stdlib_text_files()
    else:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"data path {str(p)!r} does not exist")
        if p.is_file():
            from .lengths import read_jsonl

            docs = []
            for i, rec in enumerate(read_jsonl(p)):
                if not isinstance(rec.get("text"), str):
                    raise ValueError(f"{p}: record {i + 1}: a JSONL record needs a string field 'text'")
                if rec["text"]:
                    docs.append(rec["text"])
                if limit and len(docs) >= limit:
                    break
            if not docs:
                raise ValueError(f"{p} holds no documents")
            return docs
        files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".md", ".py") and f.is_file())
    docs = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if text:
            docs.append(text)
        if limit and len(docs) >= limit:
            break
    if not docs:
        raise ValueError(f"no documents found under {path!r}")
    return docs


def byte_tokenize(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids (vocabulary 256), int64 ``[len]``."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def pack_batches(
    docs: Sequence[np.ndarray], tokens_per_step: int, max_doc_len: int, seed: int = 0
) -> Iterator[list[np.ndarray]]:
    """Pack tokenised documents into global batches of exactly ``tokens_per_step`` tokens.

    Documents are visited in a seeded random order, truncated to ``max_doc_len`` tokens
    (keeping the real long tail of lengths below the cap), and appended until the budget is
    full; the document that overflows is cut and its rest starts the next batch. Yields
    lists of token arrays (documents); stops when the documents run out.

    Raises:
        ValueError: non-positive budget or cap.
    """
    if tokens_per_step <= 0 or max_doc_len <= 0:
        raise ValueError(f"tokens_per_step and max_doc_len must be positive, got {tokens_per_step}, {max_doc_len}")
    order = np.random.default_rng(seed).permutation(len(docs))
    batch: list[np.ndarray] = []
    used = 0
    for i in order:
        piece = docs[i][:max_doc_len]
        while len(piece):
            take = min(len(piece), tokens_per_step - used)
            batch.append(piece[:take])
            used += take
            piece = piece[take:]
            if used == tokens_per_step:
                yield batch
                batch, used = [], 0


def packed_document_lengths(positions: np.ndarray | None, tokens: np.ndarray, eos_id: int | None = None) -> np.ndarray:
    """Lengths of the documents packed into rows, in row-major order (the ``doc_lens`` of the
    rows concatenated into one sequence).

    Every row starts a document; inside a row a document starts where ``positions`` is 0 (the
    loader's per-document position ids) or, without positions, right after an ``eos_id`` token
    (the EOS is the last token of its document), as torchtitan's block-causal masks have them.

    Args:
        positions: ``[R, L]`` integer position ids, or ``None``.
        tokens: ``[R, L]`` token ids.
        eos_id: the EOS token id (used when ``positions`` is ``None``).

    Returns:
        int64 ``[n_docs]``, positive, summing to ``R * L``.

    Raises:
        ValueError: ``tokens`` not 2-D or empty, ``positions`` of another shape, or neither
            positions nor an EOS id.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.size == 0:
        raise ValueError(f"packed_document_lengths: tokens must be a non-empty [rows, seq_len] array, got shape "
                         f"{list(tokens.shape)}")
    if positions is not None:
        positions = np.asarray(positions)
        if positions.shape != tokens.shape:
            raise ValueError(f"packed_document_lengths: positions {list(positions.shape)} and tokens "
                             f"{list(tokens.shape)} differ")
        starts = positions == 0
    else:
        if eos_id is None:
            raise ValueError("packed_document_lengths: without position ids the EOS token id is needed")
        starts = np.zeros(tokens.shape, dtype=bool)
        starts[:, 1:] = tokens[:, :-1] == eos_id
    starts[:, 0] = True
    idx = np.flatnonzero(starts)
    return np.diff(np.append(idx, tokens.size)).astype(np.int64)
