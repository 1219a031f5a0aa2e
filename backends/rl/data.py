"""VeRL's RL prompt data: parquet rows with the prompt as a chat-message list (data.prompt_key), the
reward routing key (data.reward_fn_key, `data_source`), `reward_model.ground_truth` and optional
`extra_info`. Prompts go through the tokenizer's chat template with the generation prompt, as
VeRL's RLHFDataset does. A prompt over max_prompt_length is dropped with filter_overlong_prompts; else
data.truncation left keeps its last max_prompt_length tokens (what VeRL 0.9.1's agent loop does to any
text prompt over rollout.prompt_length, whatever data.truncation says: its RLHFDataset reads nothing of
it), and error stops with the row named (stricter than 0.9.1, which truncates with a warning)."""

from __future__ import annotations

import json
from pathlib import Path

from .config import RLConfig, RLConfigError


def read_rows(path: str | Path, key: str = "data.train_files") -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise RLConfigError("reading parquet prompts needs pyarrow (pip install pyarrow)") from err
    path = Path(path).expanduser()
    if not path.is_file():
        raise RLConfigError(f"{key}: no file {path}")
    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # noqa: BLE001 - whatever pyarrow raises on a bad file, one message
        raise RLConfigError(f"{path}: cannot read it as parquet: {err}") from None


def prompt_ids(tokenizer, prompt, where: str) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise RLConfigError(f"{where}: the prompt must be a list of {{role, content}} chat messages (or a string)")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def verl_selection(total: int, max_samples: int, shuffle: bool, seed: int) -> list[int]:
    """The rows VeRL's RLHFDataset keeps of `total` for max_samples: a seeded random subset (numpy's
    default_rng(seed).choice, in its order) when data.shuffle, else the first ones."""
    if not 0 < max_samples < total:
        return list(range(total))
    if shuffle:
        import numpy as np

        return [int(i) for i in np.random.default_rng(seed).choice(total, size=max_samples, replace=False)]
    return list(range(max_samples))


def load_val_records(cfg: RLConfig, tokenizer) -> list[dict]:
    """cfg.val_files read as VeRL reads data.val_files: the train files' rules, val_max_samples selected before
    the overlong filter (data.seed null: the run's seed, so every rank selects the same rows)."""
    rows = [(file, i, row) for file in cfg.val_files for i, row in enumerate(read_rows(file, "data.val_files"))]
    seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    keep = verl_selection(len(rows), cfg.val_max_samples, cfg.shuffle, seed)
    records = _records(cfg, tokenizer, [rows[i] for i in keep])
    if not records:
        raise RLConfigError("data.val_files: the validation set has no prompts")
    return records


def load_records(cfg: RLConfig, tokenizer) -> list[dict]:
    """cfg.train_files -> [{"prompt_ids", "ground_truth", "data_source", "extra_info"}] (one message per bad row)."""
    records = _records(cfg, tokenizer, [(file, i, row) for file in cfg.train_files
                                        for i, row in enumerate(read_rows(file))])
    if cfg.max_samples is not None and cfg.max_samples > 0:
        records = records[:cfg.max_samples]
    if not records:
        raise RLConfigError("the RL data set has no prompts")
    return records


def _records(cfg: RLConfig, tokenizer, rows: list[tuple]) -> list[dict]:
    records: list[dict] = []
    for file, i, row in rows:
        where = f"{file} row {i}"
        if cfg.prompt_key not in row:
            raise RLConfigError(f"{where}: no {cfg.prompt_key!r} column (data.prompt_key)")
        truth = (row.get("reward_model") or {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) \
            else None
        if truth is None:
            raise RLConfigError(f"{where}: no reward_model.ground_truth (the answer the reward compares to)")
        ids = prompt_ids(tokenizer, row[cfg.prompt_key], where)
        if len(ids) > cfg.max_prompt_length:
            if cfg.filter_overlong_prompts:
                continue
            if cfg.truncation != "left":
                raise RLConfigError(f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_length "
                                    f"{cfg.max_prompt_length} (raise it, set data.filter_overlong_prompts: true, or "
                                    "data.truncation: left)")
            ids = ids[-cfg.max_prompt_length:]
        # metric_source: the data_source column VeRL's validation metrics are named by ("unknown" without one)
        records.append({"prompt_ids": ids, "ground_truth": truth,
                        "data_source": row.get(cfg.reward_fn_key) or "", "extra_info": row.get("extra_info"),
                        "metric_source": str(row["data_source"]) if "data_source" in row else "unknown"})
    return records


def stop_ids(model_path: str, tokenizer) -> list[int]:
    """The ids a response ends at when the file names none: the model's generation_config.json
    eos_token_id (Qwen's chat models list <|im_end|> there) and the tokenizer's EOS, as vLLM stops."""
    ids: list[int] = []
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))
