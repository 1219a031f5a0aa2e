"""What a run directory holds, by name, stdlib only: the engines write these files (backends/common/trainer.py,
backends/common/checkpoint/resume.py) and the orchestrator reads them back (`run`'s summary, `ascendfactory runs`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

METRICS = "metrics.jsonl"          # one JSON object a line, rank 0 (backends/common/metrics.py)
PLOT = "training_loss.png"         # the run's curves, drawn from METRICS at the end (backends/common/plot.py)
CHECKPOINTS = "checkpoints"        # resume checkpoints: CHECKPOINTS/step_N
HF_EXPORT = "hf"                   # the Hugging Face export (backends.lf writes it into the run directory itself)
LOGS = "logs"
CHECKPOINT_MARKER = "complete"     # written last into step_N: a directory without it is no checkpoint
STEP_DIR = re.compile(r"^step_(\d+)$")


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / CHECKPOINT_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def size_damage(path: str | os.PathLike) -> list[str]:
    """Files of a complete checkpoint whose size differs from what the save recorded in its marker ([] when they
    all match). A cheap look for a listing: resume itself also checks every file's CRC-32."""
    path = Path(path)
    try:
        digests = json.loads((path / CHECKPOINT_MARKER).read_text()).get("digests") or {}
    except (OSError, ValueError):
        return [f"unreadable '{CHECKPOINT_MARKER}' marker"]
    damage = []
    for name, want in sorted(digests.items()):
        try:
            size = (path / name).stat().st_size
        except OSError:
            damage.append(f"{name} is missing")
            continue
        if size != want.get("size"):
            damage.append(f"{name} has {size} bytes, {want.get('size')} were written")
    return damage


def resume_point(run_dir: str | os.PathLike) -> tuple[tuple[int, Path] | None, list[Path]]:
    """Where `resume: auto` would start: the newest complete checkpoint whose files have their recorded sizes,
    and the newer ones passed over as damaged."""
    skipped = []
    for step, path in reversed(complete_checkpoints(Path(run_dir) / CHECKPOINTS)):
        if not size_damage(path):
            return (step, path), skipped
        skipped.append(path)
    return None, skipped


def export_dir(run_dir: str | os.PathLike) -> Path | None:
    """The run's Hugging Face export: run_dir/hf, or the run directory itself where LLaMA-Factory's dialect
    saves the model beside its logs; None before any export."""
    run_dir = Path(run_dir)
    for where in (run_dir / HF_EXPORT, run_dir):
        if any((where / name).is_file() for name in ("config.json", "adapter_config.json")):
            return where
        if where != run_dir and (where / "adapter" / "adapter_config.json").is_file():  # LoRA: hf/adapter
            return where
    return None
