"""The Slurm launcher against a real Slurm (Debian slurm-wlm 22.05 + munge) started by the fixture below:
`ascendfactory run` submits with sbatch and follows the job, jobs share a node, a 2-node job trains like one
process, and a cancelled job resumes with the same losses. No stand-ins for sbatch or srun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ascendfactory.job_file import parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render
from tests.helpers.slurm import SlurmCluster, SlurmUnavailable, missing_tools
from tests.helpers.tiny_runs import ROOT, cli, logs_of, losses, records, tiny_job, write_job

import yaml


# ---------------------------------------------------------------- the rendered script (no cluster needed)
def _script(tmp_path, **changes) -> str:
    job = parse_job(yaml.safe_dump(tiny_job(tmp_path / "run", launcher="slurm", **changes)))
    return render(make_plan(job, check_memory=False), tmp_path / "run").files["launch.sh"]


def test_script_cpus_interpreter_port_and_output(tmp_path):
    s = _script(tmp_path, resources={"devices_per_node": 2})
    assert "#SBATCH --cpus-per-task=2" in s and "--cpus-per-task=2 --kill-on-bad-exit=1" in s
    assert f"#SBATCH --output={(tmp_path / 'run').resolve()}/slurm-%j.out" in s
    assert f" {sys.executable} -m torch.distributed.run" in s  # absolute: the job's PATH may lack the venv
    assert "RDZV_PORT=\"$(" in s and "SLURM_JOB_ID %" not in s and '--rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT"' in s
    assert s.index("export MASTER_ADDR=\"$HEAD_ADDR\" MASTER_PORT=\"$RDZV_PORT\"") < s.index("\nsrun ")
    fixed = _script(tmp_path, resources={"master_port": 29411}, slurm={"cpus_per_task": 6})
    assert "RDZV_PORT=29411" in fixed and "#SBATCH --cpus-per-task=6" in fixed
    subprocess.run(["bash", "-n"], input=s, text=True, check=True)


def test_the_port_is_free_on_the_first_node_when_the_job_starts(tmp_path):
    """Two jobs on one first node whose ids differ by any amount (a port derived from the id modulo a
    range gave 10005 to both job 5 and job 20005): each gets a port nothing listens on when it starts."""
    import socket

    s = _script(tmp_path)
    pick = next(line for line in s.splitlines() if line.startswith("RDZV_PORT="))

    def port_of(job_id: int) -> int:
        out = subprocess.run(["bash", "-c", f"set -euo pipefail; {pick}; echo $RDZV_PORT"], text=True,
                             capture_output=True, check=True, env={**os.environ, "SLURM_JOB_ID": str(job_id)})
        return int(out.stdout)

    first = port_of(5)
    with socket.socket() as busy:  # the first job's rendezvous store, listening
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("", first))
        busy.listen()
        second = port_of(20005)
        assert second != first
        with socket.socket() as probe:
            probe.bind(("", second))  # free when picked


def test_setup_lines_run_before_a_plain_python(tmp_path):
    s = _script(tmp_path, slurm={"setup": ["module load cann/8.0", "source '/opt/my venv/bin/activate'"]})
    body = s[s.index("set -euo pipefail"):]
    assert "set +u\nmodule load cann/8.0\nsource '/opt/my venv/bin/activate'\nset -u\n" in body
    assert " python -m torch.distributed.run" in s and sys.executable not in s
    assert " /opt/py -m torch.distributed.run" in _script(tmp_path, slurm={"python": "/opt/py"})
    with pytest.raises(Exception, match="line break"):
        parse_job(yaml.safe_dump(tiny_job(tmp_path, launcher="slurm", slurm={"setup": ["true\nrm -rf /"]})))


def test_dry_run_prints_the_submit_command(tmp_path):
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "my run", launcher="slurm"))
    res = cli("run", job, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"submit with: sbatch --parsable '{tmp_path / 'my run' / 'launch.sh'}'" in " ".join(res.stdout.split())


def test_without_sbatch_nothing_is_submitted(tmp_path):
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "run", launcher="slurm"))
    res = cli("run", job, env={"PATH": str(Path(sys.executable).parent)})
    assert res.returncode == 2 and "sbatch is not on PATH" in res.stdout + res.stderr


# ---------------------------------------------------------------- the real cluster
def _install_or_skip() -> None:
    if not missing_tools():
        return
    res = subprocess.run([str(ROOT / ".ci" / "install-slurm")], capture_output=True, text=True)
    if res.returncode != 0 or missing_tools():
        pytest.skip("no Slurm here and it cannot be installed: " + (res.stderr.strip() or ", ".join(missing_tools())))


@pytest.fixture(scope="module")
def slurm():
    """Two slurmd nodes (n1, n2) on this machine behind one slurmctld; stopped by pid at the end."""
    _install_or_skip()
    cluster = SlurmCluster(nodes=2)
    try:
        cluster.start()
    except SlurmUnavailable as err:
        pytest.skip(f"cannot start a test Slurm cluster: {err}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny job on one process without Slurm: losses the Slurm runs must reproduce."""
    def run(steps: int) -> dict[int, float]:
        out = tmp_path_factory.mktemp("reference") / "run"
        job = write_job(out.parent / "job.yaml", tiny_job(out, train={"steps": steps}))
        res = cli("run", job)
        assert res.returncode == 0, res.stdout + res.stderr
        return losses(out)

    cache: dict[int, dict[int, float]] = {}

    def get(steps: int) -> dict[int, float]:
        if steps not in cache:
            cache[steps] = run(steps)
        return cache[steps]

    return get


