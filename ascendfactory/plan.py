"""The plan: resolved architecture, parallel layout (with every layout rule) and memory estimate."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ascendfactory import buildable, catalog, field_effects
from ascendfactory.errors import JobError, Problem
from ascendfactory.frameworks import job_adapter
from ascendfactory.inputs import REMOTE_FS_LAUNCHERS  # read on the cluster's file system: not checked here
from backends.contract.layout import Layout, rl_batches
from backends.contract.layout import solve as solve_layout
from ascendfactory.matrix import CapabilityReport
from ascendfactory.spec import RL_STAGES, ROLE_INHERITS, TRAINED_ROLES, JobSpec

DEFAULT_DEVICE_MEMORY_GIB = {"npu": 64.0, "cuda": 80.0}


@dataclass
class Plan:
    job: JobSpec
    model_id: str
    card: dict[str, Any]
    family: str
    arch: dict[str, Any]
    arch_source: str
    layout: Layout
    memory: Any  # memory.MemoryEstimate
    capability: CapabilityReport
    warnings: list[str] = field(default_factory=list)
    roles: dict[str, Layout] = field(default_factory=dict)  # RL roles: each one's layout on the same devices

    def effective_config(self) -> dict[str, Any]:
        """The job with every default made explicit, plus what the planner derived."""
        out = self.job.model_dump(mode="json")
        out["resolved"] = {
            "model_id": self.model_id,
            "family": self.family,
            "architecture_from": self.arch_source,
            "architecture": self.arch,
            "layout": asdict(self.layout),
            **({"role_layouts": {role: asdict(lay) for role, lay in self.roles.items()}} if self.roles else {}),
            "device_memory_gib": self.memory.device_memory_gib,
            "estimated_peak_gib": round(self.memory.total_gib, 2),
            "capability_cells": [f"{u.feature} ← {u.because}" for u in self.capability.uses],
        }
        return out




def _remote_path_problems(job: JobSpec, field: str, value: str) -> tuple[list[Problem], list[str]] | None:
    """For a model directory the job's processes read on a remote file system and that this machine
    does not have: (problems, warnings) from what can be checked here; None where the path is read on
    this machine's file system, or this machine has it too (then its config.json is read as usual)."""
    if job.launcher not in REMOTE_FS_LAUNCHERS or Path(value).expanduser().exists():
        return None
    unchecked = (f"{field} {value} is not on this machine: it is read where the job runs, so it is not checked "
                 "here and the layout is planned on the model card's architecture (and model_overrides)")
    if "://" in value:
        return [Problem(field, f"{value} is a URL; the engine opens a directory path",
                        hint="use the path the storage is mounted at in the job (ModelArts mounts OBS / SFS; "
                             "Kubernetes: a k8s.volumes mount_path)")], []
    if job.launcher == "k8s":
        if not value.startswith("/"):
            workdir = job.k8s.workdir or "the image's working directory"
            return [], [f"{unchecked}; relative, it is found from {workdir} in the pods"]
        mounts = [v.mount_path.rstrip("/") or "/" for v in job.k8s.volumes]
        inside = [m for m in mounts if m == "/" or value == m or value.startswith(m + "/")]
        if not inside:
            listed = ", ".join(mounts) if mounts else "none"
            return [Problem(field, f"{value} is not on this machine and lies under no k8s.volumes mount_path "
                                   f"(mounted: {listed}), so the pods cannot read it either",
                            hint="mount the storage that holds it (k8s.volumes: [{name, pvc or host_path, "
                                 "mount_path}]) or point the path under a mount_path")], []
        return [], [f"{unchecked} (on the volume mounted at {max(inside, key=len)})"]
    return [], [unchecked]


