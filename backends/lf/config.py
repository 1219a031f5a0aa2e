"""The LLaMA-Factory dialect: the training YAML that `llamafactory-cli train` reads (0.9.5 keys),
the DeepSpeed JSON its `deepspeed:` names, and the engine sidecar (engine.yaml) for what LLaMA-Factory
has no key for (model card, kernels, metrics file, resume policy).

Every key is either implemented, accepted at the values that change nothing here (a logger set to
none, a worker count), or refused by name with what to do: never read and ignored.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from backends.common import engine_file as ef

STAGES = ("pt", "sft", "dpo")
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


def _only(values: tuple, why: str) -> Callable[[Any], str | None]:
    """Accepted only at values that change nothing (why: what this engine does instead)."""
    def check(value):
        return None if value in values else f"{' or '.join(map(repr, values))} here: {why}"
    return check


_ANY = lambda value: None  # noqa: E731  (no effect on training here: workers, log dirs, timeouts)
_NO_EVAL = "this engine trains only (no evaluation split or loop); evaluate the exported model separately"

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
    "stage": ("sft", _choice(STAGES, " (this engine trains pt, sft and dpo)")),
    "do_train": (False, _only((True,), "set do_train: true; this engine trains")),
    "do_eval": (False, _only((False,), _NO_EVAL)),
    "do_predict": (False, _only((False,), _NO_EVAL)),
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
    "default_system": (None, _kind(str, none=True)),
    "val_size": (0.0, _only((0, 0.0), _NO_EVAL)),
    "streaming": (False, _only((False,), "the dataset is tokenized once into a memory-mapped cache")),
    "overwrite_cache": (False, _ANY),
    "preprocessing_num_workers": (None, _ANY),
    "preprocessing_batch_size": (1000, _ANY),
    # output
    "output_dir": (None, _kind(str)),
    "overwrite_output_dir": (False, _kind(bool)),
    "logging_steps": (500, _kind(int, float)),
    "logging_first_step": (False, _ANY),
    "logging_dir": (None, _ANY),
    "save_strategy": ("steps", _choice(("steps", "no"))),
    "save_steps": (500, _kind(int, float)),
    "save_total_limit": (None, _kind(int, none=True)),
    "save_only_model": (False, _kind(bool)),
    "report_to": ("none", _only(("none", [], ["none"], None), "this engine logs to trainer_log.jsonl and "
                                                              "metrics.jsonl in output_dir")),
    "run_name": (None, _ANY),
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
    "average_tokens_across_devices": (True, _only((True,), "the loss is the mean over every trained token of "
                                                            "the global batch")),
    "gradient_checkpointing": (False, _ANY),  # LLaMA-Factory decides it from disable_gradient_checkpointing
}

# keys accepted with no effect on this engine: when the file sets them, one notice line (key -> why)
NO_EFFECT = {key: "no dataset has videos (a videos column is refused)"
             for key in ("video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen")}

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
            if key in self.given:
                by_reason.setdefault(why, []).append(key)
        return [f"{', '.join(keys)}: no effect on this engine: {why}" for why, keys in by_reason.items()]

    def names(self, key: str) -> list[str]:
        """A comma-separated key (dataset, lora_target, …) as a list."""
        value = self.args[key]
        if value is None:
            return []
        items = value if isinstance(value, list) else str(value).split(",")
        return [str(v).strip() for v in items if str(v).strip()]


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, KEYS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (f"{key}: backends.lf does not implement this key{hint} (it reads {len(KEYS)} LLaMA-Factory keys; "
            f"remove it, or train with LLaMA-Factory itself)")


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
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "cutoff_len", "lora_rank"):
        if args[key] < 1:
            problems.append(f"{key} must be at least 1, not {args[key]}")
    if not 0 <= args["lora_dropout"] < 1:
        problems.append(f"lora_dropout must be in [0, 1), not {args['lora_dropout']}")
    if args["learning_rate"] <= 0:
        problems.append(f"learning_rate must be positive, not {args['learning_rate']}")
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
    problems = [_unknown(str(k)) for k in train_file if k not in KEYS]
    args = {key: default for key, (default, _) in KEYS.items()}
    for key, value in train_file.items():
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
    try:
        side, side_source = ef.read_engine_file(ENGINE_KEYS, engine)
    except ef.EngineFileError as err:
        raise LFConfigError(str(err)) from None
    zero = read_deepspeed(args["deepspeed"], base) if args["deepspeed"] else Zero()
    return LFConfig(args, zero, side, source, tuple(k for k in train_file if k in KEYS))
