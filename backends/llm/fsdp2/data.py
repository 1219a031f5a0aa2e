"""The FSDP2 backend's data (data_manager_type lf): data.dataset resolved through dataset_dir's
dataset_info.json (backends.common.data.dataset_info), encoded with the template into the shared cache,
and batched as its DataFactory batches: torch's DistributedSampler (seed, shuffle unless
disable_shuffling, drop_last = dataloader_drop_last) dealing the samples to the ranks, a DataLoader of
per_device_train_batch_size over each rank's share, padded to a multiple of 8 (DataCollatorForSeq2Seq).
"""

from __future__ import annotations

import numpy as np

from backends.common.data import MicroBatchLoader
from backends.common.data.loader import round_up
from backends.common.data.templates import IGNORE_INDEX


class SamplerBatches(MicroBatchLoader):
    """This rank's micro-batches epoch by epoch; `position` counts those taken. n_tokens is the trainer's
    num_items_in_batch share: the labels != -100 before the shift (a sample's first label counts too)."""

    def __init__(self, dataset, *, micro_batch: int, dp_rank: int, dp_world: int, seed: int, shuffle: bool,
                 drop_last: bool, pad_id: int, seq_len: int):
        super().__init__(dataset, mode="dynamic", micro_batch=micro_batch, seq_len=seq_len, dp_rank=dp_rank,
                         dp_world=dp_world, seed=seed, shuffle=shuffle, pad_id=pad_id, group_by_length=False)
        from torch.utils.data import DistributedSampler

        self.drop_last = bool(drop_last)
        self.sampler = DistributedSampler(range(self.n_units), num_replicas=dp_world, rank=dp_rank, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last)
        share = len(self.sampler)
        self.per_epoch = share // self.micro_batch if drop_last else -(-share // self.micro_batch)
        if self.per_epoch == 0:
            raise ValueError(f"training.per_device_train_batch_size {micro_batch}: each of the {dp_world} ranks gets "
                             f"{share} samples, and dataloader_drop_last drops the partial batch: nothing to train")
        self._plan: tuple[int, list[list[int]]] | None = None

    def __len__(self) -> int:
        return self.per_epoch

    @property
    def epoch(self) -> int:
        return self.position // self.per_epoch

    def left_in_epoch(self) -> int:
        return self.per_epoch - self.position % self.per_epoch

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._plan is None or self._plan[0] != epoch:
            self.sampler.set_epoch(epoch)
            share = list(self.sampler)
            self._plan = (epoch, [share[i:i + self.micro_batch] for i in range(0, len(share), self.micro_batch)])
        return self._plan[1]

    def __next__(self) -> dict:
        import torch

        epoch, k = divmod(self.position, self.per_epoch)
        self.position += 1
        samples = [self.dataset.sample(u) for u in self._batches(epoch)[k]]
        out = self._rows(samples, round_up(max(len(ids) for ids, _ in samples), self.pad_to_multiple_of))
        out["n_tokens"] = torch.tensor(sum(int((np.asarray(y) != IGNORE_INDEX).sum()) for _, y in samples),
                                       dtype=torch.int64)
        return out

    def state_dict(self) -> dict:
        return {"position": int(self.position), "n_units": int(self.n_units), "seed": self.seed,
                "shuffle": self.shuffle, "micro_batch": self.micro_batch, "dp_world": self.dp_world,
                "drop_last": self.drop_last, "batching": "distributed-sampler"}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        changed = [k for k in mine if k != "position" and state.get(k) != mine[k]]
        if changed:
            raise ValueError(f"loader state was saved with {', '.join(f'{k}={state.get(k)!r}' for k in changed)}; "
                             "this run differs, so the sample order would too")
        self.position = int(state["position"])
