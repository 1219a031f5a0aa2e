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


def test_dpo_job_runs_from_its_rendered_files(tmp_path):
    """A DPO job (the card of Qwen2.5-14B, which the matrix lists for DPO, on a tiny Qwen2 of its
    family) through `ascendfactory run`: dataset_info.json marks the pairs as ranking data, and the
    rewards separate."""
    import yaml

    from tests.helpers.tiny_hf import make_tiny_hf

    model = make_tiny_hf("qwen2", tmp_path / "qwen2")
    job = {"model": "qwen2.5-14b", "model_path": str(model), "framework": "llamafactory", "stage": "dpo",
           "data": {"path": str(ROOT / "examples" / "data" / "arithmetic_pairs.json"), "format": "pairwise",
                    "template": "qwen", "seq_len": 256, "max_samples": 32},
           "train": {"lr": 5e-3, "global_batch": 4, "micro_batch": 2, "steps": 10, "precision": "fp32"},
           "resources": {"device": "cpu"}, "launcher": "local", "output_dir": str(tmp_path / "out")}
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "ascendfactory", "run", str(tmp_path / "dpo.yaml")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    out = tmp_path / "out"
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log")) if (out / "logs").exists() else ""
    assert res.returncode == 0, res.stdout[-3000:] + logs[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "event" not in r]
    assert len(steps) == 10 and steps[-1]["rewards/margins"] > steps[0]["rewards/margins"]
    assert json.loads((out / "dataset_info.json").read_text())["arithmetic_pairs"]["ranking"] is True
