"""MindSpeed-LLM: Megatron-style training of language models, flags in, backends.llm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ascendfactory.frameworks.base import Adapter, FeatureUse, flags_from_template


class MindSpeedLLM(Adapter):
    name = "mindspeed-llm"
    engine_module = "backends.llm"
    stages = ("pt", "sft")
    columns = {"pretrain_full": "flag", "lora": "flag", "packing": "flag", "flash_attention": "flag",
               "sptd": "flag", "long_seq": "flag", "moe_parallel": "flag", "dynamic_seq_len": "flag"}
    template = "engines/mindspeed-llm.args.j2"
    config_name = "mindspeed_llm_args.sh"
    preprocess_module = "backends.llm.preprocess"

    def limits(self, job):
        if job.parallel.zero:
            return [self.refuse("parallel.zero", "has no ZeRO stages",
                                "use parallel.distributed_optimizer: true (ZeRO-1 style) or fsdp: true")]
        return []

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

    def plan_problems(self, job, arch: dict[str, Any]):
        if arch.get("moe") and job.finetuning == "lora" and job.parallel.moe_dispatcher != "alltoall_seq":
            return [self.refuse("parallel.moe_dispatcher", "needs the alltoall_seq token dispatcher for LoRA on MoE "
                                "models", "set parallel.moe_dispatcher: alltoall_seq")]
        return []

    def render_config(self, shell, yml, context, job, run_dir: Path):
        text, args = flags_from_template(shell, self.template, context)
        return "# MindSpeed-LLM flags rendered by ascendfactory (one per line)\n" + text, args


ADAPTER = MindSpeedLLM()
