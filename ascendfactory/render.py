"""Render the engine config and launch script of a plan with Jinja (templates/).

Every value that reaches a shell goes through `finalize`: shell templates quote it with
shlex.quote unless a template marks it `raw` (numbers, validated names), and YAML templates
emit it as a JSON scalar. A path holding `; rm -rf ~` therefore stays one plain word.
"""

from __future__ import annotations

import functools

import json
import os
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ascendfactory.frameworks import job_adapter
from ascendfactory.frameworks.base import one_line
from ascendfactory.plan import Plan
from ascendfactory.resources import templates_dir
from backends.contract.megatron import CP_ALGO_FLAGS

# the chat template a family's chat models use where its name is not the family's own: GLM-4-9B-Chat
# (family glm) speaks the template LLaMA-Factory and backends.common.data name glm4
CHAT_TEMPLATE_OF_FAMILY = {"glm": "glm4"}
SIDECAR_NAME = "engine.yaml"
SIDECAR_ENV = "AF_ENGINE_FILE"  # how the engine finds the sidecar: its argv holds upstream flags only

LAUNCH_TEMPLATE = {
    "local": ("launch/local.sh.j2", "launch.sh"),
    "torchrun": ("launch/torchrun.sh.j2", "launch.sh"),
    "slurm": ("launch/slurm.sbatch.j2", "launch.sh"),
    "modelarts": ("launch/modelarts.sh.j2", "launch.sh"),
    "k8s": ("launch/k8s.yaml.j2", "launch.yaml"),
}


class Raw(str):
    """A string a template may emit as is (a number, a validated name, a shell expression we wrote)."""


def _shell_finalize(value: Any) -> str:
    if isinstance(value, Raw):
        return value
    if value is None:
        return "''"
    if isinstance(value, bool):
        return "true" if value else "false"
    return shlex.quote(str(value))


def _yaml_finalize(value: Any) -> str:
    if isinstance(value, Raw):
        return value
    text = json.dumps(value, ensure_ascii=False)
    if isinstance(value, float) and "e" in text and "." not in text:
        # YAML 1.1 (PyYAML, Hydra) reads 2e-06 as a string; 2.0e-06 is a float
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return text


def _raw_comment(value: Any) -> Raw:
    """Text for a comment or #SBATCH line: no line breaks or control characters can get out."""
    return Raw(one_line(value))


