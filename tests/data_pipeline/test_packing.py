"""Best-fit-decreasing packing and the three batch layouts (padded, packed, dynamic)."""

import numpy as np
import pytest
import torch

from backends.common.data import MicroBatchLoader, best_fit_decreasing, pack_stats, preprocess, shift_labels
from backends.common.data.templates import IGNORE_INDEX

from .conftest import DATA


def naive_best_fit_loads(lengths, cap):
    rows = []
    for n in sorted(lengths, reverse=True):
        fits = [i for i, load in enumerate(rows) if load + n <= cap]
        if fits:
            best = min(fits, key=lambda i: cap - rows[i])
            rows[best] += n
        else:
            rows.append(n)
    return sorted(rows)


@pytest.mark.parametrize("seed", range(4))
def test_best_fit_decreasing_matches_the_definition(seed):
    rng = np.random.default_rng(seed)
    cap = int(rng.choice([16, 100, 128]))
    lengths = rng.integers(1, cap + 1, size=300)
    rows = best_fit_decreasing(lengths, cap)
    flat = sorted(i for r in rows for i in r)
    assert flat == list(range(len(lengths)))
    assert all(lengths[r].sum() <= cap for r in rows)
    assert sorted(int(lengths[r].sum()) for r in rows) == naive_best_fit_loads(lengths.tolist(), cap)
    assert best_fit_decreasing(lengths, cap) == rows        # deterministic


def test_padding_waste_is_reported():
    lengths = [5, 5, 3, 3, 2]
    rows = best_fit_decreasing(lengths, 8)
    stats = pack_stats(rows, lengths, 8)
    assert sorted(sorted(lengths[i] for i in r) for r in rows) == [[2], [3, 5], [3, 5]]
    assert (stats.rows, stats.tokens, stats.slots) == (3, 18, 24) and stats.waste_pct == pytest.approx(25.0)
    with pytest.raises(ValueError, match="does not fit"):
        best_fit_decreasing([9], 8)


def test_quickstart_data_packs_tightly(tiny_tok, tmp_path):
    h = preprocess(DATA / "arithmetic_alpaca.json", "alpaca", tiny_tok, None, 128, tmp_path)
    loader = MicroBatchLoader(h, mode="packed", micro_batch=8, seq_len=128, pad_id=tiny_tok.pad_token_id)
    stats = loader.stats["packing"]
    assert stats["tokens"] == h.stats["tokens"] and stats["waste_pct"] < 10
    assert stats["rows"] < h.stats["samples"] / 2


def check_packed(batch, ds, micro, seq_len, pad_id):
    ids, labels, pos = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
    cu = batch["cu_seqlens"]
    total = micro * seq_len
    assert batch["input_ids"].shape == (1, total) and cu.dtype == torch.int32
    assert {batch[k].dtype for k in ("input_ids", "labels", "position_ids")} == {torch.int64}
    bounds = cu.tolist()
    assert bounds[0] == 0 and bounds[-1] == total and bounds == sorted(bounds)
    assert all(r * seq_len in bounds for r in range(micro + 1))           # rows are segment boundaries
    seen = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert pos[a:b].tolist() == list(range(b - a))                    # positions restart per document
        assert labels[b - 1] == IGNORE_INDEX                              # nothing predicts across a boundary
        first = int(ids[a])
        if first >= 1000:                                                 # a document (synthetic ids)
            sample = first - 1000
            seen.append(sample)
            x, y = ds.sample(sample)
            assert ids[a:b].tolist() == x.tolist()
            assert labels[a:b].tolist() == shift_labels(y).tolist()
            trained = labels[a:b - 1] != IGNORE_INDEX
            assert torch.equal(labels[a:b - 1][trained], ids[a + 1:b][trained])   # labels[t] = next token
        else:                                                             # a row's padding tail
            assert (ids[a:b] == pad_id).all() and (labels[a:b] == IGNORE_INDEX).all()
    assert int(batch["n_tokens"]) == int((labels != IGNORE_INDEX).sum())
    return seen


@pytest.mark.parametrize("with_labels", [False, True])
def test_packed_batches_never_cross_documents(synthetic, with_labels):
    rng = np.random.default_rng(1)
    ds = synthetic(rng.integers(2, 40, size=60).tolist(), 64, with_labels=with_labels)
    loader = MicroBatchLoader(ds, mode="packed", micro_batch=3, seq_len=64, pad_id=0, seed=3)
    seen = []
    for _ in range(len(loader)):
        seen += check_packed(next(loader), ds, 3, 64, 0)
    assert len(set(seen)) == 60 and len(seen) >= 60       # the first epoch covered every sample


def test_padded_rows(synthetic):
    ds = synthetic([5, 9, 3, 7], 16, with_labels=True)
    loader = MicroBatchLoader(ds, mode="padded", micro_batch=2, seq_len=16, pad_id=0, shuffle=False)
    batch = next(loader)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (2, 16)
    assert "cu_seqlens" not in batch
    for r, sample in enumerate([0, 1]):
        x, y = ds.sample(sample)
        assert batch["input_ids"][r, :len(x)].tolist() == x.tolist()
        assert (batch["input_ids"][r, len(x):] == 0).all()
        assert batch["labels"][r].tolist() == shift_labels(y).tolist() + [IGNORE_INDEX] * (16 - len(x))
    assert batch["position_ids"][1].tolist() == list(range(16))
    assert int(batch["n_tokens"]) == int((batch["labels"] != IGNORE_INDEX).sum())


def test_dynamic_pads_to_multiple_of_8_and_groups_lengths(synthetic):
    rng = np.random.default_rng(2)
    ds = synthetic(rng.integers(2, 120, size=400).tolist(), 128)
    dyn = MicroBatchLoader(ds, mode="dynamic", micro_batch=4, seq_len=128, pad_id=0, seed=5, group_factor=10)
    pad = MicroBatchLoader(ds, mode="padded", micro_batch=4, seq_len=128, pad_id=0, seed=5)
    spread_dyn, spread_rand = [], []
    for _ in range(len(dyn)):
        b = next(dyn)
        lens = (b["input_ids"] != 0).sum(1).tolist()
        width = b["input_ids"].shape[1]
        assert width % 8 == 0 and width == -(-max(lens) // 8) * 8
        assert lens == sorted(lens, reverse=True)            # a slice of a length-sorted mega-batch
        spread_dyn.append(max(lens) - min(lens))
        p = (next(pad)["input_ids"] != 0).sum(1).tolist()
        spread_rand.append(max(p) - min(p))
    assert np.mean(spread_dyn) < np.mean(spread_rand) / 4
    # the batch order is shuffled, not longest-first
    widths = [next(dyn)["input_ids"].shape[1] for _ in range(len(dyn))]
    assert widths != sorted(widths, reverse=True)
