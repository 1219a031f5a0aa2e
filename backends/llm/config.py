"""The MindSpeed-LLM flag dialect (+ AscendFactory's engine.yaml) → the engine's typed configuration.

This is the only module that knows flag spellings; everything else works on `LLMConfig`.
Flags follow MindSpeed-LLM / Megatron-LM names and types (REFERENCE.md); an unknown flag is an
error that lists the supported ones. What MindSpeed-LLM has no flag for (the model card or HF
directory, kernel choice, metrics file, HF export, epochs, LoRA dropout) comes from the sidecar
file that $AF_ENGINE_FILE names (ascendfactory renders it as engine.yaml next to the flags).
MindSpeed-LLM's published scripts run as they are: `--enable-hf2mg-convert --load <HF dir>` is the
native HF load (no engine.yaml needed), architecture flags are checked against the model, switches
with no effect on the numbers are accepted with a notice (backends.contract.megatron.NO_EFFECT), and
what is not built is refused by name.
"""

from __future__ import annotations

import argparse
import math
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
from backends.contract.lora import MODULE_LINEARS
from backends.contract.prompts import PROMPT_TYPE_TEMPLATES
from backends.contract.megatron import CP_ALGO_DEFAULT_MINDSPEED_LLM, CP_ALGO_NAMES

# Megatron's validate_args: --data-path without --split takes this legacy default
MEGATRON_DEFAULT_SPLIT = "969, 30, 1"
HANDLER_FORMATS = {
    "GeneralPretrainHandler": "text",
    "AlpacaStyleInstructionHandler": "alpaca",
    "SharegptStyleInstructionHandler": "sharegpt",
    "AlpacaStylePairwiseHandler": "pairwise",
}
# where MindSpeed-LLM's configs/finetune/templates.json differs from LLaMA-Factory 0.9.5, which the named
# templates follow: its `qwen` keeps Qwen2's default system prompt
PROMPT_TYPE_SYSTEMS = {"qwen": "You are a helpful assistant."}


class ConfigError(ValueError):
    """A flag the engine cannot accept; the message says which and what to do."""


@dataclass
class ModelArgs:
    model_id: str | None
    family: str | None
    load_hf: str | None
    tokenizer: str | None
    overrides: dict[str, Any]  # card arch keys given on the command line
    # --load of a Megatron checkpoint with neither model_id nor load_hf: the model Megatron builds from the
    # flags (flags_model), its vocabulary padded from the tokenizer's where no flag gives it
    from_flags: FlagsModel | None = None


@dataclass
class FlagsModel:
    family: str
    arch: dict[str, Any]          # ModelConfig.from_card's arch (vocab_size None: pad the tokenizer's)
    vocab_multiple: int           # Megatron pads the tokenizer's vocabulary to a multiple of this


@dataclass
class ParallelArgs:
    tp: int = 1
    pp: int = 1
    pp_layers: list[int] | None = None
    vpp_layers: int | None = None
    sp: bool = False
    cp: int = 1
    cp_algo: str = "ring"
    ulysses_degree: int | None = None
    ep: int = 1
    moe_dispatcher: str = "alltoall"
    distributed_optimizer: bool = False
    fsdp: bool = False
    recompute: str = "none"
    recompute_method: str | None = None       # full: uniform | block (Megatron's)
    recompute_num_layers: int | None = None


@dataclass
class DataArgs:
    input: str | None
    fmt: str
    prefix: str
    template: str | None
    instruction: bool
    packing: bool
    neat_pack: bool
    dynamic: bool
    pad_to_multiple_of: int
    shuffle: bool
    max_samples: int | None
    seq_len: int
    # pre-training (text) data is Megatron's GPTDataset: its train split, and the flags it reads
    split: str = MEGATRON_DEFAULT_SPLIT
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # instruction data in MindSpeed-LLM's order (backends/common/data/mtf_order.py)
    pack_rows: bool = False        # --pack / --neat-pack: records the engine tokenizes are packed into rows
    padded_samples: bool = False   # --padded-samples
    sampler: str = "single"        # --dataloader-type


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
    weight_decay: float
    betas: tuple[float, float]
    eps: float                 # --adam-eps
    grad_clip: float
    precision: str
    seed: int
    log_interval: int
    save_interval: int | None
    moe_aux_loss_coeff: float
    exit_interval: int | None = None
    warmup_fraction: float | None = None   # --lr-warmup-fraction: of the total steps
    decay_steps: int | None = None        # --lr-decay-iters
    per_token_loss: bool = False          # --calculate-per-token-loss: the global token mean, not Megatron's
    #                                       default mean of per-micro-batch token means
    log_micro_means: bool = False         # --stage sft (posttrain_gpt.py's SFTTrainer.loss_func) without it: the
    #                                       logged loss is that mean too (pretrain_gpt.py logs the token mean)


@dataclass
class LoraArgs:
    rank: int
    alpha: float
    dropout: float
    targets: list[str]
    merge_on_export: bool


@dataclass
class LoadArgs:
    """What --load may restore (Megatron's --finetune / --no-load-*), and --ckpt-format: which Megatron checkpoint
    formats it reads (torch: the legacy one only; torch_dist, Megatron's default, detects either)."""
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    exit_on_missing: bool = False
    ckpt_format: str = "torch_dist"


@dataclass
class LLMConfig:
    model: ModelArgs
    parallel: ParallelArgs
    data: DataArgs
    train: TrainArgs
    lora: LoraArgs | None
    kernel_backend: str
    kernel_overrides: dict[str, str]
    fused_ops: bool
    flash_attention: bool
    save: str | None
    load: str | None
    export_hf: str | None
    metrics_file: str | None
    load_args: LoadArgs = field(default_factory=LoadArgs)
    checks: dict[str, tuple[str, Any]] = field(default_factory=dict)  # flag → (model attr, value)
    hf2mg: bool = False
    model_type_hf: str | None = None
    tokenizer_use_fast: bool = True
    enable_thinking: bool | None = None  # a reasoning template's empty thinking block: trained (True) or not
    moe_fusions: tuple[bool, bool] = (False, False)  # --moe-grouped-gemm, --moe-permute-fusion
    trackers: Any = None  # backends.common.trackers.TrackerSettings: --tensorboard-dir, --wandb-project …


