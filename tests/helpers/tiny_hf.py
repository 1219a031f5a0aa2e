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
    "glm": ("GlmConfig", "glm-4-9b-chat", {"head_dim": 16, "attention_bias": True, "partial_rotary_factor": 0.5}),
    # GLM-4-0414 has no card of its own: it runs under glm-4-9b-chat's (the plan warns and uses the
    # checkpoint's family)
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


def to_chatglm(tensors: dict, config: dict) -> tuple[dict, dict]:
    """A transformers glm checkpoint (tensors, config.json) rewritten in the original ChatGLM layout
    of THUDM/glm-4-9b-chat (model_type chatglm, ChatGLMModel): written out independently of
    backends.models.decoder.convert, so reading it back tests that mapping."""
    import torch

    c = dict(config)
    rope = c.get("rope_parameters") or {}
    theta = c.get("rope_theta") or rope.get("rope_theta") or 10000.0
    assert (c.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5) == 0.5
    heads, head_dim = c["num_attention_heads"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    out_cfg = {
        "architectures": ["ChatGLMModel"], "model_type": "chatglm",
        "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                     "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"},
        "num_layers": c["num_hidden_layers"], "hidden_size": c["hidden_size"],
        "ffn_hidden_size": c["intermediate_size"], "kv_channels": head_dim, "num_attention_heads": heads,
        "multi_query_attention": True, "multi_query_group_num": c["num_key_value_heads"],
        "padded_vocab_size": c["vocab_size"], "seq_length": c["max_position_embeddings"],
        "layernorm_epsilon": c["rms_norm_eps"], "rope_ratio": theta / 10000.0, "original_rope": True,
        "add_qkv_bias": bool(c.get("attention_bias")), "add_bias_linear": False, "rmsnorm": True,
        "post_layer_norm": True, "apply_residual_connection_post_layernorm": False,
        "apply_query_key_layer_scaling": True, "attention_softmax_in_fp32": True, "fp32_residual_connection": False,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "float32",
        "eos_token_id": c.get("eos_token_id"), "pad_token_id": c.get("pad_token_id"),
    }
    t, out = dict(tensors), {}
    out["transformer.embedding.word_embeddings.weight"] = t.pop("model.embed_tokens.weight")
    out["transformer.encoder.final_layernorm.weight"] = t.pop("model.norm.weight")
    out["transformer.output_layer.weight"] = t.pop("lm_head.weight")
    for i in range(c["num_hidden_layers"]):
        ours, theirs = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{theirs}{norm}.weight"] = t.pop(f"{ours}{norm}.weight")
        for kind in ("weight", "bias") if out_cfg["add_qkv_bias"] else ("weight",):
            out[f"{theirs}self_attention.query_key_value.{kind}"] = torch.cat(
                [t.pop(f"{ours}self_attn.{p}_proj.{kind}") for p in "qkv"]).contiguous()
        out[f"{theirs}self_attention.dense.weight"] = t.pop(f"{ours}self_attn.o_proj.weight")
        out[f"{theirs}mlp.dense_h_to_4h.weight"] = t.pop(f"{ours}mlp.gate_up_proj.weight")
        out[f"{theirs}mlp.dense_4h_to_h.weight"] = t.pop(f"{ours}mlp.down_proj.weight")
    assert not t, f"tensors left unmapped: {sorted(t)}"
    # the release also stores ChatGLM's RotaryEmbedding(kv_channels // 2) buffer (base 10000)
    dim = head_dim // 2
    out["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    return out, out_cfg


def write_chatglm(src_dir: str | Path, out_dir: str | Path) -> Path:
    """The transformers glm model directory src_dir rewritten as a ChatGLM-layout directory."""
    import json

    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    tensors, config = to_chatglm(load_file(str(src / "model.safetensors")),
                                 json.loads((src / "config.json").read_text(encoding="utf-8")))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out
