"""Document-length lists of the long-context datasets the DCP paper benchmarks on (§7.1, §7.2).

The paper's microbenchmark draws its global batches from the document lengths of
LongDataCollections (Together's ``Long-Data-Collections``: ``pretrain/*.jsonl.zst`` and
``fine-tune/*.jsonl.zst``, one JSON object with a ``text`` field per line) and its end-to-end
runs from LongAlign (``THUDM/LongAlign-10k``: ``long.jsonl``, one JSON object with a
``messages`` list of ``{"role", "content"}`` per line). Neither ships with this package: a
user who has them on disk regenerates the length lists with :func:`dataset_lengths` (or the
two named wrappers) and passes them to the benchmark (``python -m torch_dcp.benchmarks paper
--longalign PATH --long-data-collections PATH``).

Files may be ``.jsonl``, ``.jsonl.gz`` (standard library) or ``.jsonl.zst`` (needs the
``zstandard`` package). A record's text is its ``text`` field, else the concatenated
``content`` of its ``messages`` (or ``value`` of ``conversations``), else ``prompt`` +
``completion``. A document's length is the number of tokens the given tokenizer makes of
it; without one, UTF-8 bytes (the byte-level tokens of :func:`~torch_dcp.data.byte_tokenize`,
about four times a BPE tokenizer's count on English text).
"""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["read_jsonl", "record_text", "dataset_lengths", "longalign_lengths", "long_data_collections_lengths",
           "save_lengths", "load_lengths"]

_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json")


def _open_text(path: Path) -> io.TextIOBase:
    name = path.name
    if name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ImportError(f"{path}: reading .zst files needs the 'zstandard' package "
                              "(pip install zstandard), or decompress it first") from None
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(path.open("rb")), encoding="utf-8")
    return path.open(encoding="utf-8")


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """The JSON objects of a JSON-lines file (blank lines skipped).

    Raises:
        ValueError: a line that is not a JSON object (file and line number named).
    """
    p = Path(path)
    with _open_text(p) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{p}:{i + 1}: not JSON ({err})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{p}:{i + 1}: expected a JSON object, got {type(rec).__name__}")
            yield rec


def record_text(rec: dict) -> str:
    """The document text of one record (see the module docstring for the fields read).

    Raises:
        ValueError: the record has none of the known text fields.
    """
    if isinstance(rec.get("text"), str):
        return rec["text"]
    for key, field in (("messages", "content"), ("conversations", "value")):
        turns = rec.get(key)
        if isinstance(turns, list) and all(isinstance(t, dict) and isinstance(t.get(field), str) for t in turns):
            return "\n".join(t[field] for t in turns)
    if isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
        return rec["prompt"] + rec["completion"]
    raise ValueError(f"a record needs 'text', 'messages' [{{content}}], 'conversations' [{{value}}] or "
                     f"'prompt' + 'completion'; got fields {sorted(rec)}")


def _files(path: Path) -> list[Path]:
    if not path.exists():
        raise ValueError(f"dataset path {str(path)!r} does not exist")
    if path.is_file():
        return [path]
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.name.endswith(_SUFFIXES))
    if not files:
        raise ValueError(f"no {'/'.join(_SUFFIXES)} files under {str(path)!r}")
    return files


def dataset_lengths(path: str | os.PathLike, tokenizer: Callable[[str], object] | None = None,
                    limit: int | None = None) -> list[int]:
    """Token counts of the documents of a JSON-lines dataset, in file order.

    Args:
        path: a file, or a folder (every ``.jsonl``/``.jsonl.gz``/``.jsonl.zst`` under it,
            sorted by path).
        tokenizer: ``text -> tokens`` (anything with a ``len``, e.g. a Hugging Face
            tokenizer's ``encode``); default: UTF-8 bytes.
        limit: at most this many documents.

    Returns:
        Positive lengths (empty documents are skipped).

    Raises:
        ValueError: missing path, no dataset files, malformed lines or records (named), or
            no documents at all.
        ImportError: a ``.zst`` file without the ``zstandard`` package.
    """
    lens: list[int] = []
    for f in _files(Path(path)):
        for i, rec in enumerate(read_jsonl(f)):
            try:
                text = record_text(rec)
            except ValueError as err:
                raise ValueError(f"{f}: record {i + 1}: {err}") from None
            n = len(tokenizer(text)) if tokenizer is not None else len(text.encode("utf-8"))
            if n > 0:
                lens.append(int(n))
            if limit and len(lens) >= limit:
                return lens
    if not lens:
        raise ValueError(f"{str(path)!r} holds no documents")
    return lens


def longalign_lengths(path: str | os.PathLike, tokenizer: Callable[[str], object] | None = None,
                      limit: int | None = None) -> list[int]:
    """LongAlign-10k's document lengths: ``path`` is its ``long.jsonl`` or the folder holding
    it (``messages`` records: a document is the whole conversation). See :func:`dataset_lengths`."""
    p = Path(path)
    if p.is_dir() and (p / "long.jsonl").is_file():
        p = p / "long.jsonl"
    return dataset_lengths(p, tokenizer, limit)


def long_data_collections_lengths(path: str | os.PathLike, tokenizer: Callable[[str], object] | None = None,
                                  limit: int | None = None, subsets: tuple[str, ...] = ("pretrain", "fine-tune")
                                  ) -> list[int]:
    """Long-Data-Collections' document lengths: ``path`` is the dataset folder (its
    ``subsets`` sub-folders are read, in that order, where present) or one of its files.
    See :func:`dataset_lengths`.

    Raises:
        ValueError: none of ``subsets`` is under the folder (and it holds no dataset files).
    """
    p = Path(path)
    if p.is_dir():
        parts = [p / s for s in subsets if (p / s).is_dir()]
        if parts:
            lens: list[int] = []
            for part in parts:
                lens += dataset_lengths(part, tokenizer, None if not limit else limit - len(lens))
                if limit and len(lens) >= limit:
                    break
            return lens
    return dataset_lengths(p, tokenizer, limit)


def save_lengths(lengths: list[int], path: str | os.PathLike) -> None:
    """Write a length list as JSON (``{"lengths": [...]}``), for reuse without the dataset."""
    Path(path).write_text(json.dumps({"lengths": [int(n) for n in lengths]}))


def load_lengths(path: str | os.PathLike) -> list[int]:
    """Read a length list written by :func:`save_lengths`.

    Raises:
        ValueError: not such a file, or non-positive lengths.
    """
    try:
        lens = json.loads(Path(path).read_text())["lengths"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a length list ({err})") from None
    if not lens or any(not isinstance(n, int) or n <= 0 for n in lens):
        raise ValueError(f"{path}: lengths must be positive integers")
    return lens
