"""ModelConfig from every LLM card: transformers accepts its to_hf(), builds the same parameter count
(meta device, real sizes) and the same rotary tables; from_hf(to_hf()) round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

import backends.kernels as K  # noqa: E402
from backends.kernels.rotary import rotary_attention_factor  # noqa: E402
from backends.models import decoder as models  # noqa: E402
from backends.models.decoder.config import ConfigError, ModelConfig  # noqa: E402

CARDS = yaml.safe_load((Path(__file__).resolve().parents[2] / "capability_matrix" / "models.yaml")
                       .read_text(encoding="utf-8"))["models"]
# arch null, or a family the native decoder does not build: refused by name (below, and at validate)
LLM_IDS = [k for k, c in CARDS.items() if c["type"] == "llm" and c.get("arch") and c["family"] in models.FAMILIES]
UNBUILT = [k for k, c in CARDS.items() if c.get("arch") and c["family"] not in models.FAMILIES + ("qwen2_vl",
                                                                                                   "qwen2_5_vl", "gemma3")]


def _cfg(model_id: str) -> ModelConfig:
    card = CARDS[model_id]
    return ModelConfig.from_card(card["arch"], card["family"])


def test_cards_of_families_the_native_decoder_lacks_are_refused_by_name():
    assert UNBUILT == ["gemma2-9b", "gemma2-27b", "deepseek-v3.2-671b", "glm5-744b", "glm5.2-744b", "qwen3-next-80b-a3b", "minimax-m2.7-229b"]
    for model_id in UNBUILT:
        with pytest.raises(ConfigError, match=CARDS[model_id]["family"]):
            _cfg(model_id)


@pytest.mark.parametrize("model_id", LLM_IDS)
def test_card_to_hf_builds_the_same_model_in_transformers(model_id):
    cfg = _cfg(model_id)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert type(hf_cfg).model_type == CARDS[model_id]["family"]
    assert hf_cfg.num_hidden_layers == cfg.num_layers and hf_cfg.tie_word_embeddings == cfg.tie_word_embeddings
    with torch.device("meta"):
        ours = models.build_model(cfg)
        theirs = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    buffers = sum(b.numel() for n, b in theirs.named_buffers() if "inv_freq" not in n)  # V3 correction bias
    assert sum(b.numel() for b in ours.buffers()) == buffers
    # and within 1.5% of the published size (MTP modules and rounding aside), where it is more than a name's label
    if not CARDS[model_id].get("params_label_only"):
        assert count / 1e9 == pytest.approx(CARDS[model_id]["published_params_b"], rel=0.015)


@pytest.mark.parametrize("model_id", LLM_IDS)
def test_card_rotary_tables_match_transformers(model_id):
    cfg = _cfg(model_id)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    rope_type = hf_cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        dim = int((getattr(hf_cfg, "head_dim", None) or 0) * hf_cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        want = 1.0 / (hf_cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        factor = 1.0
    else:
        want, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg)
    got = K.rotary_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert rotary_attention_factor(cfg.rope_scaling) == pytest.approx(factor)


@pytest.mark.parametrize("model_id", LLM_IDS)
def test_from_hf_inverts_to_hf(model_id):
    cfg = _cfg(model_id)
    back = ModelConfig.from_hf(cfg.to_hf())
    assert back == cfg
    # and through transformers' own config class (its saved form)
    saved = transformers.AutoConfig.for_model(**cfg.to_hf()).to_dict()
    again = ModelConfig.from_hf(saved)
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                "vocab_size", "rope_theta", "tie_word_embeddings", "qkv_bias", "qk_norm", "rotary_fraction",
                "rms_norm_eps", "moe", "mla"):
        assert getattr(again, key) == getattr(cfg, key), key


def test_yarn_tables_match_deepseek_rotary_embedding():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    for mscale in (1.0, 0.707):
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": 0.707}
        cfg = transformers.DeepseekV3Config(hidden_size=256, num_attention_heads=4, qk_rope_head_dim=64,
                                            max_position_embeddings=163840, rope_parameters=rope)
        pos = torch.tensor([[0, 1, 7, 100, 4095, 4096, 50000, 163000]])
        want_cos, want_sin = ds.DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1), pos)
        cos, sin = K.rotary_cos_sin(pos, 64, theta=10000.0, scaling=rope)
        torch.testing.assert_close(cos, want_cos, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin, want_sin, rtol=1e-5, atol=1e-5)


def test_from_card_overrides_and_lookup():
    m = models.from_card("Qwen/Qwen3-30B-A3B", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                         head_dim=16, vocab_size=128, ffn_hidden_size=96,
                         moe={"num_experts": 4, "experts_per_token": 2, "moe_ffn_hidden_size": 32})
    assert m.config.family == "qwen3_moe" and m.config.moe.num_experts == 4 and m.config.moe.norm_topk_prob
    assert len(m.model.layers) == 2
    w = m.model.layers[0].self_attn.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.004 and torch.all(m.model.norm.weight == 1)
    with pytest.raises(ValueError, match="no model card"):
        models.from_card("no-such-model")


def test_config_errors_are_clear():
    arch = dict(CARDS["qwen3-8b"]["arch"])
    with pytest.raises(ConfigError, match="not understood.*bogus"):
        ModelConfig.from_card({**arch, "bogus": 1}, "qwen3")
    with pytest.raises(ConfigError, match="no native model"):
        ModelConfig.from_card(arch, "gemma3")
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="qk_norm"):
        ModelConfig.from_card({**arch, "qk_norm": False}, "qwen3")


# THUDM/glm-4-9b-chat's config.json as published (the original ChatGLM form; the keys that shape the model)
GLM_4_9B_CHAT = {
    "architectures": ["ChatGLMModel"], "model_type": "chatglm", "add_bias_linear": False, "add_qkv_bias": True,
    "apply_query_key_layer_scaling": True, "apply_residual_connection_post_layernorm": False,
    "attention_dropout": 0.0, "attention_softmax_in_fp32": True, "eos_token_id": [151329, 151336, 151338],
    "ffn_hidden_size": 13696, "fp32_residual_connection": False, "hidden_dropout": 0.0, "hidden_size": 4096,
    "kv_channels": 128, "layernorm_epsilon": 1.5625e-07, "multi_query_attention": True, "multi_query_group_num": 2,
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_layers": 40, "original_rope": True,
    "pad_token_id": 151329, "padded_vocab_size": 151552, "post_layer_norm": True, "rmsnorm": True,
    "rope_ratio": 500, "seq_length": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 151552,
}


def test_published_chatglm_config_is_the_card():
    """The card glm-4-9b-chat is the model THUDM/glm-4-9b-chat's config.json describes (GlmForCausalLM,
    no post-sub-block norms), read by the engine and by the orchestrator alike."""
    from ascendfactory.hfconfig import arch_from_hf_config

    got = ModelConfig.from_hf(GLM_4_9B_CHAT)
    assert got == _cfg("glm-4-9b-chat") and got.family == "glm"
    assert got.hf_extra == {"eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329}
    assert got.to_hf()["architectures"] == ["GlmForCausalLM"]
    family, arch = arch_from_hf_config(GLM_4_9B_CHAT)
    card = CARDS["glm-4-9b-chat"]
    assert family == card["family"] == "glm"
    assert {k: v for k, v in arch.items() if k in card["arch"]} == {k: card["arch"][k] for k in arch}
    layer = models.build_model(got.replace(num_layers=1, vocab_size=8, hidden_size=64, num_attention_heads=4,
                                           num_kv_heads=2, head_dim=16, ffn_hidden_size=32)).model.layers[0]
    assert not hasattr(layer, "post_self_attn_layernorm") and not hasattr(layer, "post_mlp_layernorm")
