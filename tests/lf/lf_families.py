"""Tiny tokenizers for the LLaMA-Factory templates whose families tests/helpers/tiny_tokenizers.py does not
cover (Mistral, DeepSeek): the repo's tiny BPE tokenizer with the family's BOS / EOS / markers added in a
fixed order, as family_tokenizer builds the others (same ids on every run)."""

from __future__ import annotations

from tests.helpers.tiny_tokenizers import FAMILIES as SHARED
from tests.helpers.tiny_tokenizers import family_tokenizer as shared_tokenizer

FAMILIES = {
    "mistral": dict(bos="<s>", eos="</s>", special=["<s>", "</s>", "[INST]", "[/INST]"], plain=[]),
    "deepseek": dict(bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>",
                     special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                     plain=[]),
}


def family_tokenizer(family: str):
    """family_tokenizer of tests/helpers/tiny_tokenizers.py, plus the families above."""
    if family in SHARED:
        return shared_tokenizer(family)
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tests.helpers.tiny_hf import TOKENIZER_DIR

    spec = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, special=True, normalized=False) for t in spec["special"]]}, replace_extra_special_tokens=False)
    tok.bos_token = spec["bos"]
    tok.eos_token = spec["eos"]
    return tok