def prompt_template(template: str | None, tokenizer, enable_thinking: bool | None):
    """The chat template (a --prompt-type mapped by PROMPT_TYPE_TEMPLATES) as MindSpeed-LLM encodes with it;
    --enable-thinking is a reasoning template's switch, as in MindSpeed-LLM (unset: an answer's own thinking
    is kept and the empty block of one without goes in the prompt)."""
    from backends.common.data import resolve_template

    return resolve_template(template, tokenizer, enable_thinking=enable_thinking,
                            default_system=PROMPT_TYPE_SYSTEMS.get(template))


def _parser() -> megatron_args.Parser:
    """MindSpeed-LLM's flags: the Megatron ones backends.mm reads too (backends.contract.megatron), then its own."""
    p = megatron_args.Parser("python -m backends.llm", ConfigError, add_help=True)
    a = p.add_argument
    # model
    a("--tokenizer-type", choices=["PretrainedFromHF"])
    a("--tokenizer-name-or-path")
    a("--num-layers", type=int)
    a("--hidden-size", type=int)
    a("--ffn-hidden-size", type=int)
    a("--num-attention-heads", type=int)
    a("--group-query-attention", action="store_true")
    a("--num-query-groups", type=int)
    a("--kv-channels", type=int)
    a("--padded-vocab-size", type=int)
    a("--max-position-embeddings", type=int)
    a("--rotary-base", type=int)
    a("--position-embedding-type", choices=["rope"], default="rope")
    megatron_args.add(p, megatron.MODEL)  # --vocab-size --make-vocab-size-divisible-by --normalization --use-flash-attn
    a("--swiglu", action="store_true")
    a("--disable-bias-linear", action="store_true")
    a("--untie-embeddings-and-output-weights", action="store_true")
    a("--add-qkv-bias", action="store_true")
    a("--qk-layernorm", action="store_true")
    a("--num-experts", type=int)
    a("--moe-router-topk", type=int)
    a("--moe-ffn-hidden-size", type=int)
    a("--n-shared-experts", type=int)
    a("--first-k-dense-replace", type=int)
    a("--moe-aux-loss-coeff", type=float, default=0.0)
    a("--moe-token-dispatcher-type", choices=["alltoall", "alltoall_seq", "allgather"], default="alltoall")
    a("--moe-grouped-gemm", action="store_true")
    a("--moe-permute-fusion", action="store_true")
    a("--multi-latent-attention", "--multi-head-latent-attention", action="store_true")  # the second: old name
    a("--q-lora-rank", type=int)
    a("--kv-lora-rank", type=int)
    a("--qk-head-dim", type=int)
    a("--qk-pos-emb-head-dim", type=int)
    a("--v-head-dim", type=int)
    # parallel
    megatron_args.add(p, megatron.PARALLEL)
    a("--num-layer-list", type=lambda s: [int(x) for x in s.split(",")])
    a("--num-layers-per-virtual-pipeline-stage", type=int)
    a("--context-parallel-algo", choices=sorted(CP_ALGO_NAMES), default=CP_ALGO_DEFAULT_MINDSPEED_LLM)
    # general: a per-document mask (packed rows); the packed path always applies each document's causal mask
    a("--attention-mask-type", "--cp-attention-mask-type", choices=["causal", "general"], default="causal")
    a("--ulysses-degree-in-cp", type=int)
    a("--expert-model-parallel-size", type=int, default=1)
    a("--use-torch-fsdp2", action="store_true")
    # kernels
    a("--use-fused-rmsnorm", action="store_true")
    a("--use-fused-swiglu", action="store_true")
    a("--use-fused-rotary-pos-emb", action="store_true")
    # data
    a("--input")
    a("--handler-name", choices=sorted(HANDLER_FORMATS), default="GeneralPretrainHandler")
    a("--data-path", required=True)
    a("--prompt-type")
    a("--is-instruction-dataset", action="store_true")
    a("--finetune", action="store_true")
    a("--pack", action="store_true")  # preprocess_data.py: the dataset is packed rows
    a("--reset-attention-mask", action="store_true")
    a("--reset-position-ids", action="store_true")
    a("--eod-mask-loss", action="store_true")
    a("--neat-pack", action="store_true")
    a("--variable-seq-lengths", action="store_true")
    a("--pad-to-multiple-of", type=int, default=8)
    a("--no-shuffle", action="store_true")
    a("--max-samples", type=int)
    megatron_args.add(p, megatron.SEQUENCE)  # required: after --data-path in argparse's message
    # training
    megatron_args.add(p, megatron.BATCH)
    megatron_args.add(p, megatron.OPTIMIZER)
    megatron_args.add(p, megatron.PRECISION)
    megatron_args.add(p, megatron.RUN)
    megatron_args.add(p, megatron.TRACKERS)
    # LoRA
    a("--lora-r", type=int, default=16)
    a("--lora-alpha", type=int, default=32)
    a("--lora-target-modules", nargs="+", default=[])  # LoRA is on when it names modules, as in MindSpeed-LLM
    _published_script_flags(p)
    return p


