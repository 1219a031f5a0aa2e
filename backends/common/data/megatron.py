"""MindSpeed-LLM's preprocess_data.py output, written at the user's --output-prefix.

    instruction  <prefix>_packed_input_ids_document.{bin,idx}       token ids          (int32)
                 <prefix>_packed_attention_mask_document.{bin,idx}  1 per token; --neat-pack: the
                                                                    document number 1, 2, … in its row, 0 on padding
                 <prefix>_packed_labels_document.{bin,idx}          unshifted targets, -100 untrained
    pretrain     <prefix>_<key>_document.{bin,idx} per --json-keys key (text: <prefix>_text_document)

Instruction data is written in int32 as MindSpeed does (labels hold -100). With --pack the samples
are packed into rows of exactly seq_length tokens (each row one sequence, right-padded with the
tokenizer's pad id): rows of at most seq_length - 1 sample tokens, as upstream reserves one for
padding; a sample of seq_length tokens or more is dropped, or with --neat-pack cut to seq_length - 1.
The rows are packed best-fit-decreasing (upstream packs greedily), so row contents may differ from
MindSpeed's while every row obeys the same rules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import formats, indexed
from .formats import DataFormatError
from .packing import best_fit_decreasing
from .templates import IGNORE_INDEX
from .tokenizer import eod_id, pad_id, vocab_size

PACKED = "_packed"
KEYS = ("input_ids", "attention_mask", "labels")


@dataclass
class WriteOptions:
    seq_length: int | None = None
    pack: bool = False
    neat_pack: bool = False
    append_eod: bool = False
    json_keys: tuple[str, ...] = ("text",)
    max_samples: int | None = None
    log_interval: int = 100
    progress: Callable[[int, "int | None"], None] | None = None
    stats: dict = field(default_factory=dict)


def output_files(prefix: str, kind: str, json_keys=("text",)) -> list[str]:
    """The indexed-dataset prefixes preprocess_data.py writes for this prefix."""
    if kind == "instruction":
        return [f"{prefix}{PACKED}_{key}_document" for key in KEYS]
    return [f"{prefix}_{key}_document" for key in json_keys]


def write_instruction(records_path, fmt: str, tokenizer, template, prefix: str, opt: WriteOptions) -> dict:
    """Tokenize alpaca / sharegpt records with the template; write the three _packed_ files."""
    files = formats.data_files(records_path)
    samples, stats = [], {"records": 0, "samples": 0, "tokens": 0, "truncated": 0, "dropped": 0}
    limit = opt.seq_length
    if opt.pack:
        if not limit:
            raise DataFormatError("--pack needs --seq-length (the length of a packed row)")
        limit = opt.seq_length - 1
    for file, index, record in formats.iter_records_limited(files, opt.max_samples):
        sample = formats.encode_instruction(tokenizer, template, fmt, record, file, index)
        ids, labels = list(sample.input_ids), list(sample.labels)
        if opt.append_eod:
            eod = eod_id(tokenizer)
            ids, labels = ids + [eod], labels + [eod]
        stats["records"] += 1
        if limit and len(ids) > limit:
            if opt.pack and not opt.neat_pack:
                stats["dropped"] += 1  # upstream drops what does not fit a packed row
                continue
            ids, labels = ids[:limit], labels[:limit]
            stats["truncated"] += 1
        if not formats.has_target(formats.Sample(ids, labels)):
            stats["dropped"] += 1
            continue
        samples.append((ids, labels))
        if opt.progress and stats["records"] % max(opt.log_interval, 1) == 0:
            opt.progress(stats["records"], None)
    if not samples:
        raise DataFormatError(f"{', '.join(map(str, files))}: no usable samples ({stats['records']} records read, "
                              f"{stats['dropped']} dropped)")
    rows = _pack_rows(samples, opt, pad_id(tokenizer)) if opt.pack else \
        [(ids, [1] * len(ids), labels) for ids, labels in samples]
    writers = [indexed.IndexedDatasetWriter(p, np.int32) for p in output_files(prefix, "instruction")]
    for row in rows:
        for writer, values in zip(writers, row):
            writer.add_document(np.asarray(values, dtype=np.int64))
    for writer in writers:
        writer.finalize()
    stats.update(samples=len(samples), rows=len(rows), tokens=sum(len(ids) for ids, _ in samples))
    return stats


def _pack_rows(samples, opt: WriteOptions, pad: int) -> list[tuple[list, list, list]]:
    rows = []
    for bin_ in best_fit_decreasing([len(ids) for ids, _ in samples], opt.seq_length - 1):
        ids, mask, labels = [], [], []
        for number, i in enumerate(bin_, start=1):
            ids += samples[i][0]
            labels += samples[i][1]
            mask += [number if opt.neat_pack else 1] * len(samples[i][0])
        pad_len = opt.seq_length - len(ids)
        rows.append((ids + [pad] * pad_len, mask + [0 if opt.neat_pack else 1] * pad_len,
                     labels + [IGNORE_INDEX] * pad_len))
    return rows


def write_pretrain(records_path, tokenizer, prefix: str, opt: WriteOptions) -> dict:
    """One document per record and --json-keys key (the tokenizer's own BOS, + EOD with --append-eod)."""
    files = formats.data_files(records_path)
    dtype = indexed.optimal_dtype(vocab_size(tokenizer))
    writers = {key: indexed.IndexedDatasetWriter(p, dtype)
               for key, p in zip(opt.json_keys, output_files(prefix, "text", opt.json_keys))}
    stats = {"records": 0, "samples": 0, "tokens": 0}
    eod = [eod_id(tokenizer)] if opt.append_eod else []
    for file, index, record in formats.iter_records_limited(files, opt.max_samples):
        for key, writer in writers.items():
            text = record.get(key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataFormatError(f"{file} record {index}: no text under --json-keys {key!r} "
                                      f"(keys: {', '.join(record) if isinstance(record, dict) else '-'})")
            ids = list(tokenizer(text, add_special_tokens=True)["input_ids"]) + eod
            writer.add_document(np.asarray(ids, dtype=np.int64))
            stats["tokens"] += len(ids)
        stats["records"] += 1
        if opt.progress and stats["records"] % max(opt.log_interval, 1) == 0:
            opt.progress(stats["records"], None)
    for writer in writers.values():
        writer.finalize()
    if not stats["records"]:
        raise DataFormatError(f"{', '.join(map(str, files))}: no records")
    stats["samples"] = stats["records"]
    return stats


def segments(mask_prefix: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(row, offset, length) of every document of a --neat-pack attention mask (numbers 1, 2, … per
    row, 0 on padding); None when the mask numbers no documents (every value 0 or 1)."""
    mask = indexed.IndexedDataset(mask_prefix)
    if not len(mask):
        return None
    flat = np.frombuffer(mask._bin, dtype=mask.dtype.newbyteorder("<"))[: int(mask.sizes.sum())]
    if flat.max() <= 1:
        return None
    row_of = np.repeat(np.arange(len(mask)), mask.sizes)
    starts = np.ones(len(flat), dtype=bool)
    starts[1:] = (flat[1:] != flat[:-1]) | (row_of[1:] != row_of[:-1])
    first = np.flatnonzero(starts)
    lengths = np.diff(np.append(first, len(flat)))
    keep = flat[first] > 0
    row_start = np.cumsum(np.concatenate([[0], mask.sizes[:-1].astype(np.int64)]))
    rows = row_of[first][keep]
    return rows, (first[keep] - row_start[rows]).astype(np.int64), lengths[keep].astype(np.int64)


def attention_mask_prefix(base: str) -> str | None:
    p = f"{base}{PACKED}_attention_mask_document"
    return p if indexed.exists(p) else None


def exists(prefix: str) -> bool:
    return all(indexed.exists(p) for p in output_files(prefix, "instruction"))


def check_output_prefix(prefix: str) -> Path:
    parent = Path(prefix).parent
    if not parent.is_dir():
        raise FileNotFoundError(f"--output-prefix {prefix}: folder {parent} does not exist (create it first, "
                                f"as MindSpeed-LLM's data_convert scripts do with mkdir)")
    return parent
