"""The MindSpeed-LLM flag dialect → the engine's typed configuration.

This is the only module that knows flag spellings; everything else works on `LLMConfig`.
Flags follow MindSpeed-LLM / Megatron-LM names (REFERENCE.md); an unknown flag is an error
that lists the supported ones.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field
from typing import Any

HANDLER_FORMATS = {
    "GeneralPretrainHandler": "text",
    "AlpacaStyleInstructionHandler": "alpaca",
    "SharegptStyleInstructionHandler": "sharegpt",
    "AlpacaStylePairwiseHandler": "pairwise",
}
CP_ALGOS = {"megatron_cp_algo": "ring", "ulysses_cp_algo": "ulysses", "hybrid_cp_algo": "hybrid"}


class ConfigError(ValueError):
    """A flag the engine cannot accept; the message says which and what to do."""


@dataclass
class ModelArgs:
    model_id: str | None
    family: str | None
    load_hf: str | None
    tokenizer: str | None
    overrides: dict[str, Any]  # card arch keys given on the command line


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
    grad_clip: float
    precision: str
    seed: int
    log_interval: int
    save_interval: int | None
    moe_aux_loss_coeff: float
    exit_interval: int | None = None


@dataclass
class LoraArgs:
    rank: int
    alpha: float
    dropout: float
    targets: list[str]
    merge_on_export: bool


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
    finetune: bool
    extra: dict[str, Any] = field(default_factory=dict)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2; raise one clear error instead
        raise ConfigError(message)


def _parser() -> _Parser:
    p = _Parser(prog="python -m backends.llm", add_help=True, allow_abbrev=False)
    a = p.add_argument
    # model
    a("--model-id")
    a("--model-family")
    a("--load-hf")
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
    a("--rotary-base", type=float)
    a("--position-embedding-type", choices=["rope"], default="rope")
    a("--normalization", choices=["RMSNorm"], default="RMSNorm")
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
    a("--multi-head-latent-attention", action="store_true")
    a("--q-lora-rank", type=int)
    a("--kv-lora-rank", type=int)
    a("--qk-head-dim", type=int)
    a("--qk-pos-emb-head-dim", type=int)
    a("--v-head-dim", type=int)
    # parallel
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--num-layer-list", type=lambda s: [int(x) for x in s.split(",")])
    a("--num-layers-per-virtual-pipeline-stage", type=int)
    a("--sequence-parallel", action="store_true")
    a("--context-parallel-size", type=int, default=1)
    a("--context-parallel-algo", choices=sorted(CP_ALGOS), default="megatron_cp_algo")
    a("--cp-attention-mask-type", choices=["causal", "general"], default="causal")
    a("--ulysses-degree-in-cp", type=int)
    a("--expert-model-parallel-size", type=int, default=1)
    a("--use-distributed-optimizer", action="store_true")
    a("--use-torch-fsdp2", action="store_true")
    a("--recompute-granularity", choices=["full", "selective"])
    a("--recompute-method", choices=["uniform", "block"])
    a("--recompute-num-layers", type=int)
    # kernels
    a("--use-flash-attn", action="store_true")
    a("--use-fused-rmsnorm", action="store_true")
    a("--use-fused-swiglu", action="store_true")
    a("--use-fused-rotary-pos-emb", action="store_true")
    a("--kernel-backend", choices=["auto", "reference", "npu", "cuda"], default="auto")
    a("--kernel-override", action="append", default=[])
    # data
    a("--input")
    a("--handler-name", choices=sorted(HANDLER_FORMATS), default="GeneralPretrainHandler")
    a("--data-path", required=True)
    a("--prompt-type")
    a("--is-instruction-dataset", action="store_true")
    a("--finetune", action="store_true")
    a("--reset-attention-mask", action="store_true")
    a("--reset-position-ids", action="store_true")
    a("--neat-pack", action="store_true")
    a("--variable-seq-lengths", action="store_true")
    a("--pad-to-multiple-of", type=int, default=8)
    a("--no-shuffle", action="store_true")
    a("--max-samples", type=int)
    a("--seq-length", type=int, required=True)
    # training
    a("--micro-batch-size", type=int, default=1)
    a("--global-batch-size", type=int, required=True)
    a("--train-iters", type=int)
    a("--train-epochs", type=float)
    a("--lr", type=float, required=True)
    a("--min-lr", type=float, default=0.0)
    a("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    a("--lr-warmup-iters", type=int, default=0)
    a("--weight-decay", type=float, default=0.0)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.95)
    a("--clip-grad", type=float, default=0.0)
    a("--bf16", action="store_true")
    a("--fp16", action="store_true")
    a("--seed", type=int, default=1234)
    a("--log-interval", type=int, default=1)
    a("--save-interval", type=int)
    a("--exit-interval", type=int)  # Megatron: save and stop after this many iterations (pre-emptible jobs)
    a("--save")
    a("--load")
    a("--export-hf")
    a("--metrics-file")
    # LoRA
    a("--lora-r", type=int)
    a("--lora-alpha", type=float, default=16.0)
    a("--lora-dropout", type=float, default=0.0)
    a("--lora-target-modules", nargs="+", default=["all"])
    a("--lora-merge-on-export", action="store_true")
    return p


def supported_flags() -> list[str]:
    return sorted(opt for action in _parser()._actions for opt in action.option_strings if opt.startswith("--"))


def _check_unknown(unknown: list[str]) -> None:
    flags = [u for u in unknown if u.startswith("--")]
    if not unknown:
        return
    known = supported_flags()
    lines = []
    for flag in flags or unknown:
        name = flag.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1)
        lines.append(f"{name}" + (f" (did you mean {close[0]}?)" if close else ""))
    raise ConfigError("unsupported MindSpeed-LLM flag(s): " + ", ".join(lines)
                      + ". Supported flags: " + " ".join(known))


def parse_args(argv: list[str]) -> LLMConfig:
    ns, unknown = _parser().parse_known_args(argv)
    _check_unknown(unknown)
    if ns.train_iters is None and ns.train_epochs is None:
        raise ConfigError("give --train-iters or --train-epochs")
    if ns.bf16 and ns.fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other")
    if not ns.model_id and not ns.load_hf:
        raise ConfigError("give --load-hf <HF model dir> or --model-id <card id> (random init)")
    overrides = {key: getattr(ns, flag) for key, flag in (
        ("num_layers", "num_layers"), ("hidden_size", "hidden_size"), ("ffn_hidden_size", "ffn_hidden_size"),
        ("num_attention_heads", "num_attention_heads"), ("num_kv_heads", "num_query_groups"),
        ("head_dim", "kv_channels"), ("vocab_size", "padded_vocab_size"),
        ("max_position_embeddings", "max_position_embeddings"), ("rope_theta", "rotary_base"),
    ) if getattr(ns, flag) is not None}
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
    if ns.model_id:  # architecture switches the renderer spells out only when they are on
        overrides["tie_word_embeddings"] = not ns.untie_embeddings_and_output_weights
        overrides["qkv_bias"] = bool(ns.add_qkv_bias)
        overrides["qk_norm"] = bool(ns.qk_layernorm)
    fmt = HANDLER_FORMATS[ns.handler_name]
    lora = None
    if ns.lora_r:
        lora = LoraArgs(ns.lora_r, ns.lora_alpha, ns.lora_dropout, list(ns.lora_target_modules),
                        ns.lora_merge_on_export)
    overrides_k = {}
    for item in ns.kernel_override:
        op, _, impl = item.partition("=")
        if not impl:
            raise ConfigError(f"--kernel-override {item!r}: write op=backend, e.g. attention=reference")
        overrides_k[op] = impl
    return LLMConfig(
        model=ModelArgs(ns.model_id, ns.model_family, ns.load_hf, ns.tokenizer_name_or_path or ns.load_hf, overrides),
        parallel=ParallelArgs(
            tp=ns.tensor_model_parallel_size, pp=ns.pipeline_model_parallel_size, pp_layers=ns.num_layer_list,
            vpp_layers=ns.num_layers_per_virtual_pipeline_stage, sp=ns.sequence_parallel,
            cp=ns.context_parallel_size, cp_algo=CP_ALGOS[ns.context_parallel_algo],
            ulysses_degree=ns.ulysses_degree_in_cp, ep=ns.expert_model_parallel_size,
            moe_dispatcher=ns.moe_token_dispatcher_type, distributed_optimizer=ns.use_distributed_optimizer,
            fsdp=ns.use_torch_fsdp2, recompute=ns.recompute_granularity or "none",
            recompute_method=ns.recompute_method, recompute_num_layers=ns.recompute_num_layers),
        data=DataArgs(
            input=ns.input, fmt=fmt, prefix=ns.data_path, template=ns.prompt_type,
            instruction=ns.is_instruction_dataset or fmt in ("alpaca", "sharegpt"),
            packing=ns.reset_attention_mask, neat_pack=ns.neat_pack, dynamic=ns.variable_seq_lengths,
            pad_to_multiple_of=ns.pad_to_multiple_of, shuffle=not ns.no_shuffle, max_samples=ns.max_samples,
            seq_len=ns.seq_length),
        train=TrainArgs(
            micro_batch=ns.micro_batch_size, global_batch=ns.global_batch_size, steps=ns.train_iters,
            epochs=ns.train_epochs, lr=ns.lr, min_lr=ns.min_lr, schedule=ns.lr_decay_style,
            warmup=ns.lr_warmup_iters, weight_decay=ns.weight_decay, betas=(ns.adam_beta1, ns.adam_beta2),
            grad_clip=ns.clip_grad, precision="bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32",
            seed=ns.seed, log_interval=ns.log_interval, save_interval=ns.save_interval,
            moe_aux_loss_coeff=ns.moe_aux_loss_coeff, exit_interval=ns.exit_interval),
        lora=lora,
        kernel_backend=ns.kernel_backend,
        kernel_overrides=overrides_k,
        fused_ops=ns.use_fused_rmsnorm or ns.use_fused_swiglu or ns.use_fused_rotary_pos_emb,
        flash_attention=ns.use_flash_attn,
        save=ns.save,
        load=ns.load or None,
        export_hf=ns.export_hf,
        metrics_file=ns.metrics_file,
        finetune=ns.finetune,
    )
