"""MindSpeed-RL's own dataset code (tests/fixtures/upstream/mindspeed-rl/05a90d77/mindspeed_rl/datasets/, copied
verbatim; SOURCE.md) imported for the tests: its IndexedDatasetBuilder writes a preprocessed prompt dataset as
cli/preprocess_data.py does, its reader, index mappings and PromptDataLoader give the prompts it trains on."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[1] / "fixtures/upstream/mindspeed-rl/05a90d77/mindspeed_rl/datasets"
PACKAGE = "_mindspeed_rl_datasets_05a90d77"


def module(name: str):
    """mindspeed_rl/datasets/<name>.py as a submodule of a stand-in package (dataloader.py imports
    .data_samplers); no bytecode is written beside the fixtures."""
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(FOLDER)]
        sys.modules[PACKAGE] = package
    writes = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        return importlib.import_module(f"{PACKAGE}.{name}")
    finally:
        sys.dont_write_bytecode = writes


def write_prompts(prefix: Path, rows: list[tuple[list[int], list[int]]]) -> Path:
    """R1AlpacaStyleInstructionHandler's output for (prompt ids, answer ids) rows, dataset_additional_keys
    [labels]: `<prefix>_packed_<field>_document.{bin,idx}` for input_ids, attention_mask and labels, one item and
    one document per row (its _serialize_to_disk)."""
    indexed = module("indexed_dataset")
    fields = {"input_ids": [p for p, _ in rows], "attention_mask": [[1] * len(p) for p, _ in rows],
              "labels": [a for _, a in rows]}
    for field, items in fields.items():
        name = f"{prefix}_packed_{field}_document"
        builder = indexed.IndexedDatasetBuilder(name + ".bin")
        for item in items:
            builder.add_item(item)
            builder.end_document()
        builder.finalize(name + ".idx")
    return prefix


def chat_rows(tokenizer, rows: list[dict], spelt: tuple[int, ...] = ()) -> list[tuple[list[int], list[int]]]:
    """({"prompt", "answer"} rows -> (prompt ids in Qwen3's chat layout, answer ids), as a preprocessing with a
    Qwen3 template writes them; the rows numbered in `spelt` encoded character by character (ids that decoding
    and encoding again would change)."""
    out = []
    for i, row in enumerate(rows):
        text = f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        pieces = list(text) if i in spelt else [text]
        out.append(([t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)],
                    tokenizer.encode(row["answer"], add_special_tokens=False)))
    return out
