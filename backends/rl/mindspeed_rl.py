"""The MindSpeed-RL dialect: MindSpeed-RL's own YAML (cli/train_grpo.py's Hydra config) read into RLConfig.

A MindSpeed-RL file has the sections of its config classes (public repo, commit 05a90d77,
mindspeed_rl/config_cls/): `megatron_training`, `actor_config`, `ref_config`, `reward_config`,
`critic_config` (MegatronConfig), `rl_config` (RLConfig) and `generate_config` (GenerateConfig, with
`sampling_config`), and `defaults: - model: [<name>]`, which composes `model/<name>.yaml` beside the
file (configs/model/ upstream) into `model`. As MindSpeed-RL builds its roles, the actor is
MegatronConfig({**megatron_training, **actor_config}, model): the model file's entry named by the
`model` key first, then megatron_training, then actor_config on top (the reference likewise with
ref_config). Numbers are read as Hydra reads them (`1e-6` is a float).

Every key must be one those classes accept (their update() raises on any other): an unknown key is
refused by name with a did-you-mean. A key the engine maps is read with MindSpeed-RL's meaning:

  megatron_training.global_batch_size   prompts per step (train_batch_size)
  rl_config.mini_batch_size             prompts per policy update (MindSpeed-RL multiplies it by n)
  actor_config.micro_batch_size         responses per forward (micro_batch_size)
  rl_config.n_samples_per_prompt        responses per prompt (n)
  generate_config.sampling_config       temperature, top_p, top_k (-1: off), max_tokens; a missing
                                        key takes the value MindSpeed-RL's vLLM call falls back to
  rl_config.epochs / clip_ratio (clip_ratio_low / clip_ratio_high with clip_higher_enable) /
    entropy_coeff / init_kl_coef (the KL loss coefficient) / kl_penalty (its estimator) /
    token_level_loss (token-mean, else seq-mean-token-mean) / max_prompt_length / gamma / lam;
    the surrogate is MindSpeed-RL's plain clipped one (no dual clip: NO_DUAL_CLIP)
  rl_config.verifier_function           one verifier (VERIFIERS below) at weight 1.0; a name
                                        MindSpeed-RL would skip (scoring 0) is refused here
  megatron_training.prompt_type         the chat template the prompts are built with (TEMPLATES,
                                        MindSpeed-RL's configs/model/templates.json)
  megatron_training.data_path           a JSONL file of {"prompt", "labels"} rows (prompt: a string
                                        or a list of {role, content} messages; labels: the answer),
                                        as ascendfactory renders it; dataset_additional_keys: [labels]
  actor_config.load                     the Hugging Face model directory the actor starts from (the
                                        model file's architecture keys must describe it)
  lr, weight_decay, adam_beta1/2, clip_grad, lr_warmup_fraction, recompute_granularity, seed,
  train_iters, save, save_interval, bf16 (precision), actor_resource.num_npus (the world size)

A key the engine does not implement is accepted only at MindSpeed-RL's default (or where it does not
change what a step computes: kernels, fusions, logging, Ray and vLLM plumbing; NO_EFFECT), else it
is refused by name. The actor and the reference run data x pipeline x context x tensor parallel
(tensor_model_parallel_size: the LLM engine's Megatron TP plan, log-probs vocab-parallel;
context_parallel_size with context_parallel_algo megatron_cp_algo (ring) or ulysses_cp_algo: the
sequences of the log-prob passes and updates sharded over the cp ranks, backends/rl/context_parallel.py;
pipeline_model_parallel_size: the layers split evenly over the stages, log-probs and updates through them,
the rollout on the whole model gathered over the stages, backends/rl/pipeline_parallel.py; the reference
on the actor's tp or 1, on the actor's cp and pp); hybrid_cp_algo is refused (MindSpeed-RL's
MegatronConfig has no ulysses_degree_in_cp key to set its Ulysses degree with), and so are pp x cp,
an uneven or interleaved pipeline split (num_layer_list, num_layers_per_virtual_pipeline_stage) and
expert parallel sizes above 1. GRPO only (stage ray_grpo, adv_estimator group_norm):
DAPO and PPO run in the VeRL dialect. Errors name the key and the file; the engine exits 2 on them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from .config import (BATCH_NUMBERS, KL_KINDS, RLConfig, RLConfigError, _with_sidecar, apply_overrides, batch_problems,
                     did_you_mean)
from .rewards import boxed_math

DERIVED = "<computed from other keys>"   # a default MindSpeed-RL's __init__ derives from other settings
# MindSpeed-RL's GRPO loss is the plain clipped surrogate, no dual clip: a bound the engine's clamped
# ratio (at most e^20) never reaches turns the dual clip off
NO_DUAL_CLIP = 1e9

# ====================================================================== MindSpeed-RL's keys and defaults
# (mindspeed_rl/config_cls/{megatron_config,rl_config,generate_config}.py at 05a90d77; the test holds
# them against ../shared/upstream/mindspeed-rl-config-keys.tsv)

MEGATRON: dict[str, Any] = {
    "use_mcore_models": False, "spec": None, "sequence_parallel": False, "use_flash_attn": False,
    "use_rotary_position_embeddings": False, "use_fused_rmsnorm": False, "use_fused_swiglu": False,
    "shape_order": "SBH", "no_bias_dropout_fusion": False, "rope_scaling_type": None, "rope_scaling_factor": 1.0,
    "low_freq_factor": None, "high_freq_factor": None, "original_max_position_embeddings": None,
    "max_position_embeddings": None, "beta_fast": 32, "beta_slow": 1, "rope_scaling_mscale": 1.0,
    "rope_scaling_mscale_all_dim": 0.0, "rope_scaling_original_max_position_embeddings": None, "num_layers": None,
    "hidden_size": None, "ffn_hidden_size": None, "num_attention_heads": None, "kv_channels": None,
    "group_query_attention": False, "num_query_groups": 1, "untie_embeddings_and_output_weights": False,
    "multi_latent_attention": False, "qk_pos_emb_head_dim": None, "qk_head_dim": None, "q_lora_rank": None,
    "kv_lora_rank": None, "v_head_dim": None, "qk_layernorm": False, "moe_grouped_gemm": False,
    "moe_permutation_async_comm": False, "moe_tp_extend_ep": False, "moe_alltoall_overlap_comm": False,
    "use_fused_moe_token_permute_and_unpermute": False, "moe_token_dispatcher_type": None, "seq_aux": False,
    "first_k_dense_replace": None, "moe_layer_freq": None, "moe_router_topk": 2, "num_experts": None,
    "n_shared_experts": None, "moe_ffn_hidden_size": None, "moe_router_load_balancing_type": "aux_loss",
    "moe_router_num_groups": None, "moe_router_group_topk": None, "moe_router_topk_scaling_factor": None,
    "norm_topk_prob": False, "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
    "log_throughput": False, "make_vocab_size_divisible_by": 128, "padded_vocab_size": None, "add_qkv_bias": False,
    "disable_bias_linear": False, "attention_dropout": 0.1, "init_method_std": 0.02, "hidden_dropout": 0.1,
    "position_embedding_type": "learned_absolute", "rotary_base": 10000, "normalization": "LayerNorm",
    "norm_epsilon": 1e-05, "swiglu": False, "no_masked_softmax_fusion": False, "attention_softmax_in_fp32": False,
    "no_gradient_accumulation_fusion": False, "bf16": True, "use_distributed_optimizer": False,
    "global_batch_size": None, "seq_length": None, "tokenizer_type": None, "tokenizer_name_or_path": None,
    "train_iters": None, "eval_iters": 100, "distributed_backend": "nccl", "no_shared_storage": False,
    "save_interval": None, "no_load_optim": None, "no_load_rng": None, "no_save_optim": None, "no_save_rng": None,
    "is_instruction_dataset": False, "is_pairwise_dataset": False, "variable_seq_lengths": False,
    "no_pad_to_seq_lengths": False, "no_shuffle": False, "stage": None, "micro_batch_size": None,
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1,
    "num_layers_per_virtual_pipeline_stage": None, "lr": None, "lr_decay_style": "linear", "min_lr": 0.0,
    "weight_decay": 0.01, "lr_warmup_fraction": None, "clip_grad": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
    "initial_loss_scale": 2 ** 32, "finetune": False, "load": None, "save": None, "pad_to_multiple_of": DERIVED,
    "data_path": None, "split": None, "dataloader_type": None, "enable_high_availability": False,
    "context_parallel_size": 1, "context_parallel_algo": "ulysses_cp_algo", "reset_position_ids": False,
    "optimizer": "adam", "do_sample": False, "use_kv_cache": False, "use_tp_pp_dp_mapping": False,
    "log_interval": 100, "load_checkpoint_loosely": False, "prompt_type": None, "prompt_type_path": DERIVED,
    "tokenizer_not_use_fast": False, "use_fused_rotary_pos_emb": False, "full_shuffle_instruction_dataset": False,
    "tokenizer_padding_side": "right", "num_workers": 2, "skip_train": False, "eval_interval": 1000, "seed": 1234,
    "vocab_extra_ids": 0, "algorithm": None, "ddp_bucket_size": None, "no_check_for_nan_in_loss_and_grad": False,
    "overlap_grad_reduce": False, "accumulate_allreduce_grads_in_fp32": False, "pretrained_checkpoint": None,
    "reuse_fp32_param": False, "recompute_granularity": None, "recompute_method": None,
    "recompute_num_layers": None, "num_layer_list": None, "dataset_additional_keys": [],
    "npu_deterministic": False, "overlap_param_gather": False, "recompute_activation_function": False,
    "swap_attention": False, "ai_framework": None, "noop_layers": None, "attention_mask_type": "causal",
    "reset_attention_mask": False, "use_cp_send_recv_overlap": False, "use_fused_ring_attention_update": False,
    "dpo_loss_type": "sigmoid", "ref_model": "", "refer_model_iter": 1, "use_ascend_coc": False, "coc_mode": -1,
    "coc_parallel_num": 1, "coc_fused_kernel": False, "swap_optimizer": False, "mm_model": None,
    "attention_bias": False, "moe_aux_loss_coeff": 0.001, "gemm_gradient_accumulation_fusion": False,
    "lora_ckpt_filter": False, "lora_r": 8, "lora_alpha": 16, "lora_fusion": False, "lora_target_modules": None,
    "transformer_impl": "local",
}

RL: dict[str, Any] = {
    "runtime_env_path": "configs/envs/runtime_env.yaml", "hccl_buffersize": 256, "rule_reward": True, "beta": 0.1,
    "actor_resource": {"num_npus": None}, "reference_resource": None, "reward_resource": None,
    "critic_resource": None, "vit_resource": None, "num_samples_per_step": 1, "max_prompt_length": 512,
    "epochs": 1, "clip_ratio": 0.2, "cliprange_value": 0.5, "entropy_coeff": 0.0, "gamma": 1.0, "lam": 0.95,
    "advantage_whiten": True, "kl_penalty": "low_var_kl", "kl_ctrl_type": "fixed", "init_kl_coef": 0.01,
    "kl_horizon": 1000, "kl_target": 100.0, "adv_estimator": "group_norm", "verifier_function": ["base_acc"],
    "verifier_weight": [1.0], "verifier_parallel": 1, "verifier_timeout": 30, "integrated_mode_config": None,
    "use_kl_in_reward": False, "shuffle_mini_batch": False, "tp_split_expert": False, "use_tensorboard": False,
    "use_wandb": False, "wandb_project": "", "wandb_exp_name": "", "wandb_save_dir": "", "use_swanlab": False,
    "swanlab_mode": "", "swanlab_project": "", "swanlab_exp_name": "", "swanlab_save_dir": "", "blocking": True,
    "async_engine": False, "guarantee_order": False, "num_cpus_for_local_task": 1,
    "num_cpus_for_placement_group": 8, "use_integrated_worker": True, "use_dp_batch_balance": False,
    "ref_forward_micro_batch_size": None, "actor_forward_micro_batch_size": None,
    "vit_forward_micro_batch_size": None, "actor_rollout_dispatch_size": None, "actor_logprob_dispatch_size": None,
    "ref_dispatch_size": None, "reward_dispatch_size": None, "dynamic_sampling_dispatch_size": None,
    "adv_dispatch_size": None, "actor_update_dispatch_size": None, "critic_update_dispatch_size": None,
    "critic_value_dispatch_size": None, "kl_dispatch_size": None, "actor_image_embeds_dispatch_size": None,
    "is_multimodal": False, "use_remove_padding": False, "reuse_image_embeds": False,
    "colocate_actor_and_vit": False, "n_samples_per_prompt": 1, "mini_batch_size": 1,
    "use_dynamic_bsz": False, "max_packing_token_size": 4096, "ref_max_packing_token_size": DERIVED,
    "actor_max_packing_token_size": DERIVED, "update_max_packing_token_size": DERIVED,
    "dynamic_max_batch_size": None, "ref_dynamic_max_batch_size": DERIVED, "actor_dynamic_max_batch_size": DERIVED,
    "update_dynamic_max_batch_size": DERIVED, "log_max_throughput": True, "token_level_loss": True,
    "data_strategy": "td", "transfer_queue_data_shard_num": 1,
    "transfer_queue_data_shard_port_base": None, "clip_higher_enable": False, "clip_ratio_low": 0.1,
    "clip_ratio_high": 0.1, "overlong_buffer_enable": False, "overlong_buffer": 0,
    "overlong_buffer_penalty_factor": 1.0, "rollout_max_tokens": 2048, "filter_groups_enable": False,
    "filter_groups_metric": "acc", "filter_groups_max_batches": 1, "filter_groups_train_batch_size": 1,
    "zmq_communication": True, "partial_rollout_max_split": 1, "require_max_age_all_finished": True,
    "multi_turn_enable": False, "tool_config_path": None, "max_tool_calls": 0, "max_parallel_calls": 0,
    "max_total_response_length": 0, "max_tool_response_length": 0, "tool_response_truncate_side": None,
    "tool_parser_format": None, "share_backbone": False,
}

GENERATE: dict[str, Any] = {
    "limit_mm_image_per_prompt": 1, "limit_mm_video_per_prompt": 0, "data_parallel_size": None,
    "tokenizer_name_or_path": "/path/to/tokenizer", "trust_remote_code": False, "eplb_token_collects": False,
    "eplb_token_save_path": "./", "expert_map_path": None, "infer_tensor_parallel_size": 8,
    "infer_pipeline_parallel_size": 1, "infer_expert_parallel_size": 1, "max_num_seqs": 1, "max_model_len": 2048,
    "max_num_batched_tokens": 2048, "dtype": "bfloat16", "gpu_memory_utilization": 0.5,
    "offload_train_optimizer": False, "offload_train_grad": False, "offload_train_param": False,
    "enable_prefix_caching": False, "num_scheduler_steps": 1, "enforce_eager": True, "torchair_graph": False,
    "enable_expert_parallel": False, "ascend_scheduler_config_enabled": True, "sampling_config": DERIVED,
}

# GenerateConfig.sampling_config: its default, its only keys; a file's sampling_config replaces the whole
# dict and vLLM's SamplingParams call falls back to these same values for a missing key
SAMPLING: dict[str, Any] = {"logprobs": 1, "max_tokens": 128, "top_p": 1.0, "top_k": 50, "min_p": 0.0,
                            "temperature": 0.2, "detokenize": False, "seed": None}

MEGATRON_SECTIONS = ("megatron_training", "actor_config", "ref_config", "reward_config", "critic_config")
SECTIONS: dict[str, dict[str, Any]] = {**{s: MEGATRON for s in MEGATRON_SECTIONS}, "rl_config": RL,
                                       "generate_config": GENERATE}
MARKERS = ("megatron_training", "rl_config", "actor_config")   # top-level keys that tell the dialect

# keys that change nothing a training step computes here: kernels and fusions, logging, checkpoint
# plumbing, Ray / vLLM / dispatch settings, settings of features that are off (MoE kernels without
# experts, packing without dynamic batches, GAE / adaptive-KL settings under group_norm / fixed)
NO_EFFECT: dict[str, set[str]] = {
    "megatron": {
        "use_mcore_models", "sequence_parallel", "use_flash_attn", "use_rotary_position_embeddings",
        "use_fused_rmsnorm", "use_fused_swiglu", "use_fused_rotary_pos_emb", "shape_order", "no_bias_dropout_fusion",
        "no_masked_softmax_fusion", "attention_softmax_in_fp32", "no_gradient_accumulation_fusion",
        "gemm_gradient_accumulation_fusion", "use_distributed_optimizer", "log_throughput", "eval_iters",
        "eval_interval", "log_interval", "distributed_backend", "no_shared_storage", "no_load_optim", "no_load_rng",
        "no_save_optim", "no_save_rng", "num_workers", "load_checkpoint_loosely", "overlap_grad_reduce",
        "overlap_param_gather", "accumulate_allreduce_grads_in_fp32", "ddp_bucket_size", "reuse_fp32_param",
        "recompute_method", "recompute_num_layers", "recompute_activation_function", "swap_attention",
        "swap_optimizer", "npu_deterministic", "use_ascend_coc", "coc_mode", "coc_parallel_num", "coc_fused_kernel",
        "no_check_for_nan_in_loss_and_grad", "initial_loss_scale", "pad_to_multiple_of", "use_tp_pp_dp_mapping",
        "use_cp_send_recv_overlap", "use_fused_ring_attention_update", "dataloader_type",
        "variable_seq_lengths", "no_pad_to_seq_lengths", "transformer_impl", "use_kv_cache", "do_sample",
        "enable_high_availability", "finetune", "init_method_std", "seq_length", "make_vocab_size_divisible_by",
        "tokenizer_not_use_fast", "tokenizer_padding_side", "min_lr", "moe_grouped_gemm",
        "moe_permutation_async_comm", "moe_alltoall_overlap_comm", "use_fused_moe_token_permute_and_unpermute",
        "moe_aux_loss_coeff", "num_layers_per_virtual_pipeline_stage", "dpo_loss_type", "ref_model",
        "refer_model_iter", "lora_r", "lora_alpha", "lora_fusion", "lora_ckpt_filter",
    },
    "rl": {
        "runtime_env_path", "hccl_buffersize", "beta", "verifier_parallel", "verifier_timeout",
        "use_tensorboard", "use_wandb", "wandb_project", "wandb_exp_name", "wandb_save_dir", "use_swanlab",
        "swanlab_mode", "swanlab_project", "swanlab_exp_name", "swanlab_save_dir", "blocking", "guarantee_order",
        "num_cpus_for_local_task", "num_cpus_for_placement_group", "ref_forward_micro_batch_size",
        "actor_forward_micro_batch_size", "vit_forward_micro_batch_size", "actor_rollout_dispatch_size",
        "actor_logprob_dispatch_size", "ref_dispatch_size", "reward_dispatch_size", "dynamic_sampling_dispatch_size",
        "adv_dispatch_size", "actor_update_dispatch_size", "critic_update_dispatch_size", "critic_value_dispatch_size",
        "kl_dispatch_size", "actor_image_embeds_dispatch_size", "use_remove_padding", "max_packing_token_size",
        "ref_max_packing_token_size", "actor_max_packing_token_size", "update_max_packing_token_size",
        "dynamic_max_batch_size", "ref_dynamic_max_batch_size", "actor_dynamic_max_batch_size",
        "update_dynamic_max_batch_size", "log_max_throughput", "data_strategy", "transfer_queue_data_shard_num",
        "transfer_queue_data_shard_port_base", "zmq_communication", "cliprange_value", "advantage_whiten",
        "kl_horizon", "kl_target",
    },
    "generate": {
        "data_parallel_size", "trust_remote_code", "eplb_token_collects", "eplb_token_save_path", "expert_map_path",
        "max_num_seqs", "max_num_batched_tokens", "offload_train_optimizer",
        "offload_train_grad", "offload_train_param", "enable_prefix_caching", "num_scheduler_steps",
        "torchair_graph", "enable_expert_parallel", "ascend_scheduler_config_enabled",
        "limit_mm_image_per_prompt", "limit_mm_video_per_prompt",
    },
}
SAMPLING_NO_EFFECT = {"logprobs", "detokenize"}
# MindSpeed-RL's context_parallel_algo -> the engine's (hybrid_cp_algo is refused: no Ulysses degree key)
CP_ALGOS = {"megatron_cp_algo": "ring", "ulysses_cp_algo": "ulysses"}
PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size")

# ====================================================================== prompt templates
# MindSpeed-RL's configs/model/templates.json (LLaMA-Factory's formatters) for prompt_type, without the
# tool-calling templates; BOS stands for the tokenizer's bos token. Unset formatters take
# LLaMA-Factory's defaults: system "{content}", assistant "{content}" + EOS (none with efficient_eos).

BOS, EOS = ("bos_token",), ("eos_token",)
TEMPLATES: dict[str, dict[str, Any]] = {
    "default": {"user": ["Human: {content}\nAssistant:"], "system": ["{content}\n"], "separator": ["\n"]},
    "empty": {"user": ["{content}"], "assistant": ["{content}"]},
    "trl": {"user": ["{content}"], "assistant": ["{content}"], "prefix": [BOS]},
    "qwen": {"user": ["<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"],
             "system": ["<|im_start|>system\n{content}<|im_end|>\n"], "separator": ["\n"],
             "default_system": "You are a helpful assistant.", "stop": ["<|im_end|>"]},
    "qwen_r1": {"user": ["<|im_start|>user\nA conversation between User and Assistant. The user asks a question, and "
                         "the Assistant solves it. The assistant first thinks about the reasoning process in the mind "
                         "and then provides the user with the answer. The reasoning process and answer are enclosed "
                         "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning "
                         "process here </think><answer> answer here </answer>. Put your final answer within "
                         "\\boxed{}.\n{content}<|im_end|>\n<|im_start|>assistant\n"],
                "system": ["<|im_start|>system\n{content}<|im_end|>\n"], "separator": ["\n"],
                "default_system": "You are a helpful assistant.", "stop": ["<|im_end|>"]},
    "qwen_math_r1": {"user": ["<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"],
                     "system": ["<|im_start|>system\n{content}<|im_end|>\n"], "separator": ["\n"],
                     "default_system": "Please reason step by step, and put your final answer within \\boxed{}.",
                     "stop": ["<|im_end|>"]},
    "qwen3": {"user": ["<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"],
              "assistant": ["{content}<|im_end|>\n"], "system": ["<|im_start|>system\n{content}<|im_end|>\n"],
              "stop": ["<|im_end|>"]},
    "llama3": {"user": ["<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|><|start_header_id|>assistant"
                        "<|end_header_id|>\n\n"],
               "system": ["<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>"], "prefix": [BOS],
               "stop": ["<|eot_id|>"]},
    "mistral": {"user": ["[INST] {content} [/INST]"], "prefix": [BOS]},
    "mixtral": {"user": ["[INST] {content} [/INST]"], "prefix": [BOS]},
    "gemma": {"user": ["<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n"],
              "separator": ["<end_of_turn>\n"], "prefix": [BOS], "efficient_eos": True},
    "llama2": {"user": [BOS, "[INST] {content} [/INST]"], "system": ["<<SYS>>\n{content}\n<</SYS>>\n\n"],
               "system_in_user": True},
    "alpaca": {"user": ["### Instruction:\n{content}\n\n### Response:\n"], "separator": ["\n\n"],
               "default_system": "Below is an instruction that describes a task. Write a response that appropriately "
                                 "completes the request.\n\n"},
    "deepseek2": {"user": ["User: {content}\n\nAssistant:"], "system": ["{content}\n\n"], "prefix": [BOS]},
    "deepseek2-lite": {"user": ["User: {content}\n\nAssistant:"], "system": ["{content}\n\n"], "prefix": [BOS]},
    "minicpm3": {"user": ["User: {content}\n\nAssistant:"], "system": ["{content}\n\n"], "prefix": [BOS]},
    "baichuan2": {"user": ["<reserved_106>{content}<reserved_107>"], "efficient_eos": True},
    "deepseek3": {"user": ["<｜User｜>{content}<｜Assistant｜>"], "prefix": [BOS]},
    "deepseek3_r1": {"user": ["A conversation between User and Assistant. The user asks a question, and the Assistant "
                              "solves it. The assistant first thinks about the reasoning process in the mind and then "
                              "provides the user with the answer. The reasoning process and answer are enclosed within "
                              "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning "
                              "process here </think><answer> answer here </answer>. Put your final answer within "
                              "\\boxed{}. <｜User｜>{content}<｜Assistant｜>"], "prefix": [BOS]},
}


def _slots(slots: list, content: str = "") -> list:
    return [s.replace("{content}", content) if isinstance(s, str) else s for s in slots]


def prompt_parts(prompt_type: str | None, messages: list[dict]) -> list:
    """A prompt as LLaMA-Factory's Template._encode lays it out (MindSpeed-RL's preprocessing): the
    prefix and the system turn (the message's, else the template's default system) before the first
    message, a separator before each later user turn -> strings and BOS / EOS markers, each encoded
    on its own. No template (prompt_type null): the messages' text as it is. Qwen3's template is read
    with thinking enabled (no empty think block appended; MindSpeed-RL's preprocessing decides that
    with enable_thinking, outside this file)."""
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    turns = [m for m in messages if m["role"] != "system"]
    if prompt_type is None:
        return ([system] if system else []) + [m["content"] for m in turns]
    t = TEMPLATES[prompt_type]
    system = system or t.get("default_system", "")
    assistant = t.get("assistant") or ["{content}"] + ([] if t.get("efficient_eos") else [EOS])
    parts: list = []
    for i, message in enumerate(turns):
        system_text = ""
        if i == 0:
            parts += t.get("prefix", [])
            if system:
                if t.get("system_in_user"):
                    system_text = _slots(t.get("system", ["{content}"]), system)[0]
                else:
                    parts += _slots(t.get("system", ["{content}"]), system)
        elif i % 2 == 0:
            parts += t.get("separator", [])
        slots = t["user"] if message["role"] == "user" else assistant
        parts += _slots(slots, system_text + message["content"] if message["role"] == "user" else message["content"])
    return parts


# ====================================================================== verifiers

def _think_answer_boxed(response: str) -> bool:
    return re.fullmatch(r"<think>.*</think>.*<answer>.*\\boxed\{.*\}.*</answer>", response, re.DOTALL) is not None


def base_acc(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """MindSpeed-RL's base_acc: 1 when the response is <think>…</think>…<answer>…\\boxed{…}…</answer>
    and the boxed answer equals the label (compared as rewards.boxed_math does), else 0."""
    return boxed_math(solution_str, ground_truth) if _think_answer_boxed(solution_str) else 0.0


def format_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """MindSpeed-RL's format: 1 when the response is <think>…</think> <answer>…</answer>, else 0."""
    return 1.0 if re.match(r"^<think>.*?</think>\s*<answer>.*?</answer>$", solution_str, re.DOTALL | re.MULTILINE) \
        else 0.0


