"""Pre-training samples as Megatron-core 0.12.1's GPTDataset builds them (MindSpeed-LLM pre-training).

From the sequences of one indexed dataset (`<prefix>_text_document`, one sequence per document,
EOD appended by preprocessing with --append-eod) Megatron builds, for one split:

  split        `--split "969,30,1"`: normalized weights -> cumulative book-ends -> sequence ranges
               [round(b0 * n), round(b1 * n)) (split_ranges; Python's round, as upstream).
  num samples  train_iters x global_batch (or --train-samples) for train; valid and test as
               Megatron's get_train_valid_test_num_samples (num_samples_per_split).
  epochs       the fewest epochs whose tokens reach num_samples * seq_length + 1.
  document     the split's sequence ids repeated once per epoch and shuffled with
  index        numpy.random.RandomState(seed); when the last epoch contributes fewer than 80% of an
               epoch's samples it is shuffled on its own after the others ("separate final epoch").
  sample index row j = (position in the document index, token offset) where sample j starts: the
               documents laid end to end, sample j covers stream tokens [j*s, j*s + s + 1) (the
               extra token gives inputs and shifted labels of s tokens each), so consecutive
               samples share one token. The last partial sample is dropped.
  shuffle      a permutation of the samples drawn from the same RandomState after the document
  index        index; with a separate final epoch the samples before it and those of it are
               permuted separately (the final epoch's samples stay at the end).

Sample i is then shuffle_index[i]'s window: tokens = text[:-1], labels = text[1:], loss_mask 1
(0 on EOD inputs with --eod-mask-loss, 0 where the label is the pad id), position_ids 0.. s-1
(restarting after every EOD with --reset-position-ids) and, with --reset-attention-mask, no
attention across an EOD: the segments end after each EOD (`cu_seqlens`). Indices are built in
memory (Megatron caches them on disk; the cache changes nothing they hold).

One difference, on purpose: when no reset / eod-mask flag is set Megatron caches the loss mask of
the first sample and its "label == pad" rule then writes into that cached tensor, so zeros stick
to later samples of the same worker (order- and worker-dependent). Each sample here gets its own
mask, which is what Megatron computes for a sample read first.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from .indexed import IndexedDataset
from .mtf_order import MegatronSampler

SPLITS = ("train", "valid", "test")
PAD_TOKEN_ID = -1                    # Megatron's _PAD_TOKEN_ID when the tokenizer has no pad
FINAL_EPOCH_THRESHOLD = 0.80


def parse_split(split: str) -> list[float]:
    """"969,30,1" -> normalized [train, valid, test] weights (parse_and_normalize_split)."""
    weights = [float(x) for x in re.findall(r"[.0-9]+", split)]
    weights += [0.0] * (len(SPLITS) - len(weights))
    if len(weights) != len(SPLITS):
        raise ValueError(f"--split {split!r}: at most {len(SPLITS)} weights (train, valid, test)")
    total = float(np.sum(np.array(weights, dtype=np.float64)))
    if total <= 0:
        raise ValueError(f"--split {split!r}: the weights sum to 0")
    return (np.array(weights, dtype=np.float64) / total).tolist()


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """Book-ends of each split, None for an empty one (convert_split_vector_to_split_matrix)."""
    ends = functools.reduce(lambda a, b: a + [a[-1] + b], parse_split(split), [0])
    return [(lo, hi) if hi > lo else None for lo, hi in zip(ends[:-1], ends[1:])]


def split_ranges(split: str, n_sequences: int) -> list[tuple[int, int] | None]:
    """The [begin, end) sequence range of each split of n sequences."""
    out = []
    for bookend in split_matrix(split):
        if bookend is None:
            out.append(None)
        else:
            out.append((int(round(bookend[0] * float(n_sequences))), int(round(bookend[1] * float(n_sequences)))))
    return out


def num_samples_per_split(train_iters: int, global_batch: int, eval_interval: int = 1000, eval_iters: int = 100,
                          train_samples: int | None = None) -> tuple[int, int, int]:
    """Megatron's get_train_valid_test_num_samples (the defaults are Megatron's)."""
    train = train_samples if train_samples else train_iters * global_batch
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch
    return int(train), int(valid), int(eval_iters * global_batch)


def num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int) -> int:
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens")
    requested = num_samples * seq_length + extra
    return max(1, -(-requested // tokens_per_epoch))


def build_document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """_build_document_index: the documents once per epoch, shuffled; a separate final epoch is
    shuffled on its own after the others, from the same RandomState."""
    if not separate_final_epoch or epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, epochs: int,
                       tokens_per_epoch: int, drop_last_partial: bool = True, extra: int = 1) -> np.ndarray:
    """helpers.cpp build_sample_idx, vectorized: row j is (document-index position, offset) of the
    last token the samples before j consumed (plus one without the extra token)."""
    if seq_length <= 1 or tokens_per_epoch <= 1:
        raise ValueError("build_sample_index needs seq_length > 1 and more than one token per epoch")
    total = epochs * tokens_per_epoch
    if drop_last_partial:
        n = (total - extra) // seq_length
    else:
        n = -(-(total - extra) // seq_length)
    lengths = np.asarray(sizes, dtype=np.int64)[document_index]
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    dtype = np.int64 if total > np.iinfo(np.int32).max else np.int32
    out = np.zeros((n + 1, 2), dtype=dtype)
    last = np.arange(1, n + 1, dtype=np.int64) * seq_length + extra - 1
    full = last < total
    doc = np.searchsorted(starts, last[full], side="right") - 1
    out[1:][full, 0] = doc
    out[1:][full, 1] = last[full] - starts[doc] + 1 - extra
    if not full.all():                  # the partial last sample ends at the last document's end
        out[1:][~full, 0] = len(document_index) - 1
        out[1:][~full, 1] = lengths[-1] - extra
    return out


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """_build_shuffle_index: [0, num_samples) shuffled, then [num_samples, total) shuffled."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    rest = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(rest)
    return np.concatenate((first, rest))


