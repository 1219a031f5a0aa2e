"""Tokenizer loading and the few facts the pipeline needs from it (EOD, pad, fingerprint)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def load_tokenizer(model_dir: str | os.PathLike, **kwargs):
    """AutoTokenizer from a local HF model/tokenizer folder (no network: local_files_only)."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(path)!r} does not exist (pass the HF model folder that "
                                f"holds tokenizer.json / tokenizer_config.json)")
    kwargs.setdefault("local_files_only", True)
    try:
        return AutoTokenizer.from_pretrained(str(path), **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with the folder named
        files = sorted(p.name for p in path.iterdir())
        raise ValueError(f"cannot load a tokenizer from {str(path)!r} (files: {files}): {exc}") from exc


def eod_id(tokenizer) -> int:
    """End-of-document id appended to pre-training text (MindSpeed's `tokenizer.eod`: the EOS)."""
    tid = tokenizer.eos_token_id
    if tid is None:
        raise ValueError("the tokenizer has no eos_token, which pre-training data needs as its end-of-document "
                         "token; set eos_token in tokenizer_config.json")
    return int(tid)


def pad_id(tokenizer) -> int:
    """Pad id: the tokenizer's pad token, else its EOS (padding never carries a label), else 0."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def vocab_size(tokenizer) -> int:
    return len(tokenizer)


def encode(tokenizer, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
    """Batch encode (the fast backend runs the batch in parallel)."""
    if not texts:
        return []
    out = tokenizer(list(texts), add_special_tokens=add_special_tokens, return_attention_mask=False)
    return [list(ids) for ids in out["input_ids"]]


def fingerprint(tokenizer) -> str:
    """A hash of everything that decides the token ids: the full serialized tokenizer (vocab, merges,
    normalizer, pre-tokenizer, post-processor, added tokens), the special tokens and chat template.
    It covers what hashing the tokenizer files would, and also tokenizers built in memory."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow (python) tokenizer: the vocabulary and added tokens
        h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    h.update(json.dumps(specials, sort_keys=True, default=str).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").__str__().encode())
    # the ids a plain call produces (BOS/EOS added by the post-processor or add_bos_token flags)
    h.update(json.dumps(tokenizer("a b", add_special_tokens=True)["input_ids"]).encode())
    return h.hexdigest()
