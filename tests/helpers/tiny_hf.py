"""Tiny random Hugging Face models of every LLM family, written to a directory (tests only)."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / "examples" / "tiny-qwen3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
               pad_token_id=0, bos_token_id=None, eos_token_id=None)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# family → (transformers config class name, card id of that family, extra config keys)
TINY = {
    "qwen2": ("Qwen2Config", "qwen2.5-7b", {}),
    "qwen3": ("Qwen3Config", "qwen3-8b", {"head_dim": 16}),
    "llama": ("LlamaConfig", "llama3.2-1b", {"tie_word_embeddings": True,
                                             "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                                 "factor": 32.0, "low_freq_factor": 1.0,
                                                                 "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 128}}),
    "glm4": ("Glm4Config", "glm-4-9b-chat", {"head_dim": 16, "attention_bias": True, "partial_rotary_factor": 0.5}),
    "mixtral": ("MixtralConfig", "mixtral-8x7b-instruct-v0.1", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3-30b-a3b", {"head_dim": 16, "num_experts": 4, "norm_topk_prob": True,
                                                      **_MOE}),
    "deepseek_v2": ("DeepseekV2Config", "deepseek-v2-lite-16b",
                    {"num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                     "v_head_dim": 16, "topk_method": "greedy", "n_group": 1, "topk_group": 1, **_MOE}),
    "deepseek_v3": ("DeepseekV3Config", "deepseek-v3-671b",
                    {"num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                     "v_head_dim": 16, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
                     "norm_topk_prob": True, **_MOE}),
}


def make_tiny_hf(family: str, out_dir: str | Path, seed: int = 0, with_tokenizer: bool = True,
                 **config) -> Path:
    """Random-init tiny model of `family` saved with save_pretrained (+ the tiny tokenizer);
    `config` overrides HF config keys (num_hidden_layers=4, ...)."""
    import torch
    import transformers

    cls_name, _, extra = TINY[family]
    cfg = getattr(transformers, cls_name)(**{**_COMMON, **extra, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    out = Path(out_dir)
    model.save_pretrained(out)
    if with_tokenizer:
        for name in TOKENIZER_FILES:
            if (TOKENIZER_DIR / name).exists():
                shutil.copy(TOKENIZER_DIR / name, out / name)
    return out
