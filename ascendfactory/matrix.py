"""Capability check: which matrix cells a job touches, and whether the table allows them.

A ✅ cell is a promise; ❌ is refused unless the user passes --allow-unsupported (then it is a
loud warning); NA (never planned) and unlisted models are always refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ascendfactory import catalog
from ascendfactory.catalog import FRAMEWORKS, NOT_PLANNED, SUPPORTED, UNLISTED, UNSUPPORTED
from ascendfactory.errors import JobError, Problem
from ascendfactory.spec import RL_STAGES, JobSpec


@dataclass(frozen=True)
class FeatureUse:
    feature: str            # the column key in the framework table
    because: str            # the job setting that uses it, e.g. "finetuning: lora"
    needs: Any = None       # for list cells: the entry that must be present (a stage / method)


@dataclass
class CapabilityReport:
    uses: list[FeatureUse]
    refusals: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _dp(job: JobSpec) -> int:
    world = job.resources.nnodes * job.resources.devices_per_node
    denom = job.parallel.tp * job.parallel.pp * job.parallel.cp
    return world // denom if denom and world % denom == 0 else max(world // max(denom, 1), 1)


def _engine_limits(job: JobSpec) -> list[Problem]:
    """Settings a framework does not offer at all (no table column exists for them)."""
    p, fw, out = job.parallel, job.framework, []

    def refuse(where, msg, hint):
        out.append(Problem(where, f"{fw} {msg}", hint=hint))

    if fw == "mindspeed-llm":
        if p.zero:
            refuse("parallel.zero", "has no ZeRO stages", "use parallel.distributed_optimizer: true (ZeRO-1 style) or fsdp: true")
    elif fw == "llamafactory":
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(p, name) > 1:
                refuse(f"parallel.{name}", f"parallelises with data parallel + ZeRO only, not {name}={getattr(p, name)}",
                       f"set parallel.{name}: 1 and use parallel.zero, or framework: mindspeed-llm")
        if p.sp or p.distributed_optimizer:
            refuse("parallel", "has no sequence parallel or distributed optimizer", "use parallel.zero: 1–3 instead")
    elif fw == "mindspeed-mm":
        if job.finetuning == "lora":
            refuse("finetuning", "is in the matrix for full training only (no LoRA column)", "use finetuning: full, or framework: llamafactory")
        if p.zero:
            refuse("parallel.zero", "has no ZeRO stages", "use parallel.fsdp: true or distributed_optimizer: true")
        if p.ep > 1:
            refuse("parallel.ep", "has no expert parallel for its models", "set parallel.ep: 1")
        if p.cp > 1 and p.cp_algo != "ulysses":
            refuse("parallel.cp_algo", "offers Ulysses context parallel only", "set parallel.cp_algo: ulysses")
    elif fw in ("verl", "mindspeed-rl"):
        if job.stage not in RL_STAGES:
            refuse("stage", f"trains the RL stages {', '.join(RL_STAGES)} only, not {job.stage}",
                   "use framework: mindspeed-llm or llamafactory for pt/sft/dpo")
        if fw == "verl" and (p.tp > 1 or p.pp > 1 or p.ep > 1):
            refuse("parallel", "trains with its FSDP backend: tp, pp and ep must be 1",
                   "set parallel.tp/pp/ep: 1 and parallel.fsdp: true, or framework: mindspeed-rl")
        if fw == "verl" and p.cp > 1 and p.cp_algo != "ulysses":
            refuse("parallel.cp_algo", "has Ulysses sequence parallel only", "set parallel.cp_algo: ulysses")
        if fw == "mindspeed-rl" and job.rl is not None and job.rl.engine == "sglang":
            refuse("rl.engine", "rolls out with vLLM (or hf), not sglang", "set rl.engine: vllm or hf")
    if fw in ("mindspeed-llm", "llamafactory", "mindspeed-mm") and job.stage in RL_STAGES:
        refuse("stage", f"does not train RL stage {job.stage}", "use framework: verl or mindspeed-rl")
    if fw in ("mindspeed-llm", "mindspeed-mm") and job.stage == "dpo":
        refuse("stage", "has no DPO column in the matrix", "use framework: llamafactory (stages list dpo where ✅)")
    return out


def features_used(job: JobSpec) -> list[FeatureUse]:
    p, fw, uses = job.parallel, job.framework, []
    dp = _dp(job)
    distributed = []
    if p.tp > 1:
        distributed.append(f"parallel.tp={p.tp}")
    if p.pp > 1:
        distributed.append(f"parallel.pp={p.pp}")
    if p.sp:
        distributed.append("parallel.sp")
    if dp > 1:
        distributed.append(f"data parallel dp={dp}")
    if p.fsdp:
        distributed.append("parallel.fsdp")

    if fw == "mindspeed-llm":
        if job.stage in ("pt", "sft"):
            uses.append(FeatureUse("pretrain_full" if job.finetuning == "full" else "lora",
                                   f"stage: {job.stage}, finetuning: {job.finetuning}"))
        if job.data.packing:
            uses.append(FeatureUse("packing", "data.packing"))
        if job.kernels.flash_attention:
            uses.append(FeatureUse("flash_attention", "kernels.flash_attention"))
        if p.distributed_optimizer:
            distributed.append("parallel.distributed_optimizer")
        if distributed:
            uses.append(FeatureUse("sptd", ", ".join(distributed)))
        if p.cp > 1:
            uses.append(FeatureUse("long_seq", f"parallel.cp={p.cp} ({p.cp_algo})"))
        if p.ep > 1:
            uses.append(FeatureUse("moe_parallel", f"parallel.ep={p.ep}"))
        if job.data.dynamic_seq_len:
            uses.append(FeatureUse("dynamic_seq_len", "data.dynamic_seq_len"))
    elif fw == "llamafactory":
        if job.stage not in RL_STAGES:
            uses.append(FeatureUse("stages", f"stage: {job.stage}", needs=job.stage))
        if p.zero or p.fsdp:
            uses.append(FeatureUse("zero", f"parallel.zero={p.zero}" if p.zero else "parallel.fsdp"))
        if job.kernels.flash_attention:
            uses.append(FeatureUse("flash_attention", "kernels.flash_attention"))
    elif fw == "mindspeed-mm":
        if job.stage in ("pt", "sft"):
            uses.append(FeatureUse("pretrain_full", f"stage: {job.stage}, finetuning: {job.finetuning}"))
        if p.cp > 1:
            distributed.append(f"parallel.cp={p.cp}")
        if distributed:
            uses.append(FeatureUse("sptd", ", ".join(distributed)))
        if p.distributed_optimizer:
            uses.append(FeatureUse("distributed_optimizer", "parallel.distributed_optimizer"))
        if p.recompute != "none":
            uses.append(FeatureUse("recompute", f"parallel.recompute={p.recompute}"))
    elif fw in ("verl", "mindspeed-rl"):
        if job.stage in RL_STAGES:
            uses.append(FeatureUse("methods", f"stage: {job.stage}", needs=job.stage))
        engine = job.rl.engine if job.rl else "vllm"
        if engine in ("vllm", "sglang"):
            uses.append(FeatureUse(engine, f"rl.engine: {engine}"))
        if fw == "verl":
            uses.append(FeatureUse("train_backend", "the actor trains with FSDP"))
        else:
            uses.append(FeatureUse("megatron_backend", "the actor trains with the Megatron-style backend"))
            if p.cp > 1:
                uses.append(FeatureUse("long_seq", f"parallel.cp={p.cp}"))
    return uses


def cell_state(value: Any, needs: Any = None) -> str:
    """supported / unsupported / not_planned for a cell, given what the job needs of it."""
    if value == NOT_PLANNED:
        return NOT_PLANNED
    if isinstance(value, list):
        return SUPPORTED if needs in value else UNSUPPORTED
    if value == UNSUPPORTED:
        return UNSUPPORTED
    return SUPPORTED  # "supported" or a version / backend string


def frameworks_serving(model_id: str, stage: str) -> list[str]:
    """Frameworks whose table lets this model train this stage."""
    out = []
    for fw in FRAMEWORKS:
        r = catalog.table(fw).rows.get(model_id)
        if r is None:
            continue
        if fw in ("mindspeed-llm", "mindspeed-mm") and stage in ("pt", "sft") and r["pretrain_full"] == SUPPORTED:
            out.append(fw)
        elif fw == "llamafactory" and stage in (r["stages"] if isinstance(r["stages"], list) else []):
            out.append(fw)
        elif fw in ("verl", "mindspeed-rl") and stage in (r["methods"] if isinstance(r["methods"], list) else []):
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
    report = CapabilityReport(uses=uses, refusals=_engine_limits(job))
    alternatives = [f for f in frameworks_serving(model_id, job.stage) if f != fw]
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
            what = f"{cell_name} is {shown}" + (f", which does not include {use.needs}" if use.needs else " (unsupported)")
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