def _job_id(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("submitted Slurm job "):
            return line.split()[-1]
    raise AssertionError(f"no job id in:\n{output}")


def test_quickstart_submits_from_a_shell_without_the_venv_and_trains(slurm, tmp_path):
    out = tmp_path / "quickstart"
    res = cli("run", "examples/quickstart.yaml", "launcher=slurm", "train.steps=8", "resources.devices_per_node=2",
              f"output_dir={out}",
              "resume=never", env=slurm.env, clean_path=True)
    assert res.returncode == 0, res.stdout + res.stderr + logs_of(out) + slurm.logs()
    job_id = _job_id(res.stdout)
    assert f"Slurm job {job_id} completed at step 8" in " ".join(res.stdout.split())
    assert sorted(losses(out)) == list(range(1, 9)) and records(out)[-1]["event"] == "end"
    assert (out / f"slurm-{job_id}.out").exists()
    state = slurm.job_state(job_id)
    assert state["JobState"] == "COMPLETED" and state["NumCPUs"] == "2"  # one CPU per process


def _ctrl_c_reaches_it() -> None:
    """In the child before exec: SIGINT back to its default, so Python turns it into KeyboardInterrupt (the
    CLI's Ctrl-C). A shell without job control starts background commands with SIGINT ignored, and an
    ignored signal stays ignored across exec: under such a parent the Ctrl-C tests saw the job run to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_two_jobs_at_once_on_one_node_both_finish(slurm, tmp_path, reference):
    """Both jobs run on n1 at the same time; with one rendezvous port for every job the second would
    join the first's rendezvous and die when the first ends."""
    outs, ids = [tmp_path / "a", tmp_path / "b"], []
    jobs = [write_job(tmp_path / f"{out.name}.yaml", tiny_job(out, launcher="slurm", train={"steps": steps},
                                                              slurm={"extra_args": ["--nodelist=n1"]}))
            for out, steps in zip(outs, (6, 40))]  # b outlives a
    res = cli("run", jobs[0], "--no-follow", env=slurm.env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "cancel with: scancel" in res.stdout
    ids.append(_job_id(res.stdout))
    # b is followed; Ctrl-C and "no" leave it running
    follow = subprocess.Popen([sys.executable, "-m", "ascendfactory", "run", str(jobs[1])], cwd=ROOT,
                              env={**os.environ, **slurm.env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, preexec_fn=_ctrl_c_reaches_it)
    try:
        deadline = time.monotonic() + 120
        while not losses(outs[1]):
            assert follow.poll() is None and time.monotonic() < deadline, logs_of(outs[1])
            time.sleep(0.1)
        follow.send_signal(signal.SIGINT)
        text, _ = follow.communicate("n\n", timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0 and f"left Slurm job {_job_id(text)} running" in text, text
    ids.append(_job_id(text))
    states = [slurm.wait_job(i) for i in ids]
    for out, state in zip(outs, states):
        assert state["JobState"] == "COMPLETED", f"{state}\n{logs_of(out)}"
        assert state["NodeList"] == "n1"
    a, b = states
    assert b["StartTime"] <= a["EndTime"], "the jobs did not overlap"
    assert losses(outs[1]) == reference(40) and losses(outs[0]) == reference(6)


def test_two_node_job_trains_like_one_process(slurm, tmp_path, reference):
    out = tmp_path / "two-nodes"
    job = write_job(tmp_path / "job.yaml", tiny_job(out, launcher="slurm", resources={"nnodes": 2}))
    res = cli("run", job, env=slurm.env)
    assert res.returncode == 0, res.stdout + res.stderr + logs_of(out)
    state = slurm.job_state(_job_id(res.stdout))
    assert state["NodeList"] == "n[1-2]" and state["NumNodes"] == "2"
    start = next(r for r in records(out) if r.get("event") == "start")
    assert start["world"] == 2
    one = reference(6)
    got = losses(out)
    assert sorted(got) == sorted(one)
    assert [got[s] for s in sorted(got)] == pytest.approx([one[s] for s in sorted(one)], rel=1e-5, abs=1e-6)


def test_ctrl_c_scancel_then_resume_continues_with_the_same_losses(slurm, tmp_path, reference):
    """Two real Slurm jobs in a row (the one Ctrl-C cancels, then the resume), each through sbatch and slurmd:
    about 30 s alone, a minute on a loaded machine; nothing to share with the other Slurm tests' jobs."""
    steps = 150
    out = tmp_path / "resumed"
    job = write_job(tmp_path / "job.yaml", tiny_job(out, launcher="slurm", resume="auto", train={"steps": steps}))
    proc = subprocess.Popen([sys.executable, "-m", "ascendfactory", "run", str(job)], cwd=ROOT,
                            env={**os.environ, **slurm.env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_ctrl_c_reaches_it)
    try:
        deadline = time.monotonic() + 120
        while len(losses(out)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, logs_of(out)
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # Ctrl-C: asks whether to scancel
        text, _ = proc.communicate("y\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, text
    job_id = _job_id(text)
    assert slurm.wait_job(job_id)["JobState"] == "CANCELLED"
    preempted = [r for r in records(out) if r.get("event") == "preempted"]
    assert preempted and preempted[0]["checkpoint"], text + logs_of(out)
    stopped_at = preempted[0]["step"]
    assert 3 <= stopped_at < steps and max(losses(out)) == stopped_at

    res = cli("run", job, env=slurm.env)  # the same job again: resume: auto
    assert res.returncode == 0, res.stdout + res.stderr + logs_of(out)
    start = [r for r in records(out) if r.get("event") == "start"]
    assert start[-1]["resumed_step"] == stopped_at
    assert losses(out) == reference(steps)  # bit for bit, as if never stopped
