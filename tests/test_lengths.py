"""The dataset length loaders, on small files written here in the datasets' layouts."""

from __future__ import annotations

import gzip
import json

import pytest

from torch_dcp.data import dataset_lengths, load_lengths, long_data_collections_lengths, longalign_lengths, save_lengths


def _jsonl(records):
    return "".join(json.dumps(r) + "\n" for r in records)


def test_longalign_messages(tmp_path):
    recs = [{"messages": [{"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "é" * 3}]},
            {"messages": [{"role": "user", "content": "xyz"}, {"role": "assistant", "content": ""}]}]
    (tmp_path / "long.jsonl").write_text(_jsonl(recs) + "\n")
    # contents joined by a newline; bytes by default ("é" is 2 bytes)
    assert longalign_lengths(tmp_path) == [10 + 1 + 6, 3 + 1]
    assert longalign_lengths(tmp_path / "long.jsonl", tokenizer=str.split) == [2, 1]
    assert longalign_lengths(tmp_path, limit=1) == [17]


def test_long_data_collections_layout(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "fine-tune").mkdir()
    data = _jsonl([{"text": "b" * 100}, {"text": ""}, {"text": "c" * 7, "meta": 1}]).encode()
    (tmp_path / "pretrain" / "rp_sub.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    with gzip.open(tmp_path / "fine-tune" / "booksum.jsonl.gz", "wb") as f:
        f.write(_jsonl([{"prompt": "q" * 4, "completion": "a" * 5}]).encode())
    (tmp_path / "README.md").write_text("not data")
    assert long_data_collections_lengths(tmp_path) == [100, 7, 9]
    assert long_data_collections_lengths(tmp_path, subsets=("fine-tune",)) == [9]
    assert long_data_collections_lengths(tmp_path, limit=2) == [100, 7]
    assert dataset_lengths(tmp_path / "pretrain" / "rp_sub.jsonl.zst") == [100, 7]


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        dataset_lengths(tmp_path / "missing")
    with pytest.raises(ValueError, match="no .jsonl"):
        dataset_lengths(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        dataset_lengths(bad)
    bad.write_text('{"title": "no text"}\n')
    with pytest.raises(ValueError, match=r"record 1: a record needs 'text'.*'title'"):
        dataset_lengths(bad)
    bad.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match="expected a JSON object"):
        dataset_lengths(bad)
    bad.write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="holds no documents"):
        dataset_lengths(bad)


def test_length_lists_round_trip(tmp_path):
    save_lengths([5, 3, 9], tmp_path / "l.json")
    assert load_lengths(tmp_path / "l.json") == [5, 3, 9]
    (tmp_path / "x.json").write_text('{"lengths": [1, 0]}')
    with pytest.raises(ValueError, match="positive"):
        load_lengths(tmp_path / "x.json")
    with pytest.raises(ValueError, match="not a length list"):
        load_lengths(tmp_path / "missing.json")


def test_load_documents_reads_jsonl_text(tmp_path):
    from torch_dcp.data import load_documents

    f = tmp_path / "docs.jsonl"
    f.write_text(_jsonl([{"text": "hello"}, {"text": ""}, {"text": "x"}]) + "\n")
    assert load_documents(f) == ["hello", "x"]
    assert load_documents(f, limit=1) == ["hello"]
    f.write_text(_jsonl([{"body": "no text"}]))
    with pytest.raises(ValueError, match="record 1: a JSONL record needs a string field 'text'"):
        load_documents(f)
    f.write_text(_jsonl([{"text": ""}]))
    with pytest.raises(ValueError, match="holds no documents"):
        load_documents(f)


def test_packed_document_lengths_from_positions_and_from_eos():
    import numpy as np

    from torch_dcp.data import packed_document_lengths

    # two rows of 6: row 0 holds documents of 2, 3 and 1 tokens; row 1 continues a document
    # (its positions were renumbered from 0 by the loader) and then starts one of 2 tokens
    positions = np.array([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]])
    tokens = np.arange(12).reshape(2, 6)
    assert packed_document_lengths(positions, tokens).tolist() == [2, 3, 1, 4, 2]
    # a row that does not start at position 0 still starts a document
    assert packed_document_lengths(np.array([[5, 6, 0, 1]]), np.zeros((1, 4))).tolist() == [2, 2]
    # without positions: a document ends with its EOS (9); a row's last EOS ends nothing more
    eos_rows = np.array([[1, 9, 2, 3, 9, 4], [5, 6, 9, 9, 7, 9]])
    assert packed_document_lengths(None, eos_rows, eos_id=9).tolist() == [2, 3, 1, 3, 1, 2]
    with pytest.raises(ValueError, match="EOS token id"):
        packed_document_lengths(None, eos_rows)
    with pytest.raises(ValueError, match="positions .* differ"):
        packed_document_lengths(positions[:, :5], tokens)
    with pytest.raises(ValueError, match=r"\[rows, seq_len\]"):
        packed_document_lengths(None, np.arange(4), eos_id=0)