def _published_script_flags(p: megatron_args.Parser) -> None:
    """The rest of what MindSpeed-LLM's published pretrain / tune scripts pass (types as upstream)."""
    a = p.add_argument
    # the model: the native decoder of the family stands for every Megatron build of it
    a("--use-rotary-position-embeddings", action="store_true")
    a("--enable-hf2mg-convert", action="store_true")
    a("--model-type-hf")
    a("--tokenizer-not-use-fast", action="store_false", dest="tokenizer_use_fast")
    a("--enable-thinking", type=_true_false_none)
    a("--hidden-dropout", type=float)
    a("--attention-dropout", type=float)
    # facts about the architecture: checked against the model (config.json or card), see MODEL_FACTS
    a("--norm-epsilon", type=float)
    a("--init-method-std", type=float)
    a("--moe-router-topk-scaling-factor", type=float)
    a("--norm-topk-prob", action="store_true")
    a("--moe-router-num-groups", type=int)
    a("--moe-router-group-topk", type=int)
    a("--moe-layer-freq")  # an integer: the model's config.json / card places its MoE layers
    a("--moe-router-load-balancing-type", default="aux_loss")
    a("--moe-router-pre-softmax", action="store_true")
    a("--seq-aux", action="store_true")
    a("--rope-scaling-type", choices=["llama3", "yarn", "longrope", "plm"])
    a("--rope-scaling-factor", type=float, default=8.0)
    a("--low-freq-factor", type=float)                     # llama3
    a("--high-freq-factor", type=float)
    a("--original-max-position-embeddings", type=float)    # llama3 (yarn has its own flag)
    a("--beta-fast", type=int, default=32)
    a("--beta-slow", type=int, default=1)
    a("--rope-scaling-mscale", type=float, default=1.0)
    a("--rope-scaling-mscale-all-dim", type=float, default=0.0)
    a("--rope-scaling-original-max-position-embeddings", type=int)
    # partial / GLM rotary: default None, the model's own (Megatron's omitted --rotary-percent is 1.0)
    a("--use-glm-rope", action="store_true")
    a("--rotary-percent", type=float)
    # schedule, data split, evaluation, checkpoints
    a("--lr-decay-iters", type=int)
    a("--split")
    a("--stage", choices=["sft", "dpo", "ray_ppo", "ray_online_dpo", "ray_grpo"])
    a("--no-pad-to-seq-lengths", action="store_true")
    a("--calculate-per-token-loss", action="store_true")
    a("--no-load-optim", action="store_true")
    a("--no-load-rng", action="store_true")
    a("--exit-on-missing-checkpoint", action="store_true")
    a("--dataloader-type", choices=["single", "cyclic", "external"])
    a("--initial-loss-scale", type=float)
    # how a step is scheduled, overlapped, fused, checked or logged: accepted with a notice
    # (backends.contract.megatron.NO_EFFECT)
    megatron_args.add_no_effect(p, "llm")
    a("--padded-samples", action="store_true")
    a("--full-shuffle-instruction-dataset", action="store_true")


def _true_false_none(text: str):
    return {"true": True, "false": False, "none": None}[text.lower()]


# flag → the native model's attribute it states; a model that differs is refused (build_decoder)
MODEL_FACTS = {"--norm-epsilon": "rms_norm_eps", "--moe-router-topk-scaling-factor": "moe.routed_scaling_factor",
               "--norm-topk-prob": "moe.norm_topk_prob", "--moe-router-num-groups": "moe.n_group",
               "--moe-router-group-topk": "moe.topk_group",
               "--rope-scaling-factor": "rope_scaling.factor", "--beta-fast": "rope_scaling.beta_fast",
               "--beta-slow": "rope_scaling.beta_slow", "--rope-scaling-mscale": "rope_scaling.mscale",
               "--rope-scaling-mscale-all-dim": "rope_scaling.mscale_all_dim",
               "--rope-scaling-original-max-position-embeddings": "rope_scaling.original_max_position_embeddings",
               "--low-freq-factor": "rope_scaling.low_freq_factor",
               "--high-freq-factor": "rope_scaling.high_freq_factor",
               "--original-max-position-embeddings": "rope_scaling.original_max_position_embeddings",
               "--rotary-percent": "rotary_fraction", "--use-glm-rope": "rotary_interleaved",
               "--init-method-std": "initializer_range", "--vocab-size": "vocab_size"}
# --model-type-hf → the config.json model_type(s) of the native families it names
MODEL_TYPE_HF = {"qwen3": ("qwen3",), "qwen3-moe": ("qwen3_moe",), "qwen25": ("qwen2",), "qwen": ("qwen2",),
                 "llama2": ("llama",), "mixtral": ("mixtral",), "glm4": ("glm", "glm4", "chatglm"),
                 "deepseek2": ("deepseek_v2",), "deepseek2-lite": ("deepseek_v2",), "deepseek3": ("deepseek_v3",)}


def supported_flags() -> list[str]:
    return megatron_args.supported_flags(_parser())


# flags earlier renders used that no upstream parser defines: their settings live in the sidecar
_IN_ENGINE_FILE = {"--model-id": "model_id", "--model-family": "model_family", "--load-hf": "load_hf",
                   "--kernel-backend": "kernels.backend", "--kernel-override": "kernels.overrides",
                   "--metrics-file": "metrics_file", "--export-hf": "export_hf", "--train-epochs": "train_epochs",
                   "--lora-dropout": "lora.dropout", "--lora-merge-on-export": "lora.merge_on_export"}
_HINTS = {flag: f"not a MindSpeed-LLM flag: engine.yaml's {key}" for flag, key in _IN_ENGINE_FILE.items()}


@dataclass
class EngineFile:
    """engine.yaml: AscendFactory's settings that MindSpeed-LLM has no flag for."""
    model_id: str | None = None          # a model card (random init unless load_hf)
    model_family: str | None = None
    load_hf: str | None = None           # an HF model directory to start from
    kernel_backend: str = "auto"
    kernel_overrides: dict[str, str] = field(default_factory=dict)
    metrics_file: str | None = None
    export_hf: str | None = None         # write the trained model here in HF format
    train_epochs: float | None = None    # instead of --train-iters
    lora_dropout: float = 0.0
    lora_merge_on_export: bool = False
    source: str = "engine.yaml"


_TEXT_KEYS = ("model_id", "model_family", "load_hf", "metrics_file", "export_hf")
_ENGINE_KEYS = {**{key: ef.text for key in _TEXT_KEYS}, "train_epochs": ef.positive_number,
                "kernels.backend": ef.kernel_backend, "kernels.overrides": ef.kernel_overrides,
                "lora.dropout": ef.fraction, "lora.merge_on_export": ef.flag}


def read_engine_file(engine: Mapping | str | Path | None = None) -> EngineFile:
    """The sidecar from a mapping, a path, or (None) the file $AF_ENGINE_FILE names; unset: defaults."""
    try:
        flat, source = ef.read_engine_file(_ENGINE_KEYS, engine)
    except ef.EngineFileError as err:
        raise ConfigError(str(err)) from None
    epochs, dropout = flat.get("train_epochs"), flat.get("lora.dropout")
    return EngineFile(**{key: flat.get(key) or None for key in _TEXT_KEYS},
                      kernel_backend=flat.get("kernels.backend") or "auto",
                      kernel_overrides={str(k): v for k, v in (flat.get("kernels.overrides") or {}).items()},
                      train_epochs=float(epochs) if epochs is not None else None,
                      lora_dropout=float(dropout or 0.0), lora_merge_on_export=bool(flat.get("lora.merge_on_export")),
                      source=source)