def masks_and_positions(tokens: np.ndarray, eod: int, reset_position_ids: bool, reset_attention_mask: bool,
                        eod_mask_loss: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_get_ltor_masks_and_position_ids as (loss_mask, position_ids, cu_seqlens): the causal mask
    is cut after every EOD when reset_attention_mask, so its blocks are the cu_seqlens segments."""
    s = len(tokens)
    is_eod = tokens == eod
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    cuts = np.flatnonzero(is_eod[:-1]) + 1          # a segment starts after each EOD (none after the last token)
    positions = np.arange(s, dtype=np.int64)
    if reset_position_ids and len(cuts):
        seg_start = np.zeros(s, dtype=np.int64)
        seg_start[cuts] = cuts
        positions -= np.maximum.accumulate(seg_start)
    bounds = cuts if reset_attention_mask else cuts[:0]
    cu = np.concatenate(([0], bounds, [s])).astype(np.int32)
    return loss_mask, positions, cu


class GPTDataset:
    """One split of Megatron's GPT dataset over an indexed dataset; `ds[i]` is sample i."""

    def __init__(self, indexed: IndexedDataset | str, seq_length: int, seed: int, eod_id: int,
                 split: str = "969,30,1", which: str = "train", num_samples: int | None = None,
                 pad_id: int | None = None, reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 eod_mask_loss: bool = False, add_extra_token: bool = True,
                 drop_last_partial_validation_sequence: bool = True):
        if which not in SPLITS:
            raise ValueError(f"unknown split {which!r}; one of {', '.join(SPLITS)}")
        self.dataset = indexed if isinstance(indexed, IndexedDataset) else IndexedDataset(indexed)
        self.seq_length, self.seed, self.which = int(seq_length), int(seed), which
        self.eod_id = int(eod_id)
        self.pad_id = PAD_TOKEN_ID if pad_id is None else int(pad_id)
        self.reset_position_ids, self.reset_attention_mask = bool(reset_position_ids), bool(reset_attention_mask)
        self.eod_mask_loss, self.extra = bool(eod_mask_loss), int(bool(add_extra_token))
        sizes = np.asarray(self.dataset.sizes, dtype=np.int32)
        bounds = split_ranges(split, len(sizes))[SPLITS.index(which)]
        if bounds is None or bounds[1] <= bounds[0]:
            raise ValueError(f"--split {split!r} gives the {which} split none of the {len(sizes)} documents of "
                             f"{self.dataset.prefix}")
        self.documents = np.arange(bounds[0], bounds[1], dtype=np.int32)
        self.num_samples = None if num_samples is None else int(num_samples)
        self.tokens_per_epoch = int(np.sum(sizes[self.documents], dtype=np.int64))
        if self.tokens_per_epoch <= self.extra:
            raise ValueError(f"the {which} split of {self.dataset.prefix} holds {self.tokens_per_epoch} tokens")
        self.epochs = num_epochs(self.tokens_per_epoch, self.num_samples, self.seq_length, self.extra)
        separate, sans_final = False, None
        if self.epochs > 1:
            s, e = self.seq_length, self.extra
            sans_final = ((self.epochs - 1) * self.tokens_per_epoch - e) // s
            from_final = self.num_samples - sans_final
            per_epoch = (self.tokens_per_epoch - e) // s
            separate = from_final < int(FINAL_EPOCH_THRESHOLD * per_epoch)
        self.separate_final_epoch = separate
        rng = np.random.RandomState(self.seed)
        self.document_index = build_document_index(self.documents, self.epochs, rng, separate)
        drop_last = drop_last_partial_validation_sequence if which == "valid" else True
        self.sample_index = build_sample_index(sizes, self.document_index, self.seq_length, self.epochs,
                                               self.tokens_per_epoch, drop_last, self.extra)
        n = len(self.sample_index) - 1
        self.shuffle_index = build_shuffle_index(sans_final if separate else n, n, rng)

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def text(self, i: int) -> np.ndarray:
        """The seq_length + extra token ids of sample i (padded with pad_id at a partial end)."""
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        parts = []
        for d in range(d0, d1 + 1):
            seq = self.dataset[int(self.document_index[d])]
            lo = o0 if d == d0 else 0
            parts.append(seq[lo:o1 + self.extra] if d == d1 else seq[lo:])
        text = np.concatenate(parts).astype(np.int64)
        want = self.seq_length + self.extra
        if len(text) < want:
            text = np.concatenate((text, np.full(want - len(text), self.pad_id, dtype=np.int64)))
        return text

    def __getitem__(self, i: int) -> dict:
        text = self.text(i)
        if self.extra:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens, labels = text, np.roll(text, -1)
            labels[-1] = self.pad_id
        loss_mask, positions, cu = masks_and_positions(tokens, self.eod_id, self.reset_position_ids,
                                                       self.reset_attention_mask, self.eod_mask_loss)
        loss_mask[labels == self.pad_id] = 0.0
        tokens[tokens == self.pad_id] = 0      # the pad id may not be a valid embedding row (-1)
        labels[labels == self.pad_id] = 0
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions,
                "cu_seqlens": cu}