def resolve_arch(job: JobSpec, card: dict) -> tuple[str, dict[str, Any], str, list[Problem], list[str]]:
    """Architecture of the model that will train: config.json of model_path, else card + overrides."""
    from ascendfactory.hfconfig import is_tiny_test_model, read_model_dir

    problems, warnings = [], []
    family = card["family"]
    arch = copy.deepcopy(card["arch"])
    source = "capability_matrix/models.yaml"
    remote = _remote_path_problems(job, "model_path", job.model_path) if job.model_path else None
    if remote is not None:
        problems += remote[0]
        warnings += remote[1]
    elif job.model_path:
        path = Path(job.model_path).expanduser()
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            problems.append(Problem("model_path", f"{path} {what}",
                                    hint="point model_path at a Hugging Face model directory, or remove it for random init"))
        else:
            try:
                found_family, arch = read_model_dir(path)
                for key in ("moe", "mla"):  # same keys as a card, present or not
                    arch.setdefault(key, None)
                source = str(path / "config.json")
            except (ValueError, OSError) as exc:
                problems.append(Problem("model_path", f"{path / 'config.json'} is not readable JSON: {exc}"))
                found_family = family
            if found_family and found_family != family:
                if is_tiny_test_model(path):
                    source += f" (a tiny {found_family} test model standing in for {job.model})"
                else:
                    warnings.append(f"model_path holds a {found_family} model but {job.model} is a {family} "
                                    "model card")
                family = found_family
    for key, value in job.model_overrides.items():
        target = arch
        if key in ("num_experts", "experts_per_token", "moe_ffn_hidden_size", "shared_experts", "first_k_dense"):
            if not arch.get("moe"):  # dense cards carry moe: None
                problems.append(Problem(f"model_overrides.{key}", f"{job.model} is not a MoE model"))
                continue
            target = arch["moe"]
        elif key not in arch:
            from ascendfactory.errors import did_you_mean
            guess = did_you_mean(key, list(arch) + list(arch.get("moe") or {}))
            problems.append(Problem(f"model_overrides.{key}", f"unknown architecture key '{key}'",
                                    hint=f"did you mean '{guess}'?" if guess else "keys: " + ", ".join(arch)))
            continue
        target[key] = value
        source += " + model_overrides" if "overrides" not in source else ""
    if job.model_overrides.get("num_attention_heads") and "head_dim" not in job.model_overrides and "hidden_size" in job.model_overrides:
        arch["head_dim"] = arch["hidden_size"] // arch["num_attention_heads"]
    return family, arch, source, problems, warnings


def _layout_rules(job: JobSpec, arch: dict[str, Any]) -> tuple[Layout | None, list[Problem], list[str]]:
    """The layout rules of backends.contract.layout on the job's numbers, plus the job-level rules around them."""
    p, r, t, d = job.parallel, job.resources, job.train, job.data
    moe = arch.get("moe")
    layout, broken = solve_layout(
        world=r.nnodes * r.devices_per_node, nnodes=r.nnodes, heads=arch["num_attention_heads"],
        kv_heads=arch["num_kv_heads"], layers=arch["num_layers"], experts=moe["num_experts"] if moe else 0,
        tp=p.tp, pp=p.pp, vpp=p.vpp, pp_layers=p.pp_layers, cp=p.cp, cp_algo=p.cp_algo,
        ulysses_degree=p.ulysses_degree, ep=p.ep, sp=p.sp, seq_len=d.seq_len,
        # RL batches count prompts and micro-batches responses: their rules are rl_batches (_role_layouts)
        micro_batch=None if job.stage in RL_STAGES else t.micro_batch,
        global_batch=None if job.stage in RL_STAGES else t.global_batch)
    problems = [Problem(b.field, b.message, hint=b.hint) for b in broken]
    warnings: list[str] = []

    def bad(where, msg, hint):
        problems.append(Problem(where, msg, hint=hint))

    if p.cp > 1:
        if not job.kernels.flash_attention:
            bad("kernels.flash_attention", "every context-parallel algorithm needs flash attention",
                "set kernels.flash_attention: true (it is reported, never switched on silently)")
        if arch.get("sliding_window"):
            bad("parallel.cp", "context parallel does not support sliding-window attention", "set parallel.cp: 1")
    problems += job_adapter(job).plan_problems(job, arch)
    warnings += job_adapter(job).plan_warnings(job)
    warnings += field_effects.warnings(job, arch, job_adapter(job))

    # data and sharding options
    if d.neat_packing and not d.packing:
        bad("data.neat_packing", "neat packing needs packing (it is the reset attention mask of packed rows)",
            "set data.packing: true")
    if d.packing and d.dynamic_seq_len:
        bad("data.dynamic_seq_len", "packing fills every row to seq_len, so there is no length to make dynamic",
            "use data.packing or data.dynamic_seq_len, not both")
    if sum([p.zero > 0, p.fsdp, p.distributed_optimizer]) > 1:
        bad("parallel", "zero, fsdp and distributed_optimizer are three ways to shard the same states",
            "keep one of them")
    world = r.nnodes * r.devices_per_node
    if job.launcher == "local" and world > 1:
        bad("launcher", f"the local launcher runs one process, but the layout needs {world}",
            "use launcher: torchrun (or slurm / k8s / modelarts)")
    s = d.seq_len
    if arch.get("max_position_embeddings") and s > arch["max_position_embeddings"]:
        warnings.append(f"data.seq_len {s} exceeds the model's max_position_embeddings {arch['max_position_embeddings']}")
    if r.device == "cpu" and t.precision == "fp16":
        warnings.append("fp16 on the CPU is slow and loss scaling is not needed there; bf16 or fp32 is usual")
    return (None if problems else layout), problems, warnings


