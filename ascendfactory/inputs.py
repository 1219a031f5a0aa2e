"""The files a job's engine opens, checked before anything is written or launched: the data, the
checkpoint it resumes, and the images its records name. A model directory is resolve_arch's (plan.py).

Paths the job reads on a remote file system (k8s pods, ModelArts) are not checked here: they need not
exist on this machine (the planner says so about model_path).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from ascendfactory.errors import Problem

# launchers whose processes read the job's paths on another file system (the pods' volumes, ModelArts'
# storage); local and torchrun run here, and Slurm runs from this machine's shared file system
REMOTE_FS_LAUNCHERS = ("k8s", "modelarts")
# records are read for their image names only up to this much data: a bigger file is the engine's to check
MAX_SCANNED_BYTES = 64 << 20
SHOWN = 3   # missing images named in the problem (then a count)


def input_problems(job) -> list[Problem]:
    if job.launcher in REMOTE_FS_LAUNCHERS:
        return []
    problems = []
    data = Path(job.data.path).expanduser()
    if not data.exists():
        problems.append(Problem("data.path", f"{job.data.path} does not exist",
                                hint="fix the path (relative paths start at the current directory)"))
    elif data.is_file():
        problems += _image_problems(data)
    if job.resume not in ("auto", "never") and not Path(job.resume).expanduser().exists():
        problems.append(Problem("resume", f"checkpoint {job.resume} does not exist",
                                hint="use resume: auto or never, or a checkpoints/step_N directory"))
    return problems


def _image_problems(data: Path) -> list[Problem]:
    """Images named by the records (an `images` list, as every framework here reads them), relative to the
    data file's folder unless absolute."""
    if data.suffix not in (".json", ".jsonl") or data.stat().st_size > MAX_SCANNED_BYTES:
        return []
    missing, total = [], 0
    for index, name in _image_names(data):
        total += 1
        path = Path(name).expanduser()
        if not (path if path.is_absolute() else data.parent / path).exists():
            missing.append((index, name))
    if not missing:
        return []
    shown = ", ".join(f"{name} (record {index})" for index, name in missing[:SHOWN])
    more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
    return [Problem("data.path", f"{len(missing)} of the {total} images its records name do not exist: {shown}{more}",
                    hint=f"image paths are read relative to {data.parent}; fix them or add the images")]


def _image_names(data: Path) -> Iterator[tuple[int, str]]:
    try:
        text = data.read_text(encoding="utf-8")
        records = json.loads(text) if data.suffix == ".json" else [json.loads(line) for line in text.splitlines()
                                                                   if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError):
        return   # an unreadable file is the data reader's error, with its line
    for index, record in enumerate(records if isinstance(records, list) else []):
        images = record.get("images") if isinstance(record, dict) else None
        for name in images if isinstance(images, list) else [images] if isinstance(images, str) else []:
            if isinstance(name, str):
                yield index, name
