"""The Kubernetes launcher: every rendered PyTorchJob validates against the training operator 1.9 CRD's
openAPIV3Schema with unknown fields rejected, its names are DNS-1035 labels, CPU jobs ask for CPUs and no
device, volumes mount, and the manifest alone (its ConfigMap, mounted where the command reads the files)
carries everything the engine reads: the pod's command, run here on that filesystem, trains."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ascendfactory.errors import JobError
from ascendfactory.frameworks import FRAMEWORKS
from ascendfactory.job_file import load_job, parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import config_map_key, render
from tests.helpers.tiny_runs import ROOT, cli, losses, tiny_job, write_job

CRD = ROOT.parent / "shared" / "upstream" / "kubeflow-training-operator-1.9-pytorchjobs-crd.yaml"
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml"))
VARIANTS = [("cpu", 1), ("cpu", 2), ("npu", 1), ("npu", 2)]


def _strict(schema):
    """The CRD schema with every object closed (what kubectl --validate=strict and the API server's
    field validation do: an unknown field is an error, never dropped)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    if not CRD.exists():
        pytest.skip(f"no CRD at {CRD}")
    crd = yaml.safe_load(CRD.read_text())
    schema = _strict(next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def check_manifest(text: str, validator) -> tuple[dict, dict | None]:
    """Every document of launch.yaml checked; → (PyTorchJob, ConfigMap or None)."""
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    jobs = [d for d in docs if d.get("kind") == "PyTorchJob"]
    maps = [d for d in docs if d.get("kind") == "ConfigMap"]
    assert len(jobs) == 1 and len(docs) == len(jobs) + len(maps)
    job = jobs[0]
    errors = sorted(validator.iter_errors(job), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:10])
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    assert set(job["metadata"]) == {"name", "namespace"}
    assert DNS_1035.fullmatch(name) and DNS_1123_LABEL.fullmatch(ns) and len(ns) <= 63
    specs = job["spec"]["pytorchReplicaSpecs"]
    workers = specs.get("Worker", {}).get("replicas", 0)
    for role, i in [("master", 0)] + [("worker", w) for w in range(workers)]:
        pod = f"{name}-{role}-{i}"  # the operator's pod and service names are DNS-1035 labels too
        assert DNS_1035.fullmatch(pod) and len(pod) <= 63, pod
    cm = None
    if maps:
        (cm,) = maps
        assert cm["apiVersion"] == "v1" and set(cm) == {"apiVersion", "kind", "metadata", "data"}
        assert cm["metadata"]["namespace"] == ns and DNS_1123_LABEL.fullmatch(cm["metadata"]["name"])
        assert all(re.fullmatch(r"[-._a-zA-Z0-9]+", k) and isinstance(v, str) for k, v in cm["data"].items())
        assert sum(len(v.encode()) for v in cm["data"].values()) < 1_000_000  # a ConfigMap holds 1 MiB
        for spec in specs.values():
            vols = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
            assert any(v.get("configMap", {}).get("name") == cm["metadata"]["name"] for v in vols.values())
    return job, cm


def _k8s_variant(path: Path, device: str, nnodes: int):
    job = load_job(path, ["launcher=k8s", f"resources.device={device}", f"resources.nnodes={nnodes}",
                          "output_dir=/mnt/runs/job", "k8s.namespace=training"])
    for _ in range(4):  # more nodes: a bigger global batch keeps the batch rule
        try:
            return make_plan(job, check_memory=False)
        except JobError:
            job = load_job(path, ["launcher=k8s", f"resources.device={device}", f"resources.nnodes={nnodes}",
                                  "output_dir=/mnt/runs/job", f"train.global_batch={job.train.global_batch * 2}"])
    return None


