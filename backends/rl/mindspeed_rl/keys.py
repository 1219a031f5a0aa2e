"""MindSpeed-RL's config keys, their defaults and what the engine does with each (the tables the reader
and the tests hold against mindspeed_rl/config_cls/ at 05a90d77)."""

from __future__ import annotations

from typing import Any

from backends.contract.megatron import CP_ALGO_NAMES, MINDSPEED_RL_CP_ALGOS

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
CP_ALGOS = {flag: ours for flag, ours in CP_ALGO_NAMES.items() if ours in MINDSPEED_RL_CP_ALGOS}
PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size")
