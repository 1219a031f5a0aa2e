"""Micro-batches for the trainers: padded, packed or dynamic, sharded over data-parallel ranks.

The batch contract (every mode; torch tensors)
----------------------------------------------
  input_ids     int64   token ids
  labels        int64   ALREADY SHIFTED: labels[..., t] is the target of input t (the token at
                        t+1 of the same document), -100 where there is none: prompt tokens, the
                        last token of every document (so nothing predicts across a boundary),
                        padding. The trainer must NOT shift again: loss = CE(logits[t], labels[t]).
  position_ids  int64   0, 1, 2, ... restarting at every document (and at each row's padding)
  n_tokens      int64   0-d: the number of labels != -100 (the token-mean loss denominator)
  cu_seqlens    int32   packed only, see below

  padded   input_ids/labels/position_ids [micro, seq_len]: one sample a row, right-padded with
           pad_id (labels -100). Causal attention needs no mask: real tokens never see the pads.
  dynamic  [micro, L], L = the batch's longest sample rounded up to pad_to_multiple_of (8), else
           as padded. Length-grouped: each epoch's shuffled order is cut in mega-batches of
           group_factor (50) x micro x dp samples, sorted by length inside, cut in global batches,
           and the global batches are shuffled (a partial one stays last); shuffle=False keeps
           file order without grouping, as does group_by_length=False (HF Trainer's default:
           then a step's samples do not depend on micro or dp_world).
  packed   input_ids/labels/position_ids [1, micro * seq_len]: the micro rows of the best-fit-
           decreasing packing (packed once, deterministic) laid end to end. cu_seqlens int32
           [n_segments + 1] holds the offsets of every document in that flat stream, 0 ..
           micro * seq_len, with each row's padding tail as a segment of its own; so it is the
           kernels' varlen `cu_seqlens` for q/k/v as [T, H, D] with T = micro * seq_len, row
           boundaries are always segment boundaries, and the block-diagonal causal mask is
           backends.kernels.masks.packed_allowed(cu_seqlens, T, causal=True, window=None).

Order and sharding
------------------
Units are samples (padded, dynamic) or packed rows. Epoch e's order is a permutation drawn from
numpy's PCG64 seeded with (seed, e) (identity when shuffle=False). The epochs are concatenated into
one endless stream; global micro-step k covers stream positions [k*G, (k+1)*G), G = micro x dp_world,
and dp rank r takes [k*G + r*micro, k*G + (r+1)*micro). So the ranks' batches are disjoint and
together cover every unit of every epoch exactly once, nothing is dropped (a global batch may span
an epoch boundary), and `epoch` counts the epochs. `state_dict()` is the stream position (plus
what the order depends on); a loader built with the same arguments and `load_state_dict(state)`
yields exactly the batches the original would have yielded next. In padded / packed mode the
position does not depend on micro or dp_world, so a resume may change them.

MindSpeed-LLM's order instead (index=, sampler=; mtf_order.py): the units are read from a fixed index
(DecoderPackedMTFDataset's shuffle index) by Megatron's sampler, single or cyclic; packed mode then takes
`rows` as given (the rows MindSpeed-LLM's preprocessor wrote) instead of packing them here.
"""

from __future__ import annotations

import numpy as np

from .mtf_order import MegatronSampler
from .packing import best_fit_decreasing, pack_stats
from .templates import IGNORE_INDEX

MODES = ("padded", "packed", "dynamic")


def shift_labels(labels: np.ndarray) -> np.ndarray:
    """Unshifted per-token labels -> targets of each input position (last one -100)."""
    out = np.full(len(labels), IGNORE_INDEX, dtype=np.int64)
    if len(labels) > 1:
        out[:-1] = labels[1:]
    return out