def test_every_example_renders_a_valid_pytorchjob(validator, monkeypatch, tmp_path):
    """Examples of every framework, CPU and NPU, on 1 and 2 nodes."""
    monkeypatch.chdir(ROOT)
    covered = set()
    for path in EXAMPLES:
        for device, nnodes in VARIANTS:
            plan = _k8s_variant(path, device, nnodes)
            if plan is None:  # this example's layout has no such variant
                continue
            r = render(plan, tmp_path / "out")
            job, cm = check_manifest(r.files["launch.yaml"], validator)
            specs = job["spec"]["pytorchReplicaSpecs"]
            assert specs["Master"]["replicas"] == 1 and specs.get("Worker", {}).get("replicas", 0) == nnodes - 1
            limits = specs["Master"]["template"]["spec"]["containers"][0]["resources"]
            if device == "cpu":
                assert limits == {"requests": {"cpu": str(plan.layout.devices_per_node)}}
            else:
                assert limits == {"limits": {"huawei.com/Ascend910": plan.layout.devices_per_node}}
            files = {f for f, v in r.files.items() if f != "launch.yaml" and isinstance(v, str)}
            assert set(cm["data"]) == {config_map_key(f) for f in files}
            mounted = {m["subPath"]: m["mountPath"] for spec in job["spec"]["pytorchReplicaSpecs"].values()
                       for m in spec["template"]["spec"]["containers"][0]["volumeMounts"] if "subPath" in m}
            # each key is mounted at the file's own path (model/x.yaml too, whose key has no slash)
            assert {mounted[config_map_key(f)] for f in files} == {f"/mnt/runs/job/{f}" for f in files}
            covered.add((plan.job.framework, device, nnodes))
    missing = {(fw, d, n) for fw in FRAMEWORKS for d, n in VARIANTS} - covered
    assert not missing, f"no example renders as {sorted(missing)}"


@pytest.mark.parametrize("name,expected", [
    ("2nd try.Qwen3_SFT", "af-2nd-try-qwen3-sft"),
    ("qwen3-0.6b-sft", "qwen3-0-6b-sft"),
    ("--Über__job--", "ber-job"),
    ("x" * 80, "x" * 54),
])
def test_names_are_dns_1035(name, expected, validator, tmp_path):
    p = make_plan(parse_job(yaml.safe_dump(tiny_job(tmp_path, launcher="k8s", name=name, output_dir="/mnt/r",
                                                    resources={"nnodes": 2}))), check_memory=False)
    job, cm = check_manifest(render(p, tmp_path).files["launch.yaml"], validator)
    assert job["metadata"]["name"] == expected and cm["metadata"]["name"] == f"{expected}-files"


def test_devices_volumes_and_workdir(validator, tmp_path):
    spec = tiny_job(tmp_path, launcher="k8s", output_dir="runs/tiny", resources={"device": "cuda", "devices_per_node": 2},
                    k8s={"workdir": "/workspace", "image": "reg/af:1", "volumes": [
                        {"name": "shared", "mount_path": "/workspace/runs", "pvc": "runs-pvc"},
                        {"name": "data", "mount_path": "/data", "host_path": "/srv/data", "read_only": True}]})
    r = render(make_plan(parse_job(yaml.safe_dump(spec)), check_memory=False), tmp_path / "local")
    job, cm = check_manifest(r.files["launch.yaml"], validator)
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["workingDir"] == "/workspace" and c["image"] == "reg/af:1"
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["shared"]["persistentVolumeClaim"] == {"claimName": "runs-pvc", "readOnly": False}
    assert vols["data"]["hostPath"] == {"path": "/srv/data", "type": "Directory"}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/workspace/runs"]["name"] == "shared" and mounts["/data"]["readOnly"] is True
    # the engine files sit in the pods' run directory (output_dir under workdir), not the render directory
    assert mounts["/workspace/runs/tiny/engine.yaml"]["subPath"] == "engine.yaml"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["AF_ENGINE_FILE"] == "/workspace/runs/tiny/engine.yaml"
    assert str(tmp_path) not in r.files["launch.yaml"].replace(str(ROOT), "")
    assert not [w for w in r.warnings if "run directory" in w]  # it is on the PVC
    assert any("data.path" in w for w in r.warnings)  # the data is not: the image must hold it


