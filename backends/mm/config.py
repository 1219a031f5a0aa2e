"""The MindSpeed-MM dialect (Megatron flags + `--mm-data data.json` + `--mm-model model.json`, plus
AscendFactory's engine.yaml) → the engine's typed configuration, `MMConfig`.

This is the only module that knows the flag spellings and the JSON key names. The JSON files are
MindSpeed-MM's own (examples/qwen2.5vl/data_*.json, model_*.json): every key of theirs is known here
and is either used (a setting), checked against the model (a fact about the architecture), accepted
because it cannot change the numbers (dtype spellings, fusions, loader workers), or refused by name
when its value asks for something this engine does not build. An unknown key is refused by name.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.common import engine_file as ef
from backends.common import megatron_args
from backends.common.trackers import megatron_flag_settings
from backends.contract import megatron
from backends.contract.megatron import CP_ALGO_DEFAULT_MINDSPEED, CP_ALGO_FLAGS


class ConfigError(ValueError):
    """A flag or key the engine cannot accept; the message names it and says what to do."""


# ------------------------------------------------------------------------------------------ typed config


@dataclass
class Part:
    """One part of the model as model.json lists it."""
    freeze: bool = False
    pipeline_num_layers: list[int] | None = None
    # recompute of this part: model.json's recompute_granularity / _method / _num_layers where the part sets
    # them (MindSpeed-MM builds each part's TransformerConfig from its model.json entry, the Megatron flags
    # filling what it leaves out), else the flags
    recompute: str = "none"
    recompute_method: str | None = None
    recompute_num_layers: int | None = None


@dataclass
class DataArgs:
    dataset: str
    dataset_dir: str
    processor_dir: str
    template: str = "qwen2vl"
    image_max_pixels: int = 262144
    image_min_pixels: int = 0
    max_samples: int | None = None
    messages: str = "messages"
    images: str = "images"
    role_tag: str = "role"
    content_tag: str = "content"
    user_tag: str = "user"
    assistant_tag: str = "assistant"
    system_tag: str | None = None
    shuffle: bool = True
    seq_len: int = 1024


@dataclass
class ParallelArgs:
    tp: int = 1
    pp: int = 1
    sp: bool = False
    distributed_optimizer: bool = False
    recompute: str = "none"
    recompute_method: str | None = None
    recompute_num_layers: int | None = None


@dataclass
class TrainArgs:
    micro_batch: int
    global_batch: int
    steps: int | None
    epochs: float | None
    lr: float
    min_lr: float
    schedule: str
    warmup: int
    warmup_fraction: float | None
    weight_decay: float
    betas: tuple[float, float]
    eps: float                 # --adam-eps
    grad_clip: float
    precision: str
    seed: int
    log_interval: int
    save_interval: int | None
    exit_interval: int | None = None
    per_token_loss: bool = False   # --calculate-per-token-loss: the global token mean, not each micro-batch's


@dataclass
class MMConfig:
    arch: dict[str, Any]                   # VLConfig.from_hf-style facts read from model.json
    parts: dict[str, Part]                 # vision_encoder, vision_projector, text_decoder
    data: DataArgs
    parallel: ParallelArgs
    train: TrainArgs
    model_id: str | None = None            # engine.yaml: a model card (random init from model.json)
    load_hf: str | None = None             # engine.yaml / --load of an HF directory: the weights
    save: str | None = None
    load: str | None = None                # a checkpoints root or step_N to resume
    partial_load: tuple[str, ...] = ()     # --no-load-optim / --no-load-rng (refused where --load resumes)
    kernel_backend: str = "auto"
    kernel_overrides: dict[str, str] = field(default_factory=dict)
    flash_attention: bool = False
    metrics_file: str | None = None
    export_hf: str | None = None
    init_std: float = 0.02
    trackers: Any = None                   # backends.common.trackers.TrackerSettings: --tensorboard-dir, --wandb-* …


# ------------------------------------------------------------------------------------------ flags


def _parser() -> megatron_args.Parser:
    """MindSpeed-MM's flags: its own and the Megatron ones backends.llm reads too (backends.contract.megatron)."""
    p = megatron_args.Parser("python -m backends.mm", ConfigError)
    a = p.add_argument
    a("--mm-data", required=True)
    a("--mm-model", required=True)
    megatron_args.add(p, megatron.PARALLEL)
    a("--context-parallel-algo", choices=[CP_ALGO_FLAGS["ulysses"]], default=CP_ALGO_DEFAULT_MINDSPEED)
    megatron_args.add(p, megatron.BATCH)
    a("--tokenizer-type", choices=["NullTokenizer"])
    megatron_args.add(p, megatron.SEQUENCE)  # required: between --global-batch-size and --lr in argparse's message
    megatron_args.add(p, megatron.MODEL)
    megatron_args.add(p, megatron.OPTIMIZER)
    megatron_args.add(p, megatron.PRECISION)
    megatron_args.add(p, megatron.RUN)
    megatron_args.add(p, megatron.TRACKERS)
    a("--no-load-optim", action="store_true")  # refused when --load resumes an engine checkpoint
    a("--no-load-rng", action="store_true")
    a("--calculate-per-token-loss", action="store_true")
    a("--calculate-per-sample-loss", action="store_true")  # refused: see parse_args
    megatron_args.add_no_effect(p, "mm")  # --mm-tool (the profiler settings file) and the other no-effect flags
    return p


