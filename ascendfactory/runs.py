"""Run directories read back: what a run is, how far it got, whether it still runs, where it would resume. For
`ascendfactory runs`, and for the summary `run` prints at the end.

The status comes from what the run left: the closing event of metrics.jsonl (end, preempted, exit), the
launcher's files in logs/ (launcher-node<N>.pid while `run` follows a local launch, launcher-node<N>.exit with its
exit code after), Slurm's queue for a submitted job. A run started by hand has no launcher files: without a
closing event it shows as "running?" while its metrics.jsonl was written in the last few minutes, else "failed".
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ascendfactory.launch import exit_file, pid_file
from backends.contract.curves import History, history
from backends.contract.run_files import LOGS, METRICS, PLOT, export_dir, resume_point

QUIET_S = 300  # a run with no launcher files and no closing event counts as running this long after its last write


def read_history(run_dir: Path) -> History | None:
    path = run_dir / METRICS
    if not path.is_file():
        return None
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return history(records)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- one run
@dataclass
class RunInfo:
    path: Path
    job: dict = field(default_factory=dict)   # job.yaml as rendered (name, framework, stage, launcher …)
    history: History | None = None
    status: str = "not started"
    detail: str = ""                          # e.g. the exit code, the host it runs on
    resume: tuple[int, Path] | None = None    # the newest checkpoint resume: auto would load
    damaged: list[Path] = field(default_factory=list)

    @property
    def step(self) -> int | None:
        last = self.history.last if self.history else None
        if last is not None:
            return last["step"]
        start = self.history.start if self.history else None
        return start.get("resumed_step") if start else None

    @property
    def total(self) -> int | None:
        return self.history.total_steps if self.history else None

    def files(self) -> dict[str, Path]:
        """The run's outputs that exist: curves, HF export, newest checkpoint, metrics, logs."""
        out = {"curves": self.path / PLOT, "model": export_dir(self.path),
               "checkpoint": self.resume[1] if self.resume else None, "metrics": self.path / METRICS,
               "logs": self.path / LOGS}
        return {k: v for k, v in out.items() if v is not None and v.exists()}


def read_run(run_dir: Path) -> RunInfo:
    run_dir = Path(run_dir)
    info = RunInfo(run_dir, job=_job(run_dir), history=read_history(run_dir))
    info.resume, info.damaged = resume_point(run_dir)
    info.status, info.detail = _status(info)
    return info


def _job(run_dir: Path) -> dict:
    import yaml

    try:
        job = yaml.safe_load((run_dir / "job.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return job if isinstance(job, dict) else {}


def _status(info: RunInfo) -> tuple[str, str]:
    run_dir, h = info.path, info.history
    started = _read_json(pid_file(run_dir))
    if started and isinstance(started.get("pid"), int):
        if started.get("host") != socket.gethostname():
            if not (h and h.closing):
                return "running", f"on {started.get('host')}"
        elif _alive(started["pid"]):
            return "running", ""
    if h and h.closing:
        event = h.closing["event"]
        return {"end": ("finished", ""), "preempted": ("preempted", "SIGTERM"),
                "exit": ("stopped", "exit interval")}[event]
    ended = _read_json(exit_file(run_dir))
    if ended and isinstance(ended.get("code"), int) and ended["code"] != 0:
        return ("interrupted", "Ctrl-C") if ended["code"] == 130 else ("failed", f"exit {ended['code']}")
    slurm = _slurm_state(run_dir) if info.job.get("launcher") == "slurm" else None
    if slurm:
        return slurm
    if h is None or h.start is None:
        return ("not started", "") if not started else ("failed", "killed")
    if started:  # `run` followed it and is gone without writing how it ended: killed with it
        return "failed", "killed"
    quiet = time.time() - (run_dir / METRICS).stat().st_mtime
    return ("running?", "") if quiet < QUIET_S else ("failed", "no end")


def _slurm_state(run_dir: Path) -> tuple[str, str] | None:
    """A submitted job's state from Slurm (scontrol on PATH), for its newest slurm-<id>.out."""
    import shutil

    from ascendfactory.launch import SLURM_RUNNING, slurm_job_state

    outs = sorted(run_dir.glob("slurm-*.out"), key=lambda p: p.stat().st_mtime)
    job_id = outs[-1].stem.split("-", 1)[1] if outs else ""
    if not job_id.isdigit() or shutil.which("scontrol") is None:
        return None
    state, reason, _ = slurm_job_state(job_id)
    if state in SLURM_RUNNING:
        return ("queued" if state == "PENDING" else "running"), f"slurm job {job_id}"
    return None


# ---------------------------------------------------------------- many runs
SKIP = {"checkpoints", "hf", "logs", "data", "adapter", "merged", ".git", "__pycache__"}


def find_runs(root: Path, depth: int = 4) -> list[Path]:
    """Run directories under root (root itself included): a directory holding job.yaml or metrics.jsonl; the
    search does not go into a run directory, nor below `depth` levels."""
    root = Path(root)
    if (root / "job.yaml").is_file() or (root / METRICS).is_file():
        return [root]
    if depth == 0 or not root.is_dir():
        return []
    found = []
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and p.name not in SKIP and not p.name.startswith("."))
    except OSError:
        return []
    for child in children:
        found.extend(find_runs(child, depth - 1))
    return found
