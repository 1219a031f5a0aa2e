"""Every key of MindSpeed-LLM's FSDP2 arguments (mindspeed_llm/fsdp2/utils/arguments.py) with its type,
its default and what this engine does with it: USE (implemented with upstream's meaning), a notice (accepted,
one line saying why it changes no number here, printed when the key is given) or a refusal (the feature not
built, at any value but the ones listed). tests/llm/test_fsdp2_config.py holds this table against the
upstream key table (tests/fixtures/upstream/mindspeed-llm/fsdp2/arguments.tsv).

Types as upstream's parser builds them: str, int, float, bool (yes/no, true/false, t/f, y/n, 1/0; a bare
flag is true), list:T (one or more values), json (a JSON object or a plain string), or a tuple of choices.
"""

from __future__ import annotations

from dataclasses import dataclass

REQUIRED = object()


@dataclass(frozen=True)
class Use:
    allowed: tuple | None = None   # the values built (None: all); others are refused naming `missing`
    missing: str = ""


@dataclass(frozen=True)
class Notice:
    why: str


@dataclass(frozen=True)
class Refuse:
    missing: str
    allowed: tuple = ()   # values accepted besides the default (they change nothing)


USE = Use()
PERF = Notice("a performance switch: this engine picks its kernels itself and computes the same numbers")
NO_DOWNLOAD = Notice("this engine reads local model directories only and downloads nothing")
QUANT_ONLY = Notice("takes effect only with quant_recipe_name, which is refused here")
PREPROCESS = Notice("how many records or processes tokenize at once, not what they produce")
LOADER = Notice("how the data loader works, not what it yields: this engine loads batches in the main process")
LOGGING = Notice("logging/profiling: this engine logs metrics.jsonl and the progress line itself")
CP_ONLY = Notice("takes effect only with parallel.cp_size > 1 (context parallel), refused here")
TP_ONLY = Notice("takes effect only with parallel.tp_size > 1, refused here")
MG_ONLY = Notice("takes effect only with data.data_manager_type mg (Megatron data), refused here")
CHUNK_ONLY = Notice("takes effect only with parallel.enable_chunk_batch, which splits a batch for memory only")
EVAL_ONLY = Notice("evaluation/generation only; this engine does not evaluate")
DSA = Refuse("DeepSeek-V3.2 / GLM-5 sparse attention (DSA), whose models are not built here")
MODEL_IDS = ("gpt_oss", "qwen3", "qwen3_moe", "qwen3_next", "step35", "mamba3", "minimax_m27", "longcat_flash_ngram",
             "glm52", "deepseek_v4")
DTYPES = ("bf16", "fp16", "fp32")
LAYERS = ["model.layers.{*}"]

