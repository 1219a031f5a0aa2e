"""dataloader_param.drop_last: true is what backends.mm builds (each epoch's tail that does not fill
micro-batch × data-parallel size is left out, as MindSpeed-MM's BaseRandomBatchSampler does); false is refused
by name, as that sampler refuses it, instead of silently behaving as true."""

from __future__ import annotations

import pytest
import torch

from backends.mm.data import Loader, Sample
from tests.mm.test_mm_dialect import _parse_with, upstream  # noqa: F401 (a fixture)


def test_drop_last_false_is_refused_by_name(upstream, tmp_path):
    from backends.mm.config import ConfigError

    def loader_edit(value):
        return lambda d: d["dataloader_param"].update(drop_last=value)

    for value in (False, "false"):
        with pytest.raises(ConfigError) as err:
            _parse_with(tmp_path, data_edit=loader_edit(value))
        shown = "false" if value is False else '"false"'
        assert f"dataloader_param.drop_last = {shown} is not built" in str(err.value)
        assert "set it to true" in str(err.value)
    _parse_with(tmp_path, data_edit=loader_edit(True))  # the published setting parses


class Samples:
    """The part of MLLMDataset the Loader reads: samples whose single token is their index."""

    def __init__(self, n: int):
        self.samples = [Sample([i], [i], None, None) for i in range(n)]

    def __len__(self) -> int:
        return len(self.samples)


def test_each_epoch_leaves_out_the_tail_that_fills_no_span():
    """11 samples, micro-batch 2 × dp 2: two spans of 4 per epoch; the 3 left over start no third span."""
    ranks = [Loader(Samples(11), 2, rank, 2, seed=3, shuffle=True) for rank in (0, 1)]
    epochs = []
    for _ in range(3):
        seen = [int(x) for _ in range(2) for loader in ranks for x in next(loader)["input_ids"][0]]
        epochs.append(seen)
        assert len(seen) == len(set(seen)) == 8  # every rank a different slice, no sample twice in an epoch
    assert all(loader.epoch == 2 and loader.pos == 8 for loader in ranks)
    assert len({tuple(sorted(e)) for e in epochs}) > 1  # a new shuffle per epoch: other samples left out
    order = Loader(Samples(11), 2, 0, 2, seed=3, shuffle=True)._order()
    assert sorted(epochs[0]) == sorted(order[:8])
    assert torch.equal(next(Loader(Samples(11), 2, 1, 2, seed=3, shuffle=False))["input_ids"], torch.tensor([[2, 3]]))
