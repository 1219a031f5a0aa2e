"""The sample order of backends.lf's loaders is LLaMA-Factory 0.9.5's: HF Trainer's RandomSampler as
accelerate prepares it (SeedableRandomSampler from data_seed, else seed, + the epoch), each epoch cut by
BatchSampler and dealt to ranks by BatchSamplerShard (partial and evened-out batches at the epoch's end),
an epoch's last optimizer step over the micro-batches left; disable_shuffling keeps the file order (LF's
SequentialSampler)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.lf.order import LFMicroBatchLoader, epoch_order, order_seed
from backends.lf.pairs import UnitLoader


class Samples:
    """n samples, sample u all tokens u + 1 (its first id names it)."""

    def __init__(self, n: int):
        self.lengths = [3 + u % 4 for u in range(n)]
        self.seq_len = 16

    def sample(self, u):
        ids = np.full(self.lengths[u], u + 1, dtype=np.int64)
        return ids, ids


def hf_batches(n: int, micro: int, world: int, rank: int, seed: int, data_seed: int | None, epochs: int):
    """The index batches rank `rank` gets per epoch from the DataLoader HF Trainer builds (RandomSampler) once
    accelerate has prepared it with TrainingArguments' default accelerator_config."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", seed=seed, data_seed=data_seed, report_to="none")
    assert args.accelerator_config.use_seedable_sampler and args.train_sampling_strategy == "random"
    torch.manual_seed(args.seed)  # Trainer.__init__'s set_seed(args.seed)
    data = list(range(n))
    loader = prepare_data_loader(DataLoader(data, sampler=RandomSampler(data), batch_size=micro),
                                 num_processes=world, process_index=rank, put_on_device=False,
                                 use_seedable_sampler=True, data_seed=args.data_seed)
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out += [b.tolist() for b in loader]
    return out


@pytest.mark.parametrize("n,world,data_seed", [(24, 1, None), (23, 1, None), (24, 2, None), (23, 2, 7), (7, 3, None),
                                               (2, 3, 5)])
def test_the_order_is_hf_trainers(n, world, data_seed):
    micro, seed, epochs = 3, 42, 2
    for rank in range(world):
        want = hf_batches(n, micro, world, rank, seed, data_seed, epochs)
        cfg = type("Cfg", (), {"seed": seed, "data_seed": data_seed})
        ours = LFMicroBatchLoader(Samples(n), mode="dynamic", micro_batch=micro, dp_rank=rank, dp_world=world,
                                  seed=order_seed(cfg), group_by_length=False)
        assert len(ours) * epochs == len(want)
        got = [(next(ours)["input_ids"][:, 0] - 1).tolist() for _ in range(len(want))]
        assert got == want
        pairs = UnitLoader(n, micro, dp_rank=rank, dp_world=world, seed=order_seed(cfg))
        assert [pairs.next_units() for _ in range(len(want))] == want


def test_an_epochs_last_step_takes_the_micro_batches_left():
    """HF Trainer (transformers 5): ceil(batches / accumulation) steps an epoch, the last over the rest."""
    from types import SimpleNamespace

    from backends.lf.recipe import LFRecipe, steps_per_epoch, total_steps

    cfg = SimpleNamespace(gradient_accumulation_steps=3, max_steps=-1, num_train_epochs=2.0)
    assert steps_per_epoch(cfg, 4) == 2 and total_steps(cfg, 4) == 4
    assert total_steps(SimpleNamespace(gradient_accumulation_steps=8, max_steps=-1, num_train_epochs=3.0), 1090) == 411
    recipe = LFRecipe(SimpleNamespace(gradient_accumulation_steps=3, cutoff_len=16, neat_packing=False))
    recipe.rt = SimpleNamespace(device=torch.device("cpu"))
    recipe.loader = LFMicroBatchLoader(Samples(10), mode="dynamic", micro_batch=3, seed=1, group_by_length=False)
    recipe._batches = iter(recipe.loader)
    steps = [[(mb["input_ids"][:, 0] - 1).tolist() for mb in recipe.next_micro_batches()] for _ in range(4)]
    assert [len(s) for s in steps] == [3, 1, 3, 1]
    assert sorted(u for mb in steps[0] + steps[1] for u in mb) == list(range(10))


