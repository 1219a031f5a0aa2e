"""The repo's tiny BPE tokenizer (examples/tiny-qwen3) with each chat family's special tokens added.

Chat templates need their markers as single tokens (<|im_start|> for Qwen, <|start_header_id|>
for Llama 3, ...). `family_tokenizer(family)` loads the tiny tokenizer and adds that family's
tokens in a fixed order, so the ids are the same on every run (the LLaMA-Factory reference
fixtures under tests/fixtures/llamafactory/ were built with these tokenizers).
"""

from __future__ import annotations

from .tiny_hf import TOKENIZER_DIR

# family -> bos, eos, special tokens to add (in order), plain added tokens (special=False, as Qwen3's
# <think>/</think>, which its tokenizer keeps in decoded text)
FAMILIES = {
    "qwen": dict(bos=None, eos="<|im_end|>", special=[], plain=[]),
    "qwen3": dict(bos=None, eos="<|im_end|>", special=[], plain=["<think>", "</think>"]),
    "qwen2_vl": dict(bos=None, eos="<|im_end|>",
                     special=["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"], plain=[]),
    "llama3": dict(bos="<|begin_of_text|>", eos="<|eot_id|>",
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>", "<|eom_id|>"], plain=[]),
    "glm4": dict(bos=None, eos="<|endoftext|>",
                 special=["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
                 plain=[]),
    "gemma3": dict(bos="<bos>", eos="<eos>",
                   special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<image_soft_token>"], plain=[]),
}


def family_tokenizer(family: str):
    """A fresh tiny tokenizer with `family`'s special tokens (see FAMILIES)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    spec = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    if spec["special"]:
        tok.add_special_tokens({"additional_special_tokens": [
            AddedToken(t, special=True, normalized=False) for t in spec["special"]]},
            replace_extra_special_tokens=False)
    if spec["plain"]:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    if spec["bos"]:
        tok.bos_token = spec["bos"]
    tok.eos_token = spec["eos"]
    return tok


def describe(tok) -> dict:
    """What a fixture records about the tokenizer it was built with (checked when it is rebuilt)."""
    added = {t: tok.convert_tokens_to_ids(t) for t in sorted(tok.get_added_vocab())}
    return {"size": len(tok), "added": added, "bos": tok.bos_token, "eos": tok.eos_token,
            "probe": tok.encode("12 + 7 = 19\nassistant\n\n", add_special_tokens=False)}
