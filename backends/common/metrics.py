"""The metrics protocol: one JSON object a line in metrics.jsonl (rank 0), read live by `ascendfactory run`.

Every training record has at least step, total_steps, loss, lr, grad_norm, tokens_per_s and
elapsed_s; engines add their own keys. Non-step records carry an "event" key instead.
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
    """Appends records to metrics.jsonl on the main rank; a no-op elsewhere."""

    def __init__(self, path: str | Path | None, enabled: bool = True):
        self.path = Path(path) if path else None
        self.enabled = enabled and self.path is not None
        self.start = time.perf_counter()
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if "event" not in record:
            missing = [k for k in REQUIRED if k not in record]
            if missing:
                raise ValueError(f"metrics record lacks {missing}")
        line = json.dumps({k: _clean(v) for k, v in record.items()})
        with self.path.open("a", encoding="utf-8") as fh:  # one write per line: readers never see half a record
            fh.write(line + "\n")

    def event(self, name: str, **fields: Any) -> None:
        self.write({"event": name, "elapsed_s": round(self.elapsed(), 3), **fields})


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out
