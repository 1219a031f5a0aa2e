"""Megatron-core 0.12.1's GPTDataset, rebuilt: the same indices and samples as upstream.

The fixture is written by tests/fixtures/upstream/megatron-core/make_reference.py with the real
megatron-core; the `upstream` test reruns it when megatron-core is importable.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from backends.common.data import gpt_dataset as gd
from backends.common.data.indexed import IndexedDatasetWriter

REF_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "upstream" / "megatron-core"
REF = np.load(REF_DIR / "gpt_reference.npz")
META = json.loads(str(REF["configs"]))
INDICES = ("document_index", "sample_index", "shuffle_index")
FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "segment_start")


def write_corpus(prefix, lengths, tokens) -> str:
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in np.split(tokens, np.cumsum(lengths)[:-1]):
            writer.add_document(doc)
    return str(prefix)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("gpt") / "corpus_text_document", REF["doc_lengths"],
                        REF["doc_tokens"])


def ours(prefix, cfg, seq_length=META["seq_length"], eod=META["eod"]):
    n = cfg["sizes"][gd.SPLITS.index(cfg["which"])]
    return gd.GPTDataset(prefix, seq_length, cfg["seed"], eod, split=cfg["split"], which=cfg["which"],
                         num_samples=n, pad_id=cfg["pad"], reset_position_ids=cfg["reset_position_ids"],
                         reset_attention_mask=cfg["reset_attention_mask"], eod_mask_loss=cfg["eod_mask_loss"],
                         add_extra_token=cfg["extra"],
                         drop_last_partial_validation_sequence=cfg.get("drop_last_valid", True))


def sample_fields(item) -> dict:
    cu = item["cu_seqlens"]
    return {"tokens": item["tokens"], "labels": item["labels"], "loss_mask": item["loss_mask"],
            "position_ids": item["position_ids"], "segment_start": np.repeat(cu[:-1], np.diff(cu))}


@pytest.mark.parametrize("name", sorted(META["configs"]))
def test_same_indices_and_samples_as_megatron_core(corpus, name):
    cfg = META["configs"][name]
    ds = ours(corpus, cfg)
    for key in INDICES:
        np.testing.assert_array_equal(getattr(ds, key), REF[f"{name}/{key}"], err_msg=f"{name} {key}")
    assert len(ds) == len(REF[f"{name}/shuffle_index"])
    for i in range(len(REF[f"{name}/tokens"])):
        got = sample_fields(ds[i])
        for key in FIELDS:
            np.testing.assert_array_equal(got[key], REF[f"{name}/{key}"][i], err_msg=f"{name} sample {i} {key}")


def test_fixture_covers_the_rules():
    """The configurations exercise padding, pad == EOD, no extra token and every flag on and off
    (both final-epoch rules: test_final_epoch_rule)."""
    cfgs = META["configs"]
    assert any(c["pad"] == META["eod"] for c in cfgs.values())
    assert any(not c["extra"] for c in cfgs.values())
    assert any(c.get("drop_last_valid") is False for c in cfgs.values())
    assert (REF["f/loss_mask"] == 0).sum() > (REF["f/tokens"] == META["eod"]).sum()   # the padded tail
    for flag in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        assert {c[flag] for c in cfgs.values()} == {True, False}


def test_final_epoch_rule(corpus):
    """The shuffle keeps a separate final epoch's samples at the end (config a), and does not
    separate it when the final epoch gives >= 80% of an epoch's samples (config e)."""
    a = ours(corpus, META["configs"]["a"])
    e = ours(corpus, META["configs"]["e"])
    assert a.separate_final_epoch and not e.separate_final_epoch
    per_epoch = len(a.documents)
    # the first epoch's documents are a permutation of the split, the final epoch's too
    assert sorted(a.document_index[:per_epoch]) == sorted(a.documents)
    assert sorted(a.document_index[per_epoch:]) == sorted(a.documents)
    sans_final = (a.tokens_per_epoch - 1) // a.seq_length
    assert a.shuffle_index[:sans_final].max() < sans_final <= a.shuffle_index[sans_final:].min()


