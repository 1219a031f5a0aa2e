"""MindSpeed-LLM: Megatron-style training of language models, flags in, backends.llm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ascendfactory.frameworks.base import Adapter, FeatureUse, flags_from_template, megatron_tracker_warnings
from backends.contract.lora import FUSED_ALIASES, lora_groups
from backends.contract.prompts import TEMPLATE_PROMPT_TYPES

# data.template (the engine's chat templates) → MindSpeed-LLM's --prompt-type of the same format
PROMPT_TYPES = TEMPLATE_PROMPT_TYPES
# the record formats the engine's preprocessing reads (backends.common.data.formats.FORMATS)
DATA_FORMATS = ("alpaca", "sharegpt", "text")


def lora_target_modules(targets: list[str], arch: dict[str, Any]) -> tuple[list[str], str | None]:
    """(MindSpeed-LLM's --lora-target-modules, None) for the job's targets (HF or MindSpeed names, or
    'all'), or ([], why) when they name part of a fused module or a layer this model lacks."""
    groups = lora_groups(arch)
    if [t.lower() for t in targets] in (["all"], ["all-linear"]):
        return list(groups), None
    owner = {hf: group for group, names in groups.items() for hf in names}
    owner.update({alias: group for alias, group in FUSED_ALIASES.items() if group in groups})
    given = set(targets)
    for name in targets:
        if name not in groups and name not in owner:
            return [], (f"has no linear layer {name!r} to adapt with LoRA in this model "
                        f"(it has {', '.join(sorted(set(groups) | set(owner)))})")
    wanted = {name if name in groups else owner[name] for name in targets}
    for group in wanted:
        whole = group in given or set(groups[group]) <= given or \
            any(FUSED_ALIASES.get(name) == group for name in given)
        if not whole:
            return [], (f"adapts {', '.join(groups[group])} together, as one module ({group}); "
                        f"name all of them or {group}")
    return [g for g in groups if g in wanted], None


class MindSpeedLLM(Adapter):
    name = "mindspeed-llm"
    engine_module = "backends.llm"
    stages = ("pt", "sft")
    columns = {"pretrain_full": "flag", "lora": "flag", "packing": "flag", "flash_attention": "flag",
               "sptd": "flag", "long_seq": "flag", "moe_parallel": "flag", "dynamic_seq_len": "flag"}
    template = "engines/mindspeed-llm.args.j2"
    config_name = "mindspeed_llm_args.sh"
    sidecar_template = "engines/mindspeed-llm.engine.yaml.j2"
    preprocess_module = "backends.llm.preprocess"

    def limits(self, job):
        out = []
        if job.parallel.zero:
            out.append(self.refuse("parallel.zero", "has no ZeRO stages",
                                   "use parallel.distributed_optimizer: true (ZeRO-1 style) or fsdp: true"))
        if job.data.format not in DATA_FORMATS:
            out.append(self.refuse("data.format", f"preprocesses {', '.join(DATA_FORMATS)} records, not "
                                   f"{job.data.format} (its --handler-name choices for stages pt and sft)",
                                   "convert the data, or use a framework that trains on it: pairwise → "
                                   "llamafactory (stage: dpo), prompt → verl or mindspeed-rl"))
        return out

    def features_used(self, job, distributed):
        p, uses = job.parallel, []
        if job.stage in self.stages:
            uses.append(FeatureUse("pretrain_full" if job.finetuning == "full" else "lora",
                                   f"stage: {job.stage}, finetuning: {job.finetuning}"))
        if job.data.packing:
            uses.append(FeatureUse("packing", "data.packing"))
        if job.kernels.flash_attention:
            uses.append(FeatureUse("flash_attention", "kernels.flash_attention"))
        if p.distributed_optimizer:
            distributed = distributed + ["parallel.distributed_optimizer"]
        if distributed:
            uses.append(FeatureUse("sptd", ", ".join(distributed)))
        if p.cp > 1:
            uses.append(FeatureUse("long_seq", f"parallel.cp={p.cp} ({p.cp_algo})"))
        if p.ep > 1:
            uses.append(FeatureUse("moe_parallel", f"parallel.ep={p.ep}"))
        if job.data.dynamic_seq_len:
            uses.append(FeatureUse("dynamic_seq_len", "data.dynamic_seq_len"))
        return uses

    def no_effect(self, job):
        out = {}
        if job.data.format == "text":   # pre-training: Megatron's GPTDataset (backends/common/data/gpt_dataset.py)
            out["data.shuffle"] = ("pre-training samples are Megatron's GPTDataset's, whose documents and samples "
                                   "are always shuffled with train.seed")
            out["data.dynamic_seq_len"] = ("pre-training samples are Megatron's GPTDataset windows, every one "
                                           "data.seq_len tokens long")
        if not job.data.dynamic_seq_len or job.data.format == "text":
            out["data.pad_to_multiple_of"] = ("every row is padded to data.seq_len (--pad-to-multiple-of takes "
                                              "effect with data.dynamic_seq_len)")
        return out

    def plan_warnings(self, job):
        return megatron_tracker_warnings(job)

    def plan_problems(self, job, arch: dict[str, Any]):
        out = []
        if arch.get("moe") and job.finetuning == "lora" and job.parallel.moe_dispatcher != "alltoall_seq":
            out.append(self.refuse("parallel.moe_dispatcher", "needs the alltoall_seq token dispatcher for LoRA on "
                                   "MoE models", "set parallel.moe_dispatcher: alltoall_seq"))
        # Megatron declares these flags type=int: a fraction cannot be said to MindSpeed-LLM
        theta = arch.get("rope_theta")
        if theta is not None and not float(theta).is_integer():
            out.append(self.refuse("model_path" if job.model_path else "model", f"takes an integer --rotary-base; "
                                   f"this model's rope_theta is {theta}", "use framework: llamafactory"))
        if job.finetuning == "lora" and job.lora:
            if not float(job.lora.alpha).is_integer():
                out.append(self.refuse("lora.alpha", f"takes an integer --lora-alpha, not {job.lora.alpha}",
                                       "set lora.alpha to a whole number (2 × lora.rank is usual)"))
            _, why = lora_target_modules(job.lora.targets, arch)
            if why:
                out.append(self.refuse("lora.targets", why, "change lora.targets, or use framework: "
                                       "llamafactory, which adapts each linear layer on its own"))
        if job.data.template and job.data.template.lower() not in PROMPT_TYPES:
            out.append(self.refuse("data.template", f"has no --prompt-type {job.data.template!r} that this engine "
                                   f"implements (it has {', '.join(PROMPT_TYPES)})",
                                   "choose one of those, or leave data.template unset for the tokenizer's own"))
        return out

    def render_config(self, shell, yml, context, job, run_dir: Path):
        if job.finetuning == "lora" and job.lora:
            context = dict(context, lora_target_modules=lora_target_modules(job.lora.targets, context["arch"])[0])
        if job.data.template:
            context = dict(context, prompt_type=PROMPT_TYPES[job.data.template.lower()])
        text, args = flags_from_template(shell, self.template, context)
        return "# MindSpeed-LLM flags rendered by ascendfactory (one per line)\n" + text, args


ADAPTER = MindSpeedLLM()