def _role_layouts(job: JobSpec, arch: dict[str, Any]) -> tuple[dict[str, Layout], list[Problem]]:
    """Each RL role's layout over the job's devices (colocated roles share them). A role that keeps
    the job's layout is the main layout; only a role's own layout can break a rule anew."""
    from ascendfactory.hfconfig import read_model_dir

    r, d = job.resources, job.data
    world = r.nnodes * r.devices_per_node
    roles: dict[str, Layout] = {}
    problems: list[Problem] = []
    seen: set[tuple[str, str]] = set()  # batch problems already said for the actor
    for role, lay in job.role_layouts().items():
        dims = arch
        if role == "reward":
            path = Path(job.rl.reward.model_path).expanduser()
            remote = _remote_path_problems(job, "rl.reward.model_path", job.rl.reward.model_path)
            if remote is not None:  # read where the job runs: its dimensions are not known here
                problems += remote[0]
                continue
            try:
                dims = read_model_dir(path)[1]
            except (OSError, ValueError) as exc:
                problems.append(Problem("rl.reward.model_path", f"{path} holds no readable config.json ({exc})",
                                        hint="point it at a Hugging Face reward model directory"))
                continue
        moe = dims.get("moe")
        numbers = {k: getattr(lay, k) for k in ("tp", "pp", "vpp", "pp_layers", "cp", "cp_algo", "ulysses_degree",
                                                 "ep", "sp") if hasattr(lay, k)}
        solved, broken = solve_layout(
            world=world, nnodes=r.nnodes, heads=dims["num_attention_heads"], kv_heads=dims["num_kv_heads"],
            layers=dims["num_layers"], experts=moe["num_experts"] if moe else 0, seq_len=d.seq_len, **numbers)
        if solved is not None:
            roles[role] = solved
            if role in TRAINED_ROLES:
                problems += _rl_batch_problems(job, role, solved.dp, seen)
        if role != "reward" and _same_layout(lay, job.parallel):
            continue  # the job's own layout, on the same model: its problems are reported once, above
        parent = ROLE_INHERITS.get(role)
        if parent and _same_layout(lay, job.role_layouts()[parent]):
            continue  # the layout of the role it follows (the reference: the actor's), reported there
        problems += [Problem(f"rl.{role}.{b.field}" if b.field.startswith("parallel") else b.field,
                             f"the {role}'s layout: {b.message}", hint=b.hint) for b in broken]
    return roles, problems


def _rl_batch_problems(job: JobSpec, role: str, dp: int, seen: set[tuple[str, str]]) -> list[Problem]:
    """The RL batch arithmetic (backends.contract.layout.rl_batches, the engine's own rule) on a trained
    role's data-parallel size; what the actor's already broke is not said again for the critic."""
    rl, t = job.rl, job.train
    world = job.resources.nnodes * job.resources.devices_per_node
    micro = (rl.critic.micro_batch or t.micro_batch) if role == "critic" else t.micro_batch
    fields = {"micro_batch": "rl.critic.micro_batch"} if role == "critic" and rl.critic.micro_batch else None
    broken = rl_batches(algorithm=job.stage, prompts=t.global_batch, mini_batch=rl.mini_batch or t.global_batch,
                        micro_batch=micro, n=rl.rollout.n, dp=dp, ppo_epochs=rl.ppo_epochs, fields=fields,
                        **job_adapter(job).rl_batch_rules(job, world, role=role))
    out = []
    for b in broken:
        if (b.field, b.message) not in seen:
            seen.add((b.field, b.message))
            out.append(Problem(b.field, b.message if role == "actor" else f"the {role}'s layout: {b.message}",
                               hint=b.hint))
    return out


