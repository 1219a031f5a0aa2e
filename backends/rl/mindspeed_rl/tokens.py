"""The prompts' token ids, encoded part by part as MindSpeed-RL's (LLaMA-Factory's) templates do."""

from __future__ import annotations

from ..config import RLConfig, RLConfigError
from ..data import stop_ids
from .prompts import BOS, EOS

def tokenize(cfg: RLConfig, tokenizer=None, *, source: str = "mindspeed-rl config",
             stop: list[str] | None = None) -> RLConfig:
    """Encode each record's prompt parts (each string on its own, as LLaMA-Factory's templates do; BOS /
    EOS markers as the tokenizer's ids) into prompt_ids, checking rl_config.max_prompt_length (a preprocessed
    record keeps its prompt_ids and gets its labels' text); the template's stop words join the model's EOS
    ids as stop tokens."""
    if tokenizer is None:
        import transformers

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.model_path)
        except (OSError, ValueError) as err:
            raise RLConfigError(f"{source}: cannot load the tokenizer of {cfg.model_path}: {err}") from None
    for i, record in enumerate(cfg.records):
        if "prompt_parts" not in record:  # MindSpeed-RL's preprocessed prompt: its ids as they are, the answer
            # decoded as its rule verifier decodes the labels (batch_decode, skip_special_tokens)
            if "label_ids" in record:
                record["ground_truth"] = tokenizer.decode(record.pop("label_ids"), skip_special_tokens=True)
            continue
        ids: list[int] = []
        for part in record.get("prompt_parts", []):
            if part == BOS:
                ids += [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
            elif part == EOS:
                ids += [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            elif part:
                ids += list(tokenizer.encode(part, add_special_tokens=False))
        if len(ids) > cfg.max_prompt_length:
            raise RLConfigError(f"{source}: prompt {i} has {len(ids)} tokens, more than rl_config.max_prompt_length "
                                f"{cfg.max_prompt_length} (raise it)")
        record["prompt_ids"] = ids
    vocab = tokenizer.get_vocab() if stop else {}
    extra = {vocab[word] for word in stop or [] if word in vocab}
    if extra:
        ids = set(stop_ids(cfg.model_path, tokenizer))
        if extra - ids:  # else the model's own EOS ids already stop there (the recipe finds them)
            cfg.eos_token_id = sorted(ids | extra)
    return cfg
