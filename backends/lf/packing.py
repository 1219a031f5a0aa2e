"""Pre-training rows and packed SFT rows as LLaMA-Factory 0.9.5 builds them (data/processor/pretrain.py,
supervised.py's PackedSupervisedDatasetProcessor, processor_utils.greedy_knapsack), each map batch of
datasets.map(batched=True, batch_size=preprocessing_batch_size, num_proc=preprocessing_num_workers) on its own.

pt: every text gets the end token (`<|end_of_text|>` for template llama3, else the tokenizer's EOS after the
template replaced it); with packing (pt's default) a batch's texts are tokenized, chained and cut into
cutoff_len blocks, the tail shorter than a block dropped, and a tokenizer that adds BOS gets its BOS over each
block's first token; without packing each text is one row (BOS in front when the tokenizer adds one), cut at
cutoff_len. Labels are the ids with every pad id masked (DataCollatorForLanguageModeling), so an end token
that is also the pad token is not trained.

sft packing: a batch's samples longer than cutoff_len are dropped, the rest filled greedily into rows
(largest that fits first), each row right-padded to cutoff_len + 1 (pad id, position 0, label -100). Position
ids restart at every sample. LLaMA-Factory lowers cutoff_len by one whenever packing is set in the file
(data_args.py; backends.lf.config does the same), so a row is the file's cutoff_len long. Without
neat_packing the samples of a row attend to each other (an all-ones attention mask); neat_packing keeps each
to itself.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from itertools import chain

import numpy as np

from backends.common.data.templates import IGNORE_INDEX
from backends.lf.feedback import map_batches
from backends.lf.pairs import UnitLoader

# LF 0.9.5 templates (of those backends.lf implements) registered with replace_eos: the tokenizer's EOS becomes
# their first stop word
REPLACED_EOS = {"qwen": "<|im_end|>", "qwen3": "<|im_end|>", "qwen3_nothink": "<|im_end|>",
                "qwen2_vl": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "gemma3": "<end_of_turn>"}


def fixed_eos(template: str | None, tokenizer) -> str:
    """The EOS after LF's fix_special_tokens: the template's stop word, else the tokenizer's, else <|endoftext|>."""
    return REPLACED_EOS.get(template) or tokenizer.eos_token or "<|endoftext|>"


def end_token(template: str | None, tokenizer) -> str:
    """The token pretrain.py appends to every text."""
    return "<|end_of_text|>" if template == "llama3" else fixed_eos(template, tokenizer)


def lf_pad_id(template: str | None, tokenizer) -> int:
    """The pad id after LF's fix_special_tokens: the tokenizer's, else the fixed EOS."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return int(tokenizer.convert_tokens_to_ids(fixed_eos(template, tokenizer)))


def pretrain_rows(texts: list[str], tokenizer, end: str, cutoff_len: int, packing: bool,
                  batches: list[range]) -> list[list[int]]:
    """The token rows of pretrain.py for texts, map batch by map batch."""
    add_bos = getattr(tokenizer, "add_bos_token", False)
    rows: list[list[int]] = []
    for batch in batches:
        examples = [texts[i] + end for i in batch]
        if not packing:
            if add_bos:
                examples = [tokenizer.bos_token + t for t in examples]
            rows += [list(ids) for ids in tokenizer(examples, add_special_tokens=False, truncation=True,
                                                     max_length=cutoff_len)["input_ids"]]
            continue
        stream = list(chain(*tokenizer(examples, add_special_tokens=False)["input_ids"]))
        blocks = [stream[i:i + cutoff_len] for i in range(0, len(stream) // cutoff_len * cutoff_len, cutoff_len)]
        if add_bos:
            for block in blocks:
                block[0] = tokenizer.bos_token_id
        rows += blocks
    return rows


def greedy_knapsack(numbers: list[int], capacity: int) -> list[list[int]]:
    """processor_utils.greedy_knapsack: sorted ascending, each knapsack takes the largest that still fits."""
    numbers = sorted(numbers)
    knapsacks = []
    while numbers:
        current, left = [], capacity
        while True:
            index = bisect.bisect(numbers, left) - 1
            if index < 0:
                break
            left -= numbers[index]
            current.append(numbers.pop(index))
        knapsacks.append(current)
    return knapsacks


def knapsack_rows(lengths: list[int], capacity: int, batches: list[range]) -> list[list[int]]:
    """The sample indices of each packed row, in LF's row order: per map batch, samples over capacity dropped,
    each knapsack's lengths turned back into samples (of equal lengths, the last one first)."""
    rows = []
    for batch in batches:
        by_length: dict[int, list[int]] = {}
        kept = [i for i in batch if lengths[i] <= capacity]
        for i in kept:
            by_length.setdefault(lengths[i], []).append(i)
        for knapsack in greedy_knapsack([lengths[i] for i in kept], capacity):
            rows.append([by_length[n].pop() for n in knapsack])
    return rows


@dataclass
class Row:
    """One training row: input ids, unshifted labels, position ids, LF's attention mask (all ones; under
    neat_packing the sample's number from 1, 0 on padding) and how many of its tokens are not padding."""
    ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    length: int


