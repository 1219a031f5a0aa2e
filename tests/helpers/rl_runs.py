"""Running the RL engine's test cases under torchrun on the CPU (a worker script of tests/rl, such as
_rl_run_worker.py, given a JSON list of cases and an output folder) and reading each case's files back:
<name>.jsonl (the metrics) and <name>.params (the sum and the sum of squares of the trained actor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "rl"


def run_cases(worker: str, tmp: Path, nproc: int, cases: list[dict], timeout: float = 600) -> Path:
    """The cases, one after another, in one torchrun launch of `nproc` processes running tests/rl/<worker>;
    returns the folder they wrote (tmp/np<nproc>). A rank that fails fails the caller, with the output's tail."""
    out = tmp / f"np{nproc}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKERS / worker), json.dumps(cases), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return out


class Launches(dict):
    """Each case's output folder by case name, its world's launch (run_cases) started on first use, so a
    failed launch fails only the tests that read its cases. launches: {world size: that launch's cases}."""

    def __init__(self, worker: str, tmp: Path, launches: dict[int, list[dict]]):
        super().__init__()
        self.worker, self.tmp, self.launches = worker, tmp, launches

    def __missing__(self, name: str) -> Path:
        world = next(w for w, cases in self.launches.items() if any(c["name"] == name for c in cases))
        out = run_cases(self.worker, self.tmp, world, self.launches[world])
        self.update((c["name"], out) for c in self.launches[world])
        return out


def _records(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]


def steps(folder: Path, name: str) -> list[dict]:
    """The case's training-step records (those with a reward), in order."""
    return [r for r in _records(folder, name) if "reward_mean" in r]


def end_record(folder: Path, name: str) -> dict:
    """The case's end-of-run record (model_state_mib: each rank's parameter and optimizer state)."""
    return next(r for r in _records(folder, name) if r.get("event") == "end")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(a))


def assert_steps_match(one: list[dict], other: list[dict], keys, label) -> None:
    """Both ran steps 1 to 3, and each step holds the same `keys` within 1e-5 (relative above 1)."""
    numbers = [r["step"] for r in one], [r["step"] for r in other]
    assert numbers[0] == numbers[1] == [1, 2, 3], (label, numbers)
    for a, b in zip(one, other):
        for key in keys:
            assert (key in a) == (key in b), (label, key)
            if key in a:
                assert _close(a[key], b[key]), (label, a["step"], key, a[key], b[key])


def assert_same_training(one: tuple[Path, str], other: tuple[Path, str], keys) -> None:
    """Two cases, each (folder, name), trained alike: assert_steps_match over `keys`, and the trained
    actors' parameter sums within 1e-5."""
    assert_steps_match(steps(*one), steps(*other), keys, other[1])
    p1, p2 = (json.loads((folder / f"{name}.params").read_text()) for folder, name in (one, other))
    assert len(p1) == len(p2) == 2, (p1, p2)
    for x, y in zip(p1, p2):
        assert _close(x, y), (other[1], p1, p2)
