"""ModelConfig: the architecture of one native decoder, named like the card `arch` keys in
capability_matrix/models.yaml, with converters from a card, from a Hugging Face config.json and back.

Family semantics follow transformers' own classes (Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM,
GlmForCausalLM, Glm4ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, DeepseekV2ForCausalLM,
DeepseekV3ForCausalLM). `glm` is GLM-4-9B(-chat); `glm4` is GLM-4-0414, which adds a norm after each
sub-block. GLM-4-9B's original ChatGLM config.json (model_type chatglm) reads as family glm.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("qwen2", "qwen3", "llama", "glm", "glm4", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
GLM_FAMILIES = ("glm", "glm4")         # fused gate_up_proj, half the head rotated in interleaved pairs
ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
    "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}
# HF token ids carried through from_hf -> to_hf so an export generates like its source
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class ConfigError(ValueError):
    pass


@dataclass
class MoEConfig:
    num_experts: int
    experts_per_token: int
    moe_ffn_hidden_size: int
    shared_experts: int = 0            # shared expert FFN width = shared_experts * moe_ffn_hidden_size
    first_k_dense: int = 0             # leading layers with a dense MLP of ffn_hidden_size
    moe_layer_freq: int = 1            # DeepSeek: layer i >= first_k_dense is MoE if i % freq == 0;
                                       # Qwen3-MoE (decoder_sparse_step): if (i + 1) % freq == 0
    scoring_func: str = "softmax"      # softmax | sigmoid
    topk_method: str = "greedy"        # greedy | group_limited_greedy (V2) | noaux_tc (V3)
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    # carried to config.json only (the trainer picks its coefficient), so not part of equality
    router_aux_loss_coef: float | None = field(default=None, compare=False)

    def __post_init__(self):
        self.mlp_only_layers = tuple(self.mlp_only_layers or ())
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"moe.scoring_func must be softmax or sigmoid, got {self.scoring_func!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ConfigError(f"moe.topk_method {self.topk_method!r} is not one of greedy, group_limited_greedy, "
                              "noaux_tc")
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigError(f"moe.experts_per_token={self.experts_per_token} must be in 1..{self.num_experts}")
        if self.n_group and self.n_group > 1 and self.num_experts % self.n_group:
            raise ConfigError(f"moe: {self.num_experts} experts do not split into n_group={self.n_group}")


@dataclass
class MLAConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True       # DeepSeek stores the rope dims as adjacent pairs


@dataclass
class ModelConfig:
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rotary_fraction: float = 1.0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    num_nextn_predict_layers: int = 0  # DeepSeek MTP modules: recorded, not built (HF does not build them either)
    initializer_range: float = 0.02
    hf_extra: dict = field(default_factory=dict, compare=False)  # token ids from a source config.json

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"family {self.family!r} has no native model; supported: {', '.join(FAMILIES)}")
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r}: the native models implement SwiGLU (silu) only")
        for block, families in (("moe", MOE_FAMILIES), ("mla", MLA_FAMILIES)):
            if (getattr(self, block) is not None) != (self.family in families):
                need = "needs" if self.family in families else "takes no"
                raise ConfigError(f"family {self.family} {need} {block} block")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads}")
        if self.family == "qwen2" and not self.qkv_bias:
            raise ConfigError("qwen2 always has q/k/v biases (qkv_bias: true)")
        if self.qk_norm != (self.family in ("qwen3", "qwen3_moe")):
            raise ConfigError(f"qk_norm={self.qk_norm} does not match family {self.family} (only qwen3/qwen3_moe)")
        if self.family not in GLM_FAMILIES and self.rotary_fraction != 1.0:
            raise ConfigError(f"rotary_fraction={self.rotary_fraction}: only glm / glm4 rotate part of the head")
        if self.rotary_dim % 2:
            raise ConfigError(f"rotary dim {self.rotary_dim} (head_dim * rotary_fraction) must be even")
        m = self.moe
        if self.family == "mixtral" and (m.shared_experts or m.first_k_dense or not m.norm_topk_prob):
            raise ConfigError("mixtral has no shared experts or dense layers and always renormalises its top-k")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)

    # ------------------------------------------------------------------ derived

    @property
    def rotary_dim(self) -> int:
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.rotary_fraction)

    @property
    def rotary_interleaved(self) -> bool:
        if self.mla is not None:
            return self.mla.rope_interleave
        return self.family in GLM_FAMILIES

    @property
    def o_proj_bias(self) -> bool:
        # transformers' Llama/Qwen3 tie the output bias to attention_bias; Qwen2/GLM never have one
        return self.qkv_bias and self.family in ("llama", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3")

    def is_moe_layer(self, i: int) -> bool:
        m = self.moe
        if m is None or i < m.first_k_dense or i in m.mlp_only_layers:
            return False
        if self.family == "qwen3_moe":
            return (i + 1) % m.moe_layer_freq == 0
        return i % m.moe_layer_freq == 0

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_card(cls, arch: dict, family: str) -> ModelConfig:
        """From a card's `arch` block (capability_matrix/models.yaml); unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)} - {"family", "hf_extra"}
        unknown = sorted(set(arch) - names)
        if unknown:
            raise ConfigError(f"card arch keys not understood by the native {family} model: {', '.join(unknown)}")
        kw = dict(arch)
        if kw.get("moe") is not None:
            kw["moe"] = MoEConfig(**_moe_defaults(family, kw["moe"]))
        if kw.get("mla") is not None:
            kw["mla"] = MLAConfig(**kw["mla"])
        return cls(family=family, **kw)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """From a Hugging Face config.json dict (transformers 4 `rope_scaling` or 5 `rope_parameters`)."""
        return _from_hf(cls, cfg)

    def to_hf(self, dtype: str | None = "float32") -> dict[str, Any]:
        """A config.json that AutoModelForCausalLM loads as the same architecture."""
        return _to_hf(self, dtype)


