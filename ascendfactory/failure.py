"""Which worker failed first, with what error and where its log is: read after a launch ended badly, so that `run`
prints that one error once instead of every rank's traceback and torchrun's failure block.

Each engine writes its error into the file TORCHELASTIC_ERROR_FILE names (backends/common/trainer.py
`record_failure`): torchrun gives every worker one under its --log-dir (<log-dir>/<run id>/attempt_<n>/<local
rank>/error.json, beside that worker's stdout.log and stderr.log); a local launch gets logs/error-node<N>.json from
`run`. A worker killed by a signal writes none: then torchrun's own "Root Cause" lines name it."""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Failure:
    rank: int | None
    message: str
    log: Path | None
    exit_code: int | None = None


def local_error_file(logs: Path, node_rank: int) -> Path:
    return logs / f"error-node{node_rank}.json"


def first_failure(logs: Path, since: float, launcher_log: Path, node_rank: int = 0, nproc: int = 1,
                  exit_code: int | None = None) -> Failure:
    """The earliest error a worker recorded after `since` (a time.time()), else torchrun's root cause, else the
    launch's own exit code and the last line of its log."""
    recorded = []
    for path in [*logs.glob("*/attempt_*/*/error.json"), local_error_file(logs, node_rank)]:
        try:
            if path.stat().st_mtime < since:
                continue
            message = json.loads(path.read_text(encoding="utf-8"))["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        text = message.get("message", "") if isinstance(message, dict) else str(message)
        when = extra.get("time") or float(extra.get("timestamp", 0) or 0)
        worker = path.parent.name.isdigit()
        rank = extra.get("rank", node_rank * nproc + int(path.parent.name) if worker else None)
        log = _worker_log(path.parent) if worker else launcher_log
        recorded.append((when, Failure(rank, text, log, exit_code)))
    if recorded:
        return min(recorded, key=lambda item: item[0])[1]
    root = _torchrun_root_cause(launcher_log)
    if root is not None:
        local_rank, code = root
        dirs = sorted(logs.glob(f"*/attempt_*/{local_rank}"), key=lambda p: p.stat().st_mtime)
        log = _worker_log(dirs[-1]) if dirs else launcher_log
        return Failure(node_rank * nproc + local_rank, _ending(code, log), log, code)
    return Failure(None, _ending(exit_code, launcher_log), launcher_log, exit_code)


def _worker_log(folder: Path) -> Path:
    """A torchrun worker's stderr (where a traceback goes), or its stdout when stderr is empty."""
    stderr, stdout = folder / "stderr.log", folder / "stdout.log"
    if stderr.is_file() and stderr.stat().st_size:
        return stderr
    return stdout if stdout.is_file() else folder


ROOT_CAUSE = re.compile(r"Root Cause.*?local_rank:\s*(\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S)


def _torchrun_root_cause(launcher_log: Path) -> tuple[int, int] | None:
    """(local rank, exit code) of torchrun's "Root Cause (first observed failure)" in the launch's output."""
    try:
        text = launcher_log.read_text(errors="replace")[-20000:]
    except OSError:
        return None
    found = ROOT_CAUSE.findall(text)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def _ending(code: int | None, log: Path) -> str:
    """What ended a worker that left no error: the signal that killed it, or its log's last line."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()[-50:] if line.strip()]
    except OSError:
        lines = []
    return lines[-1] if lines else f"exited with code {code}"
