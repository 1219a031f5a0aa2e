"""capability_matrix/models.yaml: schema, config values, and parameter counts against published sizes."""

from pathlib import Path

import pytest

from ascendfactory.catalog import load_yaml_unique
from ascendfactory.params import count_active_params, count_params, describe_params
from tests.helpers.model_ids import MODEL_IDS as IDS

ROOT = Path(__file__).resolve().parents[1]
MODELS_YAML = ROOT / "capability_matrix" / "models.yaml"
CARDS = load_yaml_unique(MODELS_YAML.read_text(encoding="utf-8"))["models"]
# tests/data/seed_model_list.txt: a verbatim copy of shared/seeds/001_fd22b9b60aa4ca09.txt (MindSpeed-LLM's list)
SEED2_TEXT = (ROOT / "tests" / "data" / "seed_model_list.txt").read_text(encoding="utf-8")
# the second seed's models the first does not card, in card order; the first seed's carded ones carry seed2 too
SEED2_NEW = ["qwen2.5-3b", "chatglm3-6b", "deepseek-r1-distill-qwen-1.5b", "llama3.1-405b", "llama3.3-70b",
             "deepseek-r1-distill-qwen-7b", "deepseek-r1-distill-qwen-14b", "deepseek-r1-distill-qwen-32b",
             "deepseek-r1-distill-llama-8b", "deepseek-r1-distill-llama-70b", "internlm2.5-1.8b", "internlm2.5-7b",
             "internlm2.5-20b", "mistral-7b", "gemma2-9b", "gemma2-27b", "deepseek-v3.2-671b", "deepseek-v4-flash-284b",
             "glm5-744b", "glm5.2-744b", "qwen3-next-80b-a3b", "longcat-flash-560b", "minimax-m2.7-229b",
             "step-3.5-flash-196b", "mixtral-8x22b", "mamba2-2.7b", "mamba2-8b", "mamba2hybrid-8b"]
# of those, the cards whose config.json values were read (the rest: arch null, arch_unknown, refused by name)
SEED2_ARCH = ["qwen2.5-3b", "chatglm3-6b", "deepseek-r1-distill-qwen-1.5b", "llama3.1-405b", "llama3.3-70b",
              "gemma2-9b", "gemma2-27b", "deepseek-v3.2-671b", "glm5-744b", "glm5.2-744b", "qwen3-next-80b-a3b", "minimax-m2.7-229b",
              "mixtral-8x22b"]
WITH_ARCH = IDS + SEED2_ARCH

MOE = {"deepseek-r1-671b", "deepseek-v3-671b", "deepseek-v2-lite-16b", "qwen3-30b-a3b", "qwen3-235b-a22b",
       "mixtral-8x7b-instruct-v0.1", "mixtral-8x22b", "deepseek-v3.2-671b", "glm5-744b", "glm5.2-744b",
       "qwen3-next-80b-a3b", "minimax-m2.7-229b"}
MLA = {"deepseek-r1-671b", "deepseek-v3-671b", "deepseek-v2-lite-16b", "deepseek-v3.2-671b", "glm5-744b", "glm5.2-744b"}
MULTIMODAL = {i for i in IDS if "-vl-" in i} | {"gemma3-27b"}
FAMILIES = {"qwen2", "qwen3", "llama", "glm", "glm4", "mixtral", "deepseek_v2", "deepseek_v3", "qwen3_moe", "qwen2_vl",
            "qwen2_5_vl", "gemma3", "gemma2", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "minimax_m2"}
# families whose config sets head_dim independently of hidden_size / heads
FREE_HEAD_DIM = {"qwen3", "qwen3_moe", "gemma3", "gemma2", "qwen3_next", "minimax_m2"}

CARD_KEYS = {"name": str, "series": str, "type": str, "family": str, "hf_repo": str,
             "published_params_b": (int, float), "arch": dict}
ARCH_KEYS = {"num_layers": int, "hidden_size": int, "ffn_hidden_size": int, "num_attention_heads": int,
             "num_kv_heads": int, "head_dim": int, "vocab_size": int, "max_position_embeddings": int,
             "rope_theta": float, "tie_word_embeddings": bool, "qkv_bias": bool, "qk_norm": bool,
             "rotary_fraction": float}
