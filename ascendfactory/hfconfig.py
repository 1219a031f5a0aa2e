"""Read a Hugging Face config.json into the card's architecture keys (pure JSON, no transformers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILY_OF_MODEL_TYPE = {
    "qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe",
    "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3", "chatglm": "glm", "glm": "glm", "glm4": "glm4",
    "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "gemma3": "gemma3", "gemma3_text": "gemma3",
}


def _first(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def arch_from_hf_config(cfg: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(family, arch) from a config.json dict; VL configs are read from their text part."""
    model_type = cfg.get("model_type", "")
    text = dict(cfg)
    if isinstance(cfg.get("text_config"), dict):
        text.update(cfg["text_config"])
    hidden = _first(text, "hidden_size")
    heads = _first(text, "num_attention_heads")
    rope = text.get("rope_parameters") or {}
    theta = _first(text, "rope_theta") or rope.get("rope_theta")
    if theta is None and text.get("rope_ratio") is not None:
        theta = 10000.0 * text["rope_ratio"]
    arch: dict[str, Any] = {
        "num_layers": _first(text, "num_hidden_layers", "num_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": _first(text, "intermediate_size", "ffn_hidden_size"),
        "num_attention_heads": heads,
        "num_kv_heads": _first(text, "num_key_value_heads", "multi_query_group_num", default=heads),
        "head_dim": _first(text, "head_dim", "kv_channels",
                           default=(hidden // heads) if hidden and heads else None),
        "vocab_size": _first(text, "vocab_size", "padded_vocab_size"),
        "max_position_embeddings": _first(text, "max_position_embeddings", "seq_length"),
        "rope_theta": float(theta) if theta is not None else 10000.0,
        "tie_word_embeddings": bool(_first(cfg, "tie_word_embeddings", default=False)),
        "qkv_bias": model_type in ("qwen2", "qwen2_vl", "qwen2_5_vl") or bool(text.get("add_qkv_bias"))
                    or bool(text.get("attention_bias")),
        "qk_norm": model_type in ("qwen3", "qwen3_moe"),
    }
    experts = _first(text, "num_experts", "num_local_experts", "n_routed_experts")
    if experts:
        arch["moe"] = {
            "num_experts": experts,
            "experts_per_token": _first(text, "num_experts_per_tok", default=2),
            "moe_ffn_hidden_size": _first(text, "moe_intermediate_size", "intermediate_size"),
            "shared_experts": _first(text, "n_shared_experts", default=0),
            "first_k_dense": _first(text, "first_k_dense_replace", default=0),
            "moe_layer_freq": _first(text, "moe_layer_freq", "decoder_sparse_step", default=1),
        }
    if text.get("kv_lora_rank"):
        arch["mla"] = {k: text.get(k) for k in
                       ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        arch["num_kv_heads"] = heads
        arch["head_dim"] = (text.get("qk_nope_head_dim") or 0) + (text.get("qk_rope_head_dim") or 0)
    partial = _first(text, "partial_rotary_factor", default=rope.get("partial_rotary_factor"))
    if partial is None and model_type in ("chatglm", "glm", "glm4"):
        partial = 0.5  # ChatGLM rotates kv_channels // 2 dims; transformers' GLM configs default to 0.5
    if partial is not None:
        arch["rotary_fraction"] = float(partial)
    eps = _first(text, "rms_norm_eps", "layernorm_epsilon", "layer_norm_epsilon")
    if eps is not None:  # rendered where the dialect names it (MindSpeed-RL's norm_epsilon)
        arch["rms_norm_eps"] = float(eps)
    return FAMILY_OF_MODEL_TYPE.get(model_type), arch


def read_model_dir(path: str | Path) -> tuple[str | None, dict[str, Any]]:
    cfg_path = Path(path) / "config.json"
    return arch_from_hf_config(json.loads(cfg_path.read_text(encoding="utf-8")))


def is_tiny_test_model(path: str | Path) -> bool:
    """The directory says it is a tiny test model (its ascendfactory.json, as examples/make_tiny_model.py
    writes it): random weights that may stand in for any card."""
    try:
        return json.loads((Path(path) / "ascendfactory.json").read_text(encoding="utf-8")).get("tiny_test_model") is True
    except (OSError, ValueError, AttributeError):
        return False
