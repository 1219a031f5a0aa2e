"""Preprocessing into the cache: reuse without re-tokenizing, keys, atomicity, prefixes, truncation."""

import importlib
import json
import shutil

import numpy as np
import pytest

from backends.common.data import TemplateError, preprocess
from backends.common.data import formats as formats_mod

pre_mod = importlib.import_module("backends.common.data.preprocess")   # the package exports the function

from .conftest import DATA

ALPACA = DATA / "arithmetic_alpaca.json"
CORPUS = DATA / "arithmetic_corpus.jsonl"


def test_second_call_reuses_the_cache_without_tokenizing(tiny_tok, tmp_path, monkeypatch):
    calls = []
    first = preprocess(ALPACA, "alpaca", tiny_tok, None, 128, tmp_path, progress=lambda d, t: calls.append((d, t)))
    assert not first.from_cache and calls[-1] == (512, 512)
    assert first.stats["samples"] == 512 and first.stats["truncated"] == 0
    assert sorted(p.name for p in first.path.iterdir()) == [
        "dataset_packed_input_ids_document.bin", "dataset_packed_input_ids_document.idx",
        "dataset_packed_labels_document.bin", "dataset_packed_labels_document.idx", "meta.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(formats_mod, "encode_instruction", boom)
    monkeypatch.setattr(formats_mod, "encode_text", boom)
    calls.clear()
    again = preprocess(ALPACA, "alpaca", tiny_tok, None, 128, tmp_path, progress=lambda d, t: calls.append((d, t)))
    assert again.from_cache and again.path == first.path and calls == []
    assert again.stats == first.stats
    a, b = first.open(), again.open()
    assert [x.tolist() for x in a.sample(7)] == [x.tolist() for x in b.sample(7)]


def test_cache_key_follows_every_input(tiny_tok, tmp_path):
    data = tmp_path / "d.json"
    shutil.copy(ALPACA, data)
    cache = tmp_path / "cache"
    base = preprocess(data, "alpaca", tiny_tok, None, 128, cache).path
    assert preprocess(data, "alpaca", tiny_tok, None, 64, cache).path != base
    assert preprocess(data, "alpaca", tiny_tok, "qwen", 128, cache).path != base
    assert preprocess(data, "alpaca", tiny_tok, None, 128, cache, max_samples=5).path != base
    records = json.loads(data.read_text())
    records[0]["output"] = "changed"
    data.write_text(json.dumps(records))
    assert preprocess(data, "alpaca", tiny_tok, None, 128, cache).path != base
    assert len(list(cache.iterdir())) == 5


def test_a_failed_write_leaves_nothing_behind(tiny_tok, tmp_path, monkeypatch):
    def crash(folder, *a, **k):
        (folder / "dataset_packed_input_ids_document.bin").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(pre_mod, "_write", crash)
    with pytest.raises(KeyboardInterrupt):
        preprocess(ALPACA, "alpaca", tiny_tok, None, 128, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_existing_megatron_prefix_is_accepted_and_bin_is_refused(tiny_tok, tmp_path):
    inst = preprocess(ALPACA, "alpaca", tiny_tok, None, 128, tmp_path / "c")
    again = preprocess(inst.prefix, "alpaca", tiny_tok, None, 128, tmp_path / "unused")
    assert again.source == "megatron" and again.kind == "instruction" and again.stats["samples"] == 512
    assert not (tmp_path / "unused").exists()
    assert again.open().sample(3)[1].tolist() == inst.open().sample(3)[1].tolist()
    with pytest.raises(ValueError, match=r"pass its prefix '.*dataset_packed_input_ids_document'"):
        preprocess(inst.ids_prefix + ".bin", "alpaca", tiny_tok, None, 128, tmp_path / "c")
    text = preprocess(CORPUS, "text", tiny_tok, None, 128, tmp_path / "c")
    for path in (text.prefix, text.ids_prefix):          # base prefix or the _text_document prefix
        h = preprocess(path, "text", tiny_tok, None, 128, tmp_path / "c")
        assert h.kind == "text" and h.data_path == text.ids_prefix and h.stats["samples"] == 512


def test_instruction_samples_are_cut_to_seq_len_and_counted(tiny_tok, tmp_path):
    data = tmp_path / "d.json"
    records = json.loads(ALPACA.read_text())[:20]
    records.append({"instruction": "What is 1 + 1? " * 20, "output": "2."})   # prompt alone > seq_len
    data.write_text(json.dumps(records))
    h = preprocess(data, "alpaca", tiny_tok, None, 24, tmp_path / "c")
    assert h.stats["truncated"] > 1 and h.stats["dropped"] == 1 and h.stats["samples"] == 20
    ds = h.open()
    assert int(ds.lengths.max()) == 24
    full = preprocess(data, "alpaca", tiny_tok, None, 128, tmp_path / "c").open()
    for i in range(len(ds)):
        ids, labels = ds.sample(i)
        ref_ids, ref_labels = full.sample(i)
        assert ids.tolist() == ref_ids[:24].tolist() and labels.tolist() == ref_labels[:24].tolist()
    assert "truncated" in h.summary() and "dropped" in h.summary()


def test_text_documents_longer_than_seq_len_are_split(tiny_tok, tmp_path):
    h = preprocess(CORPUS, "text", tiny_tok, None, 8, tmp_path, max_samples=50)
    assert h.stats["records"] == 50 and h.stats["split"] == 50 and h.stats["chunks"] > 50
    ds = h.open()
    assert ds.lengths.max() == 8 and len(ds) == h.stats["chunks"]
    doc0 = tiny_tok.encode(json.loads(CORPUS.read_text().splitlines()[0])["text"]) + [tiny_tok.eos_token_id]
    pieces = [ds.sample(i)[0] for i in range(len(ds)) if ds.seq[i] == 0]
    joined = np.concatenate(pieces).tolist()
    assert joined == doc0[:len(joined)] and len(doc0) - len(joined) <= 1   # only a 1-token tail may go
    ids, labels = ds.sample(0)
    assert labels.tolist() == ids.tolist()


def test_errors(tiny_tok, tmp_path):
    with pytest.raises(TemplateError, match="<|eot_id|>"):
        preprocess(ALPACA, "alpaca", tiny_tok, "llama3", 128, tmp_path)
    with pytest.raises(ValueError, match="unknown data format 'csv'.*text, alpaca, sharegpt"):
        preprocess(ALPACA, "csv", tiny_tok, None, 128, tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        preprocess(tmp_path / "missing.json", "alpaca", tiny_tok, None, 128, tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "Q", "output": "A"}, {"instruction": "Q"}]))
    with pytest.raises(Exception, match=r"bad.json: record 1: missing key 'output'"):
        preprocess(bad, "alpaca", tiny_tok, None, 128, tmp_path / "c")
    assert not [p for p in (tmp_path / "c").iterdir()]
