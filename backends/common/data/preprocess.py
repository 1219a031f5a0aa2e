"""Preprocess records once into a Megatron indexed dataset under a content-keyed cache.

    handle = preprocess("examples/data/arithmetic_alpaca.json", "alpaca", tok, None, 128, "runs/cache")
    ds = handle.open()            # TokenDataset: len, lengths, sample(i) -> (input_ids, labels)

Cache: `cache_root/<key>/` where key = sha256 of (pipeline version, each data file's name and
content hash (size + mtime for files over 256 MiB), the tokenizer fingerprint (its full
serialized state, see tokenizer.fingerprint), the template definition, format, seq_len and
max_samples). It is written in `cache_root/.tmp-*` and renamed into place when complete
(`meta.json` is the last file written), so a crash never leaves a half dataset and concurrent
ranks cannot corrupt one; a second call with the same inputs opens the cache without tokenizing.

Files, named as MindSpeed-LLM's preprocess_data.py names them for prefix `dataset`:
  text         dataset_text_document.{bin,idx}                 whole documents (+EOD)
  instruction  dataset_packed_input_ids_document.{bin,idx}     token ids
               dataset_packed_labels_document.{bin,idx}        int32, unshifted: the token id where it
                                                               is trained, -100 elsewhere
(The cache leaves out MindSpeed's _packed_attention_mask_document, all ones for unpadded samples;
backends.common.data.megatron writes all three at a user's --output-prefix, and a prefix whose mask
numbers documents (--neat-pack rows) is read back one document a sample.) `handle.data_path` is what
Megatron's --data-path takes for it.

`path` may also be an existing Megatron dataset prefix: `p` with p.bin/p.idx (text), `p` with
p_text_document.*, or `p` with p_packed_input_ids_document.* and p_packed_labels_document.*;
passing `x.bin` or `x.idx` is an error that names the prefix to pass instead.

Lengths: an instruction sample longer than seq_len is cut to seq_len (counted as `truncated`;
one left with no trained token is dropped, counted as `dropped`). A text document longer than
seq_len is split into seq_len chunks when the dataset is opened (counted as `split`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import formats, indexed
from .formats import FORMATS, DataFormatError
from .templates import IGNORE_INDEX, ChatTemplate, resolve_template
from .tokenizer import eod_id, fingerprint, vocab_size

PIPELINE_VERSION = 2  # 2: LLaMA-Factory 0.9.5 labels (glm4 efficient EOS on later user turns)
PREFIX = "dataset"
TEXT_SUFFIX = "_text_document"
IDS_SUFFIX = "_packed_input_ids_document"
LABELS_SUFFIX = "_packed_labels_document"
_HASH_LIMIT = 256 << 20
_BATCH = 512

Progress = Callable[[int, "int | None"], None]


@dataclass
class DatasetHandle:
    """A preprocessed dataset on disk (a cache entry, or an existing Megatron prefix)."""

    kind: str                     # "text" | "instruction"
    prefix: str                   # Megatron prefix base (<cache>/dataset, or the user's prefix)
    ids_prefix: str               # the token ids' indexed dataset
    labels_prefix: str | None     # instruction data: the labels' indexed dataset
    seq_len: int
    stats: dict = field(default_factory=dict)
    from_cache: bool = False
    path: Path | None = None      # the cache folder (None for a user's Megatron prefix)
    source: str = "records"       # "records" | "megatron"

    @property
    def data_path(self) -> str:
        """What Megatron / MindSpeed --data-path takes: the text prefix, or the instruction base prefix."""
        return self.ids_prefix if self.kind == "text" else self.prefix

    def open(self, seq_len: int | None = None) -> "TokenDataset":
        return TokenDataset(self.ids_prefix, self.labels_prefix, seq_len or self.seq_len, self.kind)

    def summary(self) -> str:
        s = self.stats
        parts = [f"{s.get('samples', '?')} samples", f"{s.get('tokens', '?')} tokens",
                 f"max len {s.get('max_len', '?')}"]
        for key in ("truncated", "split", "dropped", "segmented", "sentinel"):
            if s.get(key):
                parts.append(f"{s[key]} {key}")
        where = "cache hit" if self.from_cache else ("existing prefix" if self.source == "megatron" else "written")
        return f"{self.kind} dataset {self.data_path} ({where}): " + ", ".join(parts)


class TokenDataset:
    """Samples of at most seq_len tokens over an indexed dataset (text documents split in chunks)."""

    def __init__(self, ids_prefix: str, labels_prefix: str | None, seq_len: int, kind: str):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        self.kind = kind
        self.seq_len = int(seq_len)
        self.tokens = indexed.IndexedDataset(ids_prefix)
        self.labels = indexed.IndexedDataset(labels_prefix) if labels_prefix else None
        sizes = self.tokens.sizes.astype(np.int64)
        if self.labels is not None:
            if len(self.labels) != len(self.tokens) or not np.array_equal(self.labels.sizes, self.tokens.sizes):
                raise indexed.IndexedFormatError(f"{labels_prefix}: labels do not line up with {ids_prefix} "
                                                 f"(sequence counts or lengths differ)")
        if kind == "text":
            n_chunks = (sizes + self.seq_len - 1) // self.seq_len
            seq = np.repeat(np.arange(len(sizes), dtype=np.int64), n_chunks)
            first = np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
            offset = (np.arange(len(seq), dtype=np.int64) - first) * self.seq_len
            length = np.minimum(self.seq_len, sizes[seq] - offset)
            keep = length >= 2            # a 1-token tail predicts nothing
            self.seq, self.offset, self.lengths = seq[keep], offset[keep], length[keep]
            self.split = int((sizes > self.seq_len).sum())
            self.truncated = 0
        else:
            self.seq = np.arange(len(sizes), dtype=np.int64)
            self.offset = np.zeros(len(sizes), dtype=np.int64)
            self.lengths = np.minimum(sizes, self.seq_len)
            self.split = 0
            self.truncated = int((sizes > self.seq_len).sum())
            docs = _neat_pack_documents(ids_prefix)
            if docs is not None:  # rows packed by preprocess_data.py --neat-pack: each document a sample
                self.seq, self.offset, lengths = docs
                self.truncated = int((lengths > self.seq_len).sum())
                self.lengths = np.minimum(lengths, self.seq_len)

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int64, labels int64 unshifted: -100 where the token is not a target)."""
        s, o, n = int(self.seq[i]), int(self.offset[i]), int(self.lengths[i])
        ids = np.asarray(self.tokens.get(s, o, n), dtype=np.int64)
        if self.labels is None:
            return ids, ids.copy()
        return ids, np.asarray(self.labels.get(s, o, n), dtype=np.int64)

    def file_rows(self) -> list[list[int]]:
        """The samples of each row of the indexed dataset, row by row: a --neat-pack row's documents, else the
        row itself (the units MindSpeed-LLM's DecoderPackedMTFDataset reads)."""
        bounds = np.searchsorted(self.seq, np.arange(len(self.tokens) + 1))
        return [list(range(a, b)) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]

    def stats(self) -> dict:
        return {"samples": len(self), "tokens": int(self.lengths.sum()),
                "max_len": int(self.lengths.max()) if len(self) else 0,
                "mean_len": round(float(self.lengths.mean()), 2) if len(self) else 0.0,
                "split": self.split, "truncated": self.truncated}


