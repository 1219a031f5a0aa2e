"""backends.lf reads a training YAML as llamafactory-cli 0.9.5 does (hparams/parser.py read_args:
OmegaConf.load, then OmegaConf.from_cli overrides merged over it), refuses every problem of a file at
once (one line each, naming the key, exit 2), and resolves paths as LLaMA-Factory does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from backends.lf.config import LFConfigError, parse_config, read_training_file
from backends.lf.recipe import parse_command
from tests.helpers.lf_runs import ROOT, lf_file


def test_exponent_numbers_are_floats_in_the_file_and_on_the_command_line(tmp_path):
    """YAML 1.1 reads `1e-4` (no dot) as text; OmegaConf, and so LLaMA-Factory, as a float."""
    path = lf_file(tmp_path)
    path.write_text(path.read_text() + "weight_decay: 1e-2\nwarmup_ratio: 5e-2\n")
    cfg = parse_command(["train", str(path), "learning_rate=1e-4", "adam_epsilon=1e-6", "max_steps=7",
                         "overwrite_output_dir=true"])
    assert cfg.learning_rate == 1e-4 and isinstance(cfg.learning_rate, float)
    assert cfg.weight_decay == 0.01 and cfg.warmup_ratio == 0.05 and cfg.adam_epsilon == 1e-6
    assert cfg.max_steps == 7 and cfg.overwrite_output_dir is True
    # an override replaces the file's value; text stays text
    assert read_training_file(path, ["template=qwen3", "dataset=a,b"])["dataset"] == "a,b"


def test_every_problem_is_refused_at_once_one_line_each(tmp_path):
    path = lf_file(tmp_path, learning_rate="fast", lora_rnak=8, cutoff_len=1.5)
    with pytest.raises(LFConfigError) as err:
        parse_command(["train", str(path), "seed=abc"])
    lines = str(err.value).splitlines()
    assert len(lines) == 4, lines
    for key in ("lora_rnak", "learning_rate must be a number", "cutoff_len must be an integer",
                "seed must be an integer"):
        assert sum(key in line for line in lines) == 1, (key, lines)
    assert all(line.startswith(str(path)) for line in lines)
    with pytest.raises(LFConfigError, match="give overrides as key=value"):
        parse_command(["train", str(path), "learning_rate"])


def test_cross_key_rules_are_reported_together():
    with pytest.raises(LFConfigError) as err:
        parse_config({"stage": "sft", "do_train": True, "bf16": True, "fp16": True, "learning_rate": -1.0,
                      "cutoff_len": 0})
    text = str(err.value)
    for needle in ("model_name_or_path is required", "dataset is required", "output_dir is required",
                   "bf16 and fp16", "cutoff_len must be at least 1", "learning_rate must be positive"):
        assert needle in text
    assert len(text.splitlines()) == 6


def test_a_wrong_type_exits_2_with_one_line_per_problem_and_no_traceback(tmp_path):
    path = lf_file(tmp_path, learning_rate="fast")
    res = subprocess.run([sys.executable, "-m", "backends.lf", "train", str(path), "num_train_epochs=many"],
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    named = [line for line in res.stderr.splitlines() if "must be a number" in line]
    assert len(named) == 2 and any("learning_rate" in x for x in named) and any("num_train_epochs" in x for x in named)


def test_deepspeed_paths_are_read_from_the_working_directory(tmp_path, monkeypatch):
    """transformers opens `deepspeed:` itself, from the working directory (LLaMA-Factory's examples say
    `deepspeed: examples/deepspeed/ds_z3_config.json`, run from the repository root), not from the YAML's
    folder."""
    work, conf = tmp_path / "work", tmp_path / "conf"
    (work / "examples" / "deepspeed").mkdir(parents=True)
    (work / "examples" / "deepspeed" / "ds_z3_config.json").write_text(
        json.dumps({"zero_optimization": {"stage": 3}}))
    path = lf_file(conf, deepspeed="examples/deepspeed/ds_z3_config.json")
    monkeypatch.chdir(work)
    assert parse_command(["train", str(path)]).zero.stage == 3
    # the same relative name next to the YAML only is not found
    (conf / "examples" / "deepspeed").mkdir(parents=True)
    (work / "examples" / "deepspeed" / "ds_z3_config.json").rename(conf / "examples" / "deepspeed" / "x.json")
    with pytest.raises(LFConfigError, match="deepspeed: .*does not exist"):
        parse_command(["train", str(lf_file(conf, deepspeed="examples/deepspeed/x.json"))])


def test_dataset_dir_is_read_from_the_working_directory(tmp_path, monkeypatch):
    """dataset_dir (default `data`) is relative to where llamafactory-cli runs, as LF's loader opens it."""
    from backends.lf.data import read_dataset_info

    work = tmp_path / "work"
    path = lf_file(tmp_path / "conf", dataset_dir="data")
    (work / "data").mkdir(parents=True)
    (tmp_path / "conf" / "dataset_info.json").rename(work / "data" / "dataset_info.json")
    monkeypatch.chdir(work)
    cfg = parse_command(["train", str(path)])
    assert [e.name for e in read_dataset_info(cfg)] == ["alpaca"]
