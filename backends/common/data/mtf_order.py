"""MindSpeed-LLM's order of instruction (SFT) data, and Megatron's two samplers.

MindSpeed-LLM trains the rows of its preprocessed `<prefix>_packed_*_document` files: one sample a row, or with
preprocess_data.py --pack the packed rows as written (DecoderPackedMTFDataset, mindspeed_llm/tasks/preprocess/
decoder_packed_mtf_dataset.py, Ascend/MindSpeed-LLM c77308a1):
  split    --split cuts the rows as megatron.legacy's get_train_valid_test_split_ does (legacy_split); the
           train split is rows [s0, s1).
  index    _build_index_mappings (shuffle_index): the split's rows, epoch after epoch, until they cover
           num_samples (train_iters x global batch); one numpy RandomState(seed) shuffles each epoch in place,
           drawing on from epoch to epoch; --no-shuffle keeps file order. --padded-samples first appends rows
           0, 1, … (absolute row numbers, as upstream) until the epoch is a whole number of global batches.
  sampler  Megatron's loader over that index (sample i is row index[i]), MegatronSampler below.
"""

from __future__ import annotations

import numpy as np

SAMPLERS = ("single", "cyclic")


def legacy_split(split: str, size: int) -> list[int]:
    """[train begin, valid begin, test begin, end] of `size` rows (megatron.legacy.data.dataset_utils.
    get_train_valid_test_split_: weights by ',' else '/', each share rounded, the rounding error taken from
    every bound)."""
    sep = "," if "," in split else "/" if "/" in split else None
    weights = [float(s) for s in (split.split(sep) if sep else [split])]
    weights = (weights + [0.0] * 3)[:3]
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--split {split!r}: the weights sum to 0")
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * float(size))))
    diff = bounds[-1] - size
    return [bounds[0]] + [b - diff for b in bounds[1:]]


def epoch_rows(start: int, count: int, global_batch: int, padded_samples: bool) -> np.ndarray:
    """One epoch's rows before shuffling (_build_sequential_idx)."""
    rows = np.arange(start, start + count, dtype=np.int64)
    remainder = count % global_batch
    if padded_samples and remainder:
        rows = np.append(rows, np.arange(0, global_batch - remainder, dtype=np.int64))
    return rows


def shuffle_index(start: int, count: int, num_samples: int, seed: int, global_batch: int, shuffle: bool = True,
                  padded_samples: bool = False) -> np.ndarray:
    """The rows DecoderPackedMTFDataset reads, in order: whole epochs of rows [start, start + count)."""
    rng = np.random.RandomState(seed=seed)
    epochs = []
    length = 0
    while length < num_samples:
        rows = epoch_rows(start, count, global_batch, padded_samples)
        if shuffle:
            rng.shuffle(rows)
        epochs.append(rows)
        length += len(rows)
    return np.concatenate(epochs) if epochs else np.zeros(0, dtype=np.int64)


class MegatronSampler:
    """Which positions of a dataset of `total` samples rank `dp_rank` reads at global micro-step k:
      single  MegatronPretrainingSampler: in order, step k the positions [k*G, (k+1)*G), G = micro x dp, rank r
              the micro of them from k*G + r*micro; running past the end is an error.
      cyclic  MegatronPretrainingRandomSampler with data sharding, as Megatron's cyclic_iter restarts it: a pass
              is S = total // G steps; rank r owns the bucket [r*B, (r+1)*B), B = S x micro, and reads it in
              torch.randperm(B) order from a generator seeded with the pass number."""

    def __init__(self, kind: str, total: int, micro_batch: int, dp_rank: int, dp_world: int):
        if kind not in SAMPLERS:
            raise ValueError(f"unknown sampler {kind!r}; one of {', '.join(SAMPLERS)}")
        self.kind, self.total, self.micro, self.rank, self.dp = kind, int(total), micro_batch, dp_rank, dp_world
        self.steps_per_pass = self.total // (micro_batch * dp_world)
        if kind == "cyclic" and not self.steps_per_pass:
            raise ValueError(f"{self.total} samples fill no global micro-batch of {micro_batch * dp_world}")
        self._perm: tuple[int, np.ndarray] | None = None

    def positions(self, step: int) -> np.ndarray:
        if self.kind == "single":
            start = step * self.micro * self.dp + self.rank * self.micro
            if start + self.micro > self.total:
                raise ValueError(f"the index holds {self.total} samples, the run asks for sample "
                                 f"{start + self.micro - 1}; build it for train_iters x global batch samples")
            return np.arange(start, start + self.micro, dtype=np.int64)
        passes, j = divmod(step, self.steps_per_pass)
        bucket = self.steps_per_pass * self.micro
        if self._perm is None or self._perm[0] != passes:
            import torch

            g = torch.Generator()
            g.manual_seed(passes)
            self._perm = (passes, torch.randperm(bucket, generator=g).numpy().astype(np.int64))
        return self.rank * bucket + self._perm[1][j * self.micro:(j + 1) * self.micro]