def _structure_ok(text: str) -> bool:
    """MindSpeed-RL's _validate_response_structure: each tag once, in order, starting <think> and ending </answer>."""
    pos = {}
    for name, tag in (("think_start", "<think>"), ("think_end", "</think>"), ("answer_start", "<answer>"),
                      ("answer_end", "</answer>")):
        if text.count(tag) != 1:
            return False
        pos[name] = text.find(tag)
    boxed = list(re.finditer(r"\\boxed\{.*?\}", text))
    if len(boxed) != 1:
        return False
    pos["boxed"] = boxed[0].start()
    return (pos["think_start"] < pos["think_end"] < pos["answer_start"] < pos["boxed"] < pos["answer_end"]
            and text.startswith("<think>") and text.endswith("</answer>"))


def strict_format(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """MindSpeed-RL's strict_format: 1 for a well-formed <think>/<answer>/\\boxed{} response, else -0.5."""
    return 1.0 if _structure_ok(solution_str) else -0.5


# verifier_function name -> (rewards.Scorer verifier, None) or (None, "module:function")
VERIFIERS: dict[str, tuple[str | None, str | None]] = {
    "gsm8k": ("gsm8k", None),              # this engine's: the "#### <n>" answer (MindSpeed-RL has no GSM8K verifier)
    "math_17k_acc": ("math", None),        # the last \boxed{} equals the label
    "base_acc": (None, f"{__name__}:base_acc"),
    "format": (None, f"{__name__}:format_score"),
    "strict_format": (None, f"{__name__}:strict_format"),
}
UPSTREAM_VERIFIERS = ("acc", "format", "step", "strict_format", "base_acc", "math_17k_acc", "acc_for_dapo",
                      "acc_for_ppo", "math_verify_reward", "retool_reward")


# ====================================================================== reading the files

def _loader():
    """PyYAML's SafeLoader with OmegaConf's float rule (Hydra reads `1e-6` and `1e5` as floats)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
        r"|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
    return Loader


def read_yaml(path: str | Path, what: str = "MindSpeed-RL config") -> dict:
    """A YAML file as Hydra (OmegaConf) reads it: `1e-6` and `1e5` are floats, not strings."""
    import yaml

    path = Path(path)
    try:
        tree = yaml.load(path.read_text(encoding="utf-8"), Loader=_loader()) or {}  # noqa: S506 - a SafeLoader
    except (OSError, yaml.YAMLError) as err:
        raise RLConfigError(f"{path}: cannot read the {what}: {err}") from None
    if not isinstance(tree, dict):
        raise RLConfigError(f"{path}: expected a mapping ({what})")
    return tree


def yaml_value(text: str) -> Any:
    """An override's value as Hydra reads it."""
    import yaml

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader
    except yaml.YAMLError:
        return text


def is_mindspeed_rl(tree: Mapping) -> bool:
    return any(key in tree for key in MARKERS)


def model_names(tree: Mapping, source: str) -> list[str]:
    """The model files `defaults` names (`- model: [name]` or `- model: name`); other groups are refused."""
    names: list[str] = []
    defaults = tree.get("defaults") or []
    if not isinstance(defaults, list):
        raise RLConfigError(f"{source}: defaults: must be a list (- model: [<name>])")
    for entry in defaults:
        if entry == "_self_":
            continue
        if not isinstance(entry, Mapping) or set(entry) != {"model"}:
            raise RLConfigError(f"{source}: defaults: {entry!r}: only the model group is read (- model: [<name>])")
        value = entry["model"]
        names += [value] if isinstance(value, str) else list(value or [])
    return names


def compose(tree: Mapping, source: str | Path) -> tuple[dict, dict[str, str]]:
    """Hydra's composition of `defaults: - model: [<name>]`: model/<name>.yaml beside the file, merged
    into `model` -> (the composed tree, {entry name: the model file it came from})."""
    tree = dict(tree)
    base = Path(source).parent
    models: dict[str, Any] = dict(tree.get("model") or {})
    origin = {name: f"{source}: model" for name in models}
    for name in model_names(tree, str(source)):
        path = base / "model" / f"{name}.yaml"
        if not path.is_file():
            raise RLConfigError(f"{source}: defaults names the model file {name!r}, but there is no {path}")
        body = read_yaml(path, "MindSpeed-RL model file")
        for entry, value in body.items():
            models[entry] = value
            origin[entry] = str(path)
    tree["model"] = models
    return tree, origin


def load(path: str | Path, overrides: list[str] | None, side: Mapping) -> RLConfig:
    """`python -m backends.rl mindspeed_rl.yaml [key=value ...]`: read, compose the model file, apply the
    overrides, parse, and build the prompts with the tokenizer."""
    tree, origin = compose(read_yaml(path), path)
    apply_overrides(tree, overrides, yaml_value)
    cfg = parse_mindspeed_rl(tree, side, source=str(path), model_files=origin)
    prompt_type = {**(tree.get("megatron_training") or {}), **(tree.get("actor_config") or {})}.get("prompt_type")
    return tokenize(cfg, source=str(path), stop=stop_words(prompt_type))


# ====================================================================== parsing

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(a, b) -> bool:
    if _is_num(a) and _is_num(b):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


class _Role:
    """A MegatronConfig as MindSpeed-RL builds it: the model entry, megatron_training, then the role's
    section on top; remembers where each value came from and which keys were read."""

    def __init__(self, tree: Mapping, section: str, model_files: Mapping[str, str], source: str):
        self.values: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        body = {**(tree.get("megatron_training") or {}), **(tree.get(section) or {})}
        entry = body.get("model")
        if entry is not None and isinstance(tree.get("model"), Mapping) and isinstance(tree["model"].get(entry),
                                                                                       Mapping):
            for key, value in tree["model"][entry].items():
                self.values[key] = value
                self.where[key] = f"{model_files.get(entry, source + ': model')}: {entry}.{key}"
        for sec in ("megatron_training", section):
            for key, value in (tree.get(sec) or {}).items():
                if key != "model":
                    self.values[key] = value
                    self.where[key] = f"{sec}.{key}"
        self.section = section
        self.read: set[str] = set()

    def get(self, key: str) -> Any:
        self.read.add(key)
        return self.values.get(key, MEGATRON[key])

    def name(self, key: str) -> str:
        return self.where.get(key, f"{self.section}.{key} (MindSpeed-RL's default)")


def parse_mindspeed_rl(tree: Mapping, side: Mapping | None = None, *, source: str = "mindspeed-rl config",
                       model_files: Mapping[str, str] | None = None) -> RLConfig:
    """A MindSpeed-RL config tree -> RLConfig (prompts read from data_path as text parts; `tokenize`
    turns them into ids). `defaults` is composed from the model files beside `source` unless the tree
    already holds `model` (then model_files names where each entry came from)."""
    side = dict(side or {})
    if "model" not in tree and tree.get("defaults"):
        tree, model_files = compose(tree, source)
    model_files = dict(model_files or {})
    problems: list[str] = []

    # ---- every key one MindSpeed-RL's config classes accept
    for section, body in tree.items():
        if section in ("defaults", "model"):
            continue
        if section not in SECTIONS:
            problems.append(f"{section}: not a section of MindSpeed-RL's config classes "
                            f"({', '.join(SECTIONS)}){did_you_mean(section, SECTIONS)}")
            continue
        if not isinstance(body, Mapping):
            problems.append(f"{section}: must be a mapping of keys")
            continue
        known = SECTIONS[section]
        for key in body:
            if key == "model" and known is MEGATRON:
                continue
            if key not in known:
                problems.append(f"{section}.{key}: not a MindSpeed-RL {_cls(section)} key{did_you_mean(key, known)}")
    sampling_given = (tree.get("generate_config") or {}).get("sampling_config")
    if sampling_given is not None:
        if not isinstance(sampling_given, Mapping):
            problems.append("generate_config.sampling_config: must be a mapping")
            sampling_given = {}
        for key in sampling_given:
            if key not in SAMPLING:
                problems.append(f"generate_config.sampling_config.{key}: not a MindSpeed-RL sampling_config key"
                                f"{did_you_mean(key, SAMPLING)}")
    models = tree.get("model") or {}
    for entry, body in (models.items() if isinstance(models, Mapping) else []):
        where = model_files.get(entry, f"{source}: model")
        if not isinstance(body, Mapping):
            problems.append(f"{where}: {entry}: must be a mapping of MegatronConfig keys")
            continue
        for key in body:
            if key not in MEGATRON:
                problems.append(f"{where}: {entry}.{key}: not a MindSpeed-RL MegatronConfig key"
                                f"{did_you_mean(key, MEGATRON)}")
    if problems:  # a misspelt key would only cause confusing follow-ups
        raise RLConfigError(f"{source}: " + "; ".join(problems))

    mt = tree.get("megatron_training") or {}
    rl_given = dict(tree.get("rl_config") or {})
    gen_given = dict(tree.get("generate_config") or {})
    entry = {**mt, **(tree.get("actor_config") or {})}.get("model")
    if entry is not None and entry not in models:
        problems.append(f"megatron_training.model: {entry!r} names no entry of the model files "
                        f"({', '.join(models) or 'none composed: defaults: - model: [<name>]'})")
    actor = _Role(tree, "actor_config", model_files, source)
    rl_read: set[str] = set()
    gen_read: set[str] = set()

    def rl(key: str) -> Any:
        rl_read.add(key)
        return rl_given.get(key, RL[key])

    def gen(key: str) -> Any:
        gen_read.add(key)
        return gen_given.get(key, GENERATE[key])

    def want(value: Any, name: str, check: Callable[[Any], bool], what: str) -> Any:
        if not check(value):
            problems.append(f"{name}: must be {what}, got {value!r}")
        return value

    def only(value: Any, name: str, allowed: tuple, why: str) -> None:
        if not any(_same(value, a) for a in allowed):
            problems.append(f"{name}: {value!r} is not built in this engine ({why}); set "
                            f"{' or '.join(map(repr, allowed))}")

    pos = lambda v: _is_int(v) and v > 0  # noqa: E731

    # ---- what the engine runs: GRPO, colocated, data parallel
    only(actor.get("stage"), actor.name("stage"), ("ray_grpo",),
         "GRPO; DAPO and PPO run in the VeRL dialect (framework: verl)")
    only(rl("adv_estimator"), "rl_config.adv_estimator", ("group_norm",),
         "GRPO's group-normalised advantages; GAE (PPO) runs in the VeRL dialect")
    only(rl("rule_reward"), "rl_config.rule_reward", (True,), "rule verifiers; reward models are not built")
    only(rl("kl_ctrl_type"), "rl_config.kl_ctrl_type", ("fixed",), "a fixed KL coefficient")
    only(rl("use_kl_in_reward"), "rl_config.use_kl_in_reward", (False,),
         "MindSpeed-RL's GRPO trainer puts the KL in the actor loss with init_kl_coef and does not read this key; "
         "the in-reward KL belongs to its PPO trainer")
    for section, why in (("reward_config", "reward models are not built (rule_reward: true)"),
                         ("critic_config", "a critic (PPO) is not built in the MindSpeed-RL dialect")):
        if section in tree:
            problems.append(f"{section}: {why}")
    tp = actor.get("tensor_model_parallel_size")
    if not pos(tp):
        problems.append(f"{actor.name('tensor_model_parallel_size')}: {tp!r}: must be a positive integer")
        tp = 1
    cp = actor.get("context_parallel_size")
    if not pos(cp):
        problems.append(f"{actor.name('context_parallel_size')}: {cp!r}: must be a positive integer")
        cp = 1
    cp_algo = actor.get("context_parallel_algo")
    if cp_algo == "hybrid_cp_algo" and cp > 1:
        problems.append(f"{actor.name('context_parallel_algo')}: hybrid_cp_algo needs a Ulysses degree, and "
                        "MindSpeed-RL's MegatronConfig has no ulysses_degree_in_cp key to give it; use "
                        "megatron_cp_algo (ring) or ulysses_cp_algo")
    elif cp_algo not in CP_ALGOS and cp_algo != "hybrid_cp_algo":
        problems.append(f"{actor.name('context_parallel_algo')}: {cp_algo!r}: not a context-parallel algorithm "
                        f"this engine runs; use {' or '.join(CP_ALGOS)}")
    pp = actor.get("pipeline_model_parallel_size")
    if not pos(pp):
        problems.append(f"{actor.name('pipeline_model_parallel_size')}: {pp!r}: must be a positive integer")
        pp = 1
    layers = actor.get("num_layers")
    if pp > 1 and _is_int(layers) and layers % pp:
        problems.append(f"{actor.name('pipeline_model_parallel_size')}: {pp} does not divide num_layers {layers}: "
                        "Megatron splits the layers evenly over the stages (an uneven num_layer_list is not built); "
                        "choose a pipeline size that divides them")
    vpp = actor.get("num_layers_per_virtual_pipeline_stage")
    if pp > 1 and vpp is not None:
        problems.append(f"{actor.name('num_layers_per_virtual_pipeline_stage')}: {vpp!r}: the engine's pipeline runs "
                        "one stage per pp rank (interleaved virtual stages are not built); leave it out")
    if pp > 1 and cp > 1:
        problems.append(f"{actor.name('pipeline_model_parallel_size')} {pp} with {actor.name('context_parallel_size')} "
                        f"{cp}: pipeline x context parallel RL actors are not built; set one of them to 1")
    value = actor.get("expert_model_parallel_size")  # TP, CP and PP are built; EP not
    if value != 1:
        problems.append(f"{actor.name('expert_model_parallel_size')}: {value!r}: the engine's actor is data x "
                        "pipeline x context x tensor parallel only in this build (Megatron expert parallel RL actors "
                        "are pending); set 1")
    integrated = rl("use_integrated_worker")
    want(integrated, "rl_config.use_integrated_worker", lambda v: isinstance(v, bool), "true or false")

    # ---- the model: a Hugging Face directory; the model file must describe it
    model_path = want(actor.get("load"), actor.name("load"), lambda v: isinstance(v, str) and v,
                      "the Hugging Face model directory the actor starts from")
    tok_type = actor.get("tokenizer_type")
    if tok_type not in (None, "PretrainedFromHF"):
        problems.append(f"{actor.name('tokenizer_type')}: {tok_type!r}: the tokenizer is the model directory's "
                        "(PretrainedFromHF)")
    for name, value in ((actor.name("tokenizer_name_or_path"), actor.get("tokenizer_name_or_path")),
                        ("generate_config.tokenizer_name_or_path", gen("tokenizer_name_or_path"))):
        if value not in (None, GENERATE["tokenizer_name_or_path"]) and isinstance(model_path, str) \
                and Path(str(value)) != Path(model_path):
            problems.append(f"{name}: {value!r} differs from {actor.name('load')} {model_path!r}; this engine reads "
                            "the tokenizer from the model directory")
    if isinstance(model_path, str) and model_path:
        _check_architecture(actor, Path(model_path), problems)

    # ---- the reference (use_integrated_worker: false gives it its own section)
    if integrated is True and "ref_config" in tree:
        problems.append("ref_config: must not be set with rl_config.use_integrated_worker: true (MindSpeed-RL "
                        "raises); the reference is then the actor's configuration")
    if integrated is False:
        if "ref_config" not in tree:
            problems.append("rl_config.use_integrated_worker: false needs a ref_config section")
        else:
            _check_reference(tree, actor, model_files, source, problems)

    # ---- batches (prompts), rollout, sampling
    train_batch = want(actor.get("global_batch_size"), actor.name("global_batch_size"), pos,
                       "a positive integer (prompts per step)")
    mini = want(rl("mini_batch_size"), "rl_config.mini_batch_size", pos, "a positive integer (prompts per update)")
    micro = want(actor.get("micro_batch_size"), actor.name("micro_batch_size"), pos,
                 "a positive integer (responses per forward)")
    n = want(rl("n_samples_per_prompt"), "rl_config.n_samples_per_prompt", pos, "a positive integer")
    sampling = {**SAMPLING, **(sampling_given or {})}
    gen_read.add("sampling_config")
    temperature = want(sampling["temperature"], "generate_config.sampling_config.temperature",
                       lambda v: _is_num(v) and v >= 0, "a number >= 0")
    top_p = want(sampling["top_p"], "generate_config.sampling_config.top_p", lambda v: _is_num(v) and 0 < v <= 1,
                 "a number in (0, 1]")
    top_k = want(sampling["top_k"], "generate_config.sampling_config.top_k", lambda v: _is_int(v) and v >= -1,
                 "an integer (-1: off)")
    max_tokens = want(sampling["max_tokens"], "generate_config.sampling_config.max_tokens", pos, "a positive integer")
    only(sampling["min_p"], "generate_config.sampling_config.min_p", (0.0,), "top-p / top-k sampling")
    seed = want(actor.get("seed"), actor.name("seed"), _is_int, "an integer")
    if sampling["seed"] is not None and sampling["seed"] != seed:
        problems.append(f"generate_config.sampling_config.seed: {sampling['seed']!r} differs from "
                        f"{actor.name('seed')} {seed!r}; this engine seeds the rollout from that one seed")
    max_prompt = want(rl("max_prompt_length"), "rl_config.max_prompt_length", pos, "a positive integer")
    max_model_len = want(gen("max_model_len"), "generate_config.max_model_len", pos, "a positive integer")
    if pos(max_model_len) and pos(max_prompt) and pos(max_tokens) and max_model_len < max_prompt + max_tokens:
        problems.append(f"generate_config.max_model_len {max_model_len} is less than rl_config.max_prompt_length "
                        f"{max_prompt} + sampling_config.max_tokens {max_tokens}: responses would be cut")
    # the in-repo generator samples on the actor itself, under its tensor parallel layout (infer tp = the actor's,
    # or 1); a vLLM engine per rank holds whole weights
    vllm = (side.get("rollout_engine") or "hf") == "vllm"
    only(gen("infer_tensor_parallel_size"), "generate_config.infer_tensor_parallel_size",
         (1,) if vllm else tuple(dict.fromkeys((1, tp))), "one vLLM engine per rank holds the whole weights" if vllm
         else f"the rollout samples on the actor, under its {actor.name('tensor_model_parallel_size')}")
    for key in ("infer_pipeline_parallel_size", "infer_expert_parallel_size"):
        only(gen(key), f"generate_config.{key}", (1,), "the rollout runs on the actor's whole, gathered stages")

    # ---- the actor's optimisation
    lr = want(actor.get("lr"), actor.name("lr"), lambda v: _is_num(v) and v > 0, "a positive number")
    only(actor.get("lr_decay_style"), actor.name("lr_decay_style"), ("constant",),
         "a constant learning rate after warm-up")
    only(actor.get("optimizer"), actor.name("optimizer"), ("adam",), "AdamW, as Megatron's adam")
    warmup = actor.get("lr_warmup_fraction")
    want(warmup, actor.name("lr_warmup_fraction"), lambda v: v is None or (_is_num(v) and 0 <= v < 1),
         "a number in [0, 1)")
    recompute = actor.get("recompute_granularity")
    want(recompute, actor.name("recompute_granularity"), lambda v: v in (None, "full", "selective"),
         "full, selective or null")
    for key in ("attention_dropout", "hidden_dropout"):
        only(actor.get(key), actor.name(key), (0.0,), "no dropout in the RL actor")
    bf16 = want(actor.get("bf16"), actor.name("bf16"), lambda v: isinstance(v, bool), "true or false")
    precision = "bf16" if bf16 is True else side.get("precision") or "fp32"
    if (bf16 is True) != (side.get("precision", precision) == "bf16"):
        problems.append(f"{actor.name('bf16')}: {bf16!r}, but engine.yaml says precision {side['precision']}")
        precision = "bf16" if bf16 is True else "fp32"
    dtype = gen("dtype")
    want_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[precision]
    if dtype != want_dtype:
        problems.append(f"generate_config.dtype: {dtype!r}, but the actor trains in {precision}: the rollout runs on "
                        f"the actor's own weights; set {want_dtype}")

    # ---- the loss
    clip_ratio = want(rl("clip_ratio"), "rl_config.clip_ratio", lambda v: _is_num(v) and v > 0, "a positive number")
    clip_low = clip_high = clip_ratio
    rl_read.update({"clip_ratio_low", "clip_ratio_high"})  # read only with clip_higher_enable, as MindSpeed-RL does
    if want(rl("clip_higher_enable"), "rl_config.clip_higher_enable", lambda v: isinstance(v, bool), "true or false"):
        clip_low = want(rl("clip_ratio_low"), "rl_config.clip_ratio_low", lambda v: _is_num(v) and v > 0,
                        "a positive number")
        clip_high = want(rl("clip_ratio_high"), "rl_config.clip_ratio_high", lambda v: _is_num(v) and v > 0,
                         "a positive number")
        if _is_num(clip_low) and _is_num(clip_high) and clip_low > clip_high:
            problems.append(f"rl_config.clip_ratio_low {clip_low} must not exceed clip_ratio_high {clip_high}")
    kl = want(rl("kl_penalty"), "rl_config.kl_penalty", lambda v: v in KL_KINDS and v != "k1" and v != "k2"
              and v != "k3", "kl, abs, mse or low_var_kl")
    kl_coef = want(rl("init_kl_coef"), "rl_config.init_kl_coef", lambda v: _is_num(v) and v >= 0, "a number >= 0")
    token_level = want(rl("token_level_loss"), "rl_config.token_level_loss", lambda v: isinstance(v, bool),
                       "true or false")

    # ---- rewards
    verifier, function = _verifier(rl("verifier_function"), rl("verifier_weight"), problems)
    resource = rl("actor_resource")
    world = None
    if resource is not None:
        if not isinstance(resource, Mapping) or set(resource) - {"num_npus"}:
            problems.append(f"rl_config.actor_resource: {resource!r}: must be {{num_npus: <devices>}}")
        else:
            world = want(resource.get("num_npus"), "rl_config.actor_resource.num_npus",
                         lambda v: v is None or pos(v), "a positive integer")

    if pos(world) and world % (tp * cp * pp):
        problems.append(f"rl_config.actor_resource.num_npus: {world} is not a multiple of "
                        f"{actor.name('tensor_model_parallel_size')} {tp} x {actor.name('context_parallel_size')} "
                        f"{cp}" + (f" x {actor.name('pipeline_model_parallel_size')} {pp} (pp x dp x tp ranks)"
                                   if pp > 1 else " (dp x cp x tp ranks)"))
    heads = actor.get("num_attention_heads")
    if cp > 1 and cp_algo == "ulysses_cp_algo" and _is_int(heads) and heads % (tp * cp):
        problems.append(f"{actor.name('context_parallel_algo')}: ulysses_cp_algo splits each tensor parallel "
                        f"rank's attention heads ({heads} / tp {tp}) over the {cp} context parallel ranks: "
                        f"num_attention_heads must be a multiple of tp x cp = {tp * cp}; use megatron_cp_algo")
    # ---- data
    records = _records(actor, max_prompt, problems)

    save_interval = actor.get("save_interval")
    values = dict(
        model_path=model_path, algorithm="grpo", records=records, max_prompt_length=max_prompt,
        shuffle=not actor.get("no_shuffle"), data_seed=seed,
        rollout_engine=side.get("rollout_engine") or "hf", n=n,
        gpu_memory_utilization=want(gen("gpu_memory_utilization"), "generate_config.gpu_memory_utilization",
                                    lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        enforce_eager=want(gen("enforce_eager"), "generate_config.enforce_eager", lambda v: isinstance(v, bool),
                           "true or false"),
        max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=0 if top_k in (-1, 0) else top_k,
        train_batch_size=train_batch, mini_batch_size=mini, micro_batch_size=micro, ppo_epochs=rl("epochs"),
        lr=lr, weight_decay=actor.get("weight_decay"), betas=(actor.get("adam_beta1"), actor.get("adam_beta2")),
        grad_clip=actor.get("clip_grad"), warmup_ratio=float(warmup) if _is_num(warmup) else 0.0,
        gradient_checkpointing=recompute is not None,
        clip_low=clip_low, clip_high=clip_high, clip_c=NO_DUAL_CLIP,
        loss_agg_mode="token-mean" if token_level else "seq-mean-token-mean",
        entropy_coeff=rl("entropy_coeff"), use_kl_loss=True, kl_loss_coef=kl_coef, kl_loss_type=kl,
        norm_adv_by_std=True, gamma=rl("gamma"), lam=rl("lam"), use_kl_in_reward=False, kl_penalty=kl,
        verifier=verifier, reward_function=function,
        total_steps=actor.get("train_iters"), expected_world=world, seed=seed, tp=tp,
        cp=cp, cp_algo=CP_ALGOS.get(cp_algo, "ring"), pp=pp,
        ref_tp=_Role(tree, "ref_config", model_files, source).get("tensor_model_parallel_size")
        if integrated is False and "ref_config" in tree else None,
        save_dir=actor.get("save"), save_interval=save_interval if pos(save_interval) else None,
    )
    for key, check, what in (("epochs", pos, "a positive integer"), ("entropy_coeff", _is_num, "a number"),
                             ("gamma", _is_num, "a number"), ("lam", _is_num, "a number")):
        want(rl(key), f"rl_config.{key}", check, what)
    for key, check, what in (("train_iters", pos, "a positive integer (the number of steps)"),
                             ("weight_decay", lambda v: _is_num(v) and v >= 0, "a number >= 0"),
                             ("adam_beta1", lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
                             ("adam_beta2", lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
                             ("clip_grad", lambda v: _is_num(v) and v >= 0, "a number >= 0"),
                             ("no_shuffle", lambda v: isinstance(v, bool), "true or false"),
                             ("save", lambda v: v is None or isinstance(v, str), "a directory")):
        want(actor.get(key), actor.name(key), check, what)

    # ---- the batch rules: backends.contract.layout.rl_batches, the planner's own (MindSpeed-RL's validate_rl_args)
    values.update(_batch_rules(tree, actor, model_files, source, rl, gen, integrated, world, problems))
    dp_size = _dp_size(actor, world)
    if dp_size and all(pos(values[k]) for k in BATCH_NUMBERS):
        problems += [f"{b.field}: {b.message} ({b.hint})" for b in batch_problems(values, dp=dp_size)]

    # ---- MindSpeed-RL's keys this engine does not implement: its default or refused by name
    for where, body, read, defaults, free in _given(tree, actor, model_files, source, rl_given, gen_given,
                                                     rl_read, gen_read):
        for key, value in body.items():
            if key == "model" or key in read or key in free or key not in defaults:
                continue
            if defaults[key] is DERIVED or _same(value, defaults[key]):
                continue
            problems.append(f"{where(key)}: MindSpeed-RL's key, but this engine does not implement it "
                            f"(MindSpeed-RL's default is {defaults[key]!r}; leave it out or set that)")
    if problems:
        raise RLConfigError(f"{source}: " + "; ".join(problems))
    return _with_sidecar(values, {**side, "precision": precision}, source)


def _dp_size(role: _Role, world: Any) -> int | None:
    """A role's data-parallel size over `world` devices: world / (tp x pp x cp), as validate_rl_args counts."""
    sizes = [role.get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "context_parallel_size")]
    if not (_is_int(world) and world > 0 and all(_is_int(s) and s > 0 for s in sizes)):
        return None
    product = math.prod(sizes)
    return world // product if world % product == 0 else None


def _batch_rules(tree, actor: _Role, model_files, source, rl, gen, integrated, world, problems: list[str]) -> dict:
    """The batch rules' dialect keys and MindSpeed-RL's own rules (validate_rl_args): the actor's rollout
    share (global_batch_size / dp x n_samples_per_prompt) in whole micro_batch_size micro-batches; the
    prompts over the generation's dp (num_npus / (infer tp x pp)); with use_integrated_worker false, the
    reference's: the prompts over its dp (reference_resource.num_npus / (its tp x pp x cp)) and its ranks'
    share in whole ref_config micro_batch_size micro-batches. MindSpeed-RL needs reference_resource then
    (and refuses it with the integrated worker); this engine runs the reference on the actor's devices."""
    ref = _Role(tree, "ref_config", model_files, source)
    fields = {"prompts": actor.name("global_batch_size"), "mini_batch": "rl_config.mini_batch_size",
              "micro_batch": actor.name("micro_batch_size"), "n": "rl_config.n_samples_per_prompt",
              "ppo_epochs": "rl_config.epochs", "ref_micro": ref.name("micro_batch_size"),
              "rollout_tp": "generate_config.infer_tensor_parallel_size"}
    gen_sizes = [gen("infer_tensor_parallel_size"), gen("infer_pipeline_parallel_size")]
    rules: dict[str, Any] = {"who": "MindSpeed-RL", "micro_share": "rollout"}
    if _is_int(world) and world > 0 and all(_is_int(s) and s > 0 for s in gen_sizes):
        rules["rollout_dp"] = world // math.prod(gen_sizes)
    resource = rl("reference_resource")
    if integrated is True and resource is not None:
        problems.append("rl_config.reference_resource: must not be set with rl_config.use_integrated_worker: true "
                        "(MindSpeed-RL raises; the reference then runs on the actor_resource)")
    if integrated is False and "ref_config" in tree:
        if not isinstance(resource, Mapping) or set(resource) != {"num_npus"}:
            problems.append(f"rl_config.reference_resource: {resource!r}: use_integrated_worker: false needs "
                            "{num_npus: <devices>} for the reference (MindSpeed-RL reads it)")
        elif resource["num_npus"] != world:
            problems.append(f"rl_config.reference_resource.num_npus: {resource['num_npus']!r} differs from "
                            f"rl_config.actor_resource.num_npus {world!r}; this engine runs the reference on the "
                            "actor's devices")
        else:
            micro = ref.get("micro_batch_size")
            ref_dp = _dp_size(ref, world)
            if not (_is_int(micro) and micro > 0):
                problems.append(f"{ref.name('micro_batch_size')}: {micro!r}: must be a positive integer")
            elif ref_dp:
                rules.update(ref_dp=ref_dp, ref_micro=micro)
    return {"batch_fields": fields, "batch_rules": rules}


def _cls(section: str) -> str:
    return {"rl_config": "RLConfig", "generate_config": "GenerateConfig"}.get(section, "MegatronConfig")


def _given(tree, actor: _Role, model_files, source, rl_given, gen_given, rl_read, gen_read):
    """(name of a key, the keys a user set, the keys read, MindSpeed-RL's defaults, no-effect keys) per place."""
    out = []
    models = tree.get("model") or {}
    entry = {**(tree.get("megatron_training") or {}), **(tree.get("actor_config") or {})}.get("model")
    if entry in models and isinstance(models[entry], Mapping):
        where = model_files.get(entry, f"{source}: model")
        out.append((lambda k, w=where, e=entry: f"{w}: {e}.{k}", models[entry], actor.read, MEGATRON,
                    NO_EFFECT["megatron"]))
    for section in ("megatron_training", "actor_config"):
        out.append((lambda k, s=section: f"{s}.{k}", tree.get(section) or {}, actor.read, MEGATRON,
                    NO_EFFECT["megatron"]))
    out.append((lambda k: f"rl_config.{k}", rl_given, rl_read, RL, NO_EFFECT["rl"]))
    out.append((lambda k: f"generate_config.{k}", gen_given, gen_read, GENERATE, NO_EFFECT["generate"]))
    return out


# the architecture keys, checked against the model directory's config.json (backends.llm's reading of it);
# (key, the value the checkpoint implies, checked when the file leaves the key at its default)
ARCH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
             "group_query_attention", "num_query_groups", "rotary_base", "untie_embeddings_and_output_weights",
             "add_qkv_bias", "qk_layernorm", "disable_bias_linear", "position_embedding_type", "normalization",
             "swiglu", "norm_epsilon", "max_position_embeddings", "padded_vocab_size")


def _arch_expectations(m) -> list[tuple[str, Any, bool]]:
    return [
        ("num_layers", m.num_layers, True), ("hidden_size", m.hidden_size, True),
        ("num_attention_heads", m.num_attention_heads, True), ("ffn_hidden_size", m.ffn_hidden_size, True),
        ("kv_channels", m.head_dim, True), ("rotary_base", m.rope_theta, True),
        ("untie_embeddings_and_output_weights", not m.tie_word_embeddings, True),
        ("add_qkv_bias", m.qkv_bias, True), ("qk_layernorm", m.qk_norm, True),
        ("disable_bias_linear", not m.o_proj_bias, True), ("position_embedding_type", "rope", True),
        ("normalization", "RMSNorm", True), ("swiglu", True, True),
        ("norm_epsilon", m.rms_norm_eps, False), ("max_position_embeddings", m.max_position_embeddings, False),
        ("padded_vocab_size", m.vocab_size, False),
    ]


def _check_architecture(actor: _Role, model_dir: Path, problems: list[str]) -> None:
    from backends.common.checkpoint.hf_io import read_config
    from backends.models.decoder.config import ConfigError, ModelConfig

    actor.read.update(ARCH_KEYS)  # implemented: checked against the checkpoint (when there is one)
    if not (model_dir / "config.json").is_file():
        problems.append(f"{actor.name('load')}: {str(model_dir)!r} is not a Hugging Face model directory (no "
                        "config.json); this engine starts the actor from Hugging Face weights")
        return
    try:
        m = ModelConfig.from_hf(read_config(model_dir))
    except (ConfigError, ValueError, KeyError) as err:
        problems.append(f"{actor.name('load')}: {model_dir}/config.json: {err}")
        return
    if m.rope_scaling is not None or m.moe is not None or m.mla is not None:
        problems.append(f"{actor.name('load')}: {model_dir} is a {m.family} model with rope scaling, experts or "
                        "latent attention; the MindSpeed-RL dialect checks dense rope models only")
        return
    heads = actor.get("num_attention_heads")
    hidden = actor.get("hidden_size")
    for key, expected, when_default in _arch_expectations(m):
        value = actor.get(key)
        if key not in actor.values:
            if not when_default:
                continue
            if value is None and key == "kv_channels" and _is_int(hidden) and _is_int(heads) and heads:
                value = hidden // heads            # Megatron: hidden_size / num_attention_heads
            elif value is None and key == "ffn_hidden_size" and _is_int(hidden):
                value = 4 * hidden                 # Megatron's default
        if not _same(value, expected):
            problems.append(f"{actor.name(key)}: {value!r}, but {model_dir}/config.json has {expected!r} (the model "
                            "file must describe the checkpoint the actor loads)")
    # key / value heads: num_query_groups with group_query_attention, else one per attention head
    gqa = actor.get("group_query_attention")
    key = "num_query_groups" if gqa else "group_query_attention"
    groups = actor.get("num_query_groups") if gqa else heads
    if not _same(groups, m.num_kv_heads):
        problems.append(f"{actor.name(key)}: {actor.get(key)!r} gives {groups!r} key/value heads, but "
                        f"{model_dir}/config.json has {m.num_kv_heads} (the model file must describe the checkpoint)")


def _check_reference(tree, actor: _Role, model_files, source, problems: list[str]) -> None:
    ref = _Role(tree, "ref_config", model_files, source)
    for key in PARALLEL:
        if key == "context_parallel_size":  # the log-prob passes shard the sequences as the actor's do
            if ref.get(key) != actor.get(key):
                problems.append(f"{ref.name(key)}: {ref.get(key)!r}: the engine's reference runs on the actor's "
                                f"context parallel layout; set {actor.get(key)!r}")
            elif actor.get(key) != 1 and ref.get("context_parallel_algo") != actor.get("context_parallel_algo"):
                problems.append(f"{ref.name('context_parallel_algo')}: {ref.get('context_parallel_algo')!r}: the "
                                "engine's reference runs the actor's context parallel algorithm; set "
                                f"{actor.get('context_parallel_algo')!r}")
            continue
        if key == "pipeline_model_parallel_size":  # the log-prob passes run through the actor's stages
            if ref.get(key) != actor.get(key):
                problems.append(f"{ref.name(key)}: {ref.get(key)!r}: the engine's reference runs on the actor's "
                                f"pipeline parallel layout; set {actor.get(key)!r}")
            continue
        allowed = (1, actor.get(key)) if key == "tensor_model_parallel_size" else (1,)
        if ref.get(key) not in allowed:
            problems.append(f"{ref.name(key)}: {ref.get(key)!r}: the engine's reference is replicated or on the "
                            f"actor's tensor parallel layout ({actor.get('tensor_model_parallel_size')!r}); "
                            "expert parallel roles are pending; set "
                            + " or ".join(str(v) for v in sorted(set(allowed))))
    for key, value in (tree.get("ref_config") or {}).items():
        if key in PARALLEL or key in NO_EFFECT["megatron"] or key in ("micro_batch_size", "model"):
            continue
        if key == "load":
            if value is not None and Path(str(value)) != Path(str(actor.get("load"))):
                problems.append(f"ref_config.load: {value!r} differs from {actor.name('load')} "
                                f"{actor.get('load')!r}; the engine's reference is the actor's starting weights")
            continue
        if not _same(value, actor.get(key)):
            problems.append(f"ref_config.{key}: {value!r} differs from the actor's {actor.get(key)!r}; the engine's "
                            "reference is the actor's starting weights under the actor's settings")


def _verifier(names: Any, weights: Any, problems: list[str]) -> tuple[str | None, str | None]:
    if not isinstance(names, list) or len(names) != 1:
        problems.append(f"rl_config.verifier_function: {names!r}: this engine scores with one verifier per run "
                        f"({', '.join(VERIFIERS)})")
        return None, None
    if weights != [1.0] and weights != [1]:
        problems.append(f"rl_config.verifier_weight: {weights!r}: one verifier at weight [1.0] in this engine")
    name = names[0]
    if name not in VERIFIERS:
        if name in UPSTREAM_VERIFIERS:
            problems.append(f"rl_config.verifier_function: {name!r} is MindSpeed-RL's, but not built in this engine "
                            f"(built: {', '.join(VERIFIERS)})")
        else:
            problems.append(f"rl_config.verifier_function: {name!r} is not a verifier (MindSpeed-RL's "
                            f"{', '.join(UPSTREAM_VERIFIERS)}; built here: {', '.join(VERIFIERS)})"
                            f"{did_you_mean(str(name), VERIFIERS)}")
        return None, None
    return VERIFIERS[name]


def _records(actor: _Role, max_prompt: Any, problems: list[str]) -> list[dict]:
    """data_path's rows -> [{"prompt_parts", "ground_truth", "data_source"}]; one message per bad row."""
    prompt_type = actor.get("prompt_type")
    if prompt_type is not None and prompt_type not in TEMPLATES:
        problems.append(f"{actor.name('prompt_type')}: {prompt_type!r} is not a MindSpeed-RL template name"
                        f"{did_you_mean(str(prompt_type), TEMPLATES)} (built: {', '.join(TEMPLATES)})")
        return []
    actor.read.add("prompt_type_path")
    if "prompt_type_path" in actor.values:
        problems.append(f"{actor.name('prompt_type_path')}: this engine builds prompts with MindSpeed-RL's own "
                        "templates.json (leave prompt_type_path out)")
    keys = actor.get("dataset_additional_keys")
    if not isinstance(keys, list) or "labels" not in keys:
        problems.append(f"{actor.name('dataset_additional_keys')}: {keys!r}: must list labels (the answer the "
                        "verifier compares with)")
    split = actor.get("split")
    if split is not None and [s.strip() for s in str(split).split(",")][1:] not in ([], ["0", "0"], ["0"]):
        problems.append(f"{actor.name('split')}: {split!r}: every row trains here (no validation or test split); "
                        "set 100,0,0")
    path = actor.get("data_path")
    if not isinstance(path, str) or not path:
        problems.append(f"{actor.name('data_path')}: must name the prompts (a JSONL file of prompt + labels rows)")
        return []
    file = Path(path).expanduser()
    if not file.is_file():
        problems.append(f"{actor.name('data_path')}: no file {file} (this engine reads a JSONL file of "
                        "{\"prompt\", \"labels\"} rows, as ascendfactory renders it; MindSpeed-RL's preprocessed "
                        "Megatron datasets are not read)")
        return []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        problems.append(f"{actor.name('data_path')}: cannot read {file}: {err}")
        return []
    records: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{file} row {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(f"{where}: not a JSON object: {err}")
            return []
        if not isinstance(row, dict) or "prompt" not in row:
            problems.append(f"{where}: no 'prompt' field")
            return []
        if row.get("labels") is None:
            problems.append(f"{where}: no 'labels' field (the answer the verifier compares with)")
            return []
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str) for m in messages):
            problems.append(f"{where}: the prompt must be a string or a list of {{role: system|user|assistant, "
                            "content}} messages")
            return []
        records.append({"prompt_parts": prompt_parts(prompt_type, messages), "ground_truth": str(row["labels"]),
                        "data_source": ""})
    if not records:
        problems.append(f"{actor.name('data_path')}: {file} has no prompts")
    return records


# ====================================================================== tokens

def tokenize(cfg: RLConfig, tokenizer=None, *, source: str = "mindspeed-rl config",
             stop: list[str] | None = None) -> RLConfig:
    """Encode each record's prompt parts (each string on its own, as LLaMA-Factory's templates do; BOS /
    EOS markers as the tokenizer's ids) into prompt_ids, checking rl_config.max_prompt_length; the
    template's stop words join the model's EOS ids as stop tokens."""
    if tokenizer is None:
        import transformers

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.model_path)
        except (OSError, ValueError) as err:
            raise RLConfigError(f"{source}: cannot load the tokenizer of {cfg.model_path}: {err}") from None
    for i, record in enumerate(cfg.records):
        ids: list[int] = []
        for part in record.get("prompt_parts", []):
            if part == BOS:
                ids += [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
            elif part == EOS:
                ids += [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            elif part:
                ids += list(tokenizer.encode(part, add_special_tokens=False))
        if len(ids) > cfg.max_prompt_length:
            raise RLConfigError(f"{source}: prompt {i} has {len(ids)} tokens, more than rl_config.max_prompt_length "
                                f"{cfg.max_prompt_length} (raise it)")
        record["prompt_ids"] = ids
    vocab = tokenizer.get_vocab() if stop else {}
    extra = {vocab[word] for word in stop or [] if word in vocab}
    if extra:
        from .recipe import stop_ids

        ids = set(stop_ids(cfg.model_path, tokenizer))
        if extra - ids:  # else the model's own EOS ids already stop there (the recipe finds them)
            cfg.eos_token_id = sorted(ids | extra)
    return cfg


def stop_words(prompt_type: str | None) -> list[str]:
    return list(TEMPLATES.get(prompt_type or "", {}).get("stop", []))
