"""`ascendfactory matrix check`: the matrix files are well formed, every ✅ cell plans, and the
engines in this build implement every ✅ cell they are responsible for."""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from ascendfactory import catalog
from ascendfactory.catalog import NOT_PLANNED, SUPPORTED, UNSTATED, UNSUPPORTED
from ascendfactory.errors import JobError
from ascendfactory.frameworks import adapter

STAGE_NAMES = {"pt", "sft", "dpo", "grpo", "dapo", "ppo"}


@dataclass
class CheckResult:
    promised: dict[tuple[str, str], int] = field(default_factory=dict)   # (fw, feature) → ✅ cells
    backed: dict[tuple[str, str], int] = field(default_factory=dict)     # … implemented by a present engine
    engines: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pending: dict[tuple[str, str], str] = field(default_factory=dict)  # (fw, feature) → engine's reason


def _legal(fw: str, feature: str, value) -> bool:
    if value == NOT_PLANNED:
        return True
    kind = adapter(fw).columns[feature]
    if value == UNSTATED:  # a plain cell of a second-seed row (verify_files checks which row)
        return kind not in ("list", "version")
    if kind == "list":
        return isinstance(value, list) and all(v in STAGE_NAMES for v in value) and len(set(value)) == len(value)
    if kind == "version":
        return value == UNSUPPORTED or (isinstance(value, str) and value == value.lower() and value != SUPPORTED)
    return value in (SUPPORTED, UNSUPPORTED)


def verify_files(frameworks) -> list[str]:
    problems = []
    try:
        known = catalog.models()
    except (yaml.YAMLError, OSError, KeyError) as exc:
        return [f"models.yaml: {exc}"]
    for fw in frameworks:
        try:
            tab = catalog.table(fw)
        except (yaml.YAMLError, OSError, KeyError) as exc:
            problems.append(f"{fw}.yaml: {exc}")
            continue
        columns = catalog.features(fw)
        if tuple(tab.features) != columns:
            problems.append(f"{fw}.yaml: feature keys {list(tab.features)} differ from {list(columns)}")
        for model_id, row in tab.rows.items():
            if model_id not in known:
                problems.append(f"{fw}.yaml: model '{model_id}' has no card in models.yaml")
            if set(row) != set(columns):
                problems.append(f"{fw}.yaml: {model_id} has cells {sorted(row)}, expected {list(columns)}")
                continue
            for feature, value in row.items():
                if value == UNSTATED and model_id not in tab.second_seed:
                    problems.append(f"{fw}.yaml: {model_id}.{feature} is unstated, which only a seed2_models row "
                                    "may be (the first seed states every cell of its rows)")
                elif not _legal(fw, feature, value):
                    problems.append(f"{fw}.yaml: {model_id}.{feature} = {value!r} is not a legal cell value")
    return problems


def promises(fw: str, model_id: str) -> list[tuple[str, str | None]]:
    """(feature, stage-or-None) for every ✅ promise in a row; list cells promise each entry."""
    row = catalog.table(fw).rows[model_id]
    out = []
    for feature, value in row.items():
        if isinstance(value, list):
            out += [(feature, stage) for stage in value]
        elif value not in (UNSUPPORTED, NOT_PLANNED, UNSTATED):
            out.append((feature, None))
    return out


def probe_job(fw: str, model_id: str, feature: str, stage: str | None) -> dict:
    """A representative job that exercises one ✅ cell (8 devices, so parallel cells have room)."""
    arch = catalog.models()[model_id]["arch"]
    fw_adapter = adapter(fw)
    job: dict = {"model": model_id, "framework": fw, "stage": stage or "sft",
                 "data": {"path": "data/train.json", "seq_len": 4096},
                 "resources": {"device": "npu", "devices_per_node": 8},
                 "parallel": {}, "train": {"global_batch": 16}}
    par, data = job["parallel"], job["data"]
    if feature == "pretrain_full":
        job["stage"] = "pt"
        data["format"] = "text"
    elif feature == "lora":
        job["finetuning"] = "lora"
        if arch.get("moe"):
            par["moe_dispatcher"] = "alltoall_seq"
    elif feature == "packing":
        data["packing"] = True
    elif feature == "dynamic_seq_len":
        data["dynamic_seq_len"] = True
    elif feature == "sptd":
        par.update(tp=2, sp=True, pp=2)
        if arch["num_layers"] % 2:
            half = arch["num_layers"] // 2
            par["pp_layers"] = [half, arch["num_layers"] - half]
    elif feature == "long_seq":
        par.update(cp=2, cp_algo=fw_adapter.cp_algos[0])
        data["seq_len"] = 8192
    elif feature == "moe_parallel" and arch.get("moe"):
        par["ep"] = 2
    elif feature == "zero":
        par["zero"] = 2
    elif feature == "distributed_optimizer":
        par["distributed_optimizer"] = True
    elif feature == "recompute":
        par["recompute"] = "full"
    fw_adapter.probe(job, catalog.table(fw).rows[model_id], feature, stage)
    if job["stage"] == "dpo":
        data["format"] = "pairwise"
    return job


def run_check(frameworks) -> CheckResult:
    from ascendfactory.engines import engine_info, implements
    from ascendfactory.plan import make_plan
    from ascendfactory.spec import JobSpec

    result = CheckResult(problems=verify_files(frameworks))
    if result.problems:
        return result
    for fw in frameworks:
        info = engine_info(fw)
        result.engines[fw] = info.present
        for feature in info.pending:
            if feature not in catalog.features(fw):
                result.problems.append(f"{info.module}.capabilities: PENDING names {feature!r}, not a {fw} feature")
        if not info.present:
            result.notes.append(f"{fw}: engine {info.module} is not in this build; its ✅ cells are promised, not backed")
        for model_id in catalog.table(fw).rows:
            family = catalog.models()[model_id]["family"]
            for feature, stage in promises(fw, model_id):
                key = (fw, feature)
                result.promised[key] = result.promised.get(key, 0) + 1
                cell = f"{fw} × {model_id} × {feature}" + (f" [{stage}]" if stage else "")
                try:
                    make_plan(JobSpec.model_validate(probe_job(fw, model_id, feature, stage)), check_memory=False)
                except JobError as err:
                    result.problems.append(f"✅ cell {cell} does not plan: {err.render()}")
                except Exception as exc:  # a bug in the planner must not hide behind the table
                    result.problems.append(f"✅ cell {cell}: planning raised {type(exc).__name__}: {exc}")
                if info.present:
                    declared = feature if stage is None else f"{feature}:{stage}"
                    if implements(info, declared, family):
                        result.backed[key] = result.backed.get(key, 0) + 1
                    elif feature in info.pending:
                        result.pending[key] = info.pending[feature]
                    else:
                        result.problems.append(f"✅ cell {cell}: engine {info.module} does not implement "
                                               f"'{declared}' for family {family}")
    return result


def coverage_table(result: CheckResult):
    from rich.table import Table

    t = Table(title="capability coverage: cells backed by an engine / ✅ cells promised")
    t.add_column("framework")
    t.add_column("engine")
    t.add_column("feature")
    t.add_column("backed / promised", justify="right")
    for (fw, feature), n in result.promised.items():
        engine = "present" if result.engines.get(fw) else "not in build"
        if (fw, feature) in result.pending:
            engine = "pending"
        t.add_row(fw, engine, feature, f"{result.backed.get((fw, feature), 0)} / {n}")
    return t