MOE_KEYS = {"num_experts": int, "experts_per_token": int, "moe_ffn_hidden_size": int, "shared_experts": int,
            "first_k_dense": int, "moe_layer_freq": int}
DSA_KEYS = {"index_n_heads": int, "index_head_dim": int, "index_topk": int}
LINEAR_KEYS = {"full_attention_interval": int, "num_key_heads": int, "num_value_heads": int, "key_head_dim": int,
               "value_head_dim": int, "conv_kernel_dim": int}
MLA_KEYS = {"q_lora_rank": (int, type(None)), "kv_lora_rank": int, "qk_nope_head_dim": int,
            "qk_rope_head_dim": int, "v_head_dim": int}
VISION_KEYS = {"depth": int, "hidden_size": int, "ffn_hidden_size": int, "num_heads": int, "patch_size": int,
               "out_hidden_size": int}


def _check_types(where: str, block: dict, keys: dict) -> None:
    for key, kind in keys.items():
        assert key in block, f"{where}: missing {key}"
        value = block[key]
        assert isinstance(value, kind), f"{where}.{key} = {value!r} is not {kind}"
        if kind is int:  # bool is an int subclass; a YAML true/false here is a typo
            assert not isinstance(value, bool), f"{where}.{key} = {value!r}"
        if kind is int and value is not None:
            assert value > 0 or key in ("shared_experts", "first_k_dense"), f"{where}.{key} = {value}"


def test_the_first_seed_s_35_models_then_the_second_seed_s_in_order():
    assert list(CARDS) == IDS + SEED2_NEW


@pytest.mark.parametrize("model_id", [m for m in SEED2_NEW if m not in SEED2_ARCH])
def test_a_card_without_config_values_says_so(model_id):
    card = CARDS[model_id]
    assert card["arch"] is None and isinstance(card["arch_unknown"], str) and card["arch_unknown"].strip()
    assert isinstance(card["family"], str) and card["seed2"] is not None


def test_seed2_copy_is_verbatim():
    original = ROOT.parent / "shared" / "seeds" / "001_fd22b9b60aa4ca09.txt"
    if not original.exists():
        pytest.skip("shared/seeds not present next to this checkout")
    assert SEED2_TEXT.encode("utf-8") == original.read_bytes()


def _seed_rows() -> dict[str, tuple[str, str, list[str]]]:
    """'<first cell> <second cell>' → (table kind, cluster, backends) for the seed's dense and MoE tables."""
    rows, kind = {}, None
    for line in SEED2_TEXT.splitlines():
        if line.startswith("| 模型系列 |"):
            kind = "dense"
        elif line.startswith("| 模型 |"):
            kind = "moe"
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if kind and line.startswith("|") and len(cells) == 4 and not set(cells[0]) <= {"-"} and cells[0] not in ("模型系列", "模型"):
            rows[f"{cells[0]} {cells[1]}"] = (kind, cells[2], [b.strip().lower() for b in cells[3].split("/")])
    return rows


def test_seed2_facts_are_the_seed_s_cell_for_cell():
    rows = _seed_rows()
    assert len(rows) == 18  # 8 dense families, 10 MoE rows
    listed = {}
    for model_id, card in CARDS.items():
        seed2 = card.get("seed2")
        if seed2 is None:
            continue
        assert set(seed2) == {"listed", "kind", "cluster", "backends"}, model_id
        listed.setdefault(seed2["listed"], []).append(model_id)
        if seed2["kind"] == "ssm":  # its paragraph names the models, no cluster and no backend column
            assert card["series"] in SEED2_TEXT and seed2["cluster"] is None and seed2["backends"] == []
            continue
        assert rows[seed2["listed"]] == (seed2["kind"], seed2["cluster"], seed2["backends"]), model_id
    assert set(rows) <= set(listed)  # every row of both tables has its cards
    assert set(SEED2_NEW) <= {m for ms in listed.values() for m in ms}
    assert listed["Qwen3 0.6B ~ 32B"] == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"]


