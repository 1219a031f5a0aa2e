"""The bundled LLaMA-Factory examples run through `ascendfactory run` on the CPU: the rendered
LLaMA-Factory files are what backends.lf trains from, SFT's first step equals plain transformers on
the same tokens, the losses fall, and output_dir holds what LLaMA-Factory leaves."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.lf_runs import ROOT, losses
from tests.lf.test_lf_engine import reference_loss


def run_example(name: str, out: Path) -> Path:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "ascendfactory", "run", str(ROOT / "examples" / "llamafactory" / name),
                          f"output_dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log")) if (out / "logs").exists() else ""
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + logs[-3000:]
    return out


def test_sft_example(tmp_path):
    out = run_example("sft.yaml", tmp_path / "sft")
    run = losses(out)
    assert len(run) == 30 and sum(run[-5:]) / 5 < run[0] - 1.0
    assert run[0] == pytest.approx(reference_loss(out / "llamafactory_train.yaml"), abs=1e-5)
    assert (out / "model.safetensors").is_file() and (out / "trainer_log.jsonl").is_file()


def test_lora_example_packs_neatly_and_writes_an_adapter(tmp_path):
    out = run_example("lora.yaml", tmp_path / "lora")
    run = losses(out)
    assert sum(run[-5:]) / 5 < run[0] - 0.5
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert json.loads((out / "dataset_info.json").read_text())["arithmetic_sharegpt"]["formatting"] == "sharegpt"
    assert "packed rows" in "".join(p.read_text() for p in (out / "logs").glob("*.log"))


def test_pt_example(tmp_path):
    out = run_example("pt.yaml", tmp_path / "pt")
    run = losses(out)
    assert len(run) == 20 and sum(run[-5:]) / 5 < run[0] - 0.5
