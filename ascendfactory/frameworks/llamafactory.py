"""LLaMA-Factory: Hugging Face models, data parallel + ZeRO, `train <file>.yaml`, backends.lf.

Render writes what `llamafactory-cli train` reads: the training YAML, the `dataset_info.json` its
`dataset_dir` names and, for ZeRO, the DeepSpeed JSON its `deepspeed` key names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ascendfactory.frameworks.base import PARALLEL_DIMS, Adapter, FeatureUse, States
from backends.contract.prompts import LF_TEMPLATES

# a family's LLaMA-Factory template (its `template:` names; Qwen2.5-VL speaks qwen2_vl)
TEMPLATE_OF_FAMILY = {"qwen2": "qwen", "qwen3": "qwen3", "llama": "llama3", "glm": "glm4", "qwen2_vl": "qwen2_vl",
                      "qwen2_5_vl": "qwen2_vl", "gemma3": "gemma3"}
# the templates backends.lf implements (a subset of llamafactory-0.9.5-templates.txt)
TEMPLATES = tuple(LF_TEMPLATES)
# our schedules → lr_scheduler_type (HF's names); cosine with a floor is cosine_with_min_lr
SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}
DATA_FORMATS = ("alpaca", "sharegpt", "text", "pairwise")


class LlamaFactory(Adapter):
    name = "llamafactory"
    engine_module = "backends.lf"
    stages = ("pt", "sft", "dpo")
    columns = {"stages": "list", "zero": "flag", "flash_attention": "flag"}
    template = "engines/llamafactory.yaml.j2"
    sidecar_template = "engines/llamafactory.engine.yaml.j2"
    config_name = "llamafactory_train.yaml"
    model_parallel = False
    starter_sharding = ({"zero": 0}, {"zero": 1}, {"zero": 2}, {"zero": 3})
    finetuning_methods = ("full", "freeze", "lora")
    reads_vision = True

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

    def no_effect(self, job):
        return {"data.pad_to_multiple_of": "LLaMA-Factory's collator pads each batch to a multiple of 8 itself (no "
                                           "key; padding changes speed, not the loss)",
                "kernels.fused_ops": "backends.lf picks its fused kernels itself (LLaMA-Factory's switch for them, "
                                     "enable_liger_kernel, changes speed, not the loss)"}

    def plan_problems(self, job, arch: dict[str, Any]):
        out = []
        if job.data.format not in DATA_FORMATS:
            out.append(self.refuse("data.format", f"reads {', '.join(DATA_FORMATS)} data, not {job.data.format}",
                                   "use framework: verl or mindspeed-rl for prompt data"))
        if (job.data.format == "pairwise") != (job.stage == "dpo"):
            out.append(self.refuse("data.format", f"stage {job.stage} takes "
                                   f"{'pairwise' if job.stage == 'dpo' else 'text, alpaca or sharegpt'} data, not "
                                   f"{job.data.format}", "match data.format to the stage"))
        if job.data.template and job.data.template not in TEMPLATES:
            out.append(self.refuse("data.template", f"has no template {job.data.template!r} that backends.lf "
                                   f"implements (it has {', '.join(TEMPLATES)})",
                                   "choose one of those, or leave data.template unset for the model's own"))
        if job.finetuning == "lora" and job.lora and not float(job.lora.alpha).is_integer():
            out.append(self.refuse("lora.alpha", f"takes an integer lora_alpha, not {job.lora.alpha}",
                                   "set lora.alpha to a whole number (2 × lora.rank is LLaMA-Factory's default)"))
        if job.finetuning == "freeze" and abs(job.freeze.trainable_layers) > arch["num_layers"]:
            out.append(self.refuse("freeze.trainable_layers", f"cannot train {abs(job.freeze.trainable_layers)} "
                                   f"layers of a {arch['num_layers']}-layer model",
                                   f"set freeze.trainable_layers to at most {arch['num_layers']}, or use "
                                   f"finetuning: full"))
        if job.train.min_lr and job.train.schedule != "cosine":
            out.append(self.refuse("train.min_lr", f"has a learning-rate floor only for the cosine schedule, not "
                                   f"{job.train.schedule}", "set train.min_lr: 0, or train.schedule: cosine"))
        sample = data_sample(job)
        if "images" in sample and job.vision is None:
            out.append(self.refuse("data.path", f"records of {job.data.path} carry images, but {job.model} is a text "
                                   "model", "use a vision-language model (qwen2-vl-*, qwen2.5-vl-*, gemma3-27b), or "
                                   "data without an images column"))
        if "images" in sample and job.data.packing:
            out.append(self.refuse("data.packing", "does not pack samples with images here",
                                   "set data.packing: false (each batch is padded to its longest sample)"))
        if job.data.dynamic_seq_len:
            out.append(self.refuse("data.dynamic_seq_len", "always pads each batch to its longest sample",
                                   "leave data.dynamic_seq_len unset"))
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

    def env(self, job, run_dir: str) -> dict[str, str]:
        # WandbCallback's wandb.init names no directory: wandb's own $WANDB_DIR (else the working directory)
        return {"WANDB_DIR": run_dir} if "wandb" in job.train.report_to else {}

    def zero_stage(self, job) -> int:
        return 3 if job.parallel.fsdp else job.parallel.zero

    def render_config(self, shell, yml, context, job, run_dir: Path):
        t = job.train
        context = dict(context, dataset_name=dataset_name(job),
                       lf_template=None if job.stage == "pt" else
                       job.data.template or TEMPLATE_OF_FAMILY.get(context["family"], context["family"]),
                       lr_scheduler="cosine_with_min_lr" if t.schedule == "cosine" and t.min_lr else
                       SCHEDULERS[t.schedule],
                       deepspeed_file=str(run_dir / deepspeed_name(job)) if self.zero_stage(job) else None,
                       media_dir=str(Path(job.data.path).resolve().parent) if "images" in data_sample(job) else None)
        return super().render_config(shell, yml, context, job, run_dir)

    def extra_files(self, context: dict[str, Any], job) -> dict[str, str]:
        files = {"dataset_info.json": json.dumps({dataset_name(job): dataset_entry(job)}, indent=2) + "\n"}
        if self.zero_stage(job):
            files[deepspeed_name(job)] = json.dumps(deepspeed_config(job, self.zero_stage(job)), indent=2) + "\n"
        return files

    def states(self, job, on_device, trainable, layer_only, c, dp):
        """ZeRO-1 shards optimizer states, 2 also gradients, 3 also weights (FSDP counts as 3)."""
        z = 3 if job.parallel.fsdp else job.parallel.zero
        master = 4 if c == 2 else 0
        return States(c * on_device / (dp if z >= 3 else 1), c * trainable / (dp if z >= 2 else 1),
                      (master + 8) * trainable / (dp if z >= 1 else 1), 2 * c * layer_only if z >= 3 else 0)

    def shards_frozen_copies(self, job):
        return job.parallel.fsdp or job.parallel.zero >= 3


def dataset_name(job) -> str:
    path = Path(job.data.path)
    return (path.stem if path.suffix else path.name) or "data"


def deepspeed_name(job) -> str:
    stage = 3 if job.parallel.fsdp else job.parallel.zero
    return f"ds_z{stage}_config.json"


def first_record(path: Path, limit: int = 1 << 20) -> dict:
    """The first record of a JSON / JSONL file, read from its first MiB (empty when that is not enough)."""
    try:
        head = path.open(encoding="utf-8").read(limit).lstrip()
    except (OSError, UnicodeDecodeError):
        return {}
    if head.startswith("["):
        head = head[1:].lstrip()
    try:
        record, _ = json.JSONDecoder().raw_decode(head)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def data_sample(job) -> dict:
    """The data file's first record (empty for a folder or an unreadable file)."""
    path = Path(job.data.path)
    return first_record(path) if path.is_file() else {}