def test_samples_are_consecutive_windows_of_the_token_stream(corpus):
    cfg = dict(META["configs"]["a"])
    ds = ours(corpus, cfg)
    inverse = np.argsort(ds.shuffle_index)
    stream = np.concatenate([ds.dataset[int(d)] for d in ds.document_index]).astype(np.int64)
    s = ds.seq_length
    for j in (0, 1, 2, len(ds) // 2, len(ds) - 1):
        item = ds[int(inverse[j])]
        np.testing.assert_array_equal(item["tokens"], stream[j * s:(j + 1) * s])
        np.testing.assert_array_equal(item["labels"], stream[j * s + 1:(j + 1) * s + 1])


def test_enough_samples_for_the_request(tmp_path):
    """The fewest epochs that give num_samples windows of seq_length + 1 tokens, for every count
    (boundaries included: 12 samples of 4 from 48 tokens need a second epoch for the extra token)."""
    prefix = write_corpus(tmp_path / "c_text_document", np.array([5, 7, 3, 9, 11, 13]), np.arange(48) % 40 + 3)
    for n in range(1, 40):
        ds = gd.GPTDataset(prefix, 4, 0, 2, split="1,0,0", num_samples=n)
        assert len(ds) >= n
        assert ((ds.epochs - 1) * 48 - 1) // 4 < n


def test_split_ranges_and_sample_counts():
    assert gd.split_ranges("969,30,1", 520) == [(0, 504), (504, 519), (519, 520)]
    assert gd.split_ranges("8,1,1", 520) == [(0, 416), (416, 468), (468, 520)]
    assert gd.split_ranges("100,0,0", 10) == [(0, 10), None, None]
    assert gd.split_ranges("98", 10) == [(0, 10), None, None]
    # Megatron-LM's get_train_valid_test_num_samples (eval_interval 1000, eval_iters 100 by default)
    assert gd.num_samples_per_split(2000, 8) == (16000, 2400, 800)
    assert gd.num_samples_per_split(10, 4, eval_interval=5, eval_iters=2) == (40, 24, 8)
    assert gd.num_samples_per_split(10, 4, train_samples=123)[0] == 123


def test_empty_split_is_refused(corpus, tmp_path):
    """Megatron loops forever on a split without tokens; refuse it by name instead."""
    prefix = write_corpus(tmp_path / "small_text_document", np.array([5, 7, 3]), np.arange(15) % 50 + 3)
    with pytest.raises(ValueError, match="test split"):
        gd.GPTDataset(prefix, 4, 1, 2, split="969,30,1", which="test", num_samples=3)


def test_index_build_is_vectorized():
    """A million documents x 3 epochs: the sample index is numpy work, not a per-token loop."""
    import time

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 400, size=1_000_000).astype(np.int32)
    doc_index = np.tile(np.arange(len(sizes), dtype=np.int32), 3)
    t = time.perf_counter()
    idx = gd.build_sample_index(sizes, doc_index, 2048, 3, int(sizes.sum()))
    assert time.perf_counter() - t < 10
    assert idx.shape == ((3 * int(sizes.sum()) - 1) // 2048 + 1, 2)


@pytest.mark.upstream
def test_rebuilt_by_megatron_core(tmp_path):
    """megatron-core's own GPTDataset on a fresh corpus: every index and every sample agrees."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core 0.12.1 is not importable")
    import sys

    sys.path.insert(0, str(REF_DIR))
    try:
        import make_reference as mr
    finally:
        sys.path.remove(str(REF_DIR))
    docs = mr.make_documents(n_docs=600, seed=9)
    prefix = str(tmp_path / "fresh_text_document")
    mr.write_documents(prefix, docs)
    rng = np.random.default_rng(1)
    separated = set()
    for k in range(8):
        cfg = {"seed": int(rng.integers(0, 10_000)), "split": ["969,30,1", "8,1,1", "7,2,1"][k % 3],
               "which": gd.SPLITS[k % 3], "sizes": [int(x) for x in rng.integers(5, 2500, size=3)],
               "pad": [None, mr.EOD][k % 2], "reset_position_ids": bool(rng.integers(2)),
               "reset_attention_mask": bool(rng.integers(2)), "eod_mask_loss": bool(rng.integers(2)),
               "extra": k != 5, "drop_last_valid": k != 4}
        up = mr.build_upstream(prefix, cfg, str(tmp_path / "cache"))
        ds = ours(prefix, cfg, mr.SEQ_LENGTH, mr.EOD)
        for key in INDICES:
            np.testing.assert_array_equal(getattr(ds, key), getattr(up, key), err_msg=f"{cfg} {key}")
        separated.add(ds.separate_final_epoch)
        picks = sorted({*range(min(20, len(up))), *rng.integers(0, len(up), size=20).tolist(), len(up) - 1})
        ref = mr.upstream_samples(up, 0, picks)
        for r, i in enumerate(picks):
            got = sample_fields(ds[i])
            for key in FIELDS:
                np.testing.assert_array_equal(got[key], ref[key][r], err_msg=f"{cfg} sample {i} {key}")
    assert separated == {True, False}


def test_megatron_batches_order_sharding_and_resume(corpus):
    """MegatronPretrainingSampler's order: micro-step k, dp rank r reads samples k*G + r*micro ...;
    a loader restored from state_dict() yields what the original would have yielded next."""
    ds = ours(corpus, META["configs"]["b"])      # reset attention mask: packed rows with cu_seqlens
    s = ds.seq_length
    loaders = [gd.MegatronBatches(ds, 2, dp_rank=r, dp_world=2) for r in range(2)]
    for k in range(3):
        for r, loader in enumerate(loaders):
            batch = next(loader)
            first = k * 4 + r * 2
            np.testing.assert_array_equal(batch["input_ids"][0].numpy(),
                                          np.concatenate([ds[first]["tokens"], ds[first + 1]["tokens"]]))
            cu = batch["cu_seqlens"].numpy()
            assert cu[0] == 0 and cu[-1] == 2 * s and s in cu
            labels = batch["labels"][0].numpy()
            mask = np.concatenate([ds[first]["loss_mask"], ds[first + 1]["loss_mask"]])
            assert ((labels == -100) == (mask == 0)).all() and int(batch["n_tokens"]) == int(mask.sum())
    state = loaders[1].state_dict()
    again = gd.MegatronBatches(ours(corpus, META["configs"]["b"]), 2, dp_rank=1, dp_world=2)
    again.load_state_dict(state)
    np.testing.assert_array_equal(next(again)["input_ids"].numpy(), next(loaders[1])["input_ids"].numpy())
    plain = gd.MegatronBatches(ours(corpus, META["configs"]["a"]), 3)   # no reset mask: rows [micro, seq]
    assert next(plain)["input_ids"].shape == (3, s)
    with pytest.raises(ValueError, match="seed"):
        plain.load_state_dict(state)