@pytest.mark.parametrize("model_id", WITH_ARCH)
def test_card_schema(model_id):
    card = CARDS[model_id]
    _check_types(model_id, card, CARD_KEYS)
    assert card["family"] in FAMILIES
    assert card["type"] == ("multimodal" if model_id in MULTIMODAL else "llm")
    assert "arch_unknown" not in card
    arch = card["arch"]
    _check_types(f"{model_id}.arch", arch, ARCH_KEYS)
    assert 0 < arch["rotary_fraction"] <= 1
    assert arch["num_attention_heads"] % arch["num_kv_heads"] == 0
    assert ("moe" in arch) == (model_id in MOE)
    assert ("mla" in arch) == (model_id in MLA)
    assert ("vision" in card) == (model_id in MULTIMODAL)
    assert ("published_active_params_b" in card) == (model_id in MOE)
    assert ("dsa" in arch) == (card["family"] in ("deepseek_v32", "glm_moe_dsa"))
    assert ("linear_attention" in arch) == (card["family"] == "qwen3_next")
    if "dsa" in arch:
        _check_types(f"{model_id}.arch.dsa", arch["dsa"], DSA_KEYS)
        assert "mla" in arch and 0 < arch["dsa"].get("indexer_layers", arch["num_layers"]) <= arch["num_layers"]
    if "linear_attention" in arch:
        _check_types(f"{model_id}.arch.linear_attention", arch["linear_attention"], LINEAR_KEYS)
    if "moe" in arch:
        moe = arch["moe"]
        _check_types(f"{model_id}.arch.moe", moe, MOE_KEYS)
        assert moe["experts_per_token"] <= moe["num_experts"]
        assert moe["first_k_dense"] < arch["num_layers"]
    if "mla" in arch:
        mla = arch["mla"]
        _check_types(f"{model_id}.arch.mla", mla, MLA_KEYS)
        assert arch["head_dim"] == mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        assert arch["num_kv_heads"] == arch["num_attention_heads"]
    elif card["family"] not in FREE_HEAD_DIM:
        assert arch["num_attention_heads"] * arch["head_dim"] == arch["hidden_size"]
    if "vision" in card:
        vision = card["vision"]
        _check_types(f"{model_id}.vision", vision, VISION_KEYS)
        assert vision["hidden_size"] % vision["num_heads"] == 0
        assert vision["out_hidden_size"] == arch["hidden_size"]


# a published size that is the name's label only says so (params_label_only); EXACT holds their totals
LABEL_ONLY = [m for m in WITH_ARCH if CARDS[m].get("params_label_only")]


def test_label_only_sizes_are_the_two_second_seed_cards_and_their_totals_are_held():
    assert LABEL_ONLY == ["chatglm3-6b", "deepseek-r1-distill-qwen-1.5b"] and set(LABEL_ONLY) <= set(EXACT)


@pytest.mark.parametrize("model_id", [m for m in WITH_ARCH if m not in LABEL_ONLY])
def test_count_matches_published_size(model_id):
    card = CARDS[model_id]
    assert count_params(card) / 1e9 == pytest.approx(card["published_params_b"], rel=0.05)


# an active size that is the name's label only (A3B) says so (active_params_label_only); EXACT holds their totals
ACTIVE_LABEL_ONLY = [m for m in sorted(MOE) if CARDS[m].get("active_params_label_only")]


def test_active_label_only_sizes_are_qwen3_next_s_and_none_is_published_for_glm5_2():
    assert ACTIVE_LABEL_ONLY == ["qwen3-next-80b-a3b"] and set(ACTIVE_LABEL_ONLY) <= set(EXACT)
    assert [m for m in sorted(MOE) if CARDS[m]["published_active_params_b"] is None] == ["glm5.2-744b"]


@pytest.mark.parametrize("model_id", [m for m in sorted(MOE) if m not in ACTIVE_LABEL_ONLY and m != "glm5.2-744b"])
def test_active_count_matches_published_active_size(model_id):
    card = CARDS[model_id]
    active = count_active_params(card)
    assert active < count_params(card)
    assert active / 1e9 == pytest.approx(card["published_active_params_b"], rel=0.10)


def test_active_equals_total_for_dense():
    for model_id in set(WITH_ARCH) - MOE:
        assert count_active_params(CARDS[model_id]) == count_params(CARDS[model_id])