def _moe_defaults(family: str, moe: dict) -> dict:
    moe = dict(moe)
    if family == "deepseek_v3":
        moe.setdefault("scoring_func", "sigmoid")
        moe.setdefault("topk_method", "noaux_tc")
    if family == "deepseek_v2":
        moe.setdefault("norm_topk_prob", False)
    return moe


# ---------------------------------------------------------------------- config.json


def _rope_from_hf(cfg: dict) -> tuple[float, dict | None, float | None]:
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    partial = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor")
    scaling = dict(legacy) if legacy else params
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling, partial


def _first(cfg: dict, *keys: str):
    """The first key present: transformers 5 saves some fields under their attribute_map alias."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise ConfigError(f"config.json of {cfg.get('model_type')} has none of {', '.join(keys)}")


# ChatGLM config.json switches that select an architecture the native glm model does not build:
# key -> (the value GLM-4-9B / ChatGLM2-3 ship, what to say otherwise)
_CHATGLM_FIXED = {
    "rmsnorm": (True, "LayerNorm blocks (rmsnorm=false) are not implemented"),
    "add_bias_linear": (False, "biases on dense / dense_h_to_4h / dense_4h_to_h are not implemented"),
    "apply_residual_connection_post_layernorm": (False, "residuals taken after the norm are not implemented"),
    "post_layer_norm": (True, "a model without final_layernorm is not implemented"),
}


def _from_chatglm(cfg: dict) -> dict:
    """The original ChatGLM config.json (THUDM/glm-4-9b-chat, chatglm2/3-6b) as the transformers glm
    config it stands for: the same blocks (GlmForCausalLM), with rotary base 10000 * rope_ratio on
    half of each head (ChatGLM's RotaryEmbedding(kv_channels // 2), adjacent pairs)."""
    where = "config.json (model_type chatglm)"
    if cfg.get("padded_vocab_size") is None or cfg.get("ffn_hidden_size") is None:
        raise ConfigError(f"{where} has no padded_vocab_size / ffn_hidden_size: the first ChatGLM-6B "
                          "(2-D positions, GLU blocks) is not implemented; GLM-4-9B and ChatGLM2/3 are")
    if cfg.get("quantization_bit"):
        raise ConfigError(f"{where}: quantization_bit={cfg['quantization_bit']} checkpoints are not loadable; "
                          "use the bf16 release")
    if cfg.get("pre_seq_len"):
        raise ConfigError(f"{where}: pre_seq_len={cfg['pre_seq_len']} (P-Tuning v2 prefix encoder) is not "
                          "implemented; remove it to load the base weights")
    for key, (want, why) in _CHATGLM_FIXED.items():
        if bool(cfg.get(key, want)) != want:
            raise ConfigError(f"{where}: {key}={cfg[key]!r}: {why}")
    heads = _first(cfg, "num_attention_heads")
    groups = cfg.get("multi_query_group_num", 1) if cfg.get("multi_query_attention") else heads
    out = {
        "model_type": "glm", "num_hidden_layers": _first(cfg, "num_layers", "num_hidden_layers"),
        "hidden_size": _first(cfg, "hidden_size"), "intermediate_size": cfg["ffn_hidden_size"],
        "num_attention_heads": heads, "num_key_value_heads": groups,
        "head_dim": cfg.get("kv_channels") or cfg["hidden_size"] // heads,
        "vocab_size": cfg["padded_vocab_size"], "max_position_embeddings": cfg.get("seq_length", 2048),
        "rope_theta": 10000.0 * float(cfg.get("rope_ratio", 1)), "partial_rotary_factor": 0.5,
        "attention_bias": bool(cfg.get("add_qkv_bias", False)), "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)), "hidden_act": "silu",
    }
    for key in (*TOKEN_KEYS, "initializer_range"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    return out


def _from_hf(cls, cfg: dict) -> ModelConfig:
    if cfg.get("model_type") == "chatglm":
        cfg = _from_chatglm(cfg)
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"config.json model_type {family!r} has no native model; supported: {', '.join(FAMILIES)}")
    if cfg.get("quantization_config"):
        q = cfg["quantization_config"].get("quant_method", "quantized")
        raise ConfigError(f"{family}: {q} checkpoints are not loadable; dequantize to bf16 first "
                          "(e.g. DeepSeek's fp8_cast_bf16.py)")
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{family}: use_sliding_window=true is not implemented by the native models")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{family}: mlp_bias=true is not implemented by the native models")
    theta, scaling, partial = _rope_from_hf(cfg)
    heads = cfg["num_attention_heads"]
    kw: dict[str, Any] = dict(
        family=family, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg.get("intermediate_size"), num_attention_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", family in GLM_FAMILIES)) or family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        rotary_fraction=float(partial if partial is not None else 0.5) if family in GLM_FAMILIES else 1.0,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), hidden_act=cfg.get("hidden_act", "silu"),
        initializer_range=cfg.get("initializer_range", 0.02),
        hf_extra={k: cfg[k] for k in TOKEN_KEYS if cfg.get(k) is not None},
    )
    if family == "mixtral":
        kw["moe"] = MoEConfig(num_experts=_first(cfg, "num_local_experts", "num_experts"),
                              experts_per_token=cfg["num_experts_per_tok"],
                              moe_ffn_hidden_size=cfg["intermediate_size"],
                              router_aux_loss_coef=cfg.get("router_aux_loss_coef"))
    elif family == "qwen3_moe":
        kw["moe"] = MoEConfig(num_experts=_first(cfg, "num_experts", "num_local_experts"),
                              experts_per_token=cfg["num_experts_per_tok"],
                              moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                              moe_layer_freq=cfg.get("decoder_sparse_step", 1),
                              norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                              mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
                              router_aux_loss_coef=cfg.get("router_aux_loss_coef"))
    elif family in MLA_FAMILIES:
        v3 = family == "deepseek_v3"
        kw["head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        kw["num_nextn_predict_layers"] = cfg.get("num_nextn_predict_layers", 0) if v3 else 0
        kw["moe"] = MoEConfig(
            num_experts=_first(cfg, "n_routed_experts", "num_local_experts", "num_experts"),
            experts_per_token=cfg["num_experts_per_tok"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"], shared_experts=cfg.get("n_shared_experts") or 0,
            first_k_dense=cfg.get("first_k_dense_replace") or 0, moe_layer_freq=cfg.get("moe_layer_freq") or 1,
            # transformers' V3 router is always sigmoid + group-limited (noaux_tc) whatever the file says
            scoring_func="sigmoid" if v3 else cfg.get("scoring_func", "softmax"),
            topk_method="noaux_tc" if v3 else cfg.get("topk_method") or "greedy",
            n_group=cfg.get("n_group"), topk_group=cfg.get("topk_group"),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
        )
        kw["mla"] = MLAConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                              qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                              v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)))
    return cls(**kw)