# -------------------------------------------------------------------------------------- helpers

def _neat_pack_documents(ids_prefix: str):
    """The documents of --neat-pack rows, from the attention-mask file beside the ids (None: not neat-packed)."""
    from . import megatron

    if not ids_prefix.endswith(IDS_SUFFIX):
        return None
    mask = megatron.attention_mask_prefix(ids_prefix[: -len(IDS_SUFFIX)])
    return megatron.segments(mask) if mask else None


def _file_fingerprint(path: Path) -> list:
    st = path.stat()
    if st.st_size <= _HASH_LIMIT:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return [path.name, st.st_size, h.hexdigest()]
    return [path.name, st.st_size, st.st_mtime_ns]


def cache_key(files: list[Path], fmt: str, tokenizer, template: ChatTemplate | None, seq_len: int,
              max_samples: int | None) -> str:
    payload = {
        "pipeline": PIPELINE_VERSION,
        "files": [_file_fingerprint(f) for f in files],
        "format": fmt,
        "tokenizer": fingerprint(tokenizer),
        "template": template.fingerprint() if template is not None else None,
        "seq_len": int(seq_len),
        "max_samples": max_samples,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def megatron_prefix(path: str | os.PathLike) -> tuple[str, str, str | None] | None:
    """(kind, ids prefix, labels prefix) when `path` names an existing Megatron dataset, else None."""
    p = indexed.check_prefix(path)
    if p.endswith(IDS_SUFFIX) and indexed.exists(p):
        base = p[: -len(IDS_SUFFIX)]
        return _instruction(base)
    if indexed.exists(p + IDS_SUFFIX):
        return _instruction(p)
    if indexed.exists(p + TEXT_SUFFIX):
        return "text", p + TEXT_SUFFIX, None
    if indexed.exists(p):
        return "text", p, None
    return None


def _instruction(base: str) -> tuple[str, str, str]:
    labels = base + LABELS_SUFFIX
    if not indexed.exists(labels):
        raise FileNotFoundError(f"instruction dataset {base!r} has {base + IDS_SUFFIX}.bin/.idx but no labels "
                                f"({labels}.bin/.idx)")
    return "instruction", base + IDS_SUFFIX, labels


# ----------------------------------------------------------------------------------- preprocess

def preprocess(records_path: str | os.PathLike, fmt: str, tokenizer, template: str | ChatTemplate | None,
               seq_len: int, cache_root: str | os.PathLike, max_samples: int | None = None,
               progress: Progress | None = None, lf_rules: dict | None = None) -> DatasetHandle:
    """lf_rules: LLaMA-Factory's encoding of instruction data ({"train_on_prompt", "mask_history"}):
    each turn cut to seq_len by its infer_seqlen instead of cutting the sample's tail."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    found = megatron_prefix(records_path)
    if found is not None:
        kind, ids, labels = found
        handle = DatasetHandle(kind=kind, prefix=ids if kind == "text" else ids[: -len(IDS_SUFFIX)],
                               ids_prefix=ids, labels_prefix=labels, seq_len=seq_len, source="megatron")
        handle.stats = handle.open().stats()
        return handle
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}; this pipeline reads: {', '.join(FORMATS)}")
    files = formats.data_files(records_path)
    tmpl = None if fmt == "text" else resolve_template(template, tokenizer)
    root = Path(cache_root)
    key = cache_key(files, fmt, tokenizer, tmpl, seq_len, max_samples)
    if lf_rules is not None and fmt != "text":
        lf_rules = {"train_on_prompt": bool(lf_rules.get("train_on_prompt")),
                    "mask_history": bool(lf_rules.get("mask_history"))}
        key = hashlib.sha256(json.dumps([key, lf_rules], sort_keys=True).encode()).hexdigest()[:24]
    else:
        lf_rules = None
    final = root / key
    meta_file = final / "meta.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if meta.get("pipeline") == PIPELINE_VERSION and meta.get("key") == key:
            return _handle(final, meta, seq_len, from_cache=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        meta = _write(tmp, files, fmt, tokenizer, tmpl, seq_len, max_samples, progress, lf_rules)
        meta.update({"pipeline": PIPELINE_VERSION, "key": key, "source": [str(f) for f in files],
                     "template": None if tmpl is None else tmpl.name})
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():   # not a concurrent writer's finished entry
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads((final / "meta.json").read_text())
    return _handle(final, meta, seq_len, from_cache=False)


def _handle(folder: Path, meta: dict, seq_len: int, from_cache: bool) -> DatasetHandle:
    base = str(folder / PREFIX)
    text = meta["kind"] == "text"
    return DatasetHandle(kind=meta["kind"], prefix=base, ids_prefix=base + (TEXT_SUFFIX if text else IDS_SUFFIX),
                         labels_prefix=None if text else base + LABELS_SUFFIX, seq_len=seq_len,
                         stats=dict(meta["stats"]), from_cache=from_cache, path=folder)


def _write(folder: Path, files: list[Path], fmt: str, tokenizer, template, seq_len: int,
           max_samples: int | None, progress: Progress | None, lf_rules: dict | None = None) -> dict:
    start = time.perf_counter()
    total = None
    counts = [formats.count_records(f) if f.suffix != ".json" else None for f in files]
    if all(c is not None for c in counts):
        total = sum(counts)
    if max_samples is not None:
        total = max_samples if total is None else min(total, max_samples)
    dtype = indexed.optimal_dtype(vocab_size(tokenizer))
    base = str(folder / PREFIX)
    stats = {"records": 0, "samples": 0, "tokens": 0, "truncated": 0, "dropped": 0, "segmented": 0,
             "sentinel": 0, "max_len": 0}
    if fmt == "text":
        writers = [indexed.IndexedDatasetWriter(base + TEXT_SUFFIX, dtype)]
    else:
        writers = [indexed.IndexedDatasetWriter(base + IDS_SUFFIX, dtype),
                   indexed.IndexedDatasetWriter(base + LABELS_SUFFIX, np.int32)]
    eod = eod_id(tokenizer) if fmt == "text" else None
    pending: list[str] = []

    def flush_text():
        for ids in formats.encode_text(tokenizer, pending, eod):
            writers[0].add_document(np.asarray(ids))
            stats["samples"] += 1
            stats["tokens"] += len(ids)
            stats["max_len"] = max(stats["max_len"], len(ids))
        pending.clear()

    def tick():
        if progress is not None and (stats["records"] % 1000 == 0):
            progress(stats["records"], total)

    for file, index, record in formats.iter_records_limited(files, max_samples):
        if fmt == "text":
            pending.append(formats.text_of(record, file, index))
            stats["records"] += 1
            if len(pending) >= _BATCH:
                flush_text()
            tick()
            continue
        if lf_rules is None:
            sample = formats.encode_instruction(tokenizer, template, fmt, record, file, index)
        else:
            sample = formats.encode_instruction(tokenizer, template, fmt, record, file, index, cutoff_len=seq_len,
                                                **lf_rules)
        stats["records"] += 1
        if sample.method.endswith("segmented"):
            stats["segmented"] += 1
        if sample.method.startswith("sentinel"):
            stats["sentinel"] += 1
        sample, cut = formats.truncate(sample, seq_len)
        stats["truncated"] += int(cut)
        if not formats.has_target(sample):
            stats["dropped"] += 1
            tick()
            continue
        writers[0].add_document(np.asarray(sample.input_ids))
        writers[1].add_document(np.asarray(sample.labels, dtype=np.int64))
        stats["samples"] += 1
        stats["tokens"] += len(sample.input_ids)
        stats["max_len"] = max(stats["max_len"], len(sample.input_ids))
        tick()
    if pending:
        flush_text()
    for w in writers:
        w.finalize()
    if stats["samples"] == 0:
        raise DataFormatError(f"{', '.join(map(str, files))}: no usable samples ({stats['records']} records read, "
                              f"{stats['dropped']} dropped with no trained token within seq_len={seq_len})")
    if progress is not None:
        progress(stats["records"], stats["records"])
    kind = "text" if fmt == "text" else "instruction"
    if kind == "text":
        view = TokenDataset(base + TEXT_SUFFIX, None, seq_len, "text")
        stats.update({"split": view.split, "chunks": len(view)})
    stats["seconds"] = round(time.perf_counter() - start, 3)
    return {"kind": kind, "format": fmt, "seq_len": seq_len, "max_samples": max_samples,
            "vocab_size": vocab_size(tokenizer), "dtype": np.dtype(dtype).name, "stats": stats,
            "ignore_index": IGNORE_INDEX}
