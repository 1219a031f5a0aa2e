"""examples/make_tiny_model.py reproduces the committed examples/tiny-qwen3/ exactly."""

import importlib.util
import json

import pytest

from .conftest import ROOT, TINY

BYTE_EXACT = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "model.safetensors"]
JSON_EXACT = ["config.json", "generation_config.json", "ascendfactory.json"]   # equal except the writing transformers version


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "examples" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(tmp_path_factory.mktemp("tiny"))


def test_committed_files_are_reproduced_bit_exactly(regenerated):
    assert sorted(p.name for p in regenerated.iterdir()) == sorted(BYTE_EXACT + JSON_EXACT)
    for name in BYTE_EXACT:
        assert (regenerated / name).read_bytes() == (TINY / name).read_bytes(), name
    for name in JSON_EXACT:
        new, old = (json.loads((d / name).read_text()) for d in (regenerated, TINY))
        new.pop("transformers_version", None)
        old.pop("transformers_version", None)
        assert new == old, name


def test_tiny_model_facts(tiny_tok):
    config = json.loads((TINY / "config.json").read_text())
    assert len(tiny_tok) == config["vocab_size"] == 512
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
            config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["max_position_embeddings"], config["tie_word_embeddings"]) == (2, 64, 192, 4, 2, 16, 512, False)
    assert config["model_type"] == "qwen3"
    assert tiny_tok.eos_token == tiny_tok.pad_token == "<|endoftext|>"
    chat = tiny_tok.apply_chat_template([{"role": "user", "content": "What is 1 + 1?"}], tokenize=False,
                                        add_generation_prompt=True)
    assert chat == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny_tok.encode(chat, add_special_tokens=False)
    assert ids.count(tiny_tok.convert_tokens_to_ids("<|im_start|>")) == 2
    gen = json.loads((TINY / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tiny_tok.convert_tokens_to_ids("<|im_end|>"), tiny_tok.eos_token_id]