def packed_row(samples: list[tuple], width: int, pad_id: int, neat: bool) -> Row:
    """Samples (ids, labels) end to end, right-padded to width (LF pads at least one position)."""
    ids = np.full(width, pad_id, dtype=np.int64)
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros(width, dtype=np.int64)
    mask = np.zeros(width, dtype=np.int64) if neat else np.ones(width, dtype=np.int64)
    at = 0
    for k, (x, y) in enumerate(samples):
        n = len(x)
        ids[at:at + n], labels[at:at + n], positions[at:at + n] = x, y, np.arange(n)
        mask[at:at + n] = k + 1 if neat else 1
        at += n
    return Row(ids, labels, positions, mask, at)


def text_row(ids: list[int], pad_id: int) -> Row:
    """A pre-training row: every token a label but the pad id's."""
    x = np.asarray(ids, dtype=np.int64)
    return Row(x, np.where(x == pad_id, IGNORE_INDEX, x), np.arange(len(x)), np.ones(len(x), dtype=np.int64), len(x))


class Rows:
    """LF's rows in LF's order (the units the sampler shuffles)."""

    def __init__(self, rows: list[Row], what: str, samples: int):
        self.rows, self.what, self.samples = rows, what, samples
        self.stats = {"samples": samples, "rows": len(rows)}

    def __len__(self) -> int:
        return len(self.rows)

    def summary(self) -> str:
        real = sum(r.length for r in self.rows)
        width = sum(len(r.ids) for r in self.rows)
        return f"{self.samples} samples in {len(self.rows)} {self.what} rows ({real} of {width} positions real)"


def sft_rows(dataset, cutoff_len: int, pad_id: int, neat: bool, batches_of) -> Rows:
    """Packed SFT rows of a tokenized dataset (its samples cut at cutoff_len, already LF's lowered one)."""
    lengths = [int(n) for n in dataset.lengths]
    rows = knapsack_rows(lengths, cutoff_len, batches_of(len(lengths)))
    out = [packed_row([dataset.sample(i) for i in row], cutoff_len + 1, pad_id, neat) for row in rows]
    return Rows(out, "neat-packed" if neat else "packed", sum(len(r) for r in rows))


def texts(records) -> list[str]:
    """The canonical JSONL's pre-training texts (backends.lf.data.write_canonical)."""
    with open(records, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def pt_rows(texts: list[str], tokenizer, template: str | None, cutoff_len: int, packing: bool, batches_of) -> Rows:
    pad = lf_pad_id(template, tokenizer)
    rows = pretrain_rows(texts, tokenizer, end_token(template, tokenizer), cutoff_len, packing, batches_of(len(texts)))
    if not rows:
        raise ValueError(f"the pre-training texts make no block of cutoff_len {cutoff_len} tokens (LLaMA-Factory: "
                         "Cannot find sufficient samples); lower cutoff_len or add text")
    return Rows([text_row(r, pad) for r in rows], "pre-training" if packing else "per-text", len(texts))


def encode(cfg, records, fmt: str, tokenizer, template, cache):
    """Stage pt's or sft's training data from the canonical records: LF's rows (pt, packed sft), else the
    tokenized samples (a backends.common.data handle) that the dynamic loader batches."""
    from backends.common.data import preprocess
    from backends.lf.config import LFConfigError

    def chunks(n: int) -> list[range]:
        return map_batches(n, cfg.preprocessing_num_workers, cfg.preprocessing_batch_size)

    if cfg.stage == "pt":
        try:
            return pt_rows(texts(records), tokenizer, cfg.template, cfg.cutoff_len, cfg.packing, chunks)
        except ValueError as err:
            raise LFConfigError(f"cutoff_len: {err}") from None
    handle = preprocess(records, fmt, tokenizer, template, cfg.cutoff_len, cache,
                        lf_rules={"train_on_prompt": cfg.train_on_prompt, "mask_history": cfg.mask_history})
    if not cfg.packing:
        return handle
    return sft_rows(handle.open(cfg.cutoff_len), cfg.cutoff_len, lf_pad_id(cfg.template, tokenizer), cfg.neat_packing,
                    chunks)


class RowLoader(UnitLoader):
    """Micro-batches of rows, right-padded to the longest (a multiple of pad_to_multiple_of); labels shifted
    over the whole row (a packed row's last token of one sample predicts the next sample's first label, as
    the Trainer's shift does). attention_mask: with LF's all-ones mask the model attends over the row."""

    def __init__(self, rows: Rows, micro_batch: int, *, neat: bool, **kw):
        super().__init__(len(rows), micro_batch, **kw)
        self.dataset, self.neat = rows, neat

    def __next__(self) -> dict:
        import torch

        rows = [self.dataset.rows[u] for u in self.next_units()]
        ids, labels = self.padded([(r.ids, r.labels) for r in rows])
        positions = np.zeros_like(ids)
        for k, r in enumerate(rows):
            positions[k, :len(r.positions)] = r.positions
        out = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
               "position_ids": torch.from_numpy(positions),
               "n_tokens": torch.tensor(sum(int((r.labels != IGNORE_INDEX).sum()) for r in rows)),
               "n_positions": torch.tensor(ids.size), "n_input": torch.tensor(sum(r.length for r in rows))}
        if not self.neat:  # positions restart per sample, attention does not: a mask keeps HF from splitting the row
            out["attention_mask"] = torch.ones_like(out["input_ids"])
        return out
