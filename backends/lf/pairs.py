"""Pairwise data (stages dpo and rm): ranking records tokenized as LLaMA-Factory's pairwise processor does (one prompt, a chosen
and a rejected answer, cut together by its infer_seqlen), cached once as a Megatron indexed dataset
of ids and labels (sequence 2i the chosen sample of pair i, 2i + 1 its rejected one), and batched as
LLaMA-Factory's pairwise collator lays them out: a micro-batch of B pairs is 2B rows, the B chosen
answers first, then the B rejected ones, right-padded to the longest row (a multiple of 8).

Pairs are shuffled per epoch as LLaMA-Factory's trainer does (backends.lf.order); global micro-step k covers pairs [k·G, (k+1)·G) of
the stream with G = micro × dp, rank r taking its micro of them, so a step's pairs do not depend on
how they are split over ranks and accumulation steps.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.common.data.formats import DataFormatError, encode_pairwise, has_target, iter_records
from backends.common.data.indexed import IndexedDataset, IndexedDatasetWriter
from backends.common.data.loader import round_up, shift_labels
from backends.common.data.templates import IGNORE_INDEX

PAIRS_VERSION = 1


@dataclass
class PairDataset:
    ids: IndexedDataset
    labels: IndexedDataset
    stats: dict

    def __len__(self) -> int:
        return len(self.ids) // 2

    def pair(self, i: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        return (self.ids[2 * i], self.labels[2 * i]), (self.ids[2 * i + 1], self.labels[2 * i + 1])

    def summary(self) -> str:
        s = self.stats
        return (f"pairwise dataset {s['folder']} ({'cache hit' if s.get('cached') else 'written'}): {s['pairs']} pairs, "
                f"{s['tokens']} tokens, longest answer row {s['max_len']}, {s['dropped']} without a trained token dropped")


def _key(records: Path, tokenizer, template, cutoff_len: int, max_samples: int | None) -> str:
    from backends.common.data.preprocess import cache_key

    return f"pairs{PAIRS_VERSION}-" + cache_key([records], "pairwise", tokenizer, template, cutoff_len, max_samples)


def build_pairs(records: Path, tokenizer, template, cutoff_len: int, cache: Path,
                max_samples: int | None = None) -> PairDataset:
    """Tokenize every pair of `records` (canonical JSONL) into the cache, or reuse it."""
    folder = cache / _key(records, tokenizer, template, cutoff_len, max_samples)
    cached = build_once(folder, lambda tmp: _write(tmp, records, tokenizer, template, cutoff_len, max_samples))
    meta = json.loads((folder / "meta.json").read_text())
    return PairDataset(IndexedDataset(folder / "ids"), IndexedDataset(folder / "labels"),
                       {**meta, "folder": str(folder), "cached": cached})


def build_once(folder: Path, write) -> bool:
    """A cache folder (complete once it holds meta.json) built by `write(tmp)` into a temporary sibling and
    renamed into place: nothing half-written stays, and a process that finishes first wins. Returns
    whether it was already there."""
    if (folder / "meta.json").is_file():
        return True
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished the same cache first
        shutil.rmtree(tmp, ignore_errors=True)
    return False


def _write(tmp: Path, records: Path, tokenizer, template, cutoff_len: int, max_samples: int | None) -> dict:
    ids_w, labels_w = IndexedDatasetWriter(tmp / "ids"), IndexedDatasetWriter(tmp / "labels")
    pairs = tokens = dropped = longest = 0
    for file, index, record in iter_records(records):
        if max_samples is not None and pairs + dropped >= max_samples:
            break
        chosen, rejected = encode_pairwise(tokenizer, template, record, file, index, cutoff_len=cutoff_len)
        if not (has_target(chosen) and has_target(rejected)):
            dropped += 1
            continue
        for sample in (chosen, rejected):
            ids_w.add_document(np.asarray(sample.input_ids, dtype=np.int64))
            labels_w.add_document(np.asarray(sample.labels, dtype=np.int64))
            tokens += len(sample.input_ids)
            longest = max(longest, len(sample.input_ids))
        pairs += 1
    ids_w.finalize()
    labels_w.finalize()
    if pairs == 0:
        raise DataFormatError(f"{records}: no pair has a trained token in both answers within cutoff_len {cutoff_len}")
    meta = {"version": PAIRS_VERSION, "pairs": pairs, "tokens": tokens, "dropped": dropped, "max_len": longest}
    (tmp / "meta.json").write_text(json.dumps(meta))
    return meta


class UnitLoader:
    """A seeded, dp-sharded, resumable stream of units (pairs, or vision-language samples), batched epoch by
    epoch as HF Trainer batches LLaMA-Factory's data (backends.lf.order; in order when not shuffle).
    Subclasses turn a micro-batch's units into tensors."""

    def __init__(self, n_units: int, micro_batch: int, dp_rank: int = 0, dp_world: int = 1, seed: int = 0,
                 pad_id: int = 0, pad_to_multiple_of: int = 8, shuffle: bool = True):
        from backends.lf.order import EpochBatches

        self.n_units, self.micro_batch, self.dp_rank, self.dp_world = n_units, micro_batch, dp_rank, dp_world
        self.seed, self.pad_id, self.multiple, self.shuffle = seed, pad_id, pad_to_multiple_of, shuffle
        self.batches = EpochBatches()
        self.batches._setup(n_units, micro_batch, dp_rank, dp_world, seed, shuffle)

    @property
    def position(self) -> int:
        return self.batches.position

    def __len__(self) -> int:
        return self.batches.per_epoch

    def left_in_epoch(self) -> int:
        return self.batches.left_in_epoch()

    def next_units(self) -> list[int]:
        """This rank's units of the next micro-batch."""
        return self.batches.take()

    def padded(self, rows: list) -> tuple[np.ndarray, np.ndarray]:
        """(ids, shifted labels) of (ids, labels) rows, right-padded to the longest (a multiple of 8)."""
        width = round_up(max(len(x) for x, _ in rows), self.multiple)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        for r, (x, y) in enumerate(rows):
            ids[r, :len(x)] = x
            labels[r, :len(x)] = shift_labels(np.asarray(y))
        return ids, labels

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return self.batches._state()

    def load_state_dict(self, state: dict) -> None:
        self.batches._check_state(state)
        self.batches.position = int(state["position"])


class PairLoader(UnitLoader):
    """Micro-batches of `micro_batch` pairs for this dp rank, as 2 × micro rows (chosen, then rejected)."""

    def __init__(self, dataset: PairDataset, micro_batch: int, **kw):
        super().__init__(len(dataset), micro_batch, **kw)
        self.dataset = dataset

    def __next__(self) -> dict:
        import torch

        units = self.next_units()
        rows = [self.dataset.pair(u)[0] for u in units] + [self.dataset.pair(u)[1] for u in units]
        ids, labels = self.padded(rows)
        width = ids.shape[1]
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.arange(width).expand(len(rows), width).contiguous(),
                "lengths": torch.tensor([len(x) for x, _ in rows]),  # the reward model scores each row's last token
                "n_tokens": torch.tensor(len(units)),  # DPO's loss terms are pairs
                "n_positions": torch.tensor(ids.size), "n_input": torch.tensor(sum(len(x) for x, _ in rows))}
