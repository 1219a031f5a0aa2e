"""The metrics protocol: one JSON object a line in metrics.jsonl (rank 0), read live by `ascendfactory run`.

Every training record has at least step, total_steps, loss, lr, grad_norm, tokens_per_s and
elapsed_s; engines add their own keys. Non-step records carry an "event" key instead. The experiment trackers
an engine's dialect asks for (backends.common.trackers: TensorBoard, W&B) get the same records, each step's
(also those left out of the file by the log interval) and the validation events.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

REQUIRED = ("step", "total_steps", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s")


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep it visible instead of breaking readers
    return value


class MetricsWriter:
    """Appends records to metrics.jsonl on the main rank, and mirrors them to the trackers there; a no-op
    elsewhere. `trackers`: a backends.common.trackers.TrackerSettings (opened here, on the main rank only)."""

    def __init__(self, path: str | Path | None, enabled: bool = True, trackers: Any = None):
        self.path = Path(path) if path else None
        self.enabled = enabled and self.path is not None
        self.start = time.perf_counter()
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers = None
        if enabled and trackers is not None and trackers.on:
            from backends.common.trackers import Trackers

            self.trackers = Trackers(trackers)

    @property
    def tracking(self) -> bool:
        return self.trackers is not None

    def track(self, record: dict[str, Any]) -> None:
        """A step record that the log interval leaves out of metrics.jsonl: the trackers only."""
        if self.trackers is not None:
            self.trackers.log({k: _clean(v) for k, v in record.items()})

    def close(self, exit_code: int = 0) -> None:
        if self.trackers is not None:
            self.trackers.close(exit_code)
            self.trackers = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled and self.trackers is None:
            return
        if "event" not in record:
            missing = [k for k in REQUIRED if k not in record]
            if missing:
                raise ValueError(f"metrics record lacks {missing}")
        clean = {k: _clean(v) for k, v in record.items()}
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as fh:  # one write per line: readers never see half a record
                fh.write(json.dumps(clean) + "\n")
        if self.trackers is not None and clean.get("event", "validation") == "validation":
            self.trackers.log(clean)

    def event(self, name: str, **fields: Any) -> None:
        self.write({"event": name, "elapsed_s": round(self.elapsed(), 3), **fields})


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out
