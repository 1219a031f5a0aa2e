"""KTO data: LLaMA-Factory 0.9.5's feedback processor. A record is one prompt and one answer with a kto_tag
(true: desirable, false: undesirable; a tag that is not a boolean drops the record, as LF's converter and
processor do). Each record also gets a KL sample: its own prompt with the answer of the record before it
in the batch LF's preprocessing sees (the first of a batch takes the last one's), for KTO's estimate of the
KL divergence between the policy and the reference. The batches are datasets.map's: the merged records cut
into preprocessing_num_workers contiguous shards, each into runs of preprocessing_batch_size.

Target and KL samples are each cut by infer_seqlen over their prompt and answer and cached as one indexed
dataset (sequence 2i the target of record i, 2i + 1 its KL sample) with the tags beside it; a micro-batch
of B records is B target rows and B KL rows, each group right-padded to its longest row (a multiple of 8),
as LF's KTODataCollatorWithPadding pads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.common.data.formats import DataFormatError, encode_pairwise, has_target, iter_records
from backends.common.data.indexed import IndexedDataset, IndexedDatasetWriter
from backends.lf.pairs import UnitLoader, build_once

FEEDBACK_VERSION = 1


def map_batches(n: int, num_proc: int | None, batch_size: int | None) -> list[range]:
    """The record batches datasets.map(batched=True, batch_size, num_proc) hands LF's processor: num_proc
    contiguous shards (at most n; the first n % num_proc one record longer), each cut into batches of
    batch_size (the whole shard when batch_size <= 0)."""
    shards = max(min(num_proc or 1, n), 1)
    div, mod = divmod(n, shards)
    out = []
    for i in range(shards):
        start = div * i + min(i, mod)
        end = start + div + (1 if i < mod else 0)
        size = batch_size if batch_size and batch_size > 0 else max(end - start, 1)
        out += [range(s, min(s + size, end)) for s in range(start, end, size)]
    return out


def kl_partners(n: int, num_proc: int | None, batch_size: int | None) -> list[int]:
    """Record i's KL answer comes from partners[i]: the record before it in its batch, the batch's last for
    its first (LF: [responses[-1]] + responses[:-1])."""
    partners = list(range(n))
    for batch in map_batches(n, num_proc, batch_size):
        for j, i in enumerate(batch):
            partners[i] = batch[j - 1] if j else batch[-1]
    return partners


def _answer(record: dict, where: str) -> str:
    if "messages" not in record:
        return record["output"]
    last = record["messages"][-1]
    if last.get("role") != "assistant":
        raise DataFormatError(f"{where}: a feedback record ends with the assistant's answer")
    return last["content"]


def _with_answer(record: dict, answer: str) -> dict:
    """The record as a ranking record whose two answers are `answer` (encode_pairwise then cuts prompt and
    answer as LF's feedback processor does: infer_seqlen over them)."""
    base = {k: v for k, v in record.items() if k not in ("output", "kto_tag")}
    if "messages" in record:
        base["messages"] = record["messages"][:-1]
        answer = {"role": "assistant", "content": answer}
    return {**base, "chosen": answer, "rejected": answer}


@dataclass
class FeedbackDataset:
    ids: IndexedDataset
    labels: IndexedDataset
    tags: np.ndarray      # bool, one per record kept
    stats: dict

    def __len__(self) -> int:
        return len(self.tags)

    def sample(self, i: int, kl: bool = False) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[2 * i + kl], self.labels[2 * i + kl]

    def summary(self) -> str:
        s = self.stats
        return (f"feedback dataset {s['folder']} ({'cache hit' if s.get('cached') else 'written'}): {s['samples']} "
                f"samples ({s['desirable']} desirable), {s['tokens']} tokens with the KL samples, {s['dropped']} "
                "dropped (no boolean kto_tag, or no trained token)")


def build_feedback(records: Path, tokenizer, template, cutoff_len: int, cache: Path, num_proc: int | None,
                   batch_size: int | None) -> FeedbackDataset:
    """Tokenize the canonical records (JSONL, each with its kto_tag) into the cache, or reuse it."""
    from backends.common.data.preprocess import cache_key

    key = cache_key([records], "feedback", tokenizer, template, cutoff_len, None)
    folder = cache / f"feedback{FEEDBACK_VERSION}-{key}-p{num_proc or 1}-b{batch_size}"
    cached = build_once(folder, lambda tmp: _write(tmp, records, tokenizer, template, cutoff_len, num_proc,
                                                   batch_size))
    meta = json.loads((folder / "meta.json").read_text())
    return FeedbackDataset(IndexedDataset(folder / "ids"), IndexedDataset(folder / "labels"),
                           np.load(folder / "tags.npy"), {**meta, "folder": str(folder), "cached": cached})


def _write(tmp: Path, records: Path, tokenizer, template, cutoff_len: int, num_proc: int | None,
           batch_size: int | None) -> dict:
    rows = list(iter_records(records))
    answers = [_answer(rec, f"{file}: record {index}") for file, index, rec in rows]
    partners = kl_partners(len(rows), num_proc, batch_size)
    ids_w, labels_w = IndexedDatasetWriter(tmp / "ids"), IndexedDatasetWriter(tmp / "labels")
    tags, tokens, dropped = [], 0, 0
    for (file, index, rec), answer, partner in zip(rows, answers, partners):
        if not isinstance(rec.get("kto_tag"), bool):
            dropped += 1
            continue
        target, kl = (encode_pairwise(tokenizer, template, _with_answer(rec, a), file, index, cutoff_len)[0]
                      for a in (answer, answers[partner]))
        if not has_target(target):
            dropped += 1
            continue
        for sample in (target, kl):
            ids_w.add_document(np.asarray(sample.input_ids, dtype=np.int64))
            labels_w.add_document(np.asarray(sample.labels, dtype=np.int64))
            tokens += len(sample.input_ids)
        # LF: desirable when the answer is in the first slot with text (an empty desirable answer counts as not)
        tags.append(bool(rec["kto_tag"] and answer))
    ids_w.finalize()
    labels_w.finalize()
    if not tags:
        raise DataFormatError(f"{records}: no record has a boolean kto_tag and a trained token within cutoff_len "
                              f"{cutoff_len}")
    np.save(tmp / "tags.npy", np.asarray(tags, dtype=bool))
    meta = {"version": FEEDBACK_VERSION, "samples": len(tags), "desirable": int(sum(tags)), "tokens": tokens,
            "dropped": dropped}
    (tmp / "meta.json").write_text(json.dumps(meta))
    return meta


class FeedbackLoader(UnitLoader):
    """Micro-batches of `micro_batch` records for this dp rank: their target rows, their KL rows (kl_*) and
    kto_tags, as LF's KTO collator lays them out."""

    def __init__(self, dataset: FeedbackDataset, micro_batch: int, **kw):
        super().__init__(len(dataset), micro_batch, **kw)
        self.dataset = dataset

    def __next__(self) -> dict:
        import torch

        units = self.next_units()
        out = {}
        for prefix, kl in (("", False), ("kl_", True)):
            rows = [self.dataset.sample(u, kl) for u in units]
            ids, labels = self.padded(rows)
            out.update({f"{prefix}input_ids": torch.from_numpy(ids), f"{prefix}labels": torch.from_numpy(labels),
                        f"{prefix}position_ids": torch.arange(ids.shape[1]).expand(ids.shape).contiguous(),
                        f"{prefix}lengths": torch.tensor([len(x) for x, _ in rows])})
        return {**out, "kto_tags": torch.from_numpy(self.dataset.tags[units]),
                "n_tokens": torch.tensor(len(units)),  # KTO's loss terms are records
                # the Trainer counts the FLOPs of input_ids (the target rows), padding included
                "n_positions": torch.tensor(out["input_ids"].numel()), "n_input": out["lengths"].sum()}
