"""Faults, drilled for real through `ascendfactory run`: SIGKILL of the whole process tree (after a
checkpoint, and while one is being written), a damaged newest checkpoint, SIGTERM preemption and a
full disk during a save. Each resumed run must give the uninterrupted run's losses."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.llm.test_engine_runs import ROOT, job, run_cli, run_job, torchrun

STEPS, EVERY = 12, 3


def fault_job(out: Path, devices: int, **train) -> dict:
    spec = job(out, train={"steps": STEPS, "save_interval": EVERY, "global_batch": 8, "micro_batch": 2,
                           "lr": 2e-3, "precision": "fp32", "warmup_steps": 1, **train}, resume="auto")
    if devices > 1:
        spec.update(torchrun(devices))
        spec["resources"] = {**spec["resources"], "device": "cpu", "devices_per_node": devices}
    return spec


def step_losses(out: Path) -> dict[int, float]:
    """The loss of every step in metrics.jsonl; a step run twice (before a kill and after the resume)
    keeps its last value."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "step" in r and "event" not in r}


def events(out: Path, name: str) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("event") == name]


def logs(out: Path) -> str:
    return "".join(p.read_text() for p in sorted((out / "logs").glob("*.log")))


def start(tmp_path: Path, spec: dict, name: str) -> subprocess.Popen:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "ascendfactory", "run", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher, torchrun and every worker at once: the node went away."""
    victims = [proc.pid, *descendants(proc.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def wait_for(cond, proc: subprocess.Popen, timeout: float = 300, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = cond()
        if hit:
            return hit
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before the fault was injected:\n{proc.stdout.read()}")
        time.sleep(poll)
    kill_tree(proc)
    raise AssertionError("timed out waiting to inject the fault")


def complete(out: Path, step: int) -> bool:
    return (out / "checkpoints" / f"step_{step}" / "complete").is_file()


def assert_same_losses(got: dict[int, float], ref: dict[int, float], rel: float) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), (sorted(got), sorted(ref))
    for s in ref:
        assert got[s] == pytest.approx(ref[s], rel=rel, abs=0), (s, got[s], ref[s])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted runs the faulted ones are held against: {devices: step losses}."""
    made = {}

    def get(devices: int) -> dict[int, float]:
        if devices not in made:
            base = tmp_path_factory.mktemp(f"uninterrupted{devices}")
            run_job(base, fault_job(base / "run", devices))
            made[devices] = step_losses(base / "run")
        return made[devices]

    return get


# one process repeats what two prove (the same resume path, less the collectives): slow
@pytest.mark.parametrize("devices,rel", [pytest.param(1, 1e-6, marks=pytest.mark.slow), (2, 1e-5)])
def test_sigkill_after_a_checkpoint_resumes_with_the_same_losses(tmp_path, uninterrupted, devices, rel):
    out = tmp_path / "run"
    spec = fault_job(out, devices)
    proc = start(tmp_path, spec, "job.yaml")
    # past the first checkpoint and into the next interval: steps after it are lost and redone
    wait_for(lambda: complete(out, EVERY) and max(step_losses(out), default=0) >= EVERY + 1
             if (out / "metrics.jsonl").exists() else False, proc)
    kill_tree(proc)
    killed_at = max(step_losses(out))
    assert killed_at < STEPS
    run_job(tmp_path, spec, "resume.yaml")
    assert "resumed from" in logs(out)
    assert_same_losses(step_losses(out), uninterrupted(devices), rel)


def test_sigkill_mid_save_then_a_damaged_newest_checkpoint(tmp_path, uninterrupted):
    """A checkpoint every step; killed while one is being written (its directory stays a .tmp), then the
    newest complete checkpoint is torn as well: resume: auto names it and what is wrong, takes the one
    before it, and the losses are the uninterrupted run's."""
    out = tmp_path / "run"
    spec = fault_job(out, 2, save_interval=1)
    proc = start(tmp_path, spec, "job.yaml")
    ckpts = out / "checkpoints"

    def mid_save():
        if not complete(out, 4):
            return None
        for tmp in ckpts.glob(".step_*.tmp"):
            if any(tmp.glob("*.distcp")):  # shards landing, marker not yet written
                return tmp
        return None

    writing = wait_for(mid_save, proc, poll=0.001)
    kill_tree(proc)
    half = int(writing.name.split("_")[1].split(".")[0])
    assert writing.exists() and not (writing / "complete").exists(), "the kill did not land during the save"
    newest = max(int(p.name.split("_")[1]) for p in ckpts.glob("step_*") if (p / "complete").is_file())
    assert newest == half - 1
    victim = next((ckpts / f"step_{newest}").glob("*.distcp"))
    with open(victim, "r+b") as fh:  # a torn write: half the shard is gone
        fh.truncate(victim.stat().st_size // 2)

    run_job(tmp_path, spec, "resume.yaml")
    text = logs(out)
    assert f"checkpoint {ckpts / f'step_{newest}'} is damaged" in text and victim.name in text, text[-3000:]
    assert f"resuming from the previous complete checkpoint {ckpts / f'step_{newest - 1}'}" in text
    assert f"resumed from {ckpts / f'step_{newest - 1}'}" in text
    assert_same_losses(step_losses(out), uninterrupted(2), 1e-5)


def test_sigterm_checkpoints_exits_0_and_resumes_with_the_same_losses(tmp_path, uninterrupted):
    out = tmp_path / "run"
    spec = fault_job(out, 2, save_interval=100)  # no cadence save: the checkpoint is SIGTERM's
    proc = start(tmp_path, spec, "job.yaml")
    wait_for(lambda: (out / "metrics.jsonl").exists() and max(step_losses(out), default=0) >= 2, proc)
    proc.send_signal(signal.SIGTERM)  # what Kubernetes / Slurm / ModelArts send to the job's main process
    said, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, said + logs(out)
    stopped = events(out, "preempted")
    assert len(stopped) == 1, said
    step = stopped[0]["step"]
    assert 2 <= step < STEPS and complete(out, step)
    assert "resume: auto" in " ".join(said.split()) and "resume: auto" in logs(out)
    assert not events(out, "end")
    run_job(tmp_path, spec, "resume.yaml")
    assert f"resumed from {out / 'checkpoints' / f'step_{step}'}" in logs(out)
    assert_same_losses(step_losses(out), uninterrupted(2), 1e-5)


def _mount_tmpfs(where: Path, size_kib: int) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)],
                         capture_output=True, text=True)
    return res.returncode == 0


def test_full_disk_during_a_save_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    from backends.common.checkpoint.resume import verify_checkpoint

    # how big one checkpoint of this job is: a short run on the ordinary disk
    probe = tmp_path / "probe"
    run_job(tmp_path, fault_job(probe, 2, steps=EVERY), "probe.yaml")
    size = sum(f.stat().st_size for f in (probe / "checkpoints" / f"step_{EVERY}").iterdir())

    out = tmp_path / "run"
    if not _mount_tmpfs(out / "checkpoints", int(size * 1.5) // 1024):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(fault_job(out, 2)))
        res = run_cli("run", path)
        said = res.stdout + res.stderr + logs(out)
        assert res.returncode != 0, said
        assert "No space left on device" in said and f"saving checkpoint step_{2 * EVERY}" in said, said[-3000:]
        first = out / "checkpoints" / f"step_{EVERY}"
        assert f"the previous checkpoint {first} is intact" in said
        assert complete(out, EVERY) and verify_checkpoint(first) == []
        assert not list((out / "checkpoints").glob(".step_*"))  # nothing half-written left behind
    finally:
        subprocess.run(["umount", str(out / "checkpoints")], capture_output=True)
