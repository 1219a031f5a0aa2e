"""LLaMA-Factory 0.9.5's own published training files (tests/fixtures/upstream/llamafactory/v0.9.5, unmodified)
read by backends.lf as llamafactory-cli reads them from the repository root, only the model and output_dir
overridden on the command line: every key accepted, numbers read as OmegaConf reads them, `deepspeed:` found
from the working directory, and the SFT example's datasets cut per dataset by max_samples 1000 (identity 91 +
alpaca_en_demo 999 = 1090 samples, as LF builds them; cutting the merged list would give 1000)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from backends.lf.recipe import LFRecipe, parse_command
from tests.helpers.lf_runs import ROOT, TINY

PUBLISHED = ROOT / "tests" / "fixtures" / "upstream" / "llamafactory" / "v0.9.5"
FILES = {"examples/train_lora/qwen3_lora_sft.yaml": ("sft", 1e-4, 0),
         "examples/train_lora/qwen3_lora_sft_ds3.yaml": ("sft", 1e-4, 3),
         "examples/train_full/qwen3_full_sft.yaml": ("sft", 1e-5, 3),
         "examples/train_lora/qwen3_lora_dpo.yaml": ("dpo", 5e-6, 0),
         "examples/train_lora/qwen3_lora_pretrain.yaml": ("pt", 1e-4, 0)}


def _parse(name: str, out: Path):
    return parse_command(["train", name, f"model_name_or_path={TINY}", f"output_dir={out}"])


@pytest.mark.parametrize("name", FILES)
def test_published_files_are_read_as_published(name, tmp_path, monkeypatch):
    monkeypatch.chdir(PUBLISHED)
    stage, lr, zero = FILES[name]
    cfg = _parse(name, tmp_path / "out")
    assert (cfg.stage, cfg.learning_rate, cfg.zero.stage) == (stage, lr, zero)
    assert isinstance(cfg.learning_rate, float) and cfg.warmup_ratio == 0.1 and cfg.max_samples == 1000
    assert cfg.template == (None if stage == "pt" else "qwen3_nothink")
    # at pt the map's 16 workers cut the texts into the chunks LF chains (backends.lf.packing): read, not noticed
    workers = "" if stage == "pt" else "preprocessing_num_workers, "
    assert cfg.notices() == [f"{workers}dataloader_num_workers, ddp_timeout: no effect on this "
                             "engine: performance and process switches this engine sets itself"]


def test_the_sft_example_builds_lf_samples(tmp_path, monkeypatch):
    monkeypatch.chdir(PUBLISHED)
    cfg = _parse("examples/train_lora/qwen3_lora_sft.yaml", tmp_path / "out")
    dataset, loader, tokenizer = LFRecipe(cfg)._data(SimpleNamespace(is_main=True),
                                                     SimpleNamespace(dp_rank=0, layout=SimpleNamespace(dp=1)))
    sizes = [len(json.loads((PUBLISHED / "data" / f).read_text())) for f in ("identity.json", "alpaca_en_demo.json")]
    assert sizes == [91, 999] and dataset.stats["samples"] == sum(min(n, cfg.max_samples) for n in sizes) == 1090
    first = next(iter(loader))
    assert tokenizer.decode(first["input_ids"][0]).startswith("<|im_start|>user\n")


def test_the_lora_sft_example_trains_as_published(tmp_path):
    """`python -m backends.lf train examples/train_lora/qwen3_lora_sft.yaml` from LF's repository root, only the
    model, output_dir and step count changed on the command line (bf16 as published)."""
    import os
    import subprocess
    import sys

    from tests.helpers.lf_runs import losses

    out = tmp_path / "out"
    env = {**{k: v for k, v in os.environ.items() if k != "AF_ENGINE_FILE"}, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1", "AF_DEVICE": "cpu"}
    res = subprocess.run([sys.executable, "-m", "backends.lf", "train", "examples/train_lora/qwen3_lora_sft.yaml",
                          f"model_name_or_path={TINY}", f"output_dir={out}", "max_steps=2"], cwd=PUBLISHED, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # logging_steps 10 as published: the last step is logged
    assert "step 2/2" in res.stdout and len(losses(out)) == 1 and (out / "adapter_model.safetensors").is_file()
    assert (out / "trainer_log.jsonl").is_file() and "1090 samples" in res.stdout
    assert res.stdout.count("notice:") == 1