def round_up(n: int, multiple: int) -> int:
    if multiple <= 1:
        return n
    return -(-n // multiple) * multiple


class MicroBatchLoader:
    def __init__(self, dataset, mode: str = "packed", micro_batch: int = 1, seq_len: int | None = None,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0, shuffle: bool = True, pad_id: int = 0,
                 pad_to_multiple_of: int = 8, group_factor: int = 50, group_by_length: bool = True,
                 rows: list[list[int]] | None = None, index: np.ndarray | None = None, sampler: str = "single"):
        if mode not in MODES:
            raise ValueError(f"unknown batch mode {mode!r}; one of {', '.join(MODES)}")
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        if not (dp_world >= 1 and 0 <= dp_rank < dp_world):
            raise ValueError(f"dp_rank {dp_rank} is not in 0..{dp_world - 1}")
        if hasattr(dataset, "open") and not hasattr(dataset, "sample"):   # a DatasetHandle
            dataset = dataset.open(seq_len)
        self.dataset = dataset
        self.seq_len = int(seq_len or dataset.seq_len)
        self.lengths = np.asarray(dataset.lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise ValueError("the dataset has no samples")
        if int(self.lengths.max()) > self.seq_len:
            raise ValueError(f"samples of up to {int(self.lengths.max())} tokens exceed seq_len {self.seq_len}; "
                             f"open the dataset with this seq_len")
        self.mode, self.micro_batch, self.dp_rank, self.dp_world = mode, int(micro_batch), int(dp_rank), int(dp_world)
        self.seed, self.shuffle, self.pad_id = int(seed), bool(shuffle), int(pad_id)
        self.pad_to_multiple_of, self.group_factor = int(pad_to_multiple_of), int(group_factor)
        self.group_by_length = bool(group_by_length)
        if mode == "packed":
            self.rows = list(rows) if rows is not None else best_fit_decreasing(self.lengths, self.seq_len)
            self.packing = pack_stats(self.rows, self.lengths, self.seq_len)
            self.n_units = len(self.rows)
        else:
            self.rows, self.packing = None, None
            self.n_units = len(self.lengths)
        self.position = 0
        self._orders: dict[int, np.ndarray] = {}
        self.index, self.sampler = None, None
        if index is not None:
            self.index = np.asarray(index, dtype=np.int64)
            if len(self.index) and not 0 <= int(self.index.min()) <= int(self.index.max()) < self.n_units:
                raise ValueError(f"the index names units outside 0..{self.n_units - 1}")
            self.sampler = MegatronSampler(sampler, len(self.index), self.micro_batch, self.dp_rank, self.dp_world)

    # ------------------------------------------------------------------------------------ order
    @property
    def global_micro(self) -> int:
        return self.micro_batch * self.dp_world

    @property
    def epoch(self) -> int:
        """The epoch of the next unit to be read."""
        return self.position // self.n_units

    def __len__(self) -> int:
        """Micro-batches per epoch on each rank (rounded up)."""
        return -(-self.n_units // self.global_micro)

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
            self._orders[epoch] = self._make_order(epoch)
        return self._orders[epoch]

    def _make_order(self, epoch: int) -> np.ndarray:
        n = self.n_units
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n).astype(np.int64)
        if self.mode != "dynamic" or not self.group_by_length:
            return order
        g = self.global_micro
        mega = max(1, self.group_factor) * g
        full, partial = [], []
        for s in range(0, n, mega):
            block = order[s:s + mega]
            block = block[np.argsort(-self.lengths[block], kind="stable")]
            for j in range(0, len(block), g):
                (full if len(block[j:j + g]) == g else partial).append(block[j:j + g])
        perm = rng.permutation(len(full))
        return np.concatenate([full[i] for i in perm] + partial).astype(np.int64)

    def units_at(self, start: int, count: int) -> list[int]:
        """Units at stream positions [start, start + count)."""
        out = []
        pos = start
        while len(out) < count:
            epoch, offset = divmod(pos, self.n_units)
            take = min(count - len(out), self.n_units - offset)
            out.extend(self.order(epoch)[offset:offset + take].tolist())
            pos += take
        return out

    # ---------------------------------------------------------------------------------- batches
    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.index is None:
            units = self.units_at(self.position + self.dp_rank * self.micro_batch, self.micro_batch)
        else:
            units = self.index[self.sampler.positions(self.position // self.global_micro)].tolist()
        self.position += self.global_micro
        if self.mode == "packed":
            return self._packed(units)
        if self.mode == "padded":
            return self._rows([self.dataset.sample(u) for u in units], self.seq_len)
        samples = [self.dataset.sample(u) for u in units]
        longest = max(len(ids) for ids, _ in samples)
        return self._rows(samples, round_up(longest, self.pad_to_multiple_of))

    def _rows(self, samples, width: int) -> dict:
        import torch

        b = len(samples)
        ids = np.full((b, width), self.pad_id, dtype=np.int64)
        labels = np.full((b, width), IGNORE_INDEX, dtype=np.int64)
        for r, (x, y) in enumerate(samples):
            ids[r, :len(x)] = x
            labels[r, :len(x)] = shift_labels(y)
        pos = np.broadcast_to(np.arange(width, dtype=np.int64), (b, width)).copy()
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos),
                "n_tokens": torch.tensor(int((labels != IGNORE_INDEX).sum()), dtype=torch.int64),
                "n_input": torch.tensor(sum(len(x) for x, _ in samples), dtype=torch.int64)}

    def _packed(self, units) -> dict:
        import torch

        s = self.seq_len
        total = len(units) * s
        ids = np.full(total, self.pad_id, dtype=np.int64)
        labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros(total, dtype=np.int64)
        cu = [0]
        real = 0
        for r, unit in enumerate(units):
            at = r * s
            for sample in self.rows[unit]:
                x, y = self.dataset.sample(sample)
                n = len(x)
                ids[at:at + n] = x
                labels[at:at + n] = shift_labels(y)
                pos[at:at + n] = np.arange(n)
                at += n
                real += n
                cu.append(at)
            end = (r + 1) * s
            if at < end:                    # the row's padding: a segment of its own
                pos[at:end] = np.arange(end - at)
                cu.append(end)
        return {"input_ids": torch.from_numpy(ids)[None], "labels": torch.from_numpy(labels)[None],
                "position_ids": torch.from_numpy(pos)[None],
                "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
                "n_tokens": torch.tensor(int((labels != IGNORE_INDEX).sum()), dtype=torch.int64),
                "n_input": torch.tensor(real, dtype=torch.int64)}

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"position": int(self.position), "epoch": int(self.epoch), "seed": self.seed,
                "shuffle": self.shuffle, "mode": self.mode, "n_units": int(self.n_units),
                "micro_batch": self.micro_batch, "dp_world": self.dp_world, "seq_len": self.seq_len,
                "order": self._order_kind()}

    def _order_kind(self) -> str:
        if self.sampler is None:
            return "epochs"
        return f"cyclic over {self.sampler.total}" if self.sampler.kind == "cyclic" else "single"

    def load_state_dict(self, state: dict) -> None:
        for key in ("mode", "seed", "shuffle", "n_units", "seq_len", "order"):
            if key in state and state[key] != self.state_dict()[key]:
                raise ValueError(f"loader state was saved with {key}={state[key]!r}, this loader has "
                                 f"{self.state_dict()[key]!r}: the sample order would differ, so it cannot resume "
                                 f"exactly (same data, seq_len, mode, seed and shuffle are needed)")
        if self.mode == "dynamic" and self.shuffle:
            for key in ("micro_batch", "dp_world"):
                if key in state and state[key] != getattr(self, key):
                    raise ValueError(f"dynamic batches are grouped by micro_batch x dp_world: the state has "
                                     f"{key}={state[key]}, this loader {getattr(self, key)}")
        self.position = int(state["position"])

    @property
    def stats(self) -> dict:
        out = {"mode": self.mode, "units": self.n_units, "samples": int(len(self.lengths)),
               "micro_batches_per_epoch": len(self)}
        if self.packing is not None:
            out["packing"] = self.packing.as_dict()
        return out
