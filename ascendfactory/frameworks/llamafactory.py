"""LLaMA-Factory: Hugging Face models, data parallel + ZeRO, `train <file>.yaml`, backends.lf."""

from __future__ import annotations

from ascendfactory.frameworks.base import PARALLEL_DIMS, Adapter, FeatureUse, States


class LlamaFactory(Adapter):
    name = "llamafactory"
    engine_module = "backends.lf"
    stages = ("pt", "sft", "dpo")
    columns = {"stages": "list", "zero": "flag", "flash_attention": "flag"}
    template = "engines/llamafactory.yaml.j2"
    config_name = "llamafactory_train.yaml"
    model_parallel = False
    starter_sharding = ({"zero": 0}, {"zero": 1}, {"zero": 2}, {"zero": 3})

    def limits(self, job):
        p, out = job.parallel, []
        for dim in PARALLEL_DIMS:
            if getattr(p, dim) > 1:
                out.append(self.refuse(f"parallel.{dim}", f"parallelises with data parallel + ZeRO only, not "
                                       f"{dim}={getattr(p, dim)}",
                                       f"set parallel.{dim}: 1 and use parallel.zero, or framework: mindspeed-llm"))
        if p.sp or p.distributed_optimizer:
            out.append(self.refuse("parallel", "has no sequence parallel or distributed optimizer",
                                   "use parallel.zero: 1–3 instead"))
        return out

    def features_used(self, job, distributed):
        p, uses = job.parallel, []
        if job.stage in self.stages:
            uses.append(FeatureUse("stages", f"stage: {job.stage}", needs=job.stage))
        if p.zero or p.fsdp:
            uses.append(FeatureUse("zero", f"parallel.zero={p.zero}" if p.zero else "parallel.fsdp"))
        if job.kernels.flash_attention:
            uses.append(FeatureUse("flash_attention", "kernels.flash_attention"))
        return uses

    def serves(self, row, stage):
        return stage in (row["stages"] if isinstance(row.get("stages"), list) else [])

    def engine_args(self, config_path):
        return ["train", str(config_path)]

    def states(self, job, on_device, trainable, layer_only, c, dp):
        """ZeRO-1 shards optimizer states, 2 also gradients, 3 also weights (FSDP counts as 3)."""
        z = 3 if job.parallel.fsdp else job.parallel.zero
        master = 4 if c == 2 else 0
        return States(c * on_device / (dp if z >= 3 else 1), c * trainable / (dp if z >= 2 else 1),
                      (master + 8) * trainable / (dp if z >= 1 else 1), 2 * c * layer_only if z >= 3 else 0)

    def shards_frozen_copies(self, job):
        return job.parallel.fsdp or job.parallel.zero >= 3


ADAPTER = LlamaFactory()
