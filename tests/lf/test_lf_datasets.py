"""How backends.lf reads LLaMA-Factory's dataset lists: max_samples truncates each dataset before they
are merged (LF's data/loader.py _load_single_dataset), not the merged list."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from backends.lf.config import LFConfigError
from backends.lf.recipe import LFRecipe, parse_command
from tests.helpers.lf_runs import DATA, lf_file

RT = SimpleNamespace(is_main=True)
PAR = SimpleNamespace(dp_rank=0, layout=SimpleNamespace(dp=1))


def test_max_samples_applies_to_each_dataset(tmp_path):
    from backends.lf.data import read_dataset_info, write_canonical

    path = lf_file(tmp_path, dataset="alpaca,sharegpt", max_samples=5)
    cfg = parse_command(["train", str(path)])
    dataset, _, _ = LFRecipe(cfg)._data(RT, PAR)
    assert dataset.stats["samples"] == 10
    records, _ = write_canonical(read_dataset_info(cfg), "sft", tmp_path / "c", None, 5)
    rows = [json.loads(x) for x in records.read_text().splitlines()]
    alpaca = json.loads((DATA / "arithmetic_alpaca.json").read_text())
    sharegpt = json.loads((DATA / "arithmetic_sharegpt.json").read_text())
    assert [r["messages"][-1]["content"] for r in rows[:5]] == [r["output"] for r in alpaca[:5]]
    assert [r["messages"][-1]["content"] for r in rows[5:]] == [r["conversations"][-1]["value"]
                                                                for r in sharegpt[:5]]
    # without max_samples every record of both
    cfg = parse_command(["train", str(path), "max_samples=null"])
    assert LFRecipe(cfg)._data(RT, PAR)[0].stats["samples"] == len(alpaca) + len(sharegpt)


def test_num_samples_resampling_is_refused_by_name(tmp_path):
    path = lf_file(tmp_path)
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    info["alpaca"]["num_samples"] = 10
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(LFConfigError, match="num_samples"):
        LFRecipe(parse_command(["train", str(path)]))._data(RT, PAR)
