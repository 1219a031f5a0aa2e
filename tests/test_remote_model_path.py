"""model_path on a cluster's storage: `plan` checks that a model directory exists on this machine only
where the job reads this machine's file system (local, torchrun, slurm). For k8s and ModelArts the path
is read in the pods / on the ModelArts nodes: a path this machine lacks is not refused, but what can be
checked is (a k8s path must lie under a mounted volume; a URL is no directory path), with a clear message."""

import pytest

from tests.helpers.tiny_runs import ROOT, cli, tiny_job, write_job

CLUSTER_MODEL = "/mnt/models/qwen3-0.6b"  # nowhere on this machine
VOLUMES = [{"name": "models", "pvc": "model-store", "mount_path": "/mnt/models"},
           {"name": "runs", "pvc": "run-store", "mount_path": "/mnt/runs/"}]


def plan_cli(tmp_path, **changes):
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "run", **changes))
    res = cli("plan", job)
    return res.returncode, " ".join((res.stdout + res.stderr).split())


@pytest.mark.parametrize("launcher", ["local", "torchrun", "slurm"])
def test_a_missing_model_path_is_refused_where_the_job_reads_this_file_system(tmp_path, launcher):
    code, out = plan_cli(tmp_path, launcher=launcher, model_path=CLUSTER_MODEL)
    assert code == 2 and f"model_path: {CLUSTER_MODEL} does not exist" in out, out


def test_k8s_path_under_a_mounted_volume_plans(tmp_path):
    code, out = plan_cli(tmp_path, launcher="k8s", model_path=CLUSTER_MODEL, k8s={"volumes": VOLUMES})
    assert code == 0, out
    assert "not on this machine" in out and "volume mounted at /mnt/models" in out


def test_k8s_path_outside_every_volume_is_refused(tmp_path):
    code, out = plan_cli(tmp_path, launcher="k8s", model_path="/data/qwen3", k8s={"volumes": VOLUMES})
    assert code == 2, out
    assert "model_path: /data/qwen3 is not on this machine and lies under no k8s.volumes mount_path" in out
    assert "(mounted: /mnt/models, /mnt/runs)" in out and "mount the storage that holds it" in out
    code, out = plan_cli(tmp_path, launcher="k8s", model_path="/mnt/modelsx/q")  # a prefix is not a parent
    assert code == 2 and "(mounted: none)" in out, out


def test_k8s_relative_path_is_found_from_the_workdir(tmp_path):
    code, out = plan_cli(tmp_path, launcher="k8s", model_path="models/qwen3", k8s={"workdir": "/mnt/models/code"})
    assert code == 0 and "found from /mnt/models/code in the pods" in out, out


def test_modelarts_path_is_read_on_the_nodes(tmp_path):
    code, out = plan_cli(tmp_path, launcher="modelarts", model_path="/cache/models/qwen3")
    assert code == 0 and "is not on this machine" in out, out
    code, out = plan_cli(tmp_path, launcher="modelarts", model_path="obs://bucket/qwen3")
    assert code == 2 and "model_path: obs://bucket/qwen3 is a URL" in out and "mounted at" in out, out


def test_a_cluster_path_this_machine_has_is_still_read(tmp_path):
    # rendered on a machine that mounts the same storage: config.json is read (its family is checked)
    code, out = plan_cli(tmp_path, launcher="k8s", model_path=str(ROOT / "examples" / "tiny-qwen3"))
    assert code == 0 and "not on this machine" not in out, out
    bad = tmp_path / "no-config"
    bad.mkdir()
    code, out = plan_cli(tmp_path, launcher="k8s", model_path=str(bad), k8s={"volumes": VOLUMES})
    assert code == 2 and "has no config.json" in out, out  # the directory is here: checked as before
