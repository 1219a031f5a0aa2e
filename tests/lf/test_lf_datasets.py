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


def test_image_and_text_datasets_train_together(tmp_path, caplog):
    """LF's Qwen2.5-VL example lists an image dataset with text ones (mllm_demo,identity,alpaca_en_demo): the
    text records are samples without images, in the same batches; the video keys it sets are accepted with one
    notice line (no dataset has videos)."""
    import shutil

    import torch

    from backends.lf.vl_data import VISION_KEYS
    from tests.helpers.lf_runs import ROOT

    bundled = ROOT / "examples" / "tiny-qwen2.5-vl"
    path = lf_file(tmp_path, model_name_or_path=str(bundled), template="qwen2_vl", dataset="vl_sft,alpaca,sharegpt",
                   media_dir=str(DATA), max_samples=2, disable_shuffling=True, video_max_pixels=16384,
                   video_fps=1.0, cutoff_len=256)
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    info["vl_sft"] = {"file_name": "vl_sft.json", "formatting": "sharegpt",
                      "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                               "assistant_tag": "assistant"}, "columns": {"messages": "messages", "images": "images"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    shutil.copy(DATA / "vl_sft.json", tmp_path / "vl_sft.json")
    cfg = parse_command(["train", str(path), "per_device_train_batch_size=6"])
    with caplog.at_level("INFO", logger="backends.lf"):
        dataset, loader, _ = LFRecipe(cfg)._data(RT, PAR)
    notices = [r.getMessage() for r in caplog.records if r.getMessage().startswith("notice:")]
    assert notices == ["notice: video_max_pixels, video_fps: no effect on this engine: no dataset has videos or "
                       "audio (those columns are refused)"]
    assert dataset.stats["units"] == 6 and dataset.stats["images"] == 2
    batch = next(loader)
    assert batch["input_ids"].shape[0] == 6 and batch["image_grid_thw"].shape[0] == 2
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(bundled)
    logits = model(input_ids=batch["input_ids"], **{k: batch[k] for k in VISION_KEYS if k in batch}).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    loss.backward()
    assert torch.isfinite(loss) and batch["n_tokens"] > 0


def test_video_keys_are_typed():
    from backends.lf.config import parse_config

    with pytest.raises(LFConfigError, match="video_fps must be a number"):
        parse_config({"video_fps": "fast"})


def test_template_gemma_takes_no_images(tmp_path):
    """LF's gemma template has gemma3's text format (tests/lf/test_lf_templates.py) but the base plugin, which
    refuses images."""
    path = lf_file(tmp_path, dataset="vl", template="gemma")
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    info["vl"] = {"file_name": str(DATA / "vl_sft.json"), "formatting": "sharegpt",
                  "columns": {"messages": "messages", "images": "images"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(LFConfigError, match="template: gemma takes no images"):
        LFRecipe(parse_command(["train", str(path)]))._data(RT, PAR)