def lora_targets(targets: list[str], linear_names: list[str]) -> list[str]:
    """--lora-target-modules (MindSpeed-LLM's module names; HF names and 'all' also taken) → the HF
    linear names of this model that inject_lora adapts."""
    if [t.lower() for t in targets] in (["all"], ["all-linear"]):
        return list(targets)
    leaves = {name.rsplit(".", 1)[-1] for name in linear_names}
    out: list[str] = []
    for target in targets:
        names = [n for n in MODULE_LINEARS.get(target, (target,)) if n in leaves or n == target]
        out += [n for n in names if n not in out]
    if not out:
        raise ConfigError(f"--lora-target-modules {' '.join(targets)}: none of them is a linear layer of this model "
                          f"(MindSpeed-LLM names: {' '.join(MODULE_LINEARS)})")
    return out


def _split_weights(text: str) -> list[float]:
    try:
        weights = [float(x) for x in text.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split {text}: expected weights such as 100,0,0") from None
    if min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(f"--split {text}: the weights must be positive or 0, and not all 0; e.g. 100,0,0")
    return weights + [0.0] * (3 - len(weights))


# Megatron's architecture switches whose omission asks for a model no family here has (Megatron's defaults:
# a GELU MLP, biases on every linear layer, LayerNorm, learned absolute positions). Every published script
# of our families and every rendered file gives them; an omitted one is refused, never read as given.
ARCHITECTURE_SWITCHES = {
    ("--swiglu",): "a GELU MLP (Megatron's default); the native decoders are gated SiLU (SwiGLU)",
    ("--disable-bias-linear",): "biases on every linear layer (Megatron's default); the native decoders have none "
                                "(--add-qkv-bias adds the attention input's)",
    ("--normalization",): "LayerNorm (Megatron's default); the native decoders use RMSNorm: give --normalization "
                          "RMSNorm",
    ("--position-embedding-type", "--use-rotary-position-embeddings"):
        "learned absolute position embeddings (Megatron's default); the native decoders are rotary: give "
        "--position-embedding-type rope",
}


def architecture_refusals(argv: list[str]) -> list[str]:
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    return [f"{flags[0]} is not given: Megatron builds {why}" for flags, why in ARCHITECTURE_SWITCHES.items()
            if not given & set(flags)]


def refusals(ns: argparse.Namespace) -> list[str]:
    """Flags of MindSpeed-LLM this build does not implement as set: each names the flag and what to use."""
    out = []
    for flag in ("hidden_dropout", "attention_dropout"):
        if getattr(ns, flag):
            out.append(f"--{flag.replace('_', '-')} {getattr(ns, flag)}: the native decoders have no dropout; "
                       f"set it to 0, as MindSpeed-LLM's published scripts do")
    if ns.num_query_groups is not None and not ns.group_query_attention:
        out.append(f"--num-query-groups {ns.num_query_groups} without --group-query-attention: Megatron ignores it "
                   f"and builds one key/value head per head; add --group-query-attention")
    mla_sizes = [f"--{name.replace('_', '-')}" for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                                             "qk_pos_emb_head_dim", "v_head_dim")
                 if getattr(ns, name) is not None]
    if mla_sizes and not ns.multi_latent_attention:
        out.append(f"{' '.join(mla_sizes)} without --multi-latent-attention: Megatron builds standard attention and "
                   f"ignores them; add --multi-latent-attention")
    if ns.stage not in (None, "sft"):
        out.append(f"--stage {ns.stage}: this engine trains pre-training and SFT only; use framework llamafactory "
                   f"(stage: dpo) or mindspeed-rl for preference and RL training")
    if ns.ckpt_format == "zarr":
        out.append("--ckpt-format zarr: not built (checkpoints are written in the engine's own layout); use torch "
                   "or torch_dist")
    if ns.dataloader_type == "external":
        out.append("--dataloader-type external: not built; use single (Megatron's default) or cyclic")
    if ns.full_shuffle_instruction_dataset and not pretraining(ns):
        out.append("--full-shuffle-instruction-dataset: MindSpeed-LLM reshuffles its whole sample index with "
                   "Python's global random.shuffle, whose state there depends on everything drawn before; not "
                   "built, drop it (each epoch is still shuffled with --seed)")
    balance = ns.moe_router_load_balancing_type
    if balance not in BALANCING:
        out.append(f"--moe-router-load-balancing-type {balance}: this routing / balancing loss is not built; use "
                   f"{', '.join(BALANCING)} (none with --moe-aux-loss-coeff 0)")
    if ns.seq_aux and balance == "none" and ns.moe_aux_loss_coeff:
        out.append("--seq-aux: MindSpeed-LLM's sequence-wise auxiliary loss (routing type none) is not built; drop "
                   "it, or use --moe-router-load-balancing-type aux_loss")
    groups, group_topk, topk = ns.moe_router_num_groups or 1, ns.moe_router_group_topk, ns.moe_router_topk
    if balance != "pai_megatron_aux_loss" and group_topk and group_topk < groups and topk and topk // group_topk != 1:
        out.append(f"--moe-router-group-topk {group_topk}: Megatron ranks the expert groups by the sum of their "
                   f"top-{topk // group_topk} scores, the native routing by their best expert (DeepSeek-V2's "
                   f"group_limited_greedy), the same only when --moe-router-topk / --moe-router-group-topk is 1; "
                   f"set --moe-router-group-topk {topk}, or leave the group flags out")
    if ns.rope_scaling_type in ("longrope", "plm"):
        out.append(f"--rope-scaling-type {ns.rope_scaling_type}: this rotary scaling is not built (llama3 and yarn "
                   f"are); use a model whose rope is one of those")
    missing = [flag for flag, value in (("--low-freq-factor", ns.low_freq_factor),
                                        ("--high-freq-factor", ns.high_freq_factor),
                                        ("--original-max-position-embeddings", ns.original_max_position_embeddings))
               if value is None]
    if ns.rope_scaling_type == "llama3" and missing:
        out.append(f"--rope-scaling-type llama3: give {', '.join(missing)} too (MindSpeed-LLM's llama3 scaling "
                   f"divides by them; the model's config.json rope_scaling has the values)")
    if ns.model_type_hf is not None and ns.model_type_hf not in MODEL_TYPE_HF:
        out.append(f"--model-type-hf {ns.model_type_hf}: no native decoder for it; use one of "
                   f"{', '.join(MODEL_TYPE_HF)}")
    if ns.enable_hf2mg_convert and not ns.load:
        out.append("--enable-hf2mg-convert: give --load <the Hugging Face model directory> to convert from")
    if ns.lr_warmup_fraction is not None and ns.lr_warmup_iters:
        out.append("--lr-warmup-fraction and --lr-warmup-iters exclude each other (as in Megatron); give one")
    if ns.initial_loss_scale is not None and ns.fp16:
        out.append("--initial-loss-scale with --fp16: the engine's fp16 loss scaler picks its own start; drop it")
    if ns.moe_layer_freq is not None and not ns.moe_layer_freq.lstrip("-").isdigit():
        out.append(f"--moe-layer-freq {ns.moe_layer_freq}: a per-layer list is not built; give an integer, or "
                   f"let the model's config place its MoE layers")
    return out