class MegatronBatches:
    """Micro-batches of a GPTDataset in Megatron's order (mtf_order.MegatronSampler): --dataloader-type single
    (MegatronPretrainingSampler, the default) consumes sample positions in order, global micro-step k takes
    [k*G, (k+1)*G) with G = micro x dp and dp rank r the micro samples at k*G + r*micro; cyclic
    (MegatronPretrainingRandomSampler) reads each rank's bucket in a seeded random order.

    Batches follow loader.py's contract: labels already shifted, -100 where the loss mask is 0.
    With reset_attention_mask a micro-batch is one packed row [1, micro * seq] whose cu_seqlens
    are the documents (each row's segments, offset); otherwise rows [micro, seq], causal per row.
    """

    mode = "megatron"
    packing = None

    def __init__(self, dataset: GPTDataset, micro_batch: int, dp_rank: int = 0, dp_world: int = 1,
                 sampler: str = "single"):
        if micro_batch < 1 or not (dp_world >= 1 and 0 <= dp_rank < dp_world):
            raise ValueError(f"micro_batch {micro_batch}, dp_rank {dp_rank} of {dp_world}: out of range")
        self.dataset, self.micro_batch, self.dp_rank, self.dp_world = dataset, int(micro_batch), int(dp_rank), int(dp_world)
        self.n_units = len(dataset)
        self.sampler = MegatronSampler(sampler, self.n_units, self.micro_batch, self.dp_rank, self.dp_world)
        self.epoch_units = self.n_units    # the samples of one epoch, where the run counts epochs
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        try:
            positions = self.sampler.positions(self.position // (self.micro_batch * self.dp_world))
        except ValueError as err:
            raise ValueError(f"the {self.dataset.which} split: {err}") from None
        items = [self.dataset[int(i)] for i in positions]
        self.position += self.micro_batch * self.dp_world
        return self.collate(items, self.dataset.reset_attention_mask)

    @staticmethod
    def collate(items: list[dict], packed: bool) -> dict:
        import torch

        ids = np.stack([it["tokens"] for it in items])
        labels = np.stack([np.where(it["loss_mask"] > 0, it["labels"], -100) for it in items])
        pos = np.stack([it["position_ids"] for it in items])
        out = {"n_tokens": torch.tensor(int((labels != -100).sum()), dtype=torch.int64),
               "n_input": torch.tensor(int(ids.size), dtype=torch.int64)}
        if not packed:
            return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                    "position_ids": torch.from_numpy(pos), **out}
        s = ids.shape[1]
        cu = np.concatenate([[0]] + [it["cu_seqlens"][1:].astype(np.int64) + r * s for r, it in enumerate(items)])
        return {"input_ids": torch.from_numpy(ids.reshape(1, -1)), "labels": torch.from_numpy(labels.reshape(1, -1)),
                "position_ids": torch.from_numpy(pos.reshape(1, -1)), "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
                **out}

    def state_dict(self) -> dict:
        d = self.dataset
        return {"position": int(self.position), "mode": self.mode, "n_units": int(self.n_units), "seed": d.seed,
                "seq_len": d.seq_length, "sampler": self.sampler.kind,
                "split_documents": [int(d.documents[0]), int(d.documents[-1]) + 1]}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("mode", "seed", "seq_len", "split_documents", "sampler"):
            if state.get(key, "single" if key == "sampler" else None) != mine[key]:   # older states: single
                raise ValueError(f"loader state was saved with {key}={state.get(key)!r}, this run has {mine[key]!r}: "
                                 f"Megatron's sample order would differ, so it cannot resume exactly")
        self.position = int(state["position"])

    @property
    def stats(self) -> dict:
        d = self.dataset
        return {"mode": self.mode, "units": self.n_units, "samples": self.n_units, "epochs": d.epochs,
                "documents": len(d.documents)}