def test_disable_shuffling_keeps_the_file_order():
    ours = LFMicroBatchLoader(Samples(10), mode="dynamic", micro_batch=4, seed=42, shuffle=False,
                              group_by_length=False)
    assert [(next(ours)["input_ids"][:, 0] - 1).tolist() for _ in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9],
                                                                                 [0, 1, 2, 3]]
    pairs = UnitLoader(5, 2, seed=42, shuffle=False)
    assert [pairs.next_units() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    assert not np.array_equal(epoch_order(10, 0, 42), np.arange(10))
    with pytest.raises(ValueError, match="order would differ"):
        UnitLoader(5, 2, seed=42).load_state_dict(pairs.state_dict())
    resumed = LFMicroBatchLoader(Samples(10), mode="dynamic", micro_batch=4, seed=42, shuffle=False,
                                 group_by_length=False)
    resumed.load_state_dict(ours.state_dict())
    assert (next(resumed)["input_ids"][:, 0] - 1).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="order would differ"):
        LFMicroBatchLoader(Samples(10), mode="dynamic", micro_batch=2, seed=42, shuffle=False,
                           group_by_length=False).load_state_dict(ours.state_dict())


def test_the_keys_reach_the_loaders(tmp_path):
    """The recipe's loader takes disable_shuffling and data_seed (else seed) from the training file."""
    from types import SimpleNamespace

    from backends.lf.recipe import LFRecipe, parse_command
    from tests.helpers.lf_runs import lf_file

    path = lf_file(tmp_path)
    rt = SimpleNamespace(is_main=True)
    par = SimpleNamespace(dp_rank=0, layout=SimpleNamespace(dp=1))
    for extra, shuffle, seed in (([], True, 42), (["disable_shuffling=true", "data_seed=7"], False, 7)):
        cfg = parse_command(["train", str(path), *extra])
        _, loader, _ = LFRecipe(cfg)._data(rt, par)
        assert (loader.shuffle, loader.seed) == (shuffle, seed)
        assert np.array_equal(loader.order(1), epoch_order(loader.n_units, 1, seed, shuffle))


def test_the_loss_denominator_counts_labels_before_the_shift():
    """HF Trainer (transformers 4.55 to 5.6, the range LLaMA-Factory 0.9.5 takes) divides a step's summed loss by
    num_items_in_batch, its labels != -100 counted before the model shifts them: a sample's first label counts
    though no position predicts it (train_on_prompt, pre-training), in padded and in packed micro-batches."""
    from backends.common.data.templates import IGNORE_INDEX

    class Labelled(Samples):
        def sample(self, u):  # even samples have their first label masked (a prompt token), odd ones do not
            ids, labels = super().sample(u)
            labels = labels.copy()
            if u % 2 == 0:
                labels[0] = IGNORE_INDEX
            return ids, labels

    data = Labelled(6)
    loader = LFMicroBatchLoader(data, mode="dynamic", micro_batch=2, seq_len=16, seed=1, shuffle=False,
                                group_by_length=False)
    mb = next(loader)
    shifted = int((mb["labels"] != IGNORE_INDEX).sum())
    assert int(mb["n_tokens"]) == sum(int((data.sample(u)[1] != IGNORE_INDEX).sum()) for u in (0, 1))
    assert int(mb["n_tokens"]) == shifted + 1  # sample 1's first label
    # a packed row (LF's packing) is shifted whole: only the row's first label goes unpredicted
    from backends.lf.packing import RowLoader, Rows, packed_row

    rows = Rows([packed_row([data.sample(1), data.sample(2), data.sample(3)], 32, 0, neat=False)], "packed", 3)
    mb = next(RowLoader(rows, 1, neat=False, shuffle=False))
    unshifted = sum(int((data.sample(u)[1] != IGNORE_INDEX).sum()) for u in (1, 2, 3))
    assert int(mb["n_tokens"]) == unshifted == int((mb["labels"] != IGNORE_INDEX).sum()) + 1