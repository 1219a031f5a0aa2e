"""Write the tiny Qwen3-architecture model under examples/tiny-qwen3/ (deterministic; rerun to regenerate).

    python examples/make_tiny_model.py [OUT_DIR]

1. Trains a byte-level BPE tokenizer (vocab 512; Qwen2/Qwen3's pre-tokenizer: NFC, the Qwen split
   regex, except that digits go in runs of up to three as in Llama 3's / GPT-4's regex, since the
   bundled corpus is too small to fill 512 ids with single digits) on the strings of
   the arithmetic data of examples/data (CORPUS) and the chat role names, with the special tokens <|endoftext|>,
   <|im_start|>, <|im_end|> and a ChatML chat_template (Qwen3's, without the tool and thinking
   branches) in tokenizer_config.json.
2. Builds a random Qwen3 model with transformers (2 layers, hidden 64, ffn 192, 4 heads, 2 kv
   heads, head_dim 16, untied embeddings, 512 positions, torch seed 0) and saves it in HF format:
   config.json, generation_config.json, model.safetensors.

Everything written is a pure function of the bundled data and the library versions, so the test
(tests/data_pipeline/test_tiny_model.py) regenerates it into a temporary folder and compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
CORPUS = ("arithmetic_alpaca.json", "arithmetic_corpus.jsonl", "arithmetic_pairs.json", "arithmetic_prompts.jsonl",
          "arithmetic_sharegpt.json")  # the tokenizer's training text (sorted: the order it was made in)
OUT = HERE / "tiny-qwen3"

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2/Qwen3's pre-tokenizer split (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX) with \p{N}{1,3}
# in place of its single-digit \p{N}.
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# ChatML as Qwen renders it: <|im_start|>{role}\n{content}<|im_end|>\n; generation prompt
# <|im_start|>assistant\n. No default system prompt (as Qwen3's template).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def corpus() -> list[str]:
    """Every string value of every record of the CORPUS files, in file order, and the chat roles (so the
    ChatML headers <|im_start|>user\n ... are a few tokens, not a dozen). A fixed list: data added to
    examples/data later must not change the committed tokenizer."""
    texts: list[str] = ["system\n", "user\n", "assistant\n"] * 64
    for path in (DATA / name for name in CORPUS):
        raw = path.read_text(encoding="utf-8")
        records = ([json.loads(line) for line in raw.splitlines() if line.strip()]
                   if path.suffix == ".jsonl" else json.loads(raw))
        texts.extend(_strings(records))
    return texts


def train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def tokenizer_config(tok) -> dict:
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # the generic fast class loads tokenizer.json as written; transformers 5's Qwen2Tokenizer
        # would rebuild the pre-tokenizer with its own single-digit regex
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_model(vocab_size: int, eos_id: int, im_end_id: int, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=[im_end_id, eos_id],
                                               pad_token_id=eos_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    os.chmod(out / "model.safetensors", 0o644)


def main(out: Path = OUT) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2, ensure_ascii=False)
                                               + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
         "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}, indent=2) + "\n", encoding="utf-8")
    build_model(tok.get_vocab_size(), tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>"), out)
    write_marker(out)
    return out


def write_marker(out: Path) -> None:
    """ascendfactory.json: this directory is a tiny test model, so a job may pair it with the card of any
    family (the examples train it under Qwen2.5 cards too) without the planner's family warning."""
    (out / "ascendfactory.json").write_text(json.dumps(
        {"tiny_test_model": True, "why": "random weights for CPU examples and tests; it stands in for any card"},
        indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
