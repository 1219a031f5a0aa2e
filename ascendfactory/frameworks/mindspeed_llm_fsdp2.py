"""MindSpeed-LLM's FSDP2 backend (`backend: fsdp2`): `train_fsdp2.py <file>.yaml`, read by backends.llm.

Render writes the YAML its examples/fsdp2 files are (sections model / data / parallel / training /
optimization, only keys of its arguments.py) and the `dataset_info.json` its `dataset_dir` names. What the
backend does not build (model parallelism, LoRA, packing, stage pt ...) is refused here before launch,
naming the job field; the engine refuses the same in its own keys (backends/llm/fsdp2/keys.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ascendfactory.frameworks.base import Adapter, FeatureUse, fsdp_states
from ascendfactory.frameworks.llamafactory import TEMPLATE_OF_FAMILY, dataset_entry, dataset_name
from ascendfactory.frameworks.mindspeed_llm import MindSpeedLLM
from backends.contract.prompts import LF_TEMPLATES

BACKEND_HINT = "or use backend: mcore (the Megatron backend)"
DATA_FORMATS = ("alpaca", "sharegpt")  # the sft records dataset_info.json entries describe
# job layout fields → the FSDP2 key that would say them (None: the backend has no such parallelism)
# a family's chat template (data.template's default): LLaMA-Factory's, Qwen3's MoE models speaking Qwen3's
FAMILY_TEMPLATE = {**TEMPLATE_OF_FAMILY, "qwen3_moe": "qwen3", "qwen3_next": "qwen3"}
MODEL_PARALLEL = {"tp": "parallel.tp_size", "pp": None, "vpp": None, "cp": "parallel.cp_size",
                  "ep": "parallel.ep_size"}


class MindSpeedLLMFSDP2(MindSpeedLLM):
    stages = ("sft",)
    template = "engines/mindspeed-llm-fsdp2.yaml.j2"
    config_name = "mindspeed_llm_fsdp2.yaml"
    sidecar_template = ""          # the upstream file says everything the engine reads
    preprocess_module = None       # it tokenizes at start, into output_dir/data
    finetuning_methods = ("full",)
    model_parallel = False
    starter_sharding = ({},)

    def refuse(self, where, message, hint):
        from ascendfactory.errors import Problem

        return Problem(where, f"{self.name}'s FSDP2 backend {message}", hint=hint)

    def common_limits(self, job, serving):
        """The shared checks, with the Megatron backend named as the way out of a stage or method."""
        out = super().common_limits(job, serving)
        for problem in out:
            if problem.where in ("stage", "finetuning"):
                problem.hint = f"{problem.hint}, {BACKEND_HINT}"
        return out

    def limits(self, job):
        from ascendfactory.catalog import seed2_backends

        p, d, out = job.parallel, job.data, []

        def no(where, message, hint):
            out.append(self.refuse(where, message, hint))

        listed = seed2_backends(job.model)
        if "fsdp2" not in listed:
            no("backend", "serves the models whose card lists backend fsdp2 (the second seed's model list); "
               + (f"{job.model}'s lists {' / '.join(listed)}" if listed else f"{job.model} is not on that list"),
               "use backend: mcore")
        if not job.model_path:
            no("model_path", "builds the model from a local Hugging Face directory (model.model_name_or_path; it "
               "downloads nothing and has no random init from the card)", f"set model_path, {BACKEND_HINT}")
        if job.model_overrides:
            no("model_overrides", "reads the model directory's config.json as it is",
               f"change the model directory's config.json, {BACKEND_HINT}")
        for dim, key in MODEL_PARALLEL.items():
            if getattr(p, dim) > 1:
                what = f"{key} > 1 is not built here" if key else "has no such parallelism"
                no(f"parallel.{dim}", f"shards with FSDP2 only: {dim}={getattr(p, dim)} ({what})",
                   f"set parallel.{dim}: 1, {BACKEND_HINT}")
        if p.pp_layers:
            no("parallel.pp_layers", "has no pipeline stages", "remove parallel.pp_layers")
        for flag, what in (("sp", "sequence parallel"), ("distributed_optimizer", "a distributed optimizer")):
            if getattr(p, flag):
                no(f"parallel.{flag}", f"has no {what}: FSDP2 shards parameters, gradients and optimizer states "
                   "itself", f"set parallel.{flag}: false, {BACKEND_HINT}")
        if p.zero:
            no("parallel.zero", "has no ZeRO stages: FSDP2 shards everything (ZeRO-3 style)",
               "set parallel.zero: 0")
        if p.recompute == "selective":
            no("parallel.recompute", "recomputes whole modules (parallel.recompute_modules), not selective parts",
               "set parallel.recompute: full (whole layers) or none")
        if d.format not in DATA_FORMATS:
            no("data.format", f"trains sft on {' / '.join(DATA_FORMATS)} records through dataset_info.json, not "
               f"{d.format}", f"convert the data, {BACKEND_HINT}")
        for flag in ("packing", "neat_packing"):
            if getattr(d, flag):
                no(f"data.{flag}", "does not pack sequences (data.packing is not built in this backend)",
                   f"set data.{flag}: false, {BACKEND_HINT}")
        if d.dynamic_seq_len:
            no("data.dynamic_seq_len", "always pads each batch to its longest sample (a multiple of 8)",
               "leave data.dynamic_seq_len unset")
        if d.template and d.template not in LF_TEMPLATES:
            no("data.template", f"has no template {d.template!r} that this engine implements (it has "
               f"{', '.join(LF_TEMPLATES)})", "choose one of those, or leave data.template unset for the family's")
        if job.train.report_to:
            no("train.report_to", "has no tracker keys (it writes metrics.jsonl)", "remove train.report_to")
        if job.train.warmup_steps and job.train.steps is None:
            no("train.warmup_steps", "warms up a fraction of the steps (training.warmup_ratio), which with "
               "train.epochs depends on the data", "give train.steps, or train.warmup_steps: 0")
        if job.kernels.overrides:
            no("kernels.overrides", "picks every op's kernel from kernels.backend (AF_KERNELS) alone",
               "remove kernels.overrides, or set kernels.backend")
        return out

    def plan_problems(self, job, arch: dict[str, Any]):
        out = []
        if arch.get("moe") and job.train.moe_aux_loss_coeff:
            out.append(self.refuse("train.moe_aux_loss_coeff", "has no MoE router auxiliary loss "
                                   "(training.router_aux_loss_coef is not built)",
                                   f"set train.moe_aux_loss_coeff: 0, {BACKEND_HINT}"))
        if not job.data.template and family_template(job) not in LF_TEMPLATES:
            out.append(self.refuse("data.template", f"has no chat template of the {model_family(job)} family",
                                   f"set data.template to one of {', '.join(LF_TEMPLATES)}"))
        return out

    def features_used(self, job, distributed):
        uses = []
        if job.stage in self.stages and job.finetuning == "full":
            uses.append(FeatureUse("pretrain_full", f"stage: {job.stage}, finetuning: full, backend: fsdp2"))
        if job.kernels.flash_attention:
            uses.append(FeatureUse("flash_attention", "kernels.flash_attention"))
        return uses

    def no_effect(self, job):
        out = {"data.pad_to_multiple_of": "its collator pads each batch to a multiple of 8 itself "
                                          "(DataCollatorForSeq2Seq)",
               "parallel.fsdp": "this backend always shards with FSDP2 (parallel.fsdp_modules)"}
        out["parallel.moe_dispatcher"] = "experts run without expert parallel here (ep_size 1): nothing is dispatched"
        return out

    def plan_warnings(self, job):
        if job.train.export_hf:
            return ["train.export_hf: the FSDP2 backend writes DCP checkpoints only (training.save_hf_weights is "
                    "accepted with a notice; its Hugging Face export is not built yet): no hf/ directory"]
        return []

    def render_config(self, shell, yml, context, job, run_dir: Path):
        t = job.train
        context = dict(context, dataset_name=dataset_name(job),
                       lf_template=job.data.template or family_template(job),
                       warmup_ratio=warmup_ratio(t.warmup_steps, t.steps),
                       resume_from=resume_from(job, run_dir))
        return Adapter.render_config(self, shell, yml, context, job, run_dir)

    def extra_files(self, context, job):
        return {"dataset_info.json": json.dumps({dataset_name(job): dataset_entry(job)}, indent=2) + "\n"}

    def states(self, job, on_device, trainable, layer_only, c, dp):
        return fsdp_states(job, on_device, trainable, layer_only, c, dp)

    def shards_frozen_copies(self, job):
        return True


def model_family(job) -> str:
    from ascendfactory.catalog import models

    return models()[job.model].get("family", "")


def family_template(job) -> str:
    """data.template's default: the family's LLaMA-Factory template (qwen3 → qwen3, llama → llama3 ...)."""
    return FAMILY_TEMPLATE.get(model_family(job), model_family(job))


def warmup_ratio(warmup_steps: int, steps: int | None) -> float:
    """training.warmup_ratio whose int(steps × ratio) (upstream's warmup count) is exactly warmup_steps."""
    if not warmup_steps or not steps:
        return 0.0
    ratio = warmup_steps / steps
    while int(steps * ratio) < warmup_steps:  # 3 / 10 * 10 is 2.9999999999999996
        ratio = math.nextafter(ratio, 1.0)
    return ratio


def resume_from(job, run_dir: Path) -> str | None:
    """training.resume_from_checkpoint: a path; `resume: auto` → this run's newest step_N checkpoint when the
    file is rendered (run renders just before it launches), none on a first run."""
    if job.resume == "never":
        return None
    if job.resume != "auto":
        return job.resume
    steps = [(int(m.group(1)), c) for c in (run_dir / "checkpoints").glob("step_*")
             if (m := re.fullmatch(r"step_(\d+)", c.name)) and c.is_dir()]
    return str(max(steps)[1]) if steps else None


ADAPTER = MindSpeedLLMFSDP2()
