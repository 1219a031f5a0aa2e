"""MindSpeed-LLM's instruction-data order (backends/common/data/mtf_order.py) against the upstream functions
themselves: decoder_packed_mtf_dataset._build_index_mappings, Megatron's legacy --split and its two samplers, run
unmodified from tests/fixtures/upstream/mindspeed-llm/index (SOURCE.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from backends.common.data import mtf_order
from backends.common.data.indexed import IndexedDatasetWriter
from tests.helpers.megatron_flags import ARCH

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "tests" / "fixtures" / "upstream" / "mindspeed-llm" / "index"


@pytest.fixture(scope="module")
def upstream():
    spec = importlib.util.spec_from_file_location("mindspeed_llm_index_upstream", UPSTREAM / "upstream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_copies_are_the_upstream_files():
    rows = re.findall(r"^\| `([^`]+)` \|.*\| ([0-9a-f]{40}) \|$", (UPSTREAM / "SOURCE.md").read_text(), re.M)
    assert len(rows) == 3
    for name, blob in rows:
        data = (UPSTREAM / name).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, name


# rows, global batch, num_samples, seed, shuffle, --padded-samples, first row of the split
INDEX_CASES = [(10, 4, 24, 1234, True, True, 0), (10, 4, 24, 1234, True, False, 0), (7, 8, 50, 42, True, True, 0),
               (7, 8, 50, 42, False, True, 0), (16, 4, 33, 1, True, True, 0), (13, 5, 100, 7, True, True, 3),
               (5, 16, 40, 0, True, True, 0), (97, 32, 320, 1234, True, True, 0), (97, 32, 1, 5, False, False, 0)]


def test_shuffle_index_is_decoder_packed_mtf_datasets(upstream):
    for rows, batch, samples, seed, shuffle, padded, start in INDEX_CASES:
        theirs = upstream.shuffle_index(rows, batch, samples, seed, shuffle, padded, start_index=start)
        ours = mtf_order.shuffle_index(start, rows, samples, seed, batch, shuffle, padded)
        assert ours.tolist() == theirs, (rows, batch, samples, seed, shuffle, padded, start)


def test_split_is_megatron_legacy(upstream):
    for split in ("100,0,0", "969, 30, 1", "98,2,0", "1/1/1", "2", "7,3"):
        for size in (1, 7, 10, 97, 1000):
            assert mtf_order.legacy_split(split, size) == upstream.train_valid_test_split(split, size), (split, size)


@pytest.mark.parametrize("kind", mtf_order.SAMPLERS)
def test_samplers_are_megatrons(upstream, kind):
    for total, micro, dp in ((24, 1, 1), (24, 2, 2), (29, 2, 3), (10, 1, 4)):
        steps = 3 * (total // (micro * dp)) + 1 if kind == "cyclic" else total // (micro * dp)
        for rank in range(dp):
            ours = mtf_order.MegatronSampler(kind, total, micro, rank, dp)
            theirs = upstream.sampler_batches(kind, total, micro, rank, dp, steps)
            assert [ours.positions(k).tolist() for k in range(steps)] == theirs, (kind, total, micro, dp, rank)
    if kind == "single":
        with pytest.raises(ValueError, match="asks for sample"):
            mtf_order.MegatronSampler(kind, 8, 2, 1, 2).positions(2)


def write_neat_rows(prefix: Path, rows: list[list[int]], seq: int) -> None:
    """MindSpeed-LLM's --pack --neat-pack files: row r's documents (their lengths given) numbered 1, 2, … in the
    attention mask, padding 0; each document's first token is 1000 + 10 r + d."""
    writers = [IndexedDatasetWriter(f"{prefix}_packed_{key}_document", np.int32)
               for key in ("input_ids", "labels", "attention_mask")]
    for r, lengths in enumerate(rows):
        ids, mask = [], []
        for d, n in enumerate(lengths):
            ids += [1000 + 10 * r + d] + [7] * (n - 1)
            mask += [d + 1] * n
        pad = seq - len(ids)
        labels = [i if m else -100 for i, m in zip(ids, mask)] + [-100] * pad
        for writer, values in zip(writers, (ids + [0] * pad, labels, mask + [0] * pad)):
            writer.add_document(np.asarray(values))
    for writer in writers:
        writer.finalize()


def test_the_engine_trains_the_published_rows_in_mindspeeds_order(upstream, tmp_path):
    """backends.llm on a --neat-pack dataset with --padded-samples, two data-parallel ranks: every micro-batch is
    the row that the upstream index, read by Megatron's sampler, gives that rank, with the row's documents kept
    apart as written."""
    from backends.llm.config import ConfigError, parse_args
    from backends.llm.recipe import _build_data

    seq, micro, dp, batch, steps, seed = 16, 1, 2, 4, 7, 1234
    rows = [[5, 6], [3, 4, 2], [10], [2, 2, 2, 2], [4], [7, 7], [15], [6, 3, 2], [9], [1, 4], [8, 3]]
    write_neat_rows(tmp_path / "alpaca", rows, seq)
    argv = [*ARCH, "--data-path", str(tmp_path / "alpaca"), "--is-instruction-dataset", "--reset-attention-mask",
            "--neat-pack", "--padded-samples", "--split", "90,10,0", "--seq-length", str(seq), "--micro-batch-size",
            str(micro), "--global-batch-size", str(batch), "--train-iters", str(steps), "--lr", "1e-4", "--seed",
            str(seed)]
    cfg = parse_args(argv, engine={"model_id": "qwen3-0.6b"})
    train_rows = upstream.train_valid_test_split("90,10,0", len(rows))[1]
    index = upstream.shuffle_index(train_rows, batch, steps * batch, seed, True, True)
    # the held-out row is never read; each epoch is the 10 train rows and 2 padding rows, 3 epochs for 28 samples
    assert max(index) < train_rows == 10 and len(index) == 3 * 12
    for rank in range(dp):
        _, loader = _build_data(cfg, SimpleNamespace(is_main=True), SimpleNamespace(dp_rank=rank,
                                                                                    layout=SimpleNamespace(dp=dp)))
        positions = upstream.sampler_batches("single", len(index), micro, rank, dp, steps * batch // (micro * dp))
        for want in positions:
            mb = next(loader)
            row = index[want[0]]
            cu = mb["cu_seqlens"].tolist()
            starts = [int(mb["input_ids"][0, a]) for a in cu[:-1]]
            assert starts[:len(rows[row])] == [1000 + 10 * row + d for d in range(len(rows[row]))]
            assert np.diff(cu).tolist()[:len(rows[row])] == rows[row]
    # without the packing flags MindSpeed-LLM would train each row as one sequence: refused, not split into samples
    plain = parse_args([a for a in argv if a not in ("--reset-attention-mask", "--neat-pack")],
                       engine={"model_id": "qwen3-0.6b"})
    with pytest.raises(ConfigError, match="--reset-attention-mask --neat-pack"):
        _build_data(plain, SimpleNamespace(is_main=True), SimpleNamespace(dp_rank=0, layout=SimpleNamespace(dp=1)))
    # padding rows the file does not have: one named error (upstream fails on the index)
    wide = parse_args(argv + ["--global-batch-size", "32"], engine={"model_id": "qwen3-0.6b"})
    with pytest.raises(ConfigError, match="--padded-samples: an epoch of 10 rows needs rows 0..21"):
        _build_data(wide, SimpleNamespace(is_main=True), SimpleNamespace(dp_rank=0, layout=SimpleNamespace(dp=1)))