@pytest.mark.parametrize("model_id", WITH_ARCH)
def test_breakdown_adds_up(model_id):
    card = CARDS[model_id]
    parts = describe_params(card)
    assert parts["total"] == sum(v for k, v in parts.items() if k not in ("total", "experts"))
    assert parts["experts"] <= parts["mlp"]
    assert (parts["vision"] > 0) == (model_id in MULTIMODAL)
    assert (parts["head"] == 0) == card["arch"]["tie_word_embeddings"]
    # the memory estimator passes the arch alone (vision None for LLMs)
    text_only = count_params({"arch": card["arch"], "vision": None})
    assert text_only == parts["total"] - parts["vision"]


# Parameter totals of the transformers implementations, instantiated on the meta device from these
# cards (Qwen2VL / Qwen2_5_VL / Gemma3 ForConditionalGeneration, DeepseekV3 incl. e_score_correction_bias).
EXACT = {
    "llama3.1-8b": 8_030_261_248,
    "qwen3-0.6b": 596_049_920,
    "qwen3-30b-a3b": 30_532_122_624,
    "deepseek-v3-671b": 671_026_419_200,
    "deepseek-v2-lite-16b": 15_706_484_224,
    "glm-4-9b-chat": 9_399_951_360,
    "mixtral-8x7b-instruct-v0.1": 46_702_792_704,
    "qwen2-vl-2b": 2_208_985_600,
    "qwen2.5-vl-3b": 3_754_622_976,
    "gemma3-27b": 27_432_406_640,
    "qwen2.5-3b": 3_085_938_688,
    "chatglm3-6b": 6_243_584_000,
    "deepseek-r1-distill-qwen-1.5b": 1_777_088_000,
    "llama3.1-405b": 405_853_388_800,
    "llama3.3-70b": 70_553_706_496,
    "mixtral-8x22b": 140_620_634_112,
    # transformers 5.25 keeps the sigmoid routers' correction bias as a buffer: added here, 256 per MoE layer
    "deepseek-v3.2-671b": 671_877_929_216 + 58 * 256,
    "glm5-744b": 743_911_199_232 + 75 * 256,
    "glm5.2-744b": 743_377_000_704 + 75 * 256,
    "minimax-m2.7-229b": 228_689_748_992 + 62 * 256,
    "qwen3-next-80b-a3b": 79_674_391_296,
    "gemma2-9b": 9_241_705_984,
    "gemma2-27b": 27_227_128_320,
}


@pytest.mark.parametrize("model_id", sorted(EXACT))
def test_exact_counts_match_the_reference_implementation(model_id):
    assert count_params(CARDS[model_id]) == EXACT[model_id]