def test_relative_output_without_workdir_and_files_nowhere_are_refused(tmp_path):
    def plan(**changes):
        return make_plan(parse_job(yaml.safe_dump(tiny_job(tmp_path, launcher="k8s", **changes))), check_memory=False)

    with pytest.raises(JobError, match="pods' path of the run directory"):
        render(plan(output_dir="runs/x"), tmp_path)
    with pytest.raises(JobError, match="cannot reach the pods"):
        render(plan(output_dir="/mnt/x", k8s={"config_map": False}), tmp_path)
    shared = plan(output_dir="/mnt/x", k8s={"config_map": False,
                                            "volumes": [{"name": "r", "mount_path": "/mnt", "pvc": "p"}]})
    doc = list(yaml.safe_load_all(render(shared, tmp_path).files["launch.yaml"]))
    assert [d["kind"] for d in doc if d] == ["PyTorchJob"]


def _materialize(manifest: str, pod_root: Path) -> dict:
    """What the kubelet does before the container starts: the ConfigMap's files at their mount paths
    (the pods' paths, here under pod_root). → the Master container."""
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    for m in container["volumeMounts"]:
        if "subPath" in m:
            target = Path(m["mountPath"])
            assert target.is_relative_to(pod_root)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(cm["data"][m["subPath"]])
            target.chmod(0o444)
    return container


@pytest.mark.parametrize("framework", ["mindspeed-llm", "llamafactory"])
def test_the_manifest_alone_carries_the_engine_files(framework, tmp_path):
    """Render into one directory, then start the pod's command (its env, its $(RANK)/$(MASTER_*) filled in
    as the operator does) with only the ConfigMap's files at the pods' run directory: it trains."""
    pod_run = tmp_path / "pod" / "run"
    if framework == "llamafactory":
        spec = yaml.safe_load((ROOT / "examples/llamafactory/sft.yaml").read_text())
        spec.update(launcher="k8s", output_dir=str(pod_run), resume="never")
        spec["train"] = {**spec.get("train", {}), "steps": 3}
        for key in ("model_path",):
            spec[key] = str(ROOT / spec[key])
        spec["data"]["path"] = str(ROOT / spec["data"]["path"])
    else:
        spec = tiny_job(pod_run, launcher="k8s", train={"steps": 3})
    spec["k8s"] = {"workdir": str(ROOT)}
    job = write_job(tmp_path / "job.yaml", spec)
    res = cli("render", job, "-o", tmp_path / "render-machine")
    assert res.returncode == 0, res.stdout + res.stderr
    manifest = (tmp_path / "render-machine" / "launch.yaml").read_text()
    assert not pod_run.exists()  # nothing of the render reached the pods' directory
    container = _materialize(manifest, tmp_path / "pod")
    operator_env = {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "WORLD_SIZE": "1"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: operator_env[m.group(1)], a) for a in container["command"]]
    assert argv[0] == "python"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AF_")}, **operator_env,
           **{e["name"]: e["value"] for e in container["env"]}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=container["workingDir"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(losses(pod_run)) == [1, 2, 3]


def test_run_applies_with_kubectl_or_prints_the_command(tmp_path):
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "run", launcher="k8s", output_dir=str(tmp_path / "run")))
    manifest = tmp_path / "run" / "launch.yaml"
    dry = cli("run", job, "--dry-run")
    assert dry.returncode == 0 and f"apply with: kubectl apply -f {manifest}" in " ".join(dry.stdout.split())
    bare = cli("run", job, env={"PATH": str(Path(sys.executable).parent)})
    assert bare.returncode == 0, bare.stdout + bare.stderr
    assert f"kubectl is not on PATH here; apply the manifest where it is: kubectl apply -f {manifest}" in \
        " ".join(bare.stdout.split())
    # a kubectl that records its arguments (no cluster here to apply to)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "kubectl").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'kubectl.args'}\n"
                                    "echo 'pytorchjob.kubeflow.org/qwen3-0-6b-sft created'\n")
    (bindir / "kubectl").chmod(0o755)
    applied = cli("run", job, env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert (tmp_path / "kubectl.args").read_text().split() == ["apply", "-f", str(manifest)]
    assert "logs -f qwen3-0-6b-sft-master-0" in applied.stdout
