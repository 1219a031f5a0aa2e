"""Running backends.lf from tests: a hand-written LLaMA-Factory YAML (with its dataset_info.json),
run as `python -m backends.lf train <file>` (optionally under torchrun), and its outputs read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-qwen3"
DATA = ROOT / "examples" / "data"
DATASETS = {
    "alpaca": {"file_name": str(DATA / "arithmetic_alpaca.json")},
    "sharegpt": {"file_name": str(DATA / "arithmetic_sharegpt.json"), "formatting": "sharegpt",
                 "columns": {"messages": "conversations"}},
    "corpus": {"file_name": str(DATA / "arithmetic_corpus.jsonl"), "columns": {"prompt": "text"}},
}


def lf_file(folder: Path, **keys) -> Path:
    """A LLaMA-Factory training YAML in `folder` (tiny Qwen3, alpaca SFT, fp32, 4 steps unless changed),
    with a dataset_info.json next to it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_info.json").write_text(json.dumps(DATASETS))
    tree = {"model_name_or_path": str(TINY), "stage": "sft", "do_train": True, "finetuning_type": "full",
            "dataset": "alpaca", "dataset_dir": str(folder), "template": "qwen", "cutoff_len": 128, "max_samples": 64,
            "output_dir": str(folder / "out"), "logging_steps": 1, "save_strategy": "no",
            "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": 1e-3,
            "max_steps": 4, "lr_scheduler_type": "constant", "disable_gradient_checkpointing": True,
            "report_to": "none"}
    tree.update(keys)
    path = folder / "train.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def run_lf(path: Path, *overrides: str, nproc: int = 1, timeout: int = 600, check: bool = True,
           env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "AF_ENGINE_FILE"}, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1", "AF_DEVICE": "cpu", **(env or {})}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "backends.lf", "train", str(path), *overrides]
    else:
        cmd = [sys.executable, "-m", "backends.lf", "train", str(path), *overrides]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out) if "step" in r and "event" not in r]


def end_event(out: Path) -> dict:
    return next(r for r in metrics(out) if r.get("event") == "end")


def add_lf(runs, name: str, path: Path, *overrides: str, nproc: int = 1, env: dict | None = None,
           after: str | None = None) -> None:
    """run_lf's command added to an EngineRuns batch (tests/helpers/engine_runs.py) instead of run at once:
    runs[name] is then the file's output_dir, trained in one launch with the batch's other runs."""
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    runs.add_command(name, "backends.lf", ["train", str(path), *overrides], out, world=nproc,
                     env={"AF_DEVICE": "cpu", **(env or {})}, after=after)
