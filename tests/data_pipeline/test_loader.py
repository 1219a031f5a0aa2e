"""MicroBatchLoader: exact resume, deterministic epochs, disjoint and covering dp shards."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from backends.common.data import MODES, MicroBatchLoader, preprocess

from .conftest import DATA


def sample_ids(batch):
    """Synthetic sample indices in a batch (first token of each document is 1000 + index)."""
    ids = batch["input_ids"]
    if "cu_seqlens" in batch:
        starts = batch["cu_seqlens"][:-1].long()
        firsts = ids[0, starts]
    else:
        firsts = ids[:, 0]
    return [int(x) - 1000 for x in firsts if x >= 1000]


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", MODES)
def test_resume_continues_exactly(synthetic, mode):
    rng = np.random.default_rng(0)
    ds = synthetic(rng.integers(2, 30, size=37).tolist(), 32, with_labels=True)
    kw = dict(mode=mode, micro_batch=2, seq_len=32, dp_rank=1, dp_world=2, seed=11, pad_id=0)
    ref = MicroBatchLoader(ds, **kw)
    for _ in range(7):
        next(ref)
    state = json.loads(json.dumps(ref.state_dict()))        # plain JSON: goes into a checkpoint as is
    expected = [next(ref) for _ in range(25)]                 # crosses at least one epoch boundary
    resumed = MicroBatchLoader(ds, **kw)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(25)]
    assert all(same(a, b) for a, b in zip(expected, got))
    assert resumed.epoch == ref.epoch >= 1


@pytest.mark.parametrize("mode", ["padded", "packed", "dynamic"])
def test_dp_shards_are_disjoint_and_cover_every_epoch(synthetic, mode):
    rng = np.random.default_rng(4)
    n = 50
    ds = synthetic(rng.integers(2, 30, size=n).tolist(), 32)
    world, micro, epochs = 3, 2, 3
    loaders = [MicroBatchLoader(ds, mode=mode, micro_batch=micro, seq_len=32, dp_rank=r, dp_world=world, seed=7,
                                pad_id=0) for r in range(world)]
    units = loaders[0].n_units
    steps = epochs * units // (world * micro)
    seen = Counter()
    for _ in range(steps):
        per_rank = [sample_ids(next(ld)) for ld in loaders]
        flat = [s for ids in per_rank for s in ids]
        assert len(flat) == len(set(flat))                   # ranks never share a sample in a step
        seen.update(flat)
    # every unit of the stream consumed once: the remainder is exactly the not-yet-read tail
    consumed = steps * world * micro
    assert epochs * units - consumed < world * micro
    assert all(seen[i] in (epochs - 1, epochs) for i in range(n))
    if mode != "packed":
        assert sum(seen.values()) == consumed
    # the first epoch alone: all ranks together read every sample exactly once
    first = MicroBatchLoader(ds, mode=mode, micro_batch=micro, seq_len=32, dp_rank=0, dp_world=1, seed=7, pad_id=0)
    order = first.units_at(0, units)
    assert sorted(order) == list(range(units))
    shards = [set() for _ in range(world)]
    for step in range(units // (world * micro)):
        for r in range(world):
            start = step * world * micro + r * micro
            shards[r].update(order[start:start + micro])
    assert all(a.isdisjoint(b) for i, a in enumerate(shards) for b in shards[i + 1:])


def test_epochs_are_reshuffled_deterministically(synthetic):
    ds = synthetic([8] * 20, 16)
    a = MicroBatchLoader(ds, mode="padded", micro_batch=5, seq_len=16, seed=1)
    b = MicroBatchLoader(ds, mode="padded", micro_batch=5, seq_len=16, seed=1)
    c = MicroBatchLoader(ds, mode="padded", micro_batch=5, seq_len=16, seed=2)
    ea = [sample_ids(next(a)) for _ in range(8)]
    assert ea == [sample_ids(next(b)) for _ in range(8)]
    assert ea != [sample_ids(next(c)) for _ in range(8)]
    epoch0, epoch1 = sum(ea[:4], []), sum(ea[4:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(20)) and epoch0 != epoch1
    assert a.epoch == 2 and len(a) == 4
    plain = MicroBatchLoader(ds, mode="padded", micro_batch=5, seq_len=16, shuffle=False)
    assert [sample_ids(next(plain)) for _ in range(2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_padded_resume_may_change_dp_world(synthetic):
    ds = synthetic([6] * 24, 8)
    two = [MicroBatchLoader(ds, mode="padded", micro_batch=2, seq_len=8, dp_rank=r, dp_world=2, seed=3)
           for r in range(2)]
    for _ in range(3):
        for ld in two:
            next(ld)
    state = two[0].state_dict()
    nxt = sample_ids(next(two[0])) + sample_ids(next(two[1]))
    one = MicroBatchLoader(ds, mode="padded", micro_batch=4, seq_len=8, dp_rank=0, dp_world=1, seed=3)
    one.load_state_dict(state)
    assert sample_ids(next(one)) == nxt


def test_state_mismatch_is_refused(synthetic):
    ds = synthetic([6] * 10, 8)
    state = MicroBatchLoader(ds, mode="dynamic", micro_batch=2, seq_len=8, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed=3"):
        MicroBatchLoader(ds, mode="dynamic", micro_batch=2, seq_len=8, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="mode='dynamic'"):
        MicroBatchLoader(ds, mode="padded", micro_batch=2, seq_len=8, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="micro_batch"):
        MicroBatchLoader(ds, mode="dynamic", micro_batch=1, seq_len=8, seed=3).load_state_dict(state)


def test_argument_errors(synthetic):
    ds = synthetic([6] * 4, 8)
    with pytest.raises(ValueError, match="unknown batch mode 'ragged'"):
        MicroBatchLoader(ds, mode="ragged")
    with pytest.raises(ValueError, match="dp_rank 2 is not in 0..1"):
        MicroBatchLoader(ds, dp_rank=2, dp_world=2)
    with pytest.raises(ValueError, match="exceed seq_len 4"):
        MicroBatchLoader(ds, seq_len=4)


def test_handle_in_and_trainer_contract(tiny_tok, tmp_path):
    h = preprocess(DATA / "arithmetic_sharegpt.json", "sharegpt", tiny_tok, None, 96, tmp_path)
    for mode in MODES:
        batch = next(MicroBatchLoader(h, mode=mode, micro_batch=4, seq_len=96, pad_id=tiny_tok.pad_token_id))
        assert batch["n_tokens"].shape == () and batch["n_tokens"].dtype == torch.int64 and int(batch["n_tokens"]) > 0
        want = {"input_ids", "labels", "position_ids", "n_tokens", "n_input"} | (
            {"cu_seqlens"} if mode == "packed" else set())
        assert set(batch) == want
        # n_input counts the real (non-pad) tokens: every sample's full length
        ids = batch["input_ids"]
        assert 0 < int(batch["n_input"]) <= ids.numel()
        if mode != "packed":
            assert int(batch["n_input"]) == sum(int(h.open(96).lengths[i]) for i in MicroBatchLoader(
                h, mode=mode, micro_batch=4, seq_len=96).units_at(0, 4))
