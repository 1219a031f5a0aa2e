"""Parameter counts from a model card's architecture numbers (stdlib only, no torch).

A card here is the dict under `models.<id>` in capability_matrix/models.yaml, or just {"arch": …}
(with an optional "vision"). Keys are the README's; the optional extras (norms_per_layer, qk_norm_type,
attn_output_gate, moe scoring_func / shared_expert_gate, dsa indexers, linear_attention layers, vision
tower) default to the common Llama-style layout.
"""

from __future__ import annotations

from typing import Any


def _attention(arch: dict[str, Any]) -> tuple[int, int]:
    """(projection weights and biases, norm weights) of one attention block."""
    h, heads = arch["hidden_size"], arch["num_attention_heads"]
    mla = arch.get("mla")
    if mla:
        qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        q_rank, kv_rank = mla.get("q_lora_rank"), mla["kv_lora_rank"]
        # q: low-rank q_a -> norm -> q_b, or one q_proj when q_lora_rank is null (V2-Lite)
        q = h * q_rank + q_rank * heads * qk if q_rank else h * heads * qk
        kv = h * (kv_rank + mla["qk_rope_head_dim"]) + kv_rank * heads * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
        o = heads * mla["v_head_dim"] * h
        return q + kv + o, (q_rank or 0) + kv_rank
    d = arch["head_dim"]
    q, kv = heads * d, arch["num_kv_heads"] * d
    weights = h * q + 2 * h * kv + q * h
    if arch.get("qkv_bias"):
        weights += q + 2 * kv
    if arch.get("attn_output_gate"):                          # q_proj also yields a sigmoid gate per q channel
        weights += h * q
    if not arch.get("qk_norm"):
        return weights, 0
    # one RMSNorm of head_dim shared by the heads, or (MiniMax's per_layer) one over all q / all k channels
    return weights, (q + kv if arch.get("qk_norm_type") == "per_layer" else 2 * d)


def _linear_attention(arch: dict[str, Any]) -> tuple[int, int]:
    """(weights, norm weights) of one Gated DeltaNet block (Qwen3-Next's linear_attention layers)."""
    lin, h = arch["linear_attention"], arch["hidden_size"]
    key = lin["num_key_heads"] * lin["key_head_dim"]
    value = lin["num_value_heads"] * lin["value_head_dim"]
    qkvz = h * (2 * key + 2 * value)                          # q, k, v and the output gate z
    ba = h * 2 * lin["num_value_heads"]                       # beta and the decay input a, one per value head
    conv = (2 * key + value) * lin["conv_kernel_dim"]         # depthwise causal conv over q, k, v, no bias
    decay = 2 * lin["num_value_heads"]                        # dt_bias and A_log
    return qkvz + ba + conv + decay + value * h, lin["value_head_dim"]  # + out_proj; gated RMSNorm


def _indexers(arch: dict[str, Any]) -> int:
    """DeepSeek sparse attention's lightning indexers (DeepSeek-V3.2, GLM-5): wq_b from the q latent,
    wk, a LayerNorm on k (weight and bias) and the per-head weights_proj, in `indexer_layers` layers."""
    dsa = arch.get("dsa")
    if not dsa:
        return 0
    h, n, d = arch["hidden_size"], dsa["index_n_heads"], dsa["index_head_dim"]
    one = arch["mla"]["q_lora_rank"] * n * d + h * d + 2 * d + h * n
    return one * dsa.get("indexer_layers", arch["num_layers"])


def _is_moe_layer(i: int, moe: dict[str, Any]) -> bool:
    return i >= (moe.get("first_k_dense") or 0) and i % (moe.get("moe_layer_freq") or 1) == 0


