"""Capability check: which matrix cells a job touches, and whether the table allows them.

A ✅ cell is a promise; ❌ is refused unless the user passes --allow-unsupported (then it is a
loud warning); NA (never planned) and unlisted models are always refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ascendfactory import catalog
from ascendfactory.catalog import NOT_PLANNED, SUPPORTED, UNSTATED, UNSUPPORTED
from ascendfactory.errors import JobError, Problem
from ascendfactory.frameworks import FRAMEWORKS, adapter, adapters, job_adapter
from ascendfactory.frameworks.base import FeatureUse
from ascendfactory.spec import JobSpec


@dataclass
class CapabilityReport:
    uses: list[FeatureUse]
    refusals: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _dp(job: JobSpec) -> int:
    world = job.resources.nnodes * job.resources.devices_per_node
    denom = job.parallel.tp * job.parallel.pp * job.parallel.cp
    return world // denom if denom and world % denom == 0 else max(world // max(denom, 1), 1)


def features_used(job: JobSpec) -> list[FeatureUse]:
    """The matrix cells the job touches, as the framework's adapter maps its columns."""
    p = job.parallel
    distributed = []
    if p.tp > 1:
        distributed.append(f"parallel.tp={p.tp}")
    if p.pp > 1:
        distributed.append(f"parallel.pp={p.pp}")
    if p.sp:
        distributed.append("parallel.sp")
    if _dp(job) > 1:
        distributed.append(f"data parallel dp={_dp(job)}")
    if p.fsdp:
        distributed.append("parallel.fsdp")
    return job_adapter(job).features_used(job, distributed)


def _stage_servers(stage: str) -> list[str]:
    """Frameworks that train a stage at all (whatever the model)."""
    return [a.name for a in adapters() if stage in a.stages]


def cell_state(value: Any, needs: Any = None) -> str:
    """supported / unsupported / not_planned for a cell, given what the job needs of it."""
    if value == NOT_PLANNED:
        return NOT_PLANNED
    if isinstance(value, list):
        return SUPPORTED if needs in value else UNSUPPORTED
    if value in (UNSUPPORTED, UNSTATED):  # what the seed does not promise is not promised
        return UNSUPPORTED
    return SUPPORTED  # "supported" or a version / backend string


def frameworks_serving(model_id: str, stage: str) -> list[str]:
    """Frameworks whose table lets this model train this stage."""
    out = []
    for fw in FRAMEWORKS:
        row = catalog.table(fw).rows.get(model_id)
        if row is not None and adapter(fw).serves(row, stage):
            out.append(fw)
    return out


_WAY_OUT = {
    "pretrain_full": "use finetuning: lora", "lora": "use finetuning: full",
    "packing": "set data.packing: false", "dynamic_seq_len": "set data.dynamic_seq_len: false",
    "flash_attention": "set kernels.flash_attention: false", "sptd": "keep parallel.tp and pp at 1 and sp off",
    "long_seq": "set parallel.cp: 1", "moe_parallel": "set parallel.ep: 1", "zero": "set parallel.zero: 0",
    "distributed_optimizer": "set parallel.distributed_optimizer: false", "recompute": "set parallel.recompute: none",
    "vllm": "choose another rl.engine", "sglang": "choose another rl.engine",
    "megatron_backend": "use framework: verl", "train_backend": "use another framework",
}


def _way_out(feature: str, listed: list) -> str:
    if feature in ("stages", "methods"):
        return f"choose a stage this cell lists ({', '.join(listed)})" if listed else "use another framework"
    return _WAY_OUT.get(feature, "change that setting")


def check(job: JobSpec, allow_unsupported: bool = False) -> CapabilityReport:
    fw, model_id = job.framework, job.model
    show = f"ascendfactory capabilities --model {model_id} --framework {fw}"
    uses = features_used(job)
    serving = frameworks_serving(model_id, job.stage)
    fw_adapter = job_adapter(job)
    report = CapabilityReport(uses=uses, refusals=fw_adapter.common_limits(job, _stage_servers(job.stage))
                              + fw_adapter.limits(job))
    alternatives = [f for f in serving if f != fw]
    alt = f"frameworks that serve {model_id} for stage {job.stage}: {', '.join(alternatives)}" if alternatives \
        else f"no framework's table lists {model_id} for stage {job.stage}"

    row = catalog.table(fw).rows.get(model_id)
    if row is None:
        report.refusals.append(Problem(
            "framework", f"{model_id} has no row in the {fw} table (unlisted)", hint=f"{alt}; see {show}"))
        return report
    for use in uses:
        value = row[use.feature]
        state = cell_state(value, use.needs)
        title = catalog.table(fw).features[use.feature].get("title", use.feature)
        cell_name = f"{fw} × {model_id} × {use.feature} ({title})"
        shown = catalog.cell_symbol(value)
        if state == NOT_PLANNED:
            report.refusals.append(Problem(
                use.because, f"{cell_name} is NA: support is never planned", hint=f"{alt}; see {show}"))
        elif state == UNSUPPORTED:
            what = f"{cell_name} is {shown}" + (f", which does not include {use.needs}" if use.needs else
                                                 " (not stated by the seed)" if value == UNSTATED else " (unsupported)")
            if allow_unsupported:
                report.warnings.append(f"UNSUPPORTED, proceeding because of --allow-unsupported: {what} [{use.because}]")
            else:
                listed = value if isinstance(value, list) else []
                report.refusals.append(Problem(
                    use.because, what,
                    hint=f"{_way_out(use.feature, listed)}, or pass --allow-unsupported to try anyway; see {show}"))
    return report


def require_supported(job: JobSpec, allow_unsupported: bool = False) -> CapabilityReport:
    report = check(job, allow_unsupported)
    if report.refusals:
        n = len(report.refusals)
        raise JobError(f"The capability matrix refuses this job ({n} reason{'s' if n != 1 else ''})", report.refusals)
    return report