@functools.lru_cache(maxsize=None)
def _environment(kind: str):
    """One environment per kind for the process: Jinja compiles each template once (renders are many in a
    planner's search, init's layout search and the tests)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        finalize=_shell_finalize if kind == "shell" else _yaml_finalize,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["raw"] = lambda v: Raw(str(v))
    env.filters["raw_comment"] = _raw_comment
    env.globals["megatron_cp_algo"] = CP_ALGO_FLAGS  # parallel.cp_algo → --context-parallel-algo
    return env


@dataclass
class Rendered:
    files: dict[str, str]            # name in the run directory → content
    argv: list[str]                  # what `run` executes on this node (no shell)
    env: dict[str, str]              # extra environment for the workers
    engine_module: str
    run_dir: Path
    warnings: list[str] = field(default_factory=list)


def run_paths(plan: Plan, run_dir: Path, resolve: bool = True) -> dict[str, str]:
    job = plan.job
    run_dir = run_dir.resolve() if resolve else run_dir
    resume = {"auto": str(run_dir / "checkpoints"), "never": ""}.get(job.resume, job.resume)
    data = Path(job.data.path)
    return {
        "workdir": str(Path.cwd()),
        "run_dir": str(run_dir),
        "metrics": str(run_dir / "metrics.jsonl"),
        "logs": str(run_dir / "logs"),
        "checkpoints": str(run_dir / "checkpoints"),
        "resume": resume,
        "hf_dir": str(run_dir / "hf"),
        "data_prefix": str(run_dir / "data" / "dataset"),
        "dataset_dir": str(data.parent if data.suffix else data),
        "dataset_name": data.stem if data.suffix else data.name,
    }


DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
K8S_FILES_VOLUME = "af-engine-files"


def _k8s_name(name: str, nnodes: int = 1) -> str:
    """A DNS-1035 label (what the training operator requires of a PyTorchJob's name) that leaves room for
    the pods' and services' `-worker-N` suffix within 63 characters."""
    cleaned = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]+", "-", name.lower())).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"af-{cleaned}".rstrip("-")
    room = 63 - len(f"-worker-{max(nnodes - 2, 0)}")
    return cleaned[:room].rstrip("-")


def _k8s_paths(plan: Plan) -> tuple[Path, dict[str, str]]:
    """The run directory and paths as the pods see them: output_dir, absolute or under k8s.workdir."""
    from ascendfactory.errors import JobError, Problem

    job = plan.job
    out = Path(job.output_dir)
    if not out.is_absolute():
        if not job.k8s.workdir:
            raise JobError("The Kubernetes manifest needs the pods' path of the run directory", [Problem(
                "output_dir", f"{job.output_dir} is relative and k8s.workdir is not set",
                hint="give an absolute output_dir on a k8s.volumes mount (e.g. /mnt/runs/<name>) or set k8s.workdir")])
        out = Path(job.k8s.workdir) / out
    paths = run_paths(plan, Path(os.path.normpath(out)), resolve=False)
    paths["workdir"] = job.k8s.workdir or ""
    return out, paths


def _k8s_context(plan: Plan, paths: dict[str, str], files: dict[str, str], device: str) -> tuple[dict, list[str]]:
    """Names, resources, volumes and mounts of the PyTorchJob (and its ConfigMap); → (context, warnings)."""
    from ascendfactory.errors import JobError, Problem

    job, lay = plan.job, plan.layout
    name = _k8s_name(job.name, lay.nnodes)
    if device == "cpu":  # no device plugin resource: CPU processes need CPUs
        resources = {"requests": {"cpu": str(lay.devices_per_node)}}
    else:
        resource = job.k8s.resource_name or ("nvidia.com/gpu" if device == "cuda" else "huawei.com/Ascend910")
        resources = {"limits": {resource: lay.devices_per_node}}
    volumes, mounts = [], []
    for v in job.k8s.volumes:
        if v.name == K8S_FILES_VOLUME:
            raise JobError("A volume name is taken", [Problem("k8s.volumes", f"{v.name} is the engine files' volume",
                                                              hint="pick another name")])
        source = ({"persistentVolumeClaim": {"claimName": v.pvc, "readOnly": v.read_only}} if v.pvc else
                  {"hostPath": {"path": v.host_path, "type": "Directory" if v.read_only else "DirectoryOrCreate"}})
        volumes.append({"name": v.name, **source})
        mounts.append({"name": v.name, "mountPath": v.mount_path, "readOnly": v.read_only})
    binary = sorted(k for k, v in files.items() if isinstance(v, bytes))
    files = {k: v for k, v in files.items() if not isinstance(v, bytes)}  # a ConfigMap's data holds text
    config_map = f"{name}-files" if job.k8s.config_map else None
    if config_map:
        volumes.append({"name": K8S_FILES_VOLUME, "configMap": {"name": config_map}})
        for file in sorted(files):  # each file at the path the command reads it from
            mounts.append({"name": K8S_FILES_VOLUME, "mountPath": f"{paths['run_dir']}/{file}",
                           "subPath": config_map_key(file), "readOnly": True})

    def on_volume(path: str) -> bool:
        full = path if path.startswith("/") else os.path.join(job.k8s.workdir or "/", path)
        return any(os.path.normpath(full) == m or os.path.normpath(full).startswith(m.rstrip("/") + "/")
                   for m in (v.mount_path for v in job.k8s.volumes))

    warnings = []
    if not on_volume(paths["run_dir"]):
        if not job.k8s.config_map:
            raise JobError("The engine files cannot reach the pods", [Problem(
                "k8s.config_map", f"false, and the run directory {paths['run_dir']} is on no k8s.volumes mount",
                hint="mount the shared volume that holds output_dir, or leave config_map: true")])
        warnings.append(f"k8s: the run directory {paths['run_dir']} is on no k8s.volumes mount: metrics, "
                        "checkpoints and the export stay in the pods and go with them")
    if binary and not on_volume(paths["run_dir"]):
        warnings.append(f"k8s: {', '.join(binary)} (binary) cannot go in the ConfigMap: put the run directory "
                        f"{paths['run_dir']} on a k8s.volumes mount and copy them there")
    if not on_volume(job.data.path):
        warnings.append(f"k8s: data.path {job.data.path} is on no k8s.volumes mount: the image must hold it")
    context = {"name": name, "config_map": config_map,
               "config_files": {config_map_key(k): files[k] for k in sorted(files)},
               "resources": resources, "volumes": volumes, "mounts": mounts}
    return context, warnings


def render(plan: Plan, run_dir: str | Path | None = None, python: str | None = None) -> Rendered:
    job = plan.job
    run_dir = Path(run_dir if run_dir is not None else job.output_dir)
    paths = run_paths(plan, run_dir)
    local_run_dir = Path(paths["run_dir"])  # where the files are written here
    if job.launcher == "k8s":  # the manifest names the pods' paths, wherever it is written
        _, paths = _k8s_paths(plan)
    elif job.launcher == "modelarts" and not run_dir.is_absolute():
        # the script cds to the job's code directory: a relative run directory stays relative to it
        paths = run_paths(plan, Path(os.path.normpath(run_dir)), resolve=False)
    device = job.resources.device
    env = {"PYTHONUNBUFFERED": "1", "AF_KERNELS": job.kernels.backend, "AF_DEVICE": device}
    fw = job_adapter(job)
    if fw.sidecar_template:
        env[SIDECAR_ENV] = str(Path(paths["run_dir"]) / SIDECAR_NAME)
    if device in ("cpu", "auto") and plan.layout.devices_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"  # several CPU ranks on one host would oversubscribe the cores
    env.update(fw.env(job, paths["run_dir"]))
    env.update(job.env)
    context: dict[str, Any] = {
        "job": job.model_dump(mode="json") | {"lora": job.lora.model_dump() if job.lora else None},
        "model_id": plan.model_id,
        "hf_repo": _hf_repo(plan),
        "family": plan.family,
        "family_template": CHAT_TEMPLATE_OF_FAMILY.get(plan.family, plan.family),
        "arch": plan.arch,
        "layout": asdict(plan.layout),
        "roles": {role: asdict(lay) for role, lay in plan.roles.items()},
        "paths": paths,
        "device": device,
        "python": python or "python",
        "env": env,
        "env_list": [{"name": k, "value": v} for k, v in env.items()],
        "rdzv_endpoint": f"{job.resources.master_addr}:{_rdzv_port(job.resources)}",
    }
    if job.launcher == "modelarts":  # ModelArts puts the code at ${MA_JOB_DIR}/<last level of its OBS path>
        context["modelarts"] = {"code_dir": Path(paths["workdir"]).name or "code"}
    if job.launcher == "slurm":
        context["slurm"] = _slurm_context(job, paths)
        context["python"] = job.slurm.python or ("python" if job.slurm.setup else sys.executable)
    shell, yml = _environment("shell"), _environment("yaml")
    files: dict[str, str] = {}

    files[fw.config_name], args = fw.render_config(shell, yml, context, job, Path(paths["run_dir"]))
    if fw.sidecar_template:
        files[SIDECAR_NAME] = yml.get_template(fw.sidecar_template).render(context)
    files.update(fw.extra_files(context, job))
    context["engine"] = {"module": fw.engine_module, "args": args}
    warnings = list(plan.warnings)
    if job.launcher == "k8s":
        context["k8s"], k8s_warnings = _k8s_context(plan, paths, files, device)
        warnings += k8s_warnings

    launch_template, launch_name = LAUNCH_TEMPLATE[job.launcher]
    engine = yml if job.launcher == "k8s" else shell
    context_script = dict(context, node_rank=Raw('"$NODE_RANK"'))
    files[launch_name] = engine.get_template(launch_template).render(context_script)

    argv_template = "launch/local.cmd.j2" if job.launcher == "local" else "launch/torchrun.cmd.j2"
    argv_ctx = dict(context, node_rank=job.resources.node_rank, python=python or sys.executable)
    argv = shlex.split(shell.get_template(argv_template).render(argv_ctx))
    if job.launcher == "local":
        env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(job.resources.master_port)})
    return Rendered(files=files, argv=argv, env=env, engine_module=fw.engine_module,
                    run_dir=local_run_dir, warnings=warnings)


def _hf_repo(plan: Plan) -> str:
    """The card's Hugging Face repository (what a model_name_or_path names without a model_path)."""
    return (plan.card or {}).get("hf_repo") or plan.model_id


def _rdzv_port(resources) -> int:
    """A one-node job without an explicit master_port rendezvouses on port 0: the agent takes a free
    port (torchrun --standalone's way), so two such jobs on one machine never collide."""
    if resources.nnodes == 1 and "master_port" not in resources.model_fields_set:
        return 0
    return resources.master_port


def _slurm_context(job, paths: dict[str, str]) -> dict[str, Any]:
    """What the sbatch script needs beyond the job: its CPUs, output file and rendezvous port."""
    fixed = "master_port" in job.resources.model_fields_set
    return {
        # one task per node runs torchrun and its devices_per_node workers: one CPU each by default
        "cpus_per_task": job.slurm.cpus_per_task or job.resources.devices_per_node,
        # Slurm creates no directory for its output file: the run directory exists once rendered
        "output": Raw(_sbatch_word(paths["run_dir"].replace("%", "%%") + "/slurm-%j.out")),
        # resources.master_port when given; else the script asks the batch host's kernel for a free port
        # when the job starts (a port derived from the job id collides with every job whose id differs
        # by the range, and with whatever else listens there)
        "port": Raw(str(job.resources.master_port)) if fixed else None,
        "fixed_port": fixed,
    }


def _sbatch_word(text: str) -> str:
    """One #SBATCH option value: sbatch splits these lines at blanks and strips double quotes."""
    text = one_line(text)
    return f'"{text}"' if re.search(r"[\s\"'\\]", text) else text


def config_map_key(file: str) -> str:
    """A ConfigMap data key for a run-directory file (keys are [-._a-zA-Z0-9]+: model/x.yaml → model.x.yaml)."""
    return file.replace("/", ".")


def write_files(rendered: Rendered, out_dir: Path, extra: dict[str, str] | None = None) -> list[Path]:
    """Write every rendered file atomically (temporary name, then rename)."""
    import os

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in {**rendered.files, **(extra or {})}.items():
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)  # e.g. MindSpeed-RL's model/<name>.yaml
        tmp = target.with_name(f".{target.name}.tmp")
        if isinstance(text, bytes):  # a binary engine file (VeRL's parquet prompts)
            tmp.write_bytes(text)
        else:
            tmp.write_text(text, encoding="utf-8")
        if name.endswith(".sh"):
            tmp.chmod(0o755)
        os.replace(tmp, target)
        written.append(target)
    return written