# the --moe-router-load-balancing-type values built: Megatron's aux_loss (its top-k routing and switch
# load-balancing loss), none (the routing, no loss) and MindSpeed-LLM's pai_megatron_aux_loss (the same loss,
# routed by the top-k softmax probabilities as they are: no groups, no renormalisation, no scaling)
BALANCING = ("aux_loss", "pai_megatron_aux_loss", "none")
_PAI = "--moe-router-load-balancing-type pai_megatron_aux_loss:"
# routing flags MindSpeed-LLM's pai routing does not read (nor --seq-aux outside routing type none)
_PAI_IGNORES = ("--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-topk-scaling-factor",
                "--norm-topk-prob", "--moe-router-pre-softmax")


def pretraining(ns: argparse.Namespace) -> bool:
    """Text documents trained as Megatron's GPTDataset samples (not instruction data)."""
    return HANDLER_FORMATS[ns.handler_name] == "text" and not ns.is_instruction_dataset


def data_notices(ns: argparse.Namespace) -> list[str]:
    """Data flags whose upstream effect is partly outside what this engine runs."""
    out = _split_notice(ns)
    if not pretraining(ns):
        # MindSpeed-LLM pads instruction batches to --seq-length unless --no-pad-to-seq-lengths (which turns
        # --variable-seq-lengths on itself); --variable-seq-lengths only lets Megatron's pipeline stages send
        # each micro-batch's shape ahead, and this engine's stages always exchange each micro-batch's own shape
        if ns.variable_seq_lengths and not ns.no_pad_to_seq_lengths:
            out.append("notice: --variable-seq-lengths has no effect here: batches are padded to --seq-length "
                       "without --no-pad-to-seq-lengths (as MindSpeed-LLM pads them), and pipeline stages always "
                       "exchange each micro-batch's own shape")
        return out
    for flag, on in (("--padded-samples", ns.padded_samples),
                     ("--full-shuffle-instruction-dataset", ns.full_shuffle_instruction_dataset)):
        if on:
            out.append(f"notice: {flag} has no effect on pre-training data: MindSpeed-LLM reads it for instruction "
                       f"data (--is-instruction-dataset) only")
    if ns.no_shuffle:
        out.append("notice: --no-shuffle has no effect on pre-training data: Megatron's GPTDataset always shuffles "
                   "its documents and samples with --seed")
    if ns.variable_seq_lengths:
        out.append("notice: --variable-seq-lengths has no effect on pre-training data: every GPTDataset sample is "
                   "--seq-length tokens long")
    return out


def _split_notice(ns: argparse.Namespace) -> list[str]:
    split = ns.split if ns.split is not None else MEGATRON_DEFAULT_SPLIT
    if not any(_split_weights(split)[1:]):
        return []
    given = "" if ns.split is not None else " (Megatron's default without --split)"
    what = "documents" if pretraining(ns) else "rows"
    return [f"notice: --split {split}{given}: training reads Megatron's train split only; the validation and test "
            f"{what} are held out and not evaluated (evaluation is not built)"]


def attention_notices(ns: argparse.Namespace) -> list[str]:
    if ns.attention_mask_type == "general":   # MindSpeed's full [s, s] mask, for CP layouts that need one
        return ["notice: --attention-mask-type general has no effect on this engine: the same causal attention is "
                "computed without materialising the mask"]
    return []


def routing_notices(ns: argparse.Namespace) -> list[str]:
    """One line per routing flag that this --moe-router-load-balancing-type leaves without effect upstream."""
    balance, out = ns.moe_router_load_balancing_type, []
    if balance == "pai_megatron_aux_loss":
        given = {"--moe-router-num-groups": ns.moe_router_num_groups,
                 "--moe-router-group-topk": ns.moe_router_group_topk,
                 "--moe-router-topk-scaling-factor": ns.moe_router_topk_scaling_factor,
                 "--norm-topk-prob": ns.norm_topk_prob or None,
                 "--moe-router-pre-softmax": ns.moe_router_pre_softmax or None}
        out += [f"notice: {flag} has no effect with --moe-router-load-balancing-type pai_megatron_aux_loss "
                f"(MindSpeed-LLM's pai routing does not read it)" for flag in _PAI_IGNORES if given[flag] is not None]
    if ns.seq_aux and (balance != "none" or not ns.moe_aux_loss_coeff):
        out.append(f"notice: --seq-aux has no effect with --moe-router-load-balancing-type {balance} and "
                   f"--moe-aux-loss-coeff {ns.moe_aux_loss_coeff} (MindSpeed-LLM applies it to routing type none "
                   f"with a coefficient only)")
    return out