def _rl_layout(layout: Layout, job: JobSpec) -> Layout:
    """An RL job's main layout with its update's numbers: micro-batches of responses per rank, and
    the responses of one mini-batch (one optimizer step) as the global batch."""
    t, rl = job.train, job.rl
    responses = (rl.mini_batch or t.global_batch) * rl.rollout.n
    return replace(layout, micro_batch=t.micro_batch, global_batch=responses,
                   grad_accum=-(-responses // (layout.dp * t.micro_batch)))


def _same_layout(role_layout, parallel) -> bool:
    return all(getattr(role_layout, k) == getattr(parallel, k) for k in type(role_layout).model_fields)


def make_plan(job: JobSpec, allow_unsupported: bool = False, check_memory: bool = True,
              check_inputs: bool = False, check_engine: bool = False) -> Plan:
    """Capability check, model, layout rules, memory estimate, with `check_inputs` the files the engine
    opens, and with `check_engine` that this build's engine runs the job where it runs here (what `run`
    checks before it writes anything): every problem in one JobError, titled by the check when one failed."""
    from ascendfactory.inputs import input_problems
    from ascendfactory.matrix import check
    from ascendfactory.memory import estimate

    unbuilt = buildable.refusal(job.model)
    if unbuilt is not None:  # nothing below may run on an architecture this build has no numbers or engine for
        raise JobError("The model is not buildable by this build", [unbuilt])
    found: dict[str, list[Problem]] = {}
    capability = check(job, allow_unsupported)
    n = len(capability.refusals)
    found[f"The capability matrix refuses this job ({n} reason{'s' if n != 1 else ''})"] = list(capability.refusals)
    card = catalog.models()[job.model]
    family, arch, source, arch_problems, warnings = resolve_arch(job, card)
    found["The model cannot be resolved"] = arch_problems
    if arch_problems:   # plan the layout on the card's architecture: its rules still hold for the job's numbers
        arch = copy.deepcopy(card["arch"])
    layout, layout_problems, more = _layout_rules(job, arch)
    roles, role_problems = _role_layouts(job, arch)
    layout_problems += role_problems
    warnings += more
    layout_only = all(pr.where.startswith(("parallel", "resources")) or
                      (pr.where.startswith("rl.") and ".parallel" in pr.where) for pr in layout_problems)
    n = len(layout_problems)
    found[f"{'The parallel layout does not work' if layout_only else 'The job cannot be planned'} "
          f"({n} problem{'s' if n != 1 else ''})"] = layout_problems
    if check_inputs:
        found["Inputs are missing"] = input_problems(job)
    unready = engine_unready(job) if check_engine else None
    if unready is not None:
        found[unready.title] = unready.problems
    mem = None
    if not layout_problems:
        if job.stage in RL_STAGES:
            layout = _rl_layout(layout, job)
        device = job.resources.device
        limit = job.resources.device_memory_gib or DEFAULT_DEVICE_MEMORY_GIB.get(device)
        mem = estimate(job, arch, layout, card, device_memory_gib=limit)
        if check_memory and limit is not None and mem.total_gib > limit:
            found[f"The job does not fit in device memory: about {mem.total_gib:.1f} GiB per device, "
                  f"{limit:g} GiB available"] = [Problem("resources.device_memory_gib", mem.breakdown_text(),
                                                         hint=mem.advice())]
    failed = {title: problems for title, problems in found.items() if problems}
    if failed:
        raise JobError(_title(failed), [pr for problems in failed.values() for pr in problems])
    return Plan(job=job, model_id=job.model, card=card, family=family, arch=arch, arch_source=source,
                layout=layout, memory=mem, capability=capability,
                warnings=capability.warnings + warnings, roles=roles)


def engine_unready(job: JobSpec) -> JobError | None:
    """What this build's engine cannot run of the job (engines.require_ready), where it runs the job: None when
    it runs every setting, or on a cluster launcher whose image brings its own engine."""
    from ascendfactory.engines import require_ready

    if job.launcher in REMOTE_FS_LAUNCHERS:
        return None
    try:
        require_ready(job)
    except JobError as err:
        return err
    return None


def _title(failed: dict[str, list[Problem]]) -> str:
    """The failed check's own title, or for several: how many problems and which checks found them."""
    if len(failed) == 1:
        return next(iter(failed))
    n = sum(len(problems) for problems in failed.values())
    said = [title.split(" (")[0].split(":")[0] for title in failed]
    return f"The job cannot run ({n} problems): " + "; ".join(what[0].lower() + what[1:] for what in said)


def check_job(path, overrides: list[str] | None = None, allow_unsupported: bool = False,
              check_inputs: bool = False, check_engine: bool = False) -> Plan:
    """load_job then make_plan in one pass: a job file with schema problems is also planned with those
    fields at their defaults (when the rest is a valid job), so the matrix, layout and inputs problems of
    the other fields come in the same error. Problems about a field the schema refused are not repeated."""
    from ascendfactory.job_file import load_job

    try:
        job = load_job(path, overrides)
    except JobError as err:
        partial, removed = getattr(err, "partial", None), getattr(err, "removed", ())
        if partial is None:
            raise
        try:
            make_plan(partial, allow_unsupported=allow_unsupported, check_inputs=check_inputs,
                      check_engine=check_engine)
        except JobError as later:
            more = [pr for pr in later.problems
                    if not any(pr.where == r or pr.where.startswith(r + ".") for r in removed)]
            if more:
                raise JobError(f"{err.title}; with those fields at their defaults, {later.title[0].lower()}"
                               f"{later.title[1:]}", err.problems + more) from None
        raise
    return make_plan(job, allow_unsupported=allow_unsupported, check_inputs=check_inputs, check_engine=check_engine)


def effective_yaml(plan: Plan) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(plan.effective_config())), sort_keys=False, allow_unicode=True)
