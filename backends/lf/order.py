"""The order LLaMA-Factory 0.9.5 trains samples in, under HF Trainer (transformers 5) and accelerate.

Trainer._get_train_sampler gives RandomSampler(train_dataset); accelerate's prepare (use_seedable_sampler,
on in TrainingArguments' accelerator_config by default) replaces it with SeedableRandomSampler, whose
epoch e is torch.randperm(n) from a generator seeded with data_seed + e, or, without data_seed, torch's
initial seed (the `seed` Trainer.__init__ set) + e. disable_shuffling: LF's trainers return a
SequentialSampler. Each epoch is cut by torch's BatchSampler (the last micro-batch partial) and, on more
than one rank, dealt by accelerate's BatchSamplerShard (rank r takes batches r, r + W, ...; even_batches
completes the last batch and adds batches from the epoch's first ones until every rank has as many).
An epoch has ceil(batches / gradient_accumulation_steps) optimizer steps, its last one over what is left.
"""

from __future__ import annotations

import numpy as np

from backends.common.data import MicroBatchLoader
from backends.common.data.loader import round_up
from backends.common.data.templates import IGNORE_INDEX


def num_items(label_rows) -> int:
    """HF Trainer's num_items_in_batch, the loss denominator, for these samples' labels (before the shift): every
    label != -100, a sample's first one too, which no position predicts (train_on_prompt, pre-training)."""
    return sum(int((np.asarray(y) != IGNORE_INDEX).sum()) for y in label_rows)


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


def epoch_batches(order: np.ndarray, micro: int, world: int) -> list[np.ndarray]:
    """An epoch's micro-batches in the order the ranks take them (rank r: batches[r::world])."""
    batches = [order[i:i + micro] for i in range(0, len(order), micro)]
    if world == 1:
        return batches
    initial = np.concatenate(batches[:world])  # BatchSamplerShard's initial_data
    while len(initial) < world * micro:
        initial = np.concatenate([initial, initial])
    cycle = 0
    if len(batches[-1]) < micro:
        cycle = micro - len(batches[-1])
        batches[-1] = np.concatenate([batches[-1], initial[:cycle]])
    while len(batches) % world:
        batches.append(initial[cycle:cycle + micro])
        cycle += micro
    return batches


class EpochBatches:
    """This rank's micro-batches epoch by epoch; `position` counts the micro-batches it has taken."""

    def _setup(self, n_units: int, micro: int, rank: int, world: int, seed: int, shuffle: bool) -> None:
        self._n, self._micro, self._rank, self._world = n_units, micro, rank, world
        self._seed, self._shuffle = seed, shuffle
        self._plans: dict[int, list[np.ndarray]] = {}
        self.position = 0

    @property
    def per_epoch(self) -> int:
        """Micro-batches per epoch on each rank (as len() of HF's prepared DataLoader)."""
        return -(-(-(-self._n // self._micro)) // self._world)

    def left_in_epoch(self) -> int:
        return self.per_epoch - self.position % self.per_epoch

    def take(self) -> list[int]:
        epoch, k = divmod(self.position, self.per_epoch)
        if epoch not in self._plans:
            self._plans = {epoch: epoch_batches(epoch_order(self._n, epoch, self._seed, self._shuffle), self._micro,
                                                self._world)}
        self.position += 1
        return self._plans[epoch][k * self._world + self._rank].tolist()

    def _check_state(self, state: dict) -> None:
        saved = tuple(state.get(k) for k in ("n_units", "seed", "shuffle", "micro_batch", "dp_world", "batching"))
        mine = (self._n, self._seed, self._shuffle, self._micro, self._world, "lf")
        if saved != mine:
            raise ValueError(f"loader state was saved with (units, seed, shuffle, micro_batch, dp_world, batching) "
                             f"{saved}, this run has {mine}: the order would differ")

    def _state(self) -> dict:
        return {"position": int(self.position), "n_units": self._n, "seed": self._seed, "shuffle": self._shuffle,
                "micro_batch": self._micro, "dp_world": self._world, "batching": "lf"}


class LFMicroBatchLoader(EpochBatches, MicroBatchLoader):
    """The shared loader's padded / dynamic samples batched as HF Trainer batches them for LLaMA-Factory (no
    length grouping; LLaMA-Factory's packed rows are backends.lf.packing's)."""

    def __init__(self, dataset, **kw):
        if kw.get("mode") == "packed":
            raise ValueError("LLaMA-Factory's packed rows come from backends.lf.packing.RowLoader")
        MicroBatchLoader.__init__(self, dataset, **kw)
        self._setup(self.n_units, self.micro_batch, self.dp_rank, self.dp_world, self.seed, self.shuffle)

    def _make_order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.n_units, epoch, self.seed, self.shuffle)

    def __len__(self) -> int:
        return self.per_epoch

    @property
    def epoch(self) -> int:
        return self.position // self.per_epoch

    def __next__(self) -> dict:
        import torch

        units = self.take()
        samples = [self.dataset.sample(u) for u in units]
        width = self.seq_len if self.mode == "padded" else \
            round_up(max(len(ids) for ids, _ in samples), self.pad_to_multiple_of)
        out = self._rows(samples, width)
        out["n_tokens"] = torch.tensor(num_items(y for _, y in samples), dtype=torch.int64)
        return out

    def state_dict(self) -> dict:
        return {**self._state(), "mode": self.mode, "seq_len": self.seq_len, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self._check_state(state)
        for key in ("mode", "seq_len"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"loader state was saved with {key}={state.get(key)!r}, this loader has "
                                 f"{getattr(self, key)!r}: the order would differ")
        self.position = int(state["position"])
