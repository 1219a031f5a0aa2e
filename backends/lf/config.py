"""The LLaMA-Factory dialect: the training YAML that `llamafactory-cli train` reads (0.9.5 keys),
the DeepSpeed JSON its `deepspeed:` names, and the engine sidecar (engine.yaml) for what LLaMA-Factory
has no key for (model card, kernels, metrics file, resume policy).

Every key of LLaMA-Factory 0.9.5's parser has one treatment (tests/test_llamafactory_keys.py holds the
tables against its key list): implemented with LF's meaning (KEYS; some only at the values that change
nothing here), accepted with no effect and one notice line naming it (NO_EFFECT: performance, logging,
inference and export switches), or refused naming the feature not built (UNBUILT, at any value but
LF's default). Never read and ignored. All problems of a file are refused together, one line each.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from backends.common import engine_file as ef
from backends.common.trackers import TrackerSettings, default_runs_dir
from backends.contract import trackers as tracker_packages
from backends.contract.trackers import TRACKERS

STAGES = ("pt", "sft", "rm", "dpo", "kto")
FINETUNING = ("full", "freeze", "lora")
PREF_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")
FLASH_ATTN = ("auto", "disabled", "sdpa", "fa2", "fa3")


class LFConfigError(ValueError):
    """A training file, DeepSpeed file or sidecar this engine cannot run; the message names the key."""


def _kind(*types: type, none: bool = False) -> Callable[[Any], str | None]:
    names = " or ".join("a number" if t is float else {bool: "true or false", int: "an integer", str: "a string",
                                                        list: "a list", dict: "a mapping"}[t] for t in types)

    def check(value):
        if value is None:
            return None if none else names
        if isinstance(value, bool) and bool not in types:
            return names
        if float in types and isinstance(value, int):
            return None
        return None if isinstance(value, types) else names
    return check


def _choice(values: tuple, why: str = "") -> Callable[[Any], str | None]:
    def check(value):
        return None if value in values else f"one of {', '.join(map(str, values))}{why}"
    return check


# transformers' report_to integrations (INTEGRATION_TO_CALLBACK); this engine writes TensorBoard and W&B
INTEGRATIONS = ("azure_ml", "comet_ml", "mlflow", "neptune", "tensorboard", "trackio", "wandb", "codecarbon",
                "clearml", "dagshub", "flyte", "dvclive", "swanlab", "kubeflow")


def _report_to(value) -> str | None:
    """none | all | an integration | a list of them (TrainingArguments.report_to); None reads as none."""
    names = value if isinstance(value, list) else [value]
    if value in (None, "none", ["none"], [], "all", ["all"]):
        return None
    if not all(isinstance(n, str) for n in names):
        return "none, all, an integration name or a list of them"
    bad = [n for n in names if n not in INTEGRATIONS]
    if bad:
        return f"none, all, a transformers integration ({', '.join(INTEGRATIONS)}) or a list of them"
    unbuilt = [n for n in names if n not in TRACKERS]
    if unbuilt:
        return (f"none, all, tensorboard or wandb here: {', '.join(unbuilt)} is not built in this engine (it writes "
                "TensorBoard event files and W&B runs)")
    return None


def _only(values: tuple, why: str) -> Callable[[Any], str | None]:
    """Accepted only at values that change nothing (why: what this engine does instead)."""
    def check(value):
        return None if value in values else f"{' or '.join(map(repr, values))} here: {why}"
    return check


_ANY = lambda value: None  # noqa: E731  (no effect on training here: workers, log dirs, timeouts)
EVAL_STRATEGIES = ("no", "steps", "epoch")

# key -> (LLaMA-Factory 0.9.5's default, check)
KEYS: dict[str, tuple[Any, Callable[[Any], str | None]]] = {
    # model
    "model_name_or_path": (None, _kind(str)),
    "trust_remote_code": (False, _kind(bool)),
    "use_fast_tokenizer": (True, _kind(bool)),
    "cache_dir": (None, _ANY),
    "flash_attn": ("auto", _choice(FLASH_ATTN)),
    "enable_liger_kernel": (False, _only((False,), "backends.kernels already fuses RMSNorm, SwiGLU, rotary and "
                                                   "the linear cross entropy (choose them in engine.yaml kernels)")),
    "disable_gradient_checkpointing": (False, _kind(bool)),
    "use_reentrant_gc": (True, _kind(bool)),
    "low_cpu_mem_usage": (True, _ANY),
    "image_max_pixels": (589824, _kind(int)),
    "image_min_pixels": (1024, _kind(int)),
    "video_max_pixels": (65536, _kind(int)),
    "video_min_pixels": (256, _kind(int)),
    "video_fps": (2.0, _kind(float)),
    "video_maxlen": (128, _kind(int)),
    "print_param_status": (False, _ANY),
    # method
    "stage": ("sft", _choice(STAGES, " (ppo is not built here)")),
    "do_train": (False, _only((True,), "set do_train: true; this engine trains")),
    "do_eval": (False, _kind(bool)),
    "finetuning_type": ("lora", _choice(FINETUNING)),
    "lora_rank": (8, _kind(int)),
    "lora_alpha": (None, _kind(int, none=True)),
    "lora_dropout": (0.0, _kind(float)),
    "lora_target": ("all", _kind(str, list)),
    "freeze_trainable_layers": (2, _kind(int)),
    "freeze_trainable_modules": ("all", _kind(str, list)),
    "freeze_extra_modules": (None, _kind(str, list, none=True)),
    "freeze_vision_tower": (True, _kind(bool)),
    "freeze_multi_modal_projector": (True, _kind(bool)),
    "freeze_language_model": (False, _kind(bool)),
    "pref_beta": (0.1, _kind(float)),
    "pref_ftx": (0.0, _kind(float)),
    "pref_loss": ("sigmoid", _choice(PREF_LOSSES)),
    "simpo_gamma": (0.5, _kind(float)),
    "dpo_label_smoothing": (0.0, _kind(float)),
    "kto_chosen_weight": (1.0, _kind(float)),
    "kto_rejected_weight": (1.0, _kind(float)),
    "plot_loss": (False, _kind(bool)),
    "disable_shuffling": (False, _kind(bool)),
    # dataset
    "dataset": (None, _kind(str, list)),
    "dataset_dir": ("data", _kind(str)),
    "media_dir": (None, _kind(str, none=True)),
    "template": (None, _kind(str, none=True)),
    "cutoff_len": (2048, _kind(int)),
    "train_on_prompt": (False, _kind(bool)),
    "mask_history": (False, _kind(bool)),
    "max_samples": (None, _kind(int, none=True)),
    "packing": (None, _kind(bool, none=True)),
    "neat_packing": (False, _kind(bool)),
    "enable_thinking": (True, _kind(bool)),
    "preserve_thinking": (False, _kind(bool)),
    "default_system": (None, _kind(str, none=True)),
    "val_size": (0.0, _kind(float)),
    "eval_dataset": (None, _kind(str, list, none=True)),
    "eval_on_each_dataset": (False, _kind(bool)),
    "streaming": (False, _only((False,), "the dataset is tokenized once into a memory-mapped cache")),
    "overwrite_cache": (False, _ANY),
    "preprocessing_num_workers": (None, _kind(int, none=True)),  # they chunk kto's KL pairing and packing
    "preprocessing_batch_size": (1000, _kind(int)),
    # output
    "output_dir": (None, _kind(str)),
    "overwrite_output_dir": (False, _kind(bool)),
    "logging_steps": (500, _kind(int, float)),
    "logging_first_step": (False, _kind(bool)),
    "include_num_input_tokens_seen": ("no", _choice((True, False, "all", "non_padding", "no"))),
    "logging_dir": (None, _kind(str, none=True)),
    "save_strategy": ("steps", _choice(("steps", "no"))),
    "save_steps": (500, _kind(int, float)),
    "save_total_limit": (None, _kind(int, none=True)),
    "save_only_model": (False, _kind(bool)),
    "report_to": ("none", _report_to),
    "run_name": (None, _kind(str, none=True)),
    "disable_tqdm": (None, _ANY),
    "resume_from_checkpoint": (None, _kind(str, none=True)),
    # train
    "per_device_train_batch_size": (8, _kind(int)),
    "gradient_accumulation_steps": (1, _kind(int)),
    "learning_rate": (5e-5, _kind(float)),
    "num_train_epochs": (3.0, _kind(float)),
    "max_steps": (-1, _kind(int)),
    "lr_scheduler_type": ("linear", _choice(SCHEDULERS)),
    "lr_scheduler_kwargs": (None, _kind(dict, none=True)),
    "warmup_steps": (0, _kind(int, float)),
    "warmup_ratio": (None, _kind(float, none=True)),
    "weight_decay": (0.0, _kind(float)),
    "adam_beta1": (0.9, _kind(float)),
    "adam_beta2": (0.999, _kind(float)),
    "adam_epsilon": (1e-8, _kind(float)),
    "max_grad_norm": (1.0, _kind(float)),
    "optim": ("adamw_torch_fused", _only(("adamw_torch", "adamw_torch_fused"), "this engine trains with AdamW")),
    "bf16": (False, _kind(bool)),
    "fp16": (False, _kind(bool)),
    "seed": (42, _kind(int)),
    "data_seed": (None, _kind(int, none=True)),
    "deepspeed": (None, _kind(str, dict, none=True)),
    "ddp_timeout": (1800, _ANY),
    "ddp_find_unused_parameters": (None, _ANY),
    "dataloader_num_workers": (0, _ANY),
    "dataloader_pin_memory": (True, _ANY),
    # evaluation (backends.lf.eval)
    "eval_strategy": ("no", _choice(EVAL_STRATEGIES)),
    "eval_steps": (None, _kind(int, float, none=True)),
    "eval_delay": (0, _kind(int, float)),
    "eval_on_start": (False, _kind(bool)),
    "per_device_eval_batch_size": (8, _kind(int)),
    "prediction_loss_only": (False, _kind(bool)),
    "compute_accuracy": (False, _kind(bool)),
    "metric_for_best_model": (None, _kind(str, none=True)),
    "greater_is_better": (None, _kind(bool, none=True)),
    "early_stopping_steps": (None, _kind(int, none=True)),
    "restore_callback_states_from_checkpoint": (False, _kind(bool)),  # the early-stopping count on resume
    "logging_nan_inf_filter": (True, _kind(bool)),  # the eval loss leaves out non-finite batch losses
    "average_tokens_across_devices": (True, _only((True,), "the loss is the mean over every trained token of "
                                                            "the global batch")),
    "gradient_checkpointing": (False, _ANY),  # LLaMA-Factory decides it from disable_gradient_checkpointing
}

# LLaMA-Factory features not built here: feature -> {key: LF's default}. A key at its default changes
# nothing and is accepted; any other value is refused naming the feature.
UNBUILT: dict[str, dict[str, Any]] = {
    "loading the best checkpoint at the end (load_best_model_at_end)": {"load_best_model_at_end": False},
    "generation in evaluation and prediction (predict_with_generate, do_predict)": {
        "predict_with_generate": False, "do_predict": False},
    "evaluation in pure half precision (bf16_full_eval, fp16_full_eval)": {
        "bf16_full_eval": False, "fp16_full_eval": False},
    "loading or stacking LoRA adapters": {
        "adapter_name_or_path": None, "adapter_folder": None, "create_new_adapter": False,
        "additional_target": None},
    "LoRA variants (rsLoRA, DoRA, PiSSA, LoRA+, module dropout)": {
        "use_rslora": False, "use_dora": False, "pissa_init": False, "pissa_iter": 16, "pissa_convert": False,
        "loraplus_lr_ratio": None, "loraplus_lr_embedding": 1e-06, "module_dropout": 0.0},
    "OFT fine-tuning": {"oft_rank": 0, "oft_block_size": 32, "oft_target": "all"},
    "vocabulary changes (added tokens, resized embeddings)": {
        "resize_vocab": False, "add_tokens": None, "add_special_tokens": None, "new_special_tokens_config": None,
        "init_special_tokens": "noise_init", "split_special_tokens": False},
    "quantized training (QLoRA)": {
        "quantization_method": "bnb", "quantization_bit": None, "quantization_type": "nf4",
        "double_quantization": True, "quantization_device_map": None},
    "model patches (RoPE scaling, shift attention, mixture of depths, LLaMA Pro, upcasting, MoE aux loss, "
    "training from scratch)": {
        "rope_scaling": None, "shift_attn": False, "mixture_of_depths": None, "use_llama_pro": False,
        "upcast_layernorm": False, "upcast_lmhead_output": False, "moe_aux_loss_coef": None,
        "train_from_scratch": False},
    "other kernel backends (Unsloth, KTransformers, Liger, LF v1 kernels; backends.kernels is this engine's)": {
        "use_unsloth": False, "use_unsloth_gc": False, "use_kt": False, "kt_weight_path": None,
        "kt_expert_checkpoint_path": None, "kt_use_lora_experts": None, "kt_lora_expert_num": None,
        "kt_lora_expert_intermediate_size": None, "use_v1_kernels": False, "use_liger_kernel": False,
        "liger_kernel_config": None},
    "image options (pan-and-scan, crop-to-patches)": {"image_do_pan_and_scan": False, "crop_to_patches": False},
    "dataset mixing and tokenized-dataset files": {
        "buffer_size": 16384, "mix_strategy": "concat", "interleave_probs": None, "tokenized_path": None},
    "tool calling (tool_format)": {"tool_format": None},
    "loss variants (label smoothing, NEFTune, DFT, ASFT, EAFT, padding in the loss)": {
        "label_smoothing_factor": 0.0, "neftune_noise_alpha": None, "use_dft_loss": False, "use_asft_loss": False,
        "asft_alpha": 0.1, "use_eaft_loss": False, "eaft_alpha": 1.0, "ignore_pad_token_for_loss": True},
    "other optimizers (GaLore, APOLLO, BAdam, Adam-mini, Muon; this engine trains with AdamW)": {
        "optim_args": None, "optim_target_modules": None, "use_galore": False, "galore_target": "all",
        "galore_rank": 16, "galore_update_interval": 200, "galore_scale": 2.0, "galore_proj_type": "std",
        "galore_layerwise": False, "use_apollo": False, "apollo_target": "all", "apollo_rank": 16,
        "apollo_update_interval": 200, "apollo_scale": 32.0, "apollo_proj": "random", "apollo_proj_type": "std",
        "apollo_scale_type": "channel", "apollo_layerwise": False, "apollo_scale_front": False, "use_badam": False,
        "badam_mode": "layer", "badam_start_block": None, "badam_switch_mode": "ascending",
        "badam_switch_interval": 50, "badam_update_ratio": 0.05, "badam_mask_mode": "adjacent", "badam_verbose": 0,
        "use_adam_mini": False, "use_muon": False},
    "the ppo stage, separate reference / reward models, BCO and LD-DPO": {
        "pref_bco_weight": 0.0, "ppo_buffer_size": 1, "ppo_epochs": 4, "ppo_score_norm": False, "ppo_target": 6.0,
        "ppo_whiten_rewards": False, "ref_model": None, "ref_model_adapters": None, "ref_model_quantization_bit": None,
        "reward_model": None, "reward_model_adapters": None, "reward_model_quantization_bit": None,
        "reward_model_type": "lora", "ld_alpha": None},
    "other precisions (pure bf16, fp8, tf32)": {
        "pure_bf16": False, "fp8": False, "fp8_backend": "auto", "fp8_enable_fsdp_float8_all_gather": False,
        "tf32": None},
    "other distributed setups (TrainingArguments' FSDP, accelerator / parallelism configs, Ray, Megatron-Core, "
    "HyperParallel; ZeRO comes from deepspeed:)": {
        "fsdp": None, "fsdp_config": None, "accelerator_config": None, "parallelism_config": None,
        "ray_num_workers": 1, "ray_init_kwargs": None, "use_mca": False, "use_hyper_parallel": False,
        "hyper_parallel_args": None},
    "other batching (dropped last batch, automatic batch size, length-grouped sampling, skipped data on resume)": {
        "dataloader_drop_last": False, "auto_find_batch_size": False, "train_sampling_strategy": "random",
        "ignore_data_skip": False},
    "other logging (logging_strategy other than steps, SwanLab)": {
        "logging_strategy": "steps", "use_swanlab": False, "swanlab_project": "llamafactory",
        "swanlab_workspace": None, "swanlab_run_name": None, "swanlab_mode": "cloud", "swanlab_api_key": None,
        "swanlab_logdir": None, "swanlab_lark_webhook_url": None, "swanlab_lark_secret": None},
    "pushing to or loading from the Hugging Face Hub (give a local model directory)": {
        "push_to_hub": False, "hub_token": None, "hub_private_repo": None, "hub_model_id": None,
        "hub_strategy": "every_save", "hub_always_push": False, "hub_revision": None, "model_revision": "main"},
}
_UNBUILT_KEYS = {key: feature for feature, keys in UNBUILT.items() for key in keys}

# keys accepted with no effect on this engine (performance, logging, tooling, or read by other llamafactory-cli
# commands): when the file sets them, one notice line per reason naming them
_EFFECTLESS = {
    "no dataset has videos or audio (those columns are refused)": (
        "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video",
        "audio_sampling_rate"),
    "how evaluation results are moved, gathered and handed to the metrics, not what they are": (
        "eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object", "include_for_metrics",
        "batch_eval_metrics", "sortish_sampler"),
    "read by generation in evaluation (predict_with_generate, not built)": (
        "eval_num_beams", "generation_max_length", "generation_num_beams", "generation_config"),
    "generation and inference settings (llamafactory-cli chat / api / predict), not read by train": (
        "do_sample", "temperature", "top_p", "top_k", "num_beams", "max_length", "max_new_tokens",
        "repetition_penalty", "length_penalty", "skip_special_tokens", "infer_backend", "use_kv_cache", "infer_dtype",
        "offload_folder", "vllm_maxlen", "vllm_gpu_util", "vllm_enforce_eager", "vllm_max_lora_rank", "vllm_config",
        "sglang_maxlen", "sglang_mem_fraction", "sglang_tp_size", "sglang_config", "sglang_lora_backend"),
    "read by llamafactory-cli export, not train (this engine exports to output_dir)": (
        "export_dir", "export_size", "export_device", "export_quantization_bit", "export_quantization_dataset",
        "export_quantization_nsamples", "export_quantization_maxlen", "export_legacy_format", "export_hub_model_id"),
    "Hub tokens: nothing is downloaded here": ("hf_hub_token", "ms_hub_token", "om_hub_token"),
    "performance and process switches this engine sets itself": (
        "cache_dir", "low_cpu_mem_usage", "overwrite_cache", "preprocessing_num_workers", "preprocessing_batch_size",
        "data_shared_file_system", "dataloader_num_workers", "dataloader_pin_memory",
        "dataloader_persistent_workers", "dataloader_prefetch_factor", "ddp_timeout", "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "local_rank",
        "master_addr", "master_port", "use_cpu", "torch_compile", "torch_compile_backend", "torch_compile_mode",
        "torch_empty_cache_steps", "gradient_checkpointing", "gradient_checkpointing_kwargs", "use_cache",
        "full_determinism", "remove_unused_columns", "label_names", "length_column_name", "save_on_each_node",
        "enable_jit_checkpoint", "skip_memory_metrics", "debug"),
    "logging and profiling switches (this engine logs to trainer_log.jsonl and metrics.jsonl)": (
        "print_param_status", "disable_tqdm", "log_on_each_node", "log_level", "log_level_replica", "project",
        "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "include_effective_tokens_per_second",
        "enable_torch_profiler", "profiler_output_dir", "profiler_wait_steps", "profiler_warmup_steps",
        "profiler_active_steps", "profiler_repeat", "profiler_record_shapes", "profiler_profile_memory",
        "profiler_with_stack", "profile_modules"),
}
NO_EFFECT = {key: why for why, keys in _EFFECTLESS.items() for key in keys}
# ...except where LF's data depends on the chunks its batched, multi-process datasets.map makes: stage kto pairs
# each record with a neighbour's answer (backends.lf.feedback), packing fills rows chunk by chunk (backends.lf.packing)
MAP_CHUNKING = ("preprocessing_num_workers", "preprocessing_batch_size")

# the sidecar's keys (ascendfactory render writes them; a hand-written LLaMA-Factory YAML needs none)
ENGINE_KEYS: dict[str, ef.Check] = {
    "model_id": ef.text, "model_family": ef.text, "metrics_file": ef.text,
    "kernels.backend": ef.kernel_backend, "kernels.overrides": ef.kernel_overrides,
    "resume": ef.text, "exit_interval": ef.positive_int, "export_hf": ef.flag, "lora.merge_on_export": ef.flag,
}


@dataclass
class Zero:
    """What the DeepSpeed file asks: the ZeRO stage and CPU offload (FSDP2 and the shared distributed
    optimizer carry it out: 1 shards optimizer states, 2 also gradients, 3 also parameters)."""
    stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    source: str | None = None


@dataclass
class LFConfig:
    args: dict[str, Any]                       # every KEYS entry, the file's value or LLaMA-Factory's default
    zero: Zero = field(default_factory=Zero)
    engine: dict[str, Any] = field(default_factory=dict)   # the sidecar's settings
    source: str = "the training file"
    given: tuple[str, ...] = ()                # the keys the file (and its overrides) set

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["args"][key]
        except KeyError:
            raise AttributeError(key) from None

    def notices(self) -> list[str]:
        """One line per reason for the keys the file sets that change nothing here (NO_EFFECT)."""
        by_reason: dict[str, list[str]] = {}
        for key, why in NO_EFFECT.items():
            if key in self.given and not ((self.stage == "kto" or self.packing) and key in MAP_CHUNKING):
                by_reason.setdefault(why, []).append(key)
        out = [f"{', '.join(keys)}: no effect on this engine: {why}" for why, keys in by_reason.items()]
        if self.args["report_to"] in ("all", ["all"]):
            out.append(f"report_to: all: this engine writes the installed ones of tensorboard and wandb "
                       f"({', '.join(self.trackers()) or 'neither is installed'}); transformers would start every "
                       "installed integration")
        return out

    def trackers(self) -> list[str]:
        """report_to as transformers reads it: all is every installed integration (of those built here)."""
        value = self.args["report_to"]
        if value in ("all", ["all"]):
            return [t for t in TRACKERS if tracker_packages.installed(t)]
        if value in (None, "none", ["none"]):
            return []
        return list(dict.fromkeys(value if isinstance(value, list) else [value]))

    def tracker_settings(self, steps_per_epoch: int) -> TrackerSettings | None:
        """transformers' TensorBoardCallback (logging_dir, else $TENSORBOARD_LOGGING_DIR, else
        output_dir/runs/<date>_<host>) and WandbCallback (project $WANDB_PROJECT, LLaMA-Factory's default
        llamafactory; name run_name; wandb's own directory rule)."""
        chosen = self.trackers()
        if not chosen:
            return None
        tb = None
        if "tensorboard" in chosen:
            tb = self.args["logging_dir"] or os.environ.get("TENSORBOARD_LOGGING_DIR") or \
                default_runs_dir(self.args["output_dir"])
        wandb = {"project": os.environ.get("WANDB_PROJECT") or "llamafactory", "name": self.args["run_name"]} \
            if "wandb" in chosen else None
        return TrackerSettings("hf", tensorboard_dir=tb, wandb=wandb,
                               options={"logging_steps": max(1, int(self.args["logging_steps"])),
                                        "steps_per_epoch": steps_per_epoch},
                               config={k: v for k, v in self.args.items() if isinstance(v, (str, int, float, bool))})

    def names(self, key: str) -> list[str]:
        """A comma-separated key (dataset, lora_target, …) as a list."""
        value = self.args[key]
        if value is None:
            return []
        items = value if isinstance(value, list) else str(value).split(",")
        return [str(v).strip() for v in items if str(v).strip()]


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, [*KEYS, *NO_EFFECT, *_UNBUILT_KEYS], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{key}: not a LLaMA-Factory 0.9.5 training key{hint}"


def read_deepspeed(value: str | Mapping, base: Path) -> Zero:
    """The ZeRO settings of a DeepSpeed config: a mapping, or a path, a relative one read from `base` (the
    working directory, as transformers' TrainingArguments opens it under llamafactory-cli)."""
    source = "deepspeed"
    if not isinstance(value, Mapping):
        path = Path(value) if Path(value).is_absolute() else base / value
        source = str(path)
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise LFConfigError(f"deepspeed: {path} does not exist; give the path of a DeepSpeed JSON "
                                "(ascendfactory render writes ds_z<N>_config.json next to the training file)") from None
        except (OSError, json.JSONDecodeError) as err:
            raise LFConfigError(f"deepspeed: cannot read {path}: {err}") from None
    zero = value.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise LFConfigError(f"{source}: zero_optimization must be a mapping")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise LFConfigError(f"{source}: zero_optimization.stage must be 0, 1, 2 or 3, not {stage!r}")

    def offload(name: str) -> bool:
        device = (zero.get(name) or {}).get("device", "none")
        if device not in ("none", "cpu"):
            raise LFConfigError(f"{source}: zero_optimization.{name}.device {device!r}: only cpu offload is built "
                                "(NVMe offload is not)")
        return device == "cpu"

    z = Zero(stage, offload("offload_optimizer"), offload("offload_param"), source)
    if z.offload_param and stage < 3:
        raise LFConfigError(f"{source}: offload_param needs zero_optimization.stage 3 (parameters are sharded "
                            "only there)")
    return z


def _check_rules(args: dict[str, Any]) -> list[str]:
    """LLaMA-Factory's own cross-key rules (hparams/parser.py) and what this engine needs: every problem."""
    problems = []
    if not args["model_name_or_path"]:
        problems.append("model_name_or_path is required: a Hugging Face model directory")
    if not args["dataset"]:
        problems.append("dataset is required: one or more names from dataset_info.json in dataset_dir")
    if not args["output_dir"]:
        problems.append("output_dir is required")
    if args["stage"] != "sft" and (args["neat_packing"] or args["train_on_prompt"] or args["mask_history"]):
        problems.append("neat_packing, train_on_prompt and mask_history apply to stage sft only (as in LLaMA-Factory)")
    if args["bf16"] and args["fp16"]:
        problems.append("bf16 and fp16 exclude each other")
    if args["max_steps"] <= 0 and args["num_train_epochs"] <= 0:
        problems.append("give max_steps > 0 or num_train_epochs > 0")
    if args["packing"] and args["cutoff_len"] < 2:
        problems.append(f"cutoff_len must be at least 2 with packing (LLaMA-Factory packs into cutoff_len - 1), "
                        f"not {args['cutoff_len']}")
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "cutoff_len", "lora_rank"):
        if args[key] < 1:
            problems.append(f"{key} must be at least 1, not {args[key]}")
    if not 0 <= args["lora_dropout"] < 1:
        problems.append(f"lora_dropout must be in [0, 1), not {args['lora_dropout']}")
    if args["learning_rate"] <= 0:
        problems.append(f"learning_rate must be positive, not {args['learning_rate']}")
    problems += tracker_packages.missing("report_to", LFConfig(args).trackers())
    return problems + _eval_rules(args)


