"""A tiny quickstart-like job (the bundled tiny Qwen3, a few steps on the CPU) and what the cluster
launcher tests read back: `ascendfactory run` as a subprocess, the losses of metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-qwen3"


def tiny_job(out: Path, **changes) -> dict:
    base = {
        "model": "qwen3-0.6b", "model_path": str(TINY), "framework": "mindspeed-llm", "stage": "sft",
        "data": {"path": str(ROOT / "examples/data/arithmetic_alpaca.json"), "seq_len": 64, "max_samples": 64},
        "train": {"steps": 6, "global_batch": 8, "micro_batch": 2, "lr": 2e-3, "precision": "fp32",
                  "warmup_steps": 1},
        "resources": {"device": "cpu", "devices_per_node": 1}, "launcher": "local", "output_dir": str(out),
        "resume": "never",
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def write_job(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def cli(*args, env: dict | None = None, cwd: Path = ROOT, timeout: float = 300, clean_path: bool = False,
        **popen) -> subprocess.CompletedProcess:
    """`python -m ascendfactory …` with this interpreter. clean_path: a shell whose PATH holds only the
    system directories (no venv, no pyenv), as a user's login shell on a cluster might."""
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"} \
        if clean_path else dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-m", "ascendfactory", *map(str, args)], cwd=cwd,
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout, **popen)


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def losses(out: Path) -> dict[int, float]:
    """step → loss; a step logged twice (before a stop and again after resume) keeps its last value."""
    return {r["step"]: r["loss"] for r in records(out) if "step" in r and "event" not in r}


def logs_of(out: Path) -> str:
    parts = []
    for p in sorted(out.glob("slurm-*.out")) + sorted((out / "logs").rglob("*.log")):
        parts.append(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)