# what the refusal of these flags says instead of a near spelling (finetune_qwen2_5_vl_72b_fsdp.sh sets them)
_FSDP2 = "MindSpeed-MM's FSDP2 training is not built in backends.mm; use --use-distributed-optimizer (ZeRO-1)"
_HINTS = {"--use-torch-fsdp2": _FSDP2, "--fsdp2-config-path": _FSDP2}


def supported_flags() -> list[str]:
    return megatron_args.supported_flags(_parser())


# ------------------------------------------------------------------------------------------ JSON keys
# how each key of MindSpeed-MM's files is taken: "use" (a setting read below), ("fact", attr) (must equal
# the model's attr), ("only", allowed values) (any other value asks for an unbuilt feature), "any"
# (cannot change the numbers). Nested dicts are sub-tables.

_DTYPE = {k: "any" for k in ("fp16", "bf16", "params_dtype")}
# Megatron TransformerConfig fields a part may set for itself (the vision encoder and the text decoder)
_RECOMPUTE = {k: "use" for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")}
VISION_KEYS = {
    "model_id": ("only", ("qwen2vit",)), "num_layers": ("fact", "vision.depth"),
    "hidden_size": ("fact", "vision.hidden_size"), "ffn_hidden_size": ("fact", "vision.intermediate_size"),
    "intermediate_size": ("fact", "vision.intermediate_size"), "llm_hidden_size": "any",
    "gated_linear_unit": ("only", (True,)), "num_attention_heads": ("fact", "vision.num_heads"),
    "hidden_dropout": ("only", (0, 0.0)), "attention_dropout": ("only", (0, 0.0)),
    "in_channels": ("fact", "vision.in_channels"), "patch_size": ("fact", "vision.patch_size"),
    "spatial_merge_size": ("fact", "vision.spatial_merge_size"),
    "temporal_patch_size": ("fact", "vision.temporal_patch_size"), "layernorm_epsilon": ("fact", "vision.rms_norm_eps"),
    "normalization": ("only", ("RMSNorm",)), "activation_func": ("only", ("silu",)), "freeze": "use",
    "use_fused_rotary_pos_emb": "any", "post_layer_norm": ("only", (False,)), "pipeline_num_layers": "use",
    "tokens_per_second": ("fact", "vision.tokens_per_second"), "window_attn_size": ("fact", "vision.window_size"),
    "fullatt_block_indexes": ("fact", "vision.fullatt_block_indexes"), "attention_mask_type": ("only", ("general",)),
    "bias_activation_fusion": "any", **_RECOMPUTE, **_DTYPE,
}
PROJECTOR_KEYS = {
    "model_id": ("only", ("lnmlp",)), "num_layers": ("only", (1,)), "gated_linear_unit": ("only", (False,)),
    "bias_activation_fusion": "any", "add_bias_linear": ("only", (True,)), "input_size": ("fact", "vision.hidden_size"),
    "hidden_size": ("fact", "vision.out_hidden_size"), "ffn_hidden_size": ("fact", "merger_hidden"),
    "activation_func": ("only", ("gelu",)), "freeze": "use", "layernorm_epsilon": ("only", (1e-6,)),
    "normalization": ("only", ("RMSNorm",)), **_DTYPE,
}
TEXT_KEYS = {
    "model_id": ("only", ("qwen2_5_lm",)), "num_layers": ("fact", "text.num_layers"), "pipeline_num_layers": "use",
    "freeze": "use",  # MindSpeed-MM's VL models read config.text_decoder.freeze (absent: false)
    "hidden_size": ("fact", "text.hidden_size"), "ffn_hidden_size": ("fact", "text.ffn_hidden_size"),
    "num_attention_heads": ("fact", "text.num_attention_heads"), "seq_length": "any",
    "max_position_embeddings": ("fact", "text.max_position_embeddings"), "vocab_size": ("fact", "text.vocab_size"),
    "rope_theta": ("fact", "text.rope_theta"), "untie_embeddings_and_output_weights": ("fact", "untied"),
    "disable_bias_linear": ("only", (True,)), "attention_dropout": ("only", (0, 0.0)), "init_method_std": "use",
    "hidden_dropout": ("only", (0, 0.0)), "position_embedding_type": ("only", ("mrope",)),
    "normalization": ("only", ("RMSNorm",)), "activation_func": ("only", ("silu",)), "use_fused_rotary_pos_emb": "any",
    "attention_softmax_in_fp32": "any", "parallel_output": "any", "group_query_attention": ("only", (True,)),
    "num_query_groups": ("fact", "text.num_kv_heads"), "mrope_section": ("fact", "text.mrope_section"),
    "rope_scaling": ("only", (None,)), "gated_linear_unit": ("only", (True,)),
    "layernorm_epsilon": ("fact", "text.rms_norm_eps"), "add_bias_linear": ("only", (False,)),
    "add_qkv_bias": ("only", (True,)), "use_remove_padding": "any", "bias_activation_fusion": "any", **_RECOMPUTE,
    **_DTYPE,
}
MODEL_KEYS = {
    "model_id": ("only", ("qwen2_5vl",)), "img_context_token_id": ("fact", "image_token_id"),
    "vision_start_token_id": ("fact", "vision_start_token_id"),
    "image_encoder": {"vision_encoder": VISION_KEYS, "vision_projector": PROJECTOR_KEYS},
    "text_decoder": TEXT_KEYS, "text_encoder": ("only", (None,)), "video_encoder": ("only", (None,)),
    "patch": {"bridge_patch": ("only", (False,))},
}
DATA_KEYS = {
    "dataset_param": {
        "dataset_type": ("only", ("huggingface",)),
        "preprocess_parameters": {
            "model_name_or_path": "use", "use_fast_tokenizer": "any", "split_special_tokens": ("only", (False,)),
            "image_max_pixels": "use", "image_min_pixels": "use", "video_max_pixels": "any",
            "video_min_pixels": "any", "video_fps": "any", "video_maxlen": "any",
        },
        "basic_parameters": {
            "template": ("only", ("qwen2vl",)), "dataset_dir": "use", "dataset": "use", "cache_dir": "any",
            "train_on_prompt": ("only", (False,)), "mask_history": ("only", (False,)),
            "preprocessing_batch_size": "any", "preprocessing_num_workers": "any", "max_samples": "use",
            "tool_format": ("only", (None,)),
        },
        "attr": {
            "system": ("only", (None,)), "images": "use", "videos": ("only", (None,)), "messages": "use",
            "role_tag": "use", "content_tag": "use", "user_tag": "use", "assistant_tag": "use",
            "observation_tag": ("only", (None,)), "function_tag": ("only", (None,)), "system_tag": "use",
        },
    },
    "dataloader_param": {
        "dataloader_mode": ("only", ("sampler",)), "drop_last": "use", "sampler_type": ("only", ("BaseRandomBatchSampler",)),
        "collate_param": {"model_name": ("only", ("qwen2vl",)), "ignore_pad_token_for_loss": ("only", (True,))},
        "pin_memory": "any", "shuffle": "use",
    },
}


def _walk(tree: Mapping, table: Mapping, where: str, facts: dict[str, tuple[str, Any]], source: str) -> None:
    """Refuse unknown keys and unbuilt values by their dotted path; collect the facts."""
    for key, value in tree.items():
        path = f"{where}.{key}" if where else key
        rule = table.get(key)
        if rule is None:
            close = difflib.get_close_matches(key, list(table), n=1)
            raise ConfigError(f"{source}: key {path} is not one this engine implements"
                              + (f" (did you mean {close[0]}?)" if close else f"; known here: {', '.join(table)}"))
        if isinstance(rule, Mapping):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: {path} must be an object, not {value!r}")
            _walk(value, rule, path, facts, source)
        elif isinstance(rule, tuple) and rule[0] == "only":
            if not any(_same(value, v) for v in rule[1]):
                raise ConfigError(f"{source}: {path} = {json.dumps(value)} is not built by backends.mm "
                                  f"(it takes {' or '.join(json.dumps(v) for v in rule[1])})")
        elif isinstance(rule, tuple) and rule[0] == "fact":
            facts[path] = (rule[1], value)


def _same(value: Any, want: Any) -> bool:
    """JSON equality that keeps true apart from 1 and null apart from false."""
    if want is None or isinstance(want, bool):
        return value is want
    if isinstance(want, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == want
    return value == want


def _read_json(path: str, flag: str) -> dict:
    try:
        tree = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot read it ({err.strerror or err})") from None
    except ValueError as err:
        raise ConfigError(f"{flag} {path}: not valid JSON ({err})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{flag} {path}: expected a JSON object")
    return tree


def _get(tree: Mapping, dotted: str, default=None):
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def model_facts(vl) -> dict[str, Any]:
    """The fact names of the key tables on a backends.models.qwen2_5_vl VLConfig."""
    t, v = vl.text, vl.vision
    out = {f"text.{k}": getattr(t, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                                  "max_position_embeddings", "vocab_size", "rope_theta",
                                                  "num_kv_heads", "rms_norm_eps")}
    out["text.mrope_section"] = list(t.mrope_section)
    out.update({f"vision.{k}": getattr(v, k) for k in ("depth", "hidden_size", "intermediate_size", "num_heads",
                                                         "in_channels", "patch_size", "spatial_merge_size",
                                                         "temporal_patch_size", "rms_norm_eps", "tokens_per_second",
                                                         "window_size", "out_hidden_size")})
    out["vision.fullatt_block_indexes"] = list(v.fullatt_block_indexes)
    out["merger_hidden"] = v.hidden_size * v.spatial_merge_size ** 2
    out["untied"] = not t.tie_word_embeddings
    out["image_token_id"] = vl.image_token_id
    out["vision_start_token_id"] = vl.vision_start_token_id
    return out


def arch_from_model_json(tree: Mapping) -> dict[str, Any]:
    """A transformers-style config dict (VLConfig.from_hf reads it) from model.json: random init."""
    v = _get(tree, "image_encoder.vision_encoder", {})
    pr = _get(tree, "image_encoder.vision_projector", {})
    t = tree.get("text_decoder") or {}
    missing = [f"text_decoder.{k}" for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                              "vocab_size") if k not in t]
    missing += [f"image_encoder.vision_encoder.{k}" for k in ("num_layers", "hidden_size", "num_attention_heads")
                if k not in v]
    if missing:
        raise ConfigError(f"model.json lacks {', '.join(missing)} (needed to build the model without load_hf)")
    heads = t["num_attention_heads"]
    return {
        "model_type": "qwen2_5_vl", "image_token_id": tree.get("img_context_token_id", 151655),
        "vision_start_token_id": tree.get("vision_start_token_id"),
        "tie_word_embeddings": not t.get("untie_embeddings_and_output_weights", False),
        "text_config": {
            "num_hidden_layers": t["num_layers"], "hidden_size": t["hidden_size"],
            "intermediate_size": t["ffn_hidden_size"], "num_attention_heads": heads,
            "num_key_value_heads": t.get("num_query_groups", heads), "vocab_size": t["vocab_size"],
            "rms_norm_eps": t.get("layernorm_epsilon", 1e-6),
            "max_position_embeddings": t.get("max_position_embeddings", 128000),
            "initializer_range": t.get("init_method_std", 0.02),
            "rope_parameters": {"rope_type": "default", "rope_theta": t.get("rope_theta", 1000000.0),
                                "mrope_section": t.get("mrope_section", [16, 24, 24])},
        },
        "vision_config": {
            "depth": v["num_layers"], "hidden_size": v["hidden_size"],
            "intermediate_size": v.get("intermediate_size", v.get("ffn_hidden_size")),
            "num_heads": v["num_attention_heads"], "out_hidden_size": pr.get("hidden_size", t["hidden_size"]),
            "patch_size": v.get("patch_size", 14), "spatial_merge_size": v.get("spatial_merge_size", 2),
            "temporal_patch_size": v.get("temporal_patch_size", 2), "in_channels": v.get("in_channels", 3),
            "window_size": v.get("window_attn_size", 112),
            "fullatt_block_indexes": v.get("fullatt_block_indexes", [7, 15, 23, 31]),
            "tokens_per_second": v.get("tokens_per_second", 2),
        },
    }


def check_facts(facts: dict[str, tuple[str, Any]], vl, source: str) -> None:
    """Every architecture number model.json states must be the model's (config.json or model.json itself)."""
    have = model_facts(vl)
    for path, (name, value) in facts.items():
        want = have[name]
        same = (list(value) == list(want)) if isinstance(want, list) and isinstance(value, list) else \
            (float(value) == float(want) if isinstance(want, float) and value is not None else value == want)
        if not same:
            raise ConfigError(f"model.json {path} = {json.dumps(value)}, but {source} has {json.dumps(want)}; make "
                              "them agree (or re-render the job from this model directory)")


_GRANULARITY = {None: "none", "full": "full", "selective": "selective"}


def _part_recompute(node: Mapping, path: str, flags: tuple[str, str | None, int | None]):
    """(granularity, method, num_layers) of one part: its model.json keys where it has them, else the flags."""
    if not any(k in node for k in _RECOMPUTE):
        return flags
    g = node.get("recompute_granularity", flags[0] if flags[0] != "none" else None)
    if g not in _GRANULARITY:
        raise ConfigError(f"model.json {path}.recompute_granularity = {json.dumps(g)} is not one of \"full\", "
                          "\"selective\", null")
    if g != "full" and ("recompute_method" in node or "recompute_num_layers" in node):
        raise ConfigError(f"model.json {path}.recompute_method / recompute_num_layers apply to recompute_granularity "
                          "\"full\" only")
    method, n = node.get("recompute_method", flags[1]), node.get("recompute_num_layers", flags[2])
    if method not in (None, "uniform", "block"):
        raise ConfigError(f"model.json {path}.recompute_method = {json.dumps(method)} is not \"uniform\" or \"block\"")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ConfigError(f"model.json {path}.recompute_num_layers must be a positive whole number, not {n!r}")
    return _GRANULARITY[g], (method if g == "full" else None), (n if g == "full" else None)


def _parts(tree: Mapping, flags: tuple[str, str | None, int | None] = ("none", None, None)) -> dict[str, Part]:
    out = {}
    for name, path in (("vision_encoder", "image_encoder.vision_encoder"),
                       ("vision_projector", "image_encoder.vision_projector"), ("text_decoder", "text_decoder")):
        node = _get(tree, path, {}) or {}
        freeze = node.get("freeze", False)
        if not isinstance(freeze, bool):
            raise ConfigError(f"model.json {path}.freeze must be true or false, not {freeze!r}")
        pnl = node.get("pipeline_num_layers")
        if pnl is not None and (not isinstance(pnl, list) or not all(isinstance(x, int) and x >= 0 for x in pnl)):
            raise ConfigError(f"model.json {path}.pipeline_num_layers must be a list of layer counts, not {pnl!r}")
        rc = _part_recompute(node, path, flags) if name != "vision_projector" else ("none", None, None)
        out[name] = Part(freeze=freeze, pipeline_num_layers=pnl, recompute=rc[0], recompute_method=rc[1],
                         recompute_num_layers=rc[2])
    if all(p.freeze for p in out.values()):
        raise ConfigError("model.json freezes every part (vision_encoder, vision_projector, text_decoder): nothing "
                          "would train")
    return out


def check_pipeline(parts: dict[str, Part], pp: int, vision_layers: int, text_layers: int) -> None:
    """pipeline_num_layers: one entry per stage (--pipeline-model-parallel-size), summing to the part's layers."""
    for name, layers in (("vision_encoder", vision_layers), ("text_decoder", text_layers)):
        pnl = parts[name].pipeline_num_layers
        where = ("image_encoder.vision_encoder" if name == "vision_encoder" else "text_decoder") + ".pipeline_num_layers"
        if pnl is None:
            if pp > 1:
                raise ConfigError(f"model.json {where} is missing: with --pipeline-model-parallel-size {pp} each part "
                                  f"lists its layers per stage")
            continue
        if len(pnl) != pp:
            raise ConfigError(f"model.json {where} = {pnl} has {len(pnl)} stages, but --pipeline-model-parallel-size "
                              f"is {pp}")
        if sum(pnl) != layers:
            raise ConfigError(f"model.json {where} = {pnl} sums to {sum(pnl)}, but the {name} has {layers} layers")


# ------------------------------------------------------------------------------------------ engine.yaml

_ENGINE_KEYS = {"model_id": ef.text, "model_family": ef.text, "load_hf": ef.text, "metrics_file": ef.text,
                "export_hf": ef.text, "train_epochs": ef.positive_number, "kernels.backend": ef.kernel_backend,
                "kernels.overrides": ef.kernel_overrides}


def parse_args(argv: list[str], engine: Mapping | str | Path | None = None) -> MMConfig:
    ns = megatron_args.parse(_parser(), argv, "MindSpeed-MM", _HINTS, engine="mm")
    try:
        side, source = ef.read_engine_file(_ENGINE_KEYS, engine)
    except ef.EngineFileError as err:
        raise ConfigError(str(err)) from None
    if ns.context_parallel_size != 1:
        raise ConfigError(f"--context-parallel-size {ns.context_parallel_size}: backends.mm does not build context "
                          "parallel; set it to 1")
    if ns.bf16 and ns.fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other")
    if ns.calculate_per_sample_loss:
        raise ConfigError("--calculate-per-sample-loss: MindSpeed-MM's per-sample mean (each sample's token mean, "
                          "averaged over the micro-batch) is not built; drop it for the micro-batch token mean, or "
                          "give --calculate-per-token-loss")
    if ns.train_iters is None and side.get("train_epochs") is None:
        raise ConfigError(f"give --train-iters, or train_epochs in {source}")
    trackers, problems, tracker_notices = megatron_flag_settings("mindspeed_mm", ns)
    if problems:
        raise ConfigError("\n".join(problems))
    if os.environ.get("RANK", "0") == "0":
        for line in tracker_notices:
            print(f"python -m backends.mm: {line}", file=sys.stderr)
    model_tree, data_tree = _read_json(ns.mm_model, "--mm-model"), _read_json(ns.mm_data, "--mm-data")
    facts: dict[str, tuple[str, Any]] = {}
    _walk(model_tree, MODEL_KEYS, "", facts, f"--mm-model {ns.mm_model}")
    _walk(data_tree, DATA_KEYS, "", {}, f"--mm-data {ns.mm_data}")
    if ns.recompute_granularity != "full" and (ns.recompute_method or ns.recompute_num_layers):
        raise ConfigError("--recompute-method / --recompute-num-layers apply to --recompute-granularity full only")
    parts = _parts(model_tree, (ns.recompute_granularity or "none", ns.recompute_method, ns.recompute_num_layers))
    load_hf = side.get("load_hf")
    if ns.load and (Path(ns.load) / "config.json").is_file():  # MindSpeed-MM's --load of a converted model
        load_hf, ns.load = load_hf or ns.load, None
    from backends.models.qwen2_5_vl import VLConfig
    from backends.models.qwen2_5_vl.config import ConfigError as ModelConfigError

    try:
        if load_hf:
            from backends.common.checkpoint.hf_io import read_config

            vl, arch_source = VLConfig.from_hf(read_config(load_hf)), f"{load_hf}/config.json"
        else:
            vl, arch_source = VLConfig.from_hf(arch_from_model_json(model_tree)), "model.json"
    except (ModelConfigError, FileNotFoundError, KeyError) as err:
        raise ConfigError(f"the model: {err}") from None
    check_facts(facts, vl, arch_source)
    if ns.vocab_size is not None and ns.vocab_size != vl.text.vocab_size:
        raise ConfigError(f"--vocab-size {ns.vocab_size}, but {arch_source} has vocab_size {vl.text.vocab_size}")
    pp = ns.pipeline_model_parallel_size
    check_pipeline(parts, pp, vl.vision.depth, vl.text.num_layers)
    pre = _get(data_tree, "dataset_param.preprocess_parameters", {}) or {}
    basic = _get(data_tree, "dataset_param.basic_parameters", {}) or {}
    attr = _get(data_tree, "dataset_param.attr", {}) or {}
    loader = data_tree.get("dataloader_param") or {}
    if not basic.get("dataset"):
        raise ConfigError(f"--mm-data {ns.mm_data}: dataset_param.basic_parameters.dataset names no data file")
    processor = pre.get("model_name_or_path") or load_hf
    if not processor:
        raise ConfigError(f"--mm-data {ns.mm_data}: dataset_param.preprocess_parameters.model_name_or_path is needed "
                          "(the directory with the tokenizer and preprocessor_config.json)")
    for key in ("image_max_pixels", "image_min_pixels"):
        if key in pre and (not isinstance(pre[key], int) or pre[key] < 0):
            raise ConfigError(f"--mm-data {ns.mm_data}: preprocess_parameters.{key} must be a whole number of pixels")
    if loader.get("drop_last", True) is not True:
        # MindSpeed-MM's BaseRandomBatchSampler raises on it too ("not implemented that the drop_last is false")
        raise ConfigError(f"--mm-data {ns.mm_data}: dataloader_param.drop_last = {json.dumps(loader['drop_last'])} is "
                          "not built: keeping each epoch's last incomplete batch is not implemented by MindSpeed-MM's "
                          "BaseRandomBatchSampler nor by backends.mm; set it to true (the samples that do not fill "
                          "micro-batch × data-parallel size at an epoch's end are left out of that epoch)")
    dataset = str(basic["dataset"])
    data = DataArgs(
        dataset=dataset, dataset_dir=str(basic.get("dataset_dir") or Path(dataset).parent), processor_dir=str(processor),
        image_max_pixels=int(pre.get("image_max_pixels", 262144)), image_min_pixels=int(pre.get("image_min_pixels", 0)),
        max_samples=basic.get("max_samples"), messages=attr.get("messages") or "messages",
        images=attr.get("images") or "images", role_tag=attr.get("role_tag") or "role",
        content_tag=attr.get("content_tag") or "content", user_tag=attr.get("user_tag") or "user",
        assistant_tag=attr.get("assistant_tag") or "assistant", system_tag=attr.get("system_tag"),
        shuffle=bool(loader.get("shuffle", True)),
        seq_len=ns.seq_length)
    if data.image_min_pixels > data.image_max_pixels:
        raise ConfigError(f"--mm-data {ns.mm_data}: image_min_pixels {data.image_min_pixels} is above image_max_pixels "
                          f"{data.image_max_pixels}")
    tp = ns.tensor_model_parallel_size
    return MMConfig(
        arch=vl.to_hf(), parts=parts, data=data,
        parallel=ParallelArgs(tp=tp, pp=pp, sp=ns.sequence_parallel and tp > 1,
                              distributed_optimizer=ns.use_distributed_optimizer,
                              recompute=ns.recompute_granularity or "none", recompute_method=ns.recompute_method,
                              recompute_num_layers=ns.recompute_num_layers),
        train=TrainArgs(
            micro_batch=ns.micro_batch_size, global_batch=ns.global_batch_size, steps=ns.train_iters,
            epochs=side.get("train_epochs"), lr=ns.lr, min_lr=ns.min_lr, schedule=ns.lr_decay_style,
            warmup=ns.lr_warmup_iters, warmup_fraction=ns.lr_warmup_fraction, weight_decay=ns.weight_decay,
            betas=(ns.adam_beta1, ns.adam_beta2), eps=ns.adam_eps, grad_clip=ns.clip_grad,
            precision="bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32", seed=ns.seed,
            log_interval=ns.log_interval, save_interval=ns.save_interval, exit_interval=ns.exit_interval,
            per_token_loss=ns.calculate_per_token_loss),
        model_id=side.get("model_id"), load_hf=load_hf, save=ns.save, load=ns.load or None,
        partial_load=tuple(flag for flag, on in (("--no-load-optim", ns.no_load_optim),
                                                 ("--no-load-rng", ns.no_load_rng)) if on),
        kernel_backend=side.get("kernels.backend", "auto"), kernel_overrides=dict(side.get("kernels.overrides") or {}),
        flash_attention=ns.use_flash_attn,
        metrics_file=side.get("metrics_file"), export_hf=side.get("export_hf"),
        init_std=float((model_tree.get("text_decoder") or {}).get("init_method_std", 0.02)), trackers=trackers)