def _rope_to_hf(c: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": c.rope_theta, "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None}
    params = {k: v for k, v in (c.rope_scaling or {}).items() if k != "type"}
    params["rope_type"] = (c.rope_scaling or {}).get("rope_type", (c.rope_scaling or {}).get("type", "default"))
    params["rope_theta"] = c.rope_theta
    if c.family in GLM_FAMILIES:
        params["partial_rotary_factor"] = c.rotary_fraction
        out["partial_rotary_factor"] = c.rotary_fraction
    out["rope_parameters"] = params
    return out


def _to_hf(c: ModelConfig, dtype: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[c.family]], "model_type": c.family,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_kv_heads, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "hidden_act": c.hidden_act, "tie_word_embeddings": c.tie_word_embeddings,
        "initializer_range": c.initializer_range, "attention_dropout": 0.0, "use_cache": True,
    }
    out.update(_rope_to_hf(c))
    for key in TOKEN_KEYS:  # explicit None: some class defaults (GLM-4's pad 151329) exceed small vocabularies
        out[key] = c.hf_extra.get(key)
    if c.mla is None:
        out["head_dim"] = c.head_dim
    if c.family != "qwen2":
        out["attention_bias"] = c.qkv_bias
    if c.family == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers)
    if c.family == "llama":
        out["mlp_bias"] = False
    m = c.moe
    if c.family == "mixtral":
        out.update(num_local_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                   intermediate_size=m.moe_ffn_hidden_size, router_jitter_noise=0.0, sliding_window=None)
    elif c.family == "qwen3_moe":
        only = sorted(set(m.mlp_only_layers) | set(range(m.first_k_dense)))
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                   moe_intermediate_size=m.moe_ffn_hidden_size, decoder_sparse_step=m.moe_layer_freq,
                   mlp_only_layers=only, norm_topk_prob=m.norm_topk_prob, use_sliding_window=False,
                   sliding_window=None)
    elif c.mla is not None:
        a = c.mla
        out.update(n_routed_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                   moe_intermediate_size=m.moe_ffn_hidden_size, n_shared_experts=m.shared_experts,
                   first_k_dense_replace=m.first_k_dense, moe_layer_freq=m.moe_layer_freq,
                   scoring_func=m.scoring_func, topk_method=m.topk_method, n_group=m.n_group,
                   topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling_factor,
                   norm_topk_prob=m.norm_topk_prob, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                   qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                   v_head_dim=a.v_head_dim)
        if c.family == "deepseek_v3":
            out.update(rope_interleave=a.rope_interleave, num_nextn_predict_layers=c.num_nextn_predict_layers)
    if m is not None and m.router_aux_loss_coef is not None:
        out["router_aux_loss_coef"] = m.router_aux_loss_coef
    if dtype is not None:
        out["torch_dtype"] = dtype  # transformers 4 reads torch_dtype, 5 reads dtype
        out["dtype"] = dtype
    return out
