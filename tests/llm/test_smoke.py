"""One optimizer step through `ascendfactory run` for every (family × feature) backends.llm declares.

Each declaration in backends/llm/capabilities.py is proven here: the job goes through the whole
path (validate → plan → render → launch → engine → metrics.jsonl → export) on the CPU.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from backends.llm.capabilities import IMPLEMENTS
from tests.helpers.tiny_hf import TINY, make_tiny_hf

ROOT = Path(__file__).resolve().parents[2]
FEATURES = ("pretrain_full", "lora", "packing", "flash_attention", "dynamic_seq_len", "long_seq", "sptd")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny_models")
    return {family: make_tiny_hf(family, base / family) for family in TINY}


def _job(family: str, feature: str, model_dir: Path, out: Path) -> dict:
    _, card, _ = TINY[family]
    moe = family in ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
    job = {
        "model": card, "model_path": str(model_dir), "framework": "mindspeed-llm", "stage": "sft",
        "data": {"path": str(ROOT / "examples/data/arithmetic_alpaca.json"), "format": "alpaca", "seq_len": 64,
                 "max_samples": 16},
        "parallel": {}, "kernels": {"flash_attention": feature == "flash_attention"},
        "train": {"steps": 1, "global_batch": 2, "micro_batch": 2, "lr": 1e-3, "precision": "fp32",
                  "moe_aux_loss_coeff": 0.01 if moe else 0.0},
        "resources": {"device": "cpu", "devices_per_node": 1}, "launcher": "local", "output_dir": str(out),
        "resume": "never",
    }
    if feature == "pretrain_full":
        job["stage"] = "pt"
        job["data"].update(path=str(ROOT / "examples/data/arithmetic_corpus.jsonl"), format="text")
    elif feature == "lora":
        job["finetuning"] = "lora"
        job["lora"] = {"rank": 4, "alpha": 8}
        if moe:
            job["parallel"]["moe_dispatcher"] = "alltoall_seq"
    elif feature == "packing":
        job["data"]["packing"] = True
    elif feature == "dynamic_seq_len":
        job["data"]["dynamic_seq_len"] = True
    elif feature == "long_seq":  # context parallel over two CPU processes, packed documents
        job["parallel"].update(cp=2, cp_algo="ring")
        job["data"]["packing"] = True
        job["kernels"]["flash_attention"] = True
        job.update(launcher="torchrun", resources={"device": "cpu", "devices_per_node": 2})
    elif feature == "sptd":  # tensor + sequence + pipeline parallel over four CPU processes
        job["parallel"].update(tp=2, sp=True, pp=2)
        job["train"]["global_batch"] = 4  # two micro-batches in flight through the two stages
        job.update(launcher="torchrun", resources={"device": "cpu", "devices_per_node": 4})
    return job


CASES = [(family, feature) for feature in FEATURES for family in IMPLEMENTS["mindspeed-llm"][feature]]


@pytest.mark.parametrize("family,feature", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_one_step_through_run(family, feature, tiny_models, tmp_path):
    out = tmp_path / "run"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(_job(family, feature, tiny_models[family], out)))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "ascendfactory", "run", str(job_file), "--allow-unsupported"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = "".join(p.read_text() for p in (out / "logs").glob("*.log")) if (out / "logs").exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1] and math.isfinite(steps[0]["loss"]) and steps[0]["grad_norm"] > 0
    if feature == "lora":
        assert (out / "hf" / "adapter" / "adapter_model.safetensors").exists()
    else:
        assert (out / "hf" / "config.json").exists()
    if feature == "packing":
        assert steps[0]["padding_waste"] < 0.5  # several samples share each 64-token row
    if feature == "dynamic_seq_len":
        start = next(r for r in records if r.get("event") == "start")
        assert start["samples"] > 0