def model_facts(ns: argparse.Namespace, random_init: bool) -> dict[str, tuple[str, Any]]:
    """{flag: (the model attribute it states, value)} for the architecture flags that were given."""
    given = {"--norm-epsilon": ns.norm_epsilon, "--moe-router-topk-scaling-factor": ns.moe_router_topk_scaling_factor,
             "--norm-topk-prob": True if ns.norm_topk_prob else None, "--moe-router-num-groups": ns.moe_router_num_groups,
             "--moe-router-group-topk": ns.moe_router_group_topk,
             "--init-method-std": ns.init_method_std if random_init else None}  # loaded weights need no init
    if ns.vocab_size is not None and ns.padded_vocab_size is None:  # Megatron pads the tokenizer's vocab
        m = ns.make_vocab_size_divisible_by * ns.tensor_model_parallel_size
        given["--vocab-size"] = -(-ns.vocab_size // m) * m
    if ns.rope_scaling_type == "llama3":  # MindSpeed-LLM's apply_llama3_scaling reads these four
        given.update({"--rope-scaling-factor": ns.rope_scaling_factor, "--low-freq-factor": ns.low_freq_factor,
                      "--high-freq-factor": ns.high_freq_factor,
                      "--original-max-position-embeddings": ns.original_max_position_embeddings})
    if ns.use_glm_rope or ns.rotary_percent is not None:
        # Megatron rotates the first --rotary-percent of each head by halves; --use-glm-rope by adjacent pairs
        # (MindSpeed-LLM's _process_partial_rope, transformers' Glm): both facts of the model
        given.update({"--rotary-percent": 1.0 if ns.rotary_percent is None else ns.rotary_percent,
                      "--use-glm-rope": bool(ns.use_glm_rope)})
    if ns.rope_scaling_type == "yarn":  # the yarn numbers only mean something with yarn
        given.update({"--rope-scaling-factor": ns.rope_scaling_factor, "--beta-fast": ns.beta_fast,
                      "--beta-slow": ns.beta_slow, "--rope-scaling-mscale": ns.rope_scaling_mscale,
                      "--rope-scaling-mscale-all-dim": ns.rope_scaling_mscale_all_dim,
                      "--rope-scaling-original-max-position-embeddings":
                          ns.rope_scaling_original_max_position_embeddings})
    pai = ns.moe_router_load_balancing_type == "pai_megatron_aux_loss"
    out = {flag: (MODEL_FACTS[flag], value) for flag, value in given.items()
           if value is not None and not (pai and flag in _PAI_IGNORES)}
    if ns.moe_router_pre_softmax and not pai:
        # Megatron's top-k of the softmax probabilities, unnormalised; MindSpeed-LLM's aux_loss routing renormalises
        # them with --norm-topk-prob. Without the flag: softmax over the top-k logits, i.e. renormalised.
        out["--moe-router-pre-softmax: top-k renormalised"] = (
            "moe.norm_topk_prob", bool(ns.norm_topk_prob) and ns.moe_router_load_balancing_type == "aux_loss")
    if pai:
        out.update({f"{_PAI} scores": ("moe.scoring_func", "softmax"),
                    f"{_PAI} expert groups": ("moe.topk_method", "greedy"),
                    f"{_PAI} top-k renormalised": ("moe.norm_topk_prob", False),
                    f"{_PAI} top-k scaled by": ("moe.routed_scaling_factor", 1.0)})
    if ns.rope_scaling_type:
        out["--rope-scaling-type"] = ("rope_scaling.rope_type", ns.rope_scaling_type)
    return out


def _attr(config, path: str):
    obj = config
    for part in path.split("."):
        if obj is None:
            return None
        if isinstance(obj, Mapping):
            obj = obj.get(part, obj.get("type")) if part == "rope_type" else obj.get(part)
        else:
            obj = getattr(obj, part, None)
    return obj


def check_model_facts(config, checks: dict[str, tuple[str, Any]], source: str) -> None:
    """Refuse a model that is not what the script's architecture flags say (MindSpeed would build the flags')."""
    wrong = []
    for flag, (path, want) in checks.items():
        have = _attr(config, path)
        same = have == want or (ef.is_number(have) and ef.is_number(want) and math.isclose(have, want, rel_tol=1e-6))
        if not same:
            wrong.append(f"{flag} {want} (the model has {path}={have!r})")
    if wrong:
        raise ConfigError(f"{source} is not the model these flags describe: " + "; ".join(wrong)
                          + ". Fix the flags to match the model, or load the model they describe")


def _megatron_checkpoint(load: str) -> bool:
    from backends.common.checkpoint.megatron_checkpoint import TRACKER

    return (Path(load) / TRACKER).is_file()


def flags_model(ns: argparse.Namespace) -> FlagsModel:
    """The model Megatron builds from these flags (its defaults where one is left out), as a native family:
    the one whose transformers class computes what this Megatron GPT computes."""
    wrong = [f"{flag}: give it (Megatron builds the model from the flags)" for flag, value in (
        ("--num-layers", ns.num_layers), ("--hidden-size", ns.hidden_size),
        ("--num-attention-heads", ns.num_attention_heads)) if value is None]
    # (omitted --swiglu / --disable-bias-linear are refused for every load: architecture_refusals)
    if ns.multi_latent_attention:
        wrong += _mla_flag_problems(ns)
    else:
        wrong += [f"{flag}: shared experts and dense leading layers are DeepSeek's; give --multi-latent-attention "
                  f"and the rest of its flags, or load a model whose config.json has them"
                  for flag, value in (("--n-shared-experts", ns.n_shared_experts),
                                      ("--first-k-dense-replace", ns.first_k_dense_replace)) if value]
    if wrong:
        raise ConfigError(f"--load {ns.load} (a Megatron checkpoint, the model from the flags): " + "; ".join(wrong))
    if ns.multi_latent_attention:
        family = "deepseek_v2"
    elif ns.num_experts:
        family = "qwen3_moe" if ns.qk_layernorm else "mixtral"
    elif ns.qk_layernorm:
        family = "qwen3"
    elif ns.use_glm_rope or ns.rotary_percent not in (None, 1.0):
        family = "glm"
    else:
        family = "qwen2" if ns.add_qkv_bias else "llama"
    if ns.model_type_hf and family not in MODEL_TYPE_HF[ns.model_type_hf]:
        raise ConfigError(f"--model-type-hf {ns.model_type_hf}: the architecture flags describe a {family} model "
                          f"(--multi-latent-attention, --qk-layernorm, --add-qkv-bias, --num-experts, --use-glm-rope "
                          f"set the family)")
    heads, hidden = ns.num_attention_heads, ns.hidden_size
    ffn = ns.ffn_hidden_size or int(4 * hidden * 2 / 3 / 64) * 64   # Megatron's default with --swiglu
    vocab = ns.padded_vocab_size
    multiple = ns.make_vocab_size_divisible_by * ns.tensor_model_parallel_size
    if vocab is None and ns.vocab_size is not None:
        vocab = -(-ns.vocab_size // multiple) * multiple
    arch: dict[str, Any] = dict(
        num_layers=ns.num_layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_kv_heads=ns.num_query_groups if ns.group_query_attention else heads,
        head_dim=ns.kv_channels or hidden // heads, vocab_size=vocab,
        max_position_embeddings=ns.max_position_embeddings or ns.seq_length,
        rope_theta=float(ns.rotary_base or 10000), rms_norm_eps=ns.norm_epsilon or 1e-5,
        tie_word_embeddings=not ns.untie_embeddings_and_output_weights, qkv_bias=bool(ns.add_qkv_bias),
        qk_norm=bool(ns.qk_layernorm), rotary_fraction=ns.rotary_percent if family == "glm" and ns.rotary_percent
        else 1.0)
    if ns.rope_scaling_type == "llama3":
        arch["rope_scaling"] = {"rope_type": "llama3", "factor": ns.rope_scaling_factor,
                                "low_freq_factor": ns.low_freq_factor, "high_freq_factor": ns.high_freq_factor,
                                "original_max_position_embeddings": ns.original_max_position_embeddings}
    elif ns.rope_scaling_type == "yarn":
        arch["rope_scaling"] = {"rope_type": "yarn", "factor": ns.rope_scaling_factor, "beta_fast": ns.beta_fast,
                                "beta_slow": ns.beta_slow, "mscale": ns.rope_scaling_mscale,
                                "mscale_all_dim": ns.rope_scaling_mscale_all_dim,
                                "original_max_position_embeddings": ns.rope_scaling_original_max_position_embeddings}
    if ns.num_experts:
        arch["moe"] = {"num_experts": ns.num_experts, "experts_per_token": ns.moe_router_topk or 2,
                       "moe_ffn_hidden_size": ns.moe_ffn_hidden_size or ffn}
    if ns.multi_latent_attention:
        _mla_arch(ns, arch)
    return FlagsModel(family, arch, multiple)


_MLA_SIZES = (("--kv-lora-rank", "kv_lora_rank"), ("--qk-head-dim", "qk_head_dim"),
              ("--qk-pos-emb-head-dim", "qk_pos_emb_head_dim"), ("--v-head-dim", "v_head_dim"))


def _mla_flag_problems(ns: argparse.Namespace) -> list[str]:
    """What keeps these MLA flags from describing a DeepSeek model (transformers' DeepseekV2)."""
    out = [f"{flag}: give it (MindSpeed-LLM's default is none; DeepSeek's config.json has the size)"
           for flag, name in _MLA_SIZES if getattr(ns, name) is None]
    if not ns.qk_layernorm:
        out.append("--multi-latent-attention without --qk-layernorm: MindSpeed-LLM builds it without the q / kv latent "
                   "norms DeepSeek's attention has; add --qk-layernorm")
    if not ns.num_experts:
        out.append("--multi-latent-attention without --num-experts: the DeepSeek models are mixtures of experts; give "
                   "the MoE flags")
    return out


def _mla_arch(ns: argparse.Namespace, arch: dict[str, Any]) -> None:
    """DeepSeek-V2's attention and MoE from the MLA flags (softmax routing: Megatron's top-k, renormalised unless
    --moe-router-pre-softmax; the routing facts of model_facts are set on it afterwards)."""
    arch.update(num_kv_heads=arch["num_attention_heads"], head_dim=ns.qk_head_dim + ns.qk_pos_emb_head_dim,
                qk_norm=False,
                mla={"q_lora_rank": ns.q_lora_rank, "kv_lora_rank": ns.kv_lora_rank,
                     "qk_nope_head_dim": ns.qk_head_dim, "qk_rope_head_dim": ns.qk_pos_emb_head_dim,
                     "v_head_dim": ns.v_head_dim})
    grouped = (ns.moe_router_num_groups or 1) > 1
    arch["moe"].update(shared_experts=ns.n_shared_experts or 0, first_k_dense=ns.first_k_dense_replace or 0,
                       moe_layer_freq=int(ns.moe_layer_freq or 1), norm_topk_prob=True,
                       topk_method="group_limited_greedy" if grouped else "greedy")


def parse_args(argv: list[str], engine: Mapping | str | Path | None = None) -> LLMConfig:
    """The flags, plus the sidecar (`engine`: a mapping or a path; None: the file $AF_ENGINE_FILE names)."""
    ns = megatron_args.parse(_parser(), argv, "MindSpeed-LLM", _HINTS, engine="llm")
    refused = refusals(ns)
    refused += architecture_refusals(argv)
    if refused:
        raise ConfigError("this build of backends.llm does not implement:\n" + "\n".join(refused))
    trackers, problems, tracker_notices = megatron_flag_settings("megatron", ns)
    if problems:
        raise ConfigError("\n".join(problems))
    if os.environ.get("RANK", "0") == "0":
        for line in routing_notices(ns) + data_notices(ns) + attention_notices(ns) + tracker_notices:
            print(f"python -m backends.llm: {line}", file=sys.stderr)
    side = read_engine_file(engine)
    if ns.enable_hf2mg_convert:  # MindSpeed-LLM converts the HF weights at load time: our native HF load
        if side.load_hf and side.load_hf != ns.load:
            raise ConfigError(f"--enable-hf2mg-convert --load {ns.load} and load_hf {side.load_hf} in {side.source} "
                              f"name two models; keep one")
        side.load_hf, ns.load = ns.load, None
    if ns.train_iters is None and side.train_epochs is None:
        raise ConfigError(f"give --train-iters, or train_epochs in {side.source}")
    if ns.bf16 and ns.fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other")
    from_flags = None
    if not side.model_id and not side.load_hf:
        if not (ns.load and _megatron_checkpoint(ns.load)):
            raise ConfigError(f"no model: give load_hf (an HF model directory) or model_id (a model card, random "
                              f"init) in {side.source}, or --load a Megatron checkpoint; `ascendfactory render` "
                              f"writes that file")
        from_flags = flags_model(ns)
    overrides = {key: getattr(ns, flag) for key, flag in (
        ("num_layers", "num_layers"), ("hidden_size", "hidden_size"), ("ffn_hidden_size", "ffn_hidden_size"),
        ("num_attention_heads", "num_attention_heads"), ("num_kv_heads", "num_query_groups"),
        ("head_dim", "kv_channels"), ("vocab_size", "padded_vocab_size"),
        ("max_position_embeddings", "max_position_embeddings"), ("rope_theta", "rotary_base"),
    ) if getattr(ns, flag) is not None}
    if "rope_theta" in overrides:  # an int on the command line (Megatron's type), a float in the model
        overrides["rope_theta"] = float(overrides["rope_theta"])
    moe = {key: getattr(ns, flag) for key, flag in (
        ("num_experts", "num_experts"), ("experts_per_token", "moe_router_topk"),
        ("moe_ffn_hidden_size", "moe_ffn_hidden_size"), ("shared_experts", "n_shared_experts"),
        ("first_k_dense", "first_k_dense_replace"),
    ) if getattr(ns, flag) is not None}
    if moe:
        overrides["moe"] = moe
    mla = {key: getattr(ns, flag) for key, flag in (
        ("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_head_dim"),
        ("qk_rope_head_dim", "qk_pos_emb_head_dim"), ("v_head_dim", "v_head_dim"),
    ) if getattr(ns, flag) is not None}
    if mla:
        overrides["mla"] = mla
    if side.model_id and not side.load_hf:  # architecture switches the renderer spells out only when they are on
        overrides["tie_word_embeddings"] = not ns.untie_embeddings_and_output_weights
        overrides["qkv_bias"] = bool(ns.add_qkv_bias)
        overrides["qk_norm"] = bool(ns.qk_layernorm)
    fmt = HANDLER_FORMATS[ns.handler_name]
    template = PROMPT_TYPE_TEMPLATES.get(ns.prompt_type, ns.prompt_type)
    lora = None
    if ns.lora_target_modules:
        lora = LoraArgs(ns.lora_r, float(ns.lora_alpha), side.lora_dropout, list(ns.lora_target_modules),
                        side.lora_merge_on_export)
    return LLMConfig(
        model=ModelArgs(side.model_id, side.model_family, side.load_hf, ns.tokenizer_name_or_path or side.load_hf,
                        overrides, from_flags),
        parallel=ParallelArgs(
            tp=ns.tensor_model_parallel_size, pp=ns.pipeline_model_parallel_size, pp_layers=ns.num_layer_list,
            vpp_layers=ns.num_layers_per_virtual_pipeline_stage,
            sp=ns.sequence_parallel and ns.tensor_model_parallel_size > 1,  # Megatron turns it off at tp 1
            cp=ns.context_parallel_size, cp_algo=CP_ALGO_NAMES[ns.context_parallel_algo],
            ulysses_degree=ns.ulysses_degree_in_cp, ep=ns.expert_model_parallel_size,
            moe_dispatcher=ns.moe_token_dispatcher_type, distributed_optimizer=ns.use_distributed_optimizer,
            fsdp=ns.use_torch_fsdp2, recompute=ns.recompute_granularity or "none",
            recompute_method=ns.recompute_method, recompute_num_layers=ns.recompute_num_layers),
        data=DataArgs(
            input=ns.input, fmt=fmt, prefix=ns.data_path, template=template,
            instruction=ns.is_instruction_dataset or fmt in ("alpaca", "sharegpt"),
            packing=ns.reset_attention_mask or ns.pack or ns.neat_pack, neat_pack=ns.neat_pack,
            dynamic=ns.no_pad_to_seq_lengths,  # MindSpeed-LLM's collator: --pad-to-multiple-of, else --seq-length
            pad_to_multiple_of=ns.pad_to_multiple_of, shuffle=not ns.no_shuffle, max_samples=ns.max_samples,
            seq_len=ns.seq_length, split=ns.split if ns.split is not None else MEGATRON_DEFAULT_SPLIT,
            reset_position_ids=ns.reset_position_ids, reset_attention_mask=ns.reset_attention_mask,
            eod_mask_loss=ns.eod_mask_loss, pack_rows=ns.pack or ns.neat_pack, padded_samples=ns.padded_samples,
            sampler=ns.dataloader_type or "single"),
        train=TrainArgs(
            micro_batch=ns.micro_batch_size, global_batch=ns.global_batch_size, steps=ns.train_iters,
            epochs=side.train_epochs, lr=ns.lr, min_lr=ns.min_lr, schedule=ns.lr_decay_style,
            warmup=ns.lr_warmup_iters, weight_decay=ns.weight_decay, betas=(ns.adam_beta1, ns.adam_beta2),
            eps=ns.adam_eps, grad_clip=ns.clip_grad, precision="bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32",
            seed=ns.seed, log_interval=ns.log_interval, save_interval=ns.save_interval,
            moe_aux_loss_coeff=ns.moe_aux_loss_coeff, exit_interval=ns.exit_interval,
            warmup_fraction=ns.lr_warmup_fraction, decay_steps=ns.lr_decay_iters,
            per_token_loss=ns.calculate_per_token_loss,
            log_micro_means=ns.stage == "sft" and not ns.calculate_per_token_loss),
        lora=lora,
        kernel_backend=side.kernel_backend,
        kernel_overrides=side.kernel_overrides,
        fused_ops=ns.use_fused_rmsnorm or ns.use_fused_swiglu or ns.use_fused_rotary_pos_emb,
        flash_attention=ns.use_flash_attn,
        save=ns.save,
        load=ns.load or None,
        export_hf=side.export_hf,
        metrics_file=side.metrics_file,
        load_args=LoadArgs(ns.finetune, ns.no_load_optim, ns.no_load_rng, ns.exit_on_missing_checkpoint,
                           ns.ckpt_format),
        checks=model_facts(ns, random_init=not side.load_hf and from_flags is None),
        hf2mg=ns.enable_hf2mg_convert,
        model_type_hf=ns.model_type_hf,
        tokenizer_use_fast=ns.tokenizer_use_fast,
        enable_thinking=ns.enable_thinking,
        moe_fusions=(ns.moe_grouped_gemm, ns.moe_permute_fusion),
        trackers=trackers,
    )
