"""VeRL's DAPO recipe rounds (v0.7.0 recipe/dapo/dapo_ray_trainer.py) on the RL recipe's own collection code, its
generator replaced by a scripted one (no model): which prompts each round rolls out, which groups are kept, what
the step trains, and when the recipe stops or fails.

The scripted rollout: prompt row r's two responses are r's token once (sample 0) and eight times (sample 1). The
reward function scores a "mixed" row's long response 1 and its short one 0 (a group that differs), any other row's
responses 1 (a uniform acc); the overlong buffer (4 of 8 tokens) takes 1 off every long response, so the reward
itself differs in every group: only a filter by the recipe's metric acc keeps the mixed rows alone."""

from types import SimpleNamespace

import pytest
import torch

from backends.rl import dapo_rounds
from backends.rl.config import RLConfig
from backends.rl.recipe import RLRecipe
from backends.rl.rewards import Scorer

ROWS = 24
MIXED = [r for r in range(ROWS) if r % 3 == 0]  # 0, 3, 6, ...: two of every gen batch of 6 rows


def _reward(data_source, response, ground_truth, extra_info=None):
    return float(response.endswith(":8")) if ground_truth == "mixed" else 1.0


def _recipe(**settings) -> RLRecipe:
    values = dict(model_path="scripted", algorithm="dapo", n=2, train_batch_size=3, mini_batch_size=3,
                  micro_batch_size=2, filter_groups=True, gen_batch_size=6, filter_metric="acc", max_gen_rounds=0,
                  total_steps=3, total_epochs=1, overlong_buffer=4, max_new_tokens=8,
                  records=[{"prompt_ids": [r], "ground_truth": "mixed" if r in MIXED else "same",
                            "data_source": "scripted"} for r in range(ROWS)])
    recipe = RLRecipe(RLConfig(**{**values, **settings}))
    c = recipe.cfg
    recipe.rt = SimpleNamespace(device=torch.device("cpu"), is_main=True)
    recipe.gen_dp, recipe.gen_rank, recipe.gen_group, recipe.vllm, recipe.vision = 1, 0, None, None, None
    recipe.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: f"{ids[0]}:{len(ids)}")
    recipe.scorer = Scorer(function=_reward, overlong_buffer=c.overlong_buffer, max_response_length=c.max_new_tokens)
    recipe.rolled_out = []  # the prompt rows of each round

    def generate(prompts, ids, seed, *, rows, n, **sampling):
        recipe.rolled_out.append(rows)
        return [[p[0]] * (1 if j == 0 else 8) for p in prompts for j in range(n)], None

    recipe.generate = generate
    return recipe


def _trained_rows(batch) -> list[int]:
    return batch.extra["record"][::2].tolist()


def test_rounds_of_gen_batch_size_keep_the_groups_that_differ_and_drop_the_surplus():
    """Step 1: two rounds of 6 rows (0-5: 0 and 3 kept; 6-11: 6 and 9), 4 >= 3 kept, the surplus (9) dropped; step 2
    starts at row 12 (the surplus is not carried over) and takes two rounds again. train/num_gen_batches counts them."""
    recipe = _recipe()
    batch, metrics = recipe._collect(0)
    assert recipe.rolled_out == [list(range(0, 6)), list(range(6, 12))]
    assert _trained_rows(batch) == [0, 3, 6] and batch.groups.tolist() == [0, 0, 1, 1, 2, 2]
    assert (metrics["train/num_gen_batches"], metrics["kept_groups"]) == (2.0, 4.0)
    assert batch.scores.tolist() == [0.0, 0.0] * 3  # each kept group: acc 0 and 1, the long one less 1
    batch, metrics = recipe._collect(1)
    assert recipe.rolled_out[2:] == [list(range(12, 18)), list(range(18, 24))]
    assert _trained_rows(batch) == [12, 15, 18] and metrics["train/num_gen_batches"] == 2.0


def test_max_num_gen_batches_exceeded_is_the_recipe_s_error():
    with pytest.raises(ValueError, match=r"num_gen_batches=1 >= max_num_gen_batches=1\. Generated too many"):
        _recipe(max_gen_rounds=1)._collect(0)


def test_groups_are_kept_by_numpy_s_std_and_no_filter_is_one_round():
    """A group is kept where np.std of its values is above 0 (three 0.1s: 1.4e-17, kept as the recipe keeps it) or
    it has one response; without filter_groups one round of gen_batch_size (= train_batch_size, the reader refuses
    another) is the batch."""
    values = torch.tensor([1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.0, 1.0, 0.0], dtype=torch.float64)
    assert dapo_rounds.kept_groups(values, 3).tolist() == [False, True, True]
    assert dapo_rounds.kept_groups(values[:2], 1).tolist() == [True, True]
    recipe = _recipe(filter_groups=False, gen_batch_size=3)
    batch, metrics = recipe._collect(0)
    assert recipe.rolled_out == [[0, 1, 2]] and _trained_rows(batch) == [0, 1, 2]
    assert metrics["train/num_gen_batches"] == 1.0


def test_the_loader_runs_out_as_the_recipe_s():
    """1 epoch of 24 rows is 4 batches of 6: two steps of two rounds use them up; the recipe's loop ends there
    (should_stop), and a step that would need a fifth batch is refused by name. An epoch is whole batches."""
    recipe = _recipe()
    recipe._collect(0)
    recipe.steps_done = 1
    assert recipe.should_stop() is None
    recipe._collect(1)
    recipe.steps_done = 2
    assert "data loader is exhausted" in recipe.should_stop()
    with pytest.raises(ValueError, match="the data loader ran out .* VeRL's DAPO recipe ends its training loop"):
        recipe._collect(2)
    # 26 rows, 2 epochs: each epoch's last 2 rows are dropped (drop_last); step 3 opens epoch 2 at row 0
    recipe = _recipe(total_epochs=2)
    recipe.cfg.records += [dict(recipe.cfg.records[1]), dict(recipe.cfg.records[1])]
    for step in range(3):
        recipe._collect(step)
    assert recipe.rolled_out[4] == list(range(6))


def test_the_filter_metric_is_a_reward_info():
    """acc: a float reward's value (VeRL's DAPO reward manager); seq_reward: the reward; a name the reward does not
    give is refused, naming what it gives."""
    infos = [{"reward": 0.5, "acc": 1.0, "pred": "7"}]
    assert dapo_rounds.metric_values(infos, "acc") == [1.0]
    assert dapo_rounds.metric_values(infos, "seq_reward") == [0.5]
    with pytest.raises(ValueError, match=r"'score' is not a number among the reward's infos \(acc; seq_reward"):
        dapo_rounds.metric_values(infos, "score")
    with pytest.raises(ValueError, match="'pred' is not a number"):
        dapo_rounds.metric_values(infos, "pred")