# Values read from the published config.json files.
SPOT = [
    ("qwen3-32b", "num_layers", 64), ("qwen3-32b", "num_kv_heads", 8), ("qwen3-32b", "vocab_size", 151936),
    ("qwen3-32b", "ffn_hidden_size", 25600), ("qwen3-32b", "max_position_embeddings", 40960),
    ("qwen3-4b", "tie_word_embeddings", True), ("qwen3-8b", "tie_word_embeddings", False),
    ("qwen3-30b-a3b", "moe.moe_ffn_hidden_size", 768), ("qwen3-30b-a3b", "num_kv_heads", 4),
    ("qwen3-235b-a22b", "num_layers", 94), ("qwen3-235b-a22b", "moe.moe_ffn_hidden_size", 1536),
    ("qwen2.5-0.5b", "max_position_embeddings", 32768), ("qwen2.5-14b", "rms_norm_eps", 1e-5),
    ("qwen2-72b", "ffn_hidden_size", 29568), ("qwen2-7b", "vocab_size", 152064),
    ("llama3.1-8b", "rope_theta", 500000.0), ("llama3.1-8b", "rope_scaling.factor", 8.0),
    ("llama3.2-1b", "head_dim", 64), ("llama3.2-3b", "rope_scaling.factor", 32.0),
    ("deepseek-v3-671b", "vocab_size", 129280), ("deepseek-v3-671b", "moe.first_k_dense", 3),
    ("deepseek-v3-671b", "moe.num_experts", 256), ("deepseek-v3-671b", "mla.q_lora_rank", 1536),
    ("deepseek-v3-671b", "moe.scoring_func", "sigmoid"), ("deepseek-v3-671b", "rope_scaling.mscale_all_dim", 1.0),
    ("deepseek-v2-lite-16b", "mla.q_lora_rank", None), ("deepseek-v2-lite-16b", "moe.shared_experts", 2),
    ("deepseek-v2-lite-16b", "moe.experts_per_token", 6), ("deepseek-v2-lite-16b", "rope_scaling.mscale", 0.707),
    ("glm-4-9b-chat", "num_kv_heads", 2), ("glm-4-9b-chat", "vocab_size", 151552),
    ("glm-4-9b-chat", "rope_theta", 5000000.0), ("glm-4-9b-chat", "rotary_fraction", 0.5),
    ("mixtral-8x7b-instruct-v0.1", "vocab_size", 32000), ("mixtral-8x7b-instruct-v0.1", "rope_theta", 1e6),
    ("qwen2.5-vl-3b", "num_layers", 36), ("qwen2.5-vl-3b", "max_position_embeddings", 128000),
    ("qwen2.5-vl-3b", "mrope_section", [16, 24, 24]),
    ("gemma3-27b", "vocab_size", 262208), ("gemma3-27b", "sliding_window", 1024),
    ("gemma3-27b", "query_pre_attn_scalar", 168),
    ("qwen2.5-3b", "max_position_embeddings", 32768), ("qwen2.5-3b", "tie_word_embeddings", True),
    ("chatglm3-6b", "vocab_size", 65024), ("chatglm3-6b", "max_position_embeddings", 8192),
    ("deepseek-r1-distill-qwen-1.5b", "rope_theta", 10000.0), ("deepseek-r1-distill-qwen-1.5b", "ffn_hidden_size", 8960),
    ("llama3.1-405b", "num_layers", 126), ("llama3.1-405b", "ffn_hidden_size", 53248),
    ("llama3.3-70b", "rope_scaling.factor", 8.0), ("mixtral-8x22b", "max_position_embeddings", 65536),
    ("mixtral-8x22b", "moe.moe_ffn_hidden_size", 16384), ("mixtral-8x22b", "num_attention_heads", 48),
    ("deepseek-v3.2-671b", "dsa.index_n_heads", 64), ("deepseek-v3.2-671b", "mla.q_lora_rank", 1536),
    ("glm5-744b", "mla.qk_nope_head_dim", 192), ("glm5-744b", "vocab_size", 154880), ("glm5-744b", "dsa.index_n_heads", 32),
    ("glm5.2-744b", "max_position_embeddings", 1048576), ("glm5.2-744b", "dsa.indexer_layers", 21),
    ("qwen3-next-80b-a3b", "linear_attention.num_value_heads", 32), ("qwen3-next-80b-a3b", "moe.experts_per_token", 10),
    ("qwen3-next-80b-a3b", "rotary_fraction", 0.25), ("minimax-m2.7-229b", "qk_norm_type", "per_layer"),
    ("minimax-m2.7-229b", "vocab_size", 200064), ("minimax-m2.7-229b", "moe.num_experts", 256),
    ("gemma2-9b", "query_pre_attn_scalar", 256), ("gemma2-9b", "head_dim", 256), ("gemma2-27b", "head_dim", 128),
    ("gemma2-27b", "query_pre_attn_scalar", 144), ("gemma2-27b", "attn_logit_softcapping", 50.0),
]
VISION_SPOT = [
    ("qwen2.5-vl-3b", "ffn_hidden_size", 3420), ("qwen2.5-vl-3b", "out_hidden_size", 2048),
    ("qwen2-vl-7b", "ffn_hidden_size", 5120), ("gemma3-27b", "depth", 27), ("gemma3-27b", "ffn_hidden_size", 4304),
]


@pytest.mark.parametrize("model_id,path,expected", SPOT)
def test_config_spot_values(model_id, path, expected):
    value = CARDS[model_id]["arch"]
    for key in path.split("."):
        value = value[key]
    assert value == expected


@pytest.mark.parametrize("model_id,key,expected", VISION_SPOT)
def test_vision_spot_values(model_id, key, expected):
    assert CARDS[model_id]["vision"][key] == expected