KEYS: dict[str, dict[str, tuple]] = {
    "model": {
        "model_name_or_path": ("str", REQUIRED, USE),
        # without model_id any causal LM transformers builds; qwen3 / qwen3_moe are transformers' own classes here
        "model_id": (MODEL_IDS, None, Use((None, "qwen3", "qwen3_moe"), "MindSpeed-LLM's own modeling of that model")),
        "init_model_with_meta_device": ("bool", False, Notice("where the weights are built first (memory), not what "
                                                              "they are")),
        "trust_remote_code": ("bool", False, USE),
        "train_from_scratch": ("bool", False, USE),
        "tokenizer_name_or_path": ("str", None, USE),
        "cache_dir": ("str", None, NO_DOWNLOAD),
        "use_fast_tokenizer": ("bool", True, USE),
        "resize_vocab": ("bool", False, Refuse("resizing the vocabulary")),
        "split_special_tokens": ("bool", False, Refuse("split_special_tokens tokenization")),
        "add_tokens": ("str", None, Refuse("adding tokens to the tokenizer")),
        "add_special_tokens": ("str", None, Refuse("adding special tokens to the tokenizer")),
        "new_special_tokens_config": ("str", None, Refuse("adding special tokens to the tokenizer")),
        "init_special_tokens": (("noise_init", "desc_init", "desc_init_w_noise"), "noise_init",
                                Notice("initialises added special tokens, and adding tokens is refused here")),
        "model_revision": ("str", "main", Refuse("model revisions (a local model directory is read as it is)")),
        "hf_hub_token": ("str", None, NO_DOWNLOAD),
        "ms_hub_token": ("str", None, NO_DOWNLOAD),
        "om_hub_token": ("str", None, NO_DOWNLOAD),
        "quant_recipe_name": (("mxfp8",), None, Refuse("MXFP8 quantized training")),
        "quant_apply_modules": ("list:str", LAYERS, QUANT_ONLY),
        "quant_ignored_modules": ("list:str", ["*lm_head", "*gate"], QUANT_ONLY),
        "quant_converters": ("list:str", ["quantize.linear.mx"], QUANT_ONLY),
        "enable_fsdp_low_precision_all_gather": ("bool", True, QUANT_ONLY),
        "fsdp_low_precision_all_gather_mode": (("on-demand", "all"), "on-demand", QUANT_ONLY),
    },
    "data": {
        "template": ("str", None, USE),
        "dataset": ("json", None, USE),
        "eval_dataset": ("json", None, Refuse("evaluation during training")),
        "dataset_dir": ("str", "./configs/fsdp2/data", USE),
        "cutoff_len": ("int", 2048, USE),
        "train_on_prompt": ("bool", False, USE),
        "mask_history": ("bool", False, USE),
        "streaming": ("bool", False, Refuse("dataset streaming")),
        "buffer_size": ("int", 16384, Notice("takes effect only with streaming, which is refused here")),
        "mix_strategy": (("concat", "interleave_under", "interleave_over"), "concat",
                         Refuse("interleaved dataset mixing")),
        "interleave_probs": ("str", None, Refuse("interleaved dataset mixing")),
        "overwrite_cache": ("bool", False, Notice("this engine's tokenized cache is keyed by its inputs, so a stale "
                                                  "one is never read")),
        "preprocessing_batch_size": ("int", 1000, PREPROCESS),
        "preprocessing_num_workers": ("int", None, PREPROCESS),
        "max_samples": ("int", None, USE),
        "eval_num_beams": ("int", None, EVAL_ONLY),
        "ignore_pad_token_for_loss": ("bool", True, Notice("read by generation only (padding never enters the loss "
                                                           "in training)")),
        "val_size": ("float", 0.0, Refuse("evaluation during training (val_size)")),
        "eval_on_each_dataset": ("bool", False, EVAL_ONLY),
        "packing": ("bool", False, Refuse("sequence packing in this backend")),
        "neat_packing": ("bool", False, Refuse("sequence packing in this backend")),
        "tool_format": ("str", None, Refuse("tool formats (function calling)")),
        "default_system": ("str", None, Refuse("overriding the template's system message")),
        "enable_thinking": ("bool?", True, Use((True,), "enable_thinking false (thinking-off templates)")),
        "tokenized_path": ("str", None, Refuse("saving / loading tokenized datasets")),
        "data_shared_file_system": ("bool", False, Notice("where ranks write caches, not what they hold")),
        "data_manager_type": (("lf", "mg"), "lf", Use(("lf",), "data_manager_type mg (Megatron data) in this "
                                                              "backend")),
        "split": ("str", "100,0,0", MG_ONLY),
        "create_attention_mask_in_dataloader": ("bool?", False, MG_ONLY),
        "no_shared_storage": ("bool?", False, MG_ONLY),
        "dataloader_type": (("single",), "single", MG_ONLY),
        "reset_attention_mask": ("bool?", False, MG_ONLY),
        "append_eod": ("bool?", False, MG_ONLY),
    },
    "parallel": {
        "tp_size": ("int", 1, Use((1,), "tensor parallel (tp_size > 1) in this backend")),
        "fsdp_size": ("int", 1, USE),
        "recompute": ("bool", False, USE),
        "ep_size": ("int", 1, USE),
        "ep_fsdp_size": ("int", 1, Use((1,), "FSDP inside expert-parallel groups (ep_fsdp_size > 1)")),
        "cp_size": ("int", 1, Use((1,), "context parallel (cp_size > 1) in this backend")),
        "cp_type": (("ulysses", "ring", "kvallgather"), "ulysses", CP_ONLY),
        "fsdp_modules": ("list:str", LAYERS + ["model.embed_tokens", "lm_head"], USE),
        "ignored_modules": ("list:str", None, Refuse("modules left out of FSDP (ignored_modules)")),
        "reshard_after_forward": ("bool", True, USE),
        "shard_placement_fn": ("str", None, Refuse("custom shard placement functions")),
        "efsdp_shard_placement_fn": ("str", "shard_by_dim_1", Notice("takes effect only with ep_fsdp_size > 1, "
                                                                     "refused here")),
        "hook_modules": ("list:str", LAYERS, Notice("modules given prefetch hooks (performance)")),
        "fsdp_implementation": (("custom", "native"), "native", Refuse("MindSpeed's custom FSDP implementation")),
        "tp_colwise": ("list:str", ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"], TP_ONLY),
        "tp_rowwise": ("list:str", ["*.o_proj", "*.down_proj"], TP_ONLY),
        "ep_modules": ("list:str", ["model.layers.{*}.mlp.experts"], USE),
        "ep_fsdp_modules": ("list:str", ["model.layers.{*}.mlp.experts"], Notice("takes effect only with "
                                                                                 "ep_fsdp_size > 1, refused here")),
        "ep_dispatcher": (("eager", "fused", "mc2"), "eager", Use(("eager",), "the fused / mc2 token dispatchers "
                                                                           "(eager, all-to-all, is built)")),
        "recompute_modules": ("list:str", LAYERS, USE),
        "param_dtype": (DTYPES, "bf16", USE),
        "reduce_dtype": (DTYPES, "fp32", USE),
        "num_to_forward_prefetch": ("int", 1, PERF),
        "num_to_backward_prefetch": ("int", 1, PERF),
        "enable_chunk_batch": ("bool", False, Notice("splits each batch inside a layer to save memory; the numbers "
                                                     "are those of the whole batch")),
        "chunk_mbs": ("int", 1, CHUNK_ONLY),
        "chunk_mbs_batch_dim": ("int", 0, CHUNK_ONLY),
        "chunk_mbs_modules": ("list:str", LAYERS, CHUNK_ONLY),
        "chunk_mbs_arg_indexs": ("list:int", [0], CHUNK_ONLY),
        "chunk_mbs_kwarg_names": ("list:str", ["position_embeddings", "position_ids", "attention_mask", "input_ids"],
                                  CHUNK_ONLY),
    },
    "training": {
        "output_dir": ("str", REQUIRED, USE),
        "deterministic": ("bool?", True, Notice("this engine's CPU and GPU kernels are deterministic as chosen")),
        "optimizer": (("adamw", "muon", "fused_adamw"), "adamw", Use(("adamw", "fused_adamw"), "the Muon optimizer")),
        "lr": ("float", 1e-05, USE),
        "weight_decay": ("float", 0.01, USE),
        "adam_beta1": ("float", 0.9, USE),
        "adam_beta2": ("float", 0.95, USE),
        "adam_epsilon": ("float", 1e-08, USE),
        "max_grad_norm": ("float", 1.0, USE),
        "lr_scheduler_type": (("cosine", "linear", "constant"), "cosine", USE),
        "warmup_ratio": ("float", 0.03, USE),
        "min_lr": ("float", 1e-06, USE),
        "num_train_epochs": ("float", 3.0, USE),
        "max_steps": ("int", -1, USE),
        "gradient_accumulation_steps": ("int", 1, USE),
        "disable_shuffling": ("bool", False, USE),
        "seed": ("int", 42, USE),
        "indexer_loss_coeff": ("float", 1.0, Notice("weights the DSA indexer loss of DeepSeek-V3.2 / GLM-5, models "
                                                    "not built here")),
        "router_aux_loss_coef": ("float", 0.0, Refuse("the MoE router auxiliary loss in this backend")),
        "save_steps": ("int", 500, USE),
        "save_total_limit": ("int", 3, USE),
        "resume_from_checkpoint": ("str", None, USE),
        "logging_steps": ("int", 1, USE),
        "log_throughput": ("bool", False, LOGGING),
        "log_cpu_memory": ("bool", False, LOGGING),
        "mtp_loss_scaling_factor": ("float", 0.3, Notice("weights multi-token-prediction losses, which the models "
                                                         "built here do not have")),
        "stage": (("pt", "sft"), "sft", Use(("sft",), "stage pt (pretraining goes through data_manager_type mg)")),
        "calculate_per_token_loss": ("bool", False, Notice("read by stage pt only (refused here); sft takes the "
                                                           "token mean over the global batch")),
        "dataloader_num_workers": ("int", 0, LOADER),
        "dataloader_prefetch_factor": ("int", None, LOADER),
        "dataloader_pin_memory": ("bool", True, LOADER),
        "dataloader_persistent_workers": ("bool", False, LOADER),
        "dataloader_drop_last": ("bool", False, USE),
        "per_device_train_batch_size": ("int", 8, USE),
        "save_only_model": ("bool", False, Refuse("checkpoints without the optimizer state (save_only_model)")),
        "save_async": ("bool", False, Notice("when the checkpoint is written, not what it holds")),
        "save_epochs": ("int", 1, Notice("checkpoint cadence: this engine saves every save_steps and at "
                                                 "the end of training")),
        "save_hf_weights": ("bool", True, Notice("the Hugging Face export is not written by this backend yet; "
                                                       "checkpoints are DCP")),
        "profile": ("bool", False, LOGGING),
        "profile_step_start": ("int", 0, LOGGING),
        "profile_step_end": ("int", -1, LOGGING),
        "profile_ranks": ("list:int", [-1], LOGGING),
        "profile_level": ("str", "level0", LOGGING),
        "profile_export_type": ("str", "text", LOGGING),
        "profile_data_simplification": ("bool", False, LOGGING),
        "profile_with_cpu": ("bool", False, LOGGING),
        "profile_with_stack": ("bool", False, LOGGING),
        "profile_with_memory": ("bool", False, LOGGING),
        "profile_record_shapes": ("bool", False, LOGGING),
        "profile_save_path": ("str", "./profile", LOGGING),
    },
    "optimization": {
        "use_fused_rmsnorm": ("bool", False, PERF),
        "moe_grouped_gemm": ("bool", False, PERF),
        "use_fused_rotary_pos_emb": ("bool", False, PERF),
        "use_flash_attn": ("bool", False, PERF),
        "use_sparse_flash_attn": ("bool", False, DSA),
        "use_fused_lightning_indexer": ("bool", False, DSA),
        "use_fused_lightning_indexer_loss": ("bool", False, DSA),
        "use_ascend_mhc": ("bool", False, Refuse("DeepSeek-V4's MHC, whose model is not built here")),
        "use_triton_swiglu_limit": ("bool", False, Refuse("DeepSeek-V4's SwiGLU with limit, whose model is not "
                                                          "built here")),
        "pre_tokens": ("int", 1048576, Refuse("attention windows (pre_tokens / next_tokens) other than causal")),
        "next_tokens": ("int", 0, Refuse("attention windows (pre_tokens / next_tokens) other than causal")),
        "use_triton_gdn": ("bool", False, PERF),
        "use_flash_gdn": ("bool", False, PERF),
        "gdn_chunk_size": ("int", 64, PERF),
        "chunk_loss_size": ("int", None, Notice("this engine's loss is always the chunked linear cross entropy (the "
                                                "logits are never built whole); the numbers are the same")),
        "use_triton_rmsnormgated": ("bool", False, PERF),
        "fix_router": ("bool", False, Refuse("round-robin MoE routing (fix_router)")),
    },
}