def _eval_rules(args: dict[str, Any]) -> list[str]:
    """LLaMA-Factory's and TrainingArguments' rules for the evaluation keys (do_eval follows eval_strategy)."""
    problems = []
    held_out = args["val_size"] > 1e-6
    if held_out and args["eval_dataset"]:
        problems.append("val_size and eval_dataset exclude each other (LLaMA-Factory: cannot specify val_size if "
                        "eval_dataset is given)")
    if (args["do_eval"] or args["eval_strategy"] != "no") and not (held_out or args["eval_dataset"]):
        problems.append("do_eval / eval_strategy: evaluation needs eval_dataset or val_size > 0")
    steps = args["eval_steps"]
    if steps is not None and (steps < 0 or (steps > 1 and steps != int(steps))):
        problems.append(f"eval_steps must be a positive integer, or a fraction of the run below 1, not {steps}")
    if args["per_device_eval_batch_size"] < 1:
        problems.append(f"per_device_eval_batch_size must be at least 1, not {args['per_device_eval_batch_size']}")
    if args["early_stopping_steps"] is not None and (args["metric_for_best_model"] is None
                                                     or args["eval_strategy"] == "no"):
        problems.append("early_stopping_steps needs metric_for_best_model and an eval_strategy of steps or epoch "
                        "(transformers' EarlyStoppingCallback)")
    if args["metric_for_best_model"] and args["save_total_limit"] and args["save_strategy"] == "steps":
        problems.append("metric_for_best_model with save_total_limit: keeping the best checkpoint out of the "
                        "rotation is not built; drop one of them")
    return problems


