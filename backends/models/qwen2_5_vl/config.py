"""VLConfig: the architecture of a native Qwen2.5-VL (vision tower, patch merger, M-RoPE text decoder),
read from and written to a transformers `Qwen2_5_VLForConditionalGeneration` config.json.

The text part carries the attribute names backends.common.layers.Attention reads (hidden_size, head_dim,
num_attention_heads, num_kv_heads, qkv_bias, o_proj_bias, qk_norm, rms_norm_eps, rotary_dim,
rotary_interleaved).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = ("qwen2_5_vl",)


class ConfigError(ValueError):
    pass


@dataclass
class TextConfig:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    mrope_section: tuple[int, ...] = (16, 24, 24)
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 128000
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    # fixed for Qwen2.5: q/k/v biases, no output bias, no q/k norm, full half-split rotary
    qkv_bias: bool = True
    o_proj_bias: bool = False
    qk_norm: bool = False
    rotary_interleaved: bool = False

    def __post_init__(self):
        self.mrope_section = tuple(int(x) for x in self.mrope_section)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"text hidden_size {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(f"text num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ConfigError(f"mrope_section {list(self.mrope_section)} must sum to head_dim/2 = {self.head_dim // 2}")
        if self.hidden_act != "silu":
            raise ConfigError(f"text hidden_act {self.hidden_act!r}: the native decoder implements SwiGLU (silu) only")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return self.head_dim


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    tokens_per_second: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self):
        self.fullatt_block_indexes = tuple(int(i) for i in self.fullatt_block_indexes)
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.hidden_act != "silu":
            raise ConfigError(f"vision hidden_act {self.hidden_act!r}: the native vision MLP implements SwiGLU "
                              "(silu) only")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ConfigError(f"fullatt_block_indexes {bad} are outside the {self.depth} vision blocks")
        unit = self.spatial_merge_size * self.patch_size
        if self.window_size < unit or self.window_size % unit:
            raise ConfigError(f"window_size {self.window_size} must be a positive multiple of patch_size × "
                              f"spatial_merge_size = {unit}")
        if (self.hidden_size // self.num_heads) % 4:
            raise ConfigError("the vision head dim must be a multiple of 4 (2-D rotary over h and w)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


@dataclass
class VLConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    kind: str = "qwen2_5_vl"
    hf_extra: dict = field(default_factory=dict, compare=False)  # token ids of the text config

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"model type {self.kind!r} has no native vision-language model; supported: "
                              f"{', '.join(KINDS)}")
        if not 0 <= self.image_token_id < self.text.vocab_size:
            raise ConfigError(f"image_token_id {self.image_token_id} is outside the vocabulary "
                              f"({self.text.vocab_size})")

    @property
    def tie_word_embeddings(self) -> bool:
        return self.text.tie_word_embeddings

    # ------------------------------------------------------------------ transformers config.json

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VLConfig:
        kind = cfg.get("model_type")
        if kind not in KINDS:
            raise ConfigError(f"config.json model_type {kind!r}: backends.mm builds {', '.join(KINDS)}")
        text = dict(cfg.get("text_config") or cfg)  # transformers 4 kept the text keys at the top level
        vision = dict(cfg["vision_config"])
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"text rope type {rope_type!r}: only M-RoPE without scaling is built")
        tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        t = TextConfig(
            num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
            ffn_hidden_size=text["intermediate_size"], num_attention_heads=text["num_attention_heads"],
            num_kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
            vocab_size=text["vocab_size"], mrope_section=rope.get("mrope_section", (16, 24, 24)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1000000.0))),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=text.get("max_position_embeddings", 128000), tie_word_embeddings=tie,
            hidden_act=text.get("hidden_act", "silu"), initializer_range=text.get("initializer_range", 0.02))
        vrope = vision.get("rope_parameters") or {}
        v = VisionConfig(
            depth=vision["depth"], hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
            num_heads=vision["num_heads"], out_hidden_size=vision["out_hidden_size"],
            patch_size=vision.get("patch_size", 14), spatial_merge_size=vision.get("spatial_merge_size", 2),
            temporal_patch_size=vision.get("temporal_patch_size", 2), in_channels=vision.get("in_channels", 3),
            window_size=vision.get("window_size", 112),
            fullatt_block_indexes=vision.get("fullatt_block_indexes", (7, 15, 23, 31)),
            hidden_act=vision.get("hidden_act", "silu"), tokens_per_second=vision.get("tokens_per_second", 2),
            rope_theta=float(vrope.get("rope_theta", 10000.0)),
            initializer_range=vision.get("initializer_range", 0.02))
        extra = {k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in text}
        return cls(text=t, vision=v, image_token_id=cfg["image_token_id"], video_token_id=cfg.get("video_token_id"),
                   vision_start_token_id=cfg.get("vision_start_token_id"),
                   vision_end_token_id=cfg.get("vision_end_token_id"), kind=kind, hf_extra=extra)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json that transformers loads as Qwen2_5_VLForConditionalGeneration of this shape."""
        t, v = self.text, self.vision
        text = {
            "model_type": "qwen2_5_vl_text", "hidden_size": t.hidden_size, "intermediate_size": t.ffn_hidden_size,
            "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_kv_heads, "vocab_size": t.vocab_size, "rms_norm_eps": t.rms_norm_eps,
            "max_position_embeddings": t.max_position_embeddings, "hidden_act": t.hidden_act,
            "initializer_range": t.initializer_range, "tie_word_embeddings": t.tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                                "mrope_section": list(t.mrope_section)},
            "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0,
            **self.hf_extra,
        }
        vision = {
            "model_type": "qwen2_5_vl_vision", "depth": v.depth, "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size, "num_heads": v.num_heads, "out_hidden_size": v.out_hidden_size,
            "patch_size": v.patch_size, "spatial_merge_size": v.spatial_merge_size,
            "temporal_patch_size": v.temporal_patch_size, "in_channels": v.in_channels,
            "window_size": v.window_size, "fullatt_block_indexes": list(v.fullatt_block_indexes),
            "hidden_act": v.hidden_act, "tokens_per_second": v.tokens_per_second,
            "initializer_range": v.initializer_range,
            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
        }
        return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": self.kind, "dtype": dtype,
                "text_config": text, "vision_config": vision, "image_token_id": self.image_token_id,
                "video_token_id": self.video_token_id, "vision_start_token_id": self.vision_start_token_id,
                "vision_end_token_id": self.vision_end_token_id, "tie_word_embeddings": t.tie_word_embeddings}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