def dataset_entry(job) -> dict[str, Any]:
    """The data file's dataset_info.json entry: LLaMA-Factory's formatting, columns and tags for it
    (file_name absolute, so dataset_dir can be the run directory)."""
    d = job.data
    path = Path(d.path).resolve()
    entry: dict[str, Any] = {"file_name": str(path)}
    sample = first_record(path) if path.is_file() else {}
    if d.format == "text":
        entry["columns"] = {"prompt": "text"}
    elif d.format == "alpaca" or (d.format == "pairwise" and not ({"messages", "conversations"} & set(sample))):
        columns = {"prompt": "instruction", "query": "input"}
        if d.format == "pairwise":
            entry["ranking"] = True
            columns.update(chosen="chosen", rejected="rejected")
        else:
            columns["response"] = "output"
        columns.update({key: key for key in ("system", "history") if key in sample})
        entry["columns"] = columns
    else:  # sharegpt, or pairwise records whose prompt is a list of turns
        entry["formatting"] = "sharegpt"
        if "messages" in sample and "conversations" not in sample:  # OpenAI-style role / content turns
            entry["columns"] = {"messages": "messages"}
            entry["tags"] = {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant", "system_tag": "system"}
        else:
            entry["columns"] = {"messages": "conversations"}
            entry["tags"] = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                             "system_tag": "system"}
        if "system" in sample:
            entry["columns"]["system"] = "system"
        if d.format == "pairwise":  # chosen / rejected: one assistant message each
            entry["ranking"] = True
            entry["columns"].update(chosen="chosen", rejected="rejected")
    if "images" in sample and "columns" in entry:  # paths relative to media_dir (the data file's folder)
        entry["columns"]["images"] = "images"
    return entry


def deepspeed_config(job, stage: int) -> dict[str, Any]:
    """A DeepSpeed config as LLaMA-Factory's examples/deepspeed ones are: batch sizes, clipping and
    precision left to the trainer ("auto"), the ZeRO stage and offload spelled out."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=5e8, reduce_scatter=True,
                    reduce_bucket_size=5e8, round_robin_gradients=True)
    elif stage == 3:
        zero.update(sub_group_size=1e9, reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                    stage3_param_persistence_threshold="auto", stage3_max_live_parameters=1e9,
                    stage3_max_reuse_distance=1e9, stage3_gather_16bit_weights_on_model_save=True)
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True,
            "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                     "hysteresis": 2, "min_loss_scale": 1},
            "bf16": {"enabled": "auto"},
            "zero_optimization": zero}


ADAPTER = LlamaFactory()
