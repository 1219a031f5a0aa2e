"""MindSpeed-MM: Megatron-style training of vision-language models, backends.mm."""

from __future__ import annotations

from ascendfactory.frameworks.base import Adapter, FeatureUse


class MindSpeedMM(Adapter):
    name = "mindspeed-mm"
    engine_module = "backends.mm"
    stages = ("pt", "sft")
    columns = {"pretrain_full": "flag", "sptd": "flag", "distributed_optimizer": "flag", "recompute": "flag"}
    template = "engines/mindspeed-mm.yaml.j2"
    config_name = "mindspeed_mm.yaml"
    cp_algos = ("ulysses",)
    finetuning_methods = ("full",)     # the matrix has no LoRA column for it

    def limits(self, job):
        p, out = job.parallel, []
        if p.zero:
            out.append(self.refuse("parallel.zero", "has no ZeRO stages",
                                   "use parallel.fsdp: true or distributed_optimizer: true"))
        if p.ep > 1:
            out.append(self.refuse("parallel.ep", "has no expert parallel for its models", "set parallel.ep: 1"))
        return out

    def features_used(self, job, distributed):
        p, uses = job.parallel, []
        if job.stage in self.stages:
            uses.append(FeatureUse("pretrain_full", f"stage: {job.stage}, finetuning: {job.finetuning}"))
        if p.cp > 1:
            distributed = distributed + [f"parallel.cp={p.cp}"]
        if distributed:
            uses.append(FeatureUse("sptd", ", ".join(distributed)))
        if p.distributed_optimizer:
            uses.append(FeatureUse("distributed_optimizer", "parallel.distributed_optimizer"))
        if p.recompute != "none":
            uses.append(FeatureUse("recompute", f"parallel.recompute={p.recompute}"))
        return uses


ADAPTER = MindSpeedMM()
