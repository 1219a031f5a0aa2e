"""The bundled LLaMA-Factory examples on the CPU (sft.yaml and the freeze job through `ascendfactory run`
itself, the others rendered as `run` renders them and trained in one launch: tests/helpers/engine_runs.py):
the rendered LLaMA-Factory files are what backends.lf trains from, SFT's first step equals plain transformers on
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


EXAMPLES = ("lora", "pt", "dpo", "vl-sft", "vl-dpo")


@pytest.fixture(scope="module")
def examples(engine_runs, tmp_path_factory):
    """The examples but sft.yaml (run through `ascendfactory run` itself by test_sft_example), rendered as
    `ascendfactory run <example> output_dir=…` renders them and trained in one launch (tests/helpers/
    engine_runs.py): name -> a function giving its output dir."""
    tmp = tmp_path_factory.mktemp("lf-examples")
    for name in EXAMPLES:
        engine_runs.add(f"lf-examples/{name}", ROOT / "examples" / "llamafactory" / f"{name}.yaml",
                        f"output_dir={tmp / name}")
    return {name: (lambda n=name: engine_runs[f"lf-examples/{n}"]) for name in EXAMPLES}


def test_sft_example(tmp_path):
    out = run_example("sft.yaml", tmp_path / "sft")
    run = losses(out)
    assert len(run) == 30 and sum(run[-5:]) / 5 < run[0] - 1.0
    assert run[0] == pytest.approx(reference_loss(out / "llamafactory_train.yaml"), abs=1e-5)
    assert (out / "model.safetensors").is_file() and (out / "trainer_log.jsonl").is_file()


def test_lora_example_packs_neatly_and_writes_an_adapter(examples):
    out = examples["lora"]()
    run = losses(out)
    assert sum(run[-5:]) / 5 < run[0] - 0.5
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert json.loads((out / "dataset_info.json").read_text())["arithmetic_sharegpt"]["formatting"] == "sharegpt"
    assert "packed rows" in "".join(p.read_text() for p in (out / "logs").glob("*.log"))


def test_pt_example(examples):
    out = examples["pt"]()
    run = losses(out)
    assert len(run) == 20 and sum(run[-5:]) / 5 < run[0] - 0.5


def run_job(job: dict, tmp_path: Path) -> Path:
    """Write `job` as a job file, run it through `ascendfactory run`, return its output_dir."""
    import yaml

    out = tmp_path / "out"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**job, "output_dir": str(out)}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "ascendfactory", "run", str(tmp_path / "job.yaml")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log")) if (out / "logs").exists() else ""
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + logs[-3000:]
    return out


def tiny_job(model: Path, **fields) -> dict:
    """A job on a tiny Qwen2 under the card of Qwen2.5-14B (the matrix lists it for SFT and DPO)."""
    return {"model": "qwen2.5-14b", "model_path": str(model), "framework": "llamafactory",
            "train": {"lr": 5e-3, "global_batch": 4, "micro_batch": 2, "steps": 10, "precision": "fp32"},
            "resources": {"device": "cpu"}, "launcher": "local", **fields}


def test_dpo_example_separates_chosen_from_rejected(examples):
    """The DPO example as `ascendfactory run` renders it: dataset_info.json marks the pairs as ranking data,
    and over the run the implicit rewards' accuracy and margin rise."""
    out = examples["dpo"]()
    steps = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())
             if "step" in r and "event" not in r]
    assert len(steps) == 20

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows)

    assert mean("rewards/accuracies", steps[-5:]) > mean("rewards/accuracies", steps[:5]) + 0.2
    assert mean("rewards/margins", steps[-5:]) > mean("rewards/margins", steps[:5]) + 0.2
    assert json.loads((out / "dataset_info.json").read_text())["arithmetic_pairs"]["ranking"] is True


def rewards(out: Path) -> tuple[list[float], list[float]]:
    rows = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())
            if "rewards/accuracies" in r]
    return [r["rewards/accuracies"] for r in rows], [r["rewards/margins"] for r in rows]


def test_vl_sft_example_learns_from_images(examples):
    """The tiny Qwen2.5-VL example as `ascendfactory run` renders it: images reach the engine through the rendered
    dataset_info.json (images column) and media_dir, the vision tower trains, the loss falls."""
    out = examples["vl-sft"]()
    run = losses(out)
    assert len(run) == 20 and run[-1] < 0.7 * run[0]
    info = json.loads((out / "dataset_info.json").read_text())["vl_sft"]
    assert info["columns"]["images"] == "images"
    log = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "32 images" in log and (out / "model.safetensors").is_file()
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    assert AutoImageProcessor.from_pretrained(out).merge_size == 2  # the processor travels with the export
    assert type(AutoModelForImageTextToText.from_pretrained(out)).__name__ == "Qwen2_5_VLForConditionalGeneration"


def test_vl_dpo_example_separates_chosen_from_rejected(examples):
    out = examples["vl-dpo"]()
    acc, margin = rewards(out)
    assert len(acc) == 48
    assert sum(acc[-8:]) / 8 > sum(acc[:8]) / 8 + 0.2
    assert sum(margin[-8:]) / 8 > sum(margin[:8]) / 8 + 0.05
    assert json.loads((out / "dataset_info.json").read_text())["vl_pairs"]["ranking"] is True


def test_freeze_job_trains_only_the_named_modules(tmp_path):
    """`finetuning: freeze` in the job file: the first layer's MLP and the final norm train, every
    other weight of the saved model is the base model's, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from tests.helpers.tiny_hf import make_tiny_hf

    model = make_tiny_hf("qwen2", tmp_path / "qwen2")
    out = run_job(tiny_job(model, finetuning="freeze", train={
        "lr": 5e-3, "global_batch": 2, "micro_batch": 2, "steps": 2, "precision": "fp32"},
        freeze={"trainable_layers": -1, "trainable_modules": ["mlp"], "extra_modules": ["norm"]},
        data={"path": str(ROOT / "examples" / "data" / "arithmetic_alpaca.json"), "format": "alpaca",
              "template": "qwen", "seq_len": 128, "max_samples": 8}), tmp_path)
    rendered = (out / "llamafactory_train.yaml").read_text()
    assert "freeze_trainable_layers: -1" in rendered and "finetuning_type: freeze" in rendered
    trained, base = load_file(out / "model.safetensors"), load_file(model / "model.safetensors")
    changed = {k for k in base if not torch.equal(trained[k], base[k])}
    assert changed and all(k.startswith("model.layers.0.mlp.") or k == "model.norm.weight" for k in changed), changed
    assert "model.norm.weight" in changed

