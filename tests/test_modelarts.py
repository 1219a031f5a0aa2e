"""The ModelArts launcher: the script finds the code where the job puts it (AF_WORKDIR, or ModelArts'
${MA_JOB_DIR}/<code directory>), not where it was rendered. Rendered in one copy of the code, which is
then moved away, and run twice as ModelArts would (node 0 and 1 on this machine, from another
directory), it trains like one process."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.tiny_runs import ROOT, cli, losses, tiny_job, write_job


def _code_copy(dest: Path) -> Path:
    """What a user uploads to OBS as the code directory: the package, the engines and the job's inputs."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("ascendfactory", "backends", "templates", "capability_matrix", "examples/tiny-qwen3"):
        shutil.copytree(ROOT / part, dest / part, ignore=skip)
    (dest / "examples" / "data").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "data" / "arithmetic_alpaca.json", dest / "examples" / "data")
    return dest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("ma-reference") / "run"
    res = cli("run", write_job(out.parent / "job.yaml", tiny_job(out)))
    assert res.returncode == 0, res.stdout + res.stderr
    return losses(out)


def test_two_nodes_from_the_job_code_directory_train_like_one_process(tmp_path, one_process):
    render_code = _code_copy(tmp_path / "laptop" / "afcode")
    spec = tiny_job(Path("runs/ma"), launcher="modelarts", resources={"nnodes": 2, "master_port": _free_port()},
                    model_path="examples/tiny-qwen3",
                    data={"path": "examples/data/arithmetic_alpaca.json"})
    spec["output_dir"] = "runs/ma"  # relative: inside the code directory the user uploads
    job = write_job(render_code / "job.yaml", spec)
    res = cli("render", job, cwd=render_code)
    assert res.returncode == 0, res.stdout + res.stderr
    script_text = (render_code / "runs" / "ma" / "launch.sh").read_text()
    assert str(render_code) not in script_text  # nothing points back at the render machine

    # ModelArts downloads the OBS code directory to ${MA_JOB_DIR}/<its last level>; the render copy is gone
    ma_job_dir = tmp_path / "modelarts" / "user-job-dir"
    ma_job_dir.mkdir(parents=True)
    code = ma_job_dir / "afcode"
    shutil.move(str(render_code), code)
    assert not render_code.exists()
    elsewhere = tmp_path / "boot-cwd"
    elsewhere.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AF_", "MA_", "VC_"))},
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": "", "MA_JOB_DIR": str(ma_job_dir), "MA_NUM_HOSTS": "2", "VC_WORKER_NUM": "2",
           "VC_WORKER_HOSTS": "127.0.0.1,127.0.0.1", "MA_NUM_GPUS": "1"}
    nodes = [subprocess.Popen(["bash", str(code / "runs" / "ma" / "launch.sh")], cwd=elsewhere,
                              env={**env, "VC_TASK_INDEX": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    run = code / "runs" / "ma"
    start = [yaml.safe_load(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"start"' in line]
    assert start[0]["world"] == 2
    got = losses(run)
    assert sorted(got) == sorted(one_process)
    assert [got[s] for s in sorted(got)] == pytest.approx([one_process[s] for s in sorted(one_process)],
                                                         rel=1e-5, abs=1e-6)
    assert not (elsewhere / "runs").exists()


def test_af_workdir_wins_and_a_missing_code_directory_is_named(tmp_path):
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "run", launcher="modelarts"))
    assert cli("render", job).returncode == 0
    script = tmp_path / "run" / "launch.sh"
    text = script.read_text()
    assert f"cd {ROOT}" not in text and f'cd "$MA_JOB_DIR"/{shlex.quote(ROOT.name)}' in text
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AF_", "MA_", "VC_"))}
    missing = subprocess.run(["bash", str(script)], env={**base, "MA_JOB_DIR": str(tmp_path / "nowhere")},
                             cwd=tmp_path, capture_output=True, text=True)
    assert missing.returncode == 2 and "set AF_WORKDIR" in missing.stderr
    # AF_WORKDIR is used as given (a bad one stops the script before anything starts)
    bad = subprocess.run(["bash", str(script)], env={**base, "AF_WORKDIR": str(tmp_path / "no-such-dir"),
                                                     "MA_JOB_DIR": str(tmp_path)},
                         cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode != 0 and "no-such-dir" in bad.stderr
