"""The order LLaMA-Factory 0.9.5 trains samples in, under HF Trainer (transformers 5) and accelerate.

Trainer._get_train_sampler gives RandomSampler(train_dataset); accelerate's prepare (use_seedable_sampler,
on in TrainingArguments' accelerator_config by default) replaces it with SeedableRandomSampler, whose
epoch e is torch.randperm(n) from a generator seeded with data_seed + e, or, without data_seed, torch's
initial seed (the `seed` Trainer.__init__ set) + e. disable_shuffling: LF's trainers return a
SequentialSampler. The epoch's order is cut in consecutive micro-batches and rank r takes batches r,
r + W, ... (BatchSamplerShard): the stream layout our loaders already use.
"""

from __future__ import annotations

import numpy as np

from backends.common.data import MicroBatchLoader


def order_seed(cfg) -> int:
    """data_seed when given, else seed (what SeedableRandomSampler is seeded from)."""
    return int(cfg.data_seed if cfg.data_seed is not None else cfg.seed)


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """Epoch `epoch`'s permutation of n units (0..n-1 in order without shuffling)."""
    import torch

    if not shuffle:
        return np.arange(n, dtype=np.int64)
    generator = torch.Generator()
    generator.manual_seed(int(seed) + int(epoch))
    return torch.randperm(n, generator=generator).numpy().astype(np.int64)


class LFMicroBatchLoader(MicroBatchLoader):
    """The shared loader (padded / dynamic / packed units) in LLaMA-Factory's order (no length grouping,
    as HF Trainer's default)."""

    def _make_order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.n_units, epoch, self.seed, self.shuffle)
