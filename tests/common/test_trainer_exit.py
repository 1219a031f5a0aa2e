"""How a multi-process engine ends (backends.common.trainer.main): every rank destroys the process
group, then leaves without the interpreter's teardown (trainer.leave_process says why), keeping
its last output and its exit code."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests/common/_exit_worker.py"), str(tmp_path)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_every_rank_destroys_the_group_then_skips_the_teardown(tmp_path):
    proc = _run(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("[exit-worker] process group destroyed, initialized=False") == 2, out[-4000:]
    assert "interpreter teardown ran" not in out  # the finalisation that can abort a gloo rank
    assert (tmp_path / "ckpt" / "step_8" / "complete").is_file()  # both ranks saved to the end
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines and lines[-1].endswith("}")  # the metrics file was closed whole


def test_a_single_process_returns_normally(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": "0"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests/common/_exit_worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "destroyed" not in proc.stdout  # no group to leave
    assert "interpreter teardown ran" in proc.stdout