def _refuse(source: str, problems: list[str]) -> None:
    """One line per problem, each naming its key (the whole file is checked before anything is refused)."""
    if problems:
        raise LFConfigError("\n".join(f"{source}: {p}" for p in problems))


def read_training_file(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The training YAML with `key=value` overrides, read as llamafactory-cli reads them: OmegaConf.load,
    OmegaConf.from_cli merged over it (OmegaConf's YAML: `1e-4` is a float, not text)."""
    import yaml

    from backends.common import omegaconf_yaml

    path = Path(path)
    try:
        tree = omegaconf_yaml.load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LFConfigError(f"{path}: no such training file") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise LFConfigError(f"{path}: cannot read it as YAML: {err}") from None
    tree = {} if tree is None else tree
    if not isinstance(tree, Mapping):
        raise LFConfigError(f"{path}: expected a mapping of LLaMA-Factory keys, got {type(tree).__name__}")
    tree = dict(tree)
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"{item!r}: give overrides as key=value")
            continue
        tree[key.strip()] = omegaconf_yaml.value(value)
    _refuse("the command line", problems)
    return tree


def parse_config(train_file: str | Path | Mapping, engine: Mapping | str | Path | None = None, *,
                 base: Path | None = None, source: str | None = None) -> LFConfig:
    """The training YAML (a path, or its mapping), its DeepSpeed file and the sidecar, checked; every
    problem of the file refused at once, one line each.
    base: where a relative `deepspeed` path is read from (default: the working directory, as in LLaMA-Factory)."""
    base, source = base or Path.cwd(), source or "the training file"
    if not isinstance(train_file, Mapping):
        source = str(train_file)
        train_file = read_training_file(train_file)
    problems = [_unknown(str(k)) for k in train_file if k not in KEYS and k not in NO_EFFECT
                and k not in _UNBUILT_KEYS]
    args = {key: default for key, (default, _) in KEYS.items()}
    for key, value in train_file.items():
        if key in _UNBUILT_KEYS:
            if value != UNBUILT[_UNBUILT_KEYS[key]][key]:
                problems.append(f"{key}: {value!r} asks for {_UNBUILT_KEYS[key]}, which backends.lf does not build; "
                                "remove it, or train with LLaMA-Factory itself")
            continue
        if key not in KEYS:
            continue
        want = KEYS[key][1](value)
        if want:
            problems.append(f"{key} must be {want}, not {value!r}")
        args[key] = value
    _refuse(source, problems)
    if args["lora_alpha"] is None:
        args["lora_alpha"] = args["lora_rank"] * 2  # LLaMA-Factory's default
    if args["neat_packing"]:
        args["packing"] = True
    if args["packing"] is None:
        args["packing"] = args["stage"] == "pt"  # LLaMA-Factory packs pre-training by default
    _refuse(source, _check_rules(args))
    if train_file.get("packing") or args["neat_packing"]:  # LF's DataArguments: packing set in the file lowers
        args["cutoff_len"] -= 1                               # cutoff_len by one (pt's default packing does not)
    try:
        side, side_source = ef.read_engine_file(ENGINE_KEYS, engine)
    except ef.EngineFileError as err:
        raise LFConfigError(str(err)) from None
    zero = read_deepspeed(args["deepspeed"], base) if args["deepspeed"] else Zero()
    return LFConfig(args, zero, side, source, tuple(k for k in train_file if k in KEYS or k in NO_EFFECT))