def _vision(v: dict[str, Any]) -> int:
    """Vision tower plus the projector into the LLM width."""
    h, f, out = v["hidden_size"], v["ffn_hidden_size"], v["out_hidden_size"]
    tower, p, ch = v.get("tower", "qwen2_vl"), v["patch_size"], v.get("in_channels", 3)
    attn = 4 * (h * h + h)                                   # q, k, v (fused in Qwen) and out, all with bias
    if tower == "qwen2_5_vl":
        mlp, norm = 3 * h * f + 2 * f + h, h                 # SwiGLU with biases; RMSNorm
    else:
        mlp, norm = 2 * h * f + f + h, 2 * h                 # GELU fc1/fc2 with biases; LayerNorm
    blocks = v["depth"] * (attn + mlp + 2 * norm)
    if tower == "siglip":                                     # Gemma 3: SigLIP + soft-token projector
        patch = ch * p * p * h + h                           # Conv2d with bias
        pos = (v["image_size"] // p) ** 2 * h                # learned position table
        return patch + pos + blocks + norm + (h + h * out)  # post-layernorm; projector RMSNorm + matrix
    patch = ch * v.get("temporal_patch_size", 2) * p * p * h  # Conv3d without bias
    merged = h * v.get("spatial_merge_size", 2) ** 2          # 2x2 patches concatenated
    merger = norm + merged * merged + merged + merged * out + out
    return patch + blocks + merger


def describe_params(card: dict[str, Any]) -> dict[str, int]:
    """Parameter breakdown: embedding, attention, mlp (its routed experts also as `experts`), norms,
    head (0 when tied), vision (tower + projector) and total."""
    arch = card["arch"]
    h, layers, vocab = arch["hidden_size"], arch["num_layers"], arch["vocab_size"]
    attn, qk_norms = _attention(arch)
    lin = arch.get("linear_attention")
    # hybrid models: every full_attention_interval-th layer attends, the others are linear attention
    full = layers // lin["full_attention_interval"] if lin else layers
    lin_attn, lin_norms = _linear_attention(arch) if lin else (0, 0)
    moe = arch.get("moe")
    dense_mlp = 3 * h * arch["ffn_hidden_size"]               # SwiGLU / GeGLU: gate, up, down
    mlp = experts = 0
    for i in range(layers):
        if moe and _is_moe_layer(i, moe):
            n, mf = moe["num_experts"], moe["moe_ffn_hidden_size"]
            router = h * n + (n if moe.get("scoring_func") == "sigmoid" else 0)  # + correction bias
            routed = n * 3 * h * mf
            mlp += router + routed + 3 * h * (moe.get("shared_experts") or 0) * mf
            mlp += h if moe.get("shared_expert_gate") else 0    # Qwen3-Next's sigmoid gate on the shared expert
            experts += routed
        else:
            mlp += dense_mlp
    norms = layers * (arch.get("norms_per_layer") or 2) * h + full * qk_norms + (layers - full) * lin_norms + h
    vision = _vision(card["vision"]) if card.get("vision") else 0
    parts = {
        "embedding": vocab * h,
        "attention": full * attn + (layers - full) * lin_attn + _indexers(arch),
        "mlp": mlp,
        "experts": experts,
        "norms": norms,
        "head": 0 if arch.get("tie_word_embeddings") else vocab * h,
        "vision": vision,
    }
    parts["total"] = sum(v for k, v in parts.items() if k != "experts")
    return parts


def count_params(card: dict[str, Any]) -> int:
    return describe_params(card)["total"]


def count_active_params(card: dict[str, Any]) -> int:
    """Weights one token computes with. Dense models: the total. MoE: routed experts the token is not
    sent to are idle, and the untied input embedding is a row lookup, not a matmul (DeepSeek's
    convention: V3's 37B counts the output head, not the input embedding)."""
    parts = describe_params(card)
    moe = card["arch"].get("moe")
    if not moe:
        return parts["total"]
    n, k = moe["num_experts"], moe["experts_per_token"]
    idle = parts["experts"] // n * (n - k)
    lookup = 0 if card["arch"].get("tie_word_embeddings") else parts["embedding"]
    return parts["total"] - idle - lookup
