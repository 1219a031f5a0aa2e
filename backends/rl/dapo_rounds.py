"""The generation rounds of VeRL's DAPO recipe (v0.7.0 recipe/dapo/dapo_ray_trainer.py, RayDAPOTrainer.fit), for a
run handed the recipe's config (`python3 -m recipe.dapo.main_dapo`): each round rolls out the data loader's next
batch of data.gen_batch_size prompts; with algorithm.filter_groups a prompt's group is kept when the std of its
responses' filter metric is above 0 (or it has one response), kept groups gather over rounds until
data.train_batch_size prompts, and the surplus past the train batch is dropped. A step that needs more than
max_num_gen_batches rounds (> 0) is an error, as the recipe's ValueError. Logged: train/num_gen_batches.

VeRL 0.9.1's main_ppo reads the same keys otherwise (recipe.py _collect: rounds of train_batch_size prompts)."""

from __future__ import annotations

import numpy as np
import torch

from .batches import Rollouts, step_metrics

# filter metrics that are the response's reward itself (token_level_scores / token_level_rewards summed)
REWARD_METRICS = ("seq_reward", "seq_final_reward")


def metric_values(infos: list[dict], metric: str) -> list[float]:
    """Each response's filter metric: its reward (seq_reward, seq_final_reward) or the reward info of that name
    (the reward manager's extra infos: a rule reward's acc, a function's dict keys)."""
    key = "reward" if metric in REWARD_METRICS else metric
    out = []
    for info in infos:
        if key not in info or isinstance(info[key], str):
            have = sorted(k for k, v in info.items() if k != "reward" and not isinstance(v, str))
            raise ValueError(f"algorithm.filter_groups.metric: {metric!r} is not a number among the reward's infos "
                             f"({', '.join(have) or 'none'}; seq_reward / seq_final_reward: the reward); VeRL's DAPO "
                             "recipe filters the groups by it")
        out.append(float(info[key]))
    return out


def kept_groups(values: torch.Tensor, n: int) -> torch.Tensor:
    """[groups] True for each group of n responses the recipe keeps: np.std of its metric values above 0, or a
    single response (computed as the recipe computes it, np.std over the values)."""
    groups = values.detach().cpu().double().numpy().reshape(-1, n)
    return torch.tensor([n == 1 or float(np.std(g)) > 0 for g in groups], dtype=torch.bool, device=values.device)


def loader_rows(records: int, gen_batch_size: int) -> int:
    """Prompts the recipe's data loader yields per epoch (batches of gen_batch_size, drop_last)."""
    return records - records % gen_batch_size


def collect(recipe, step: int) -> tuple[Rollouts, dict]:
    """One step's batch as the recipe gathers it -> (the batch, the same on every rank, group indices 0..; metrics)."""
    c = recipe.cfg
    available = c.total_epochs * loader_rows(len(c.records), c.gen_batch_size)
    parts, scores, num_gen_batches, kept = [], [], 0, 0
    while True:
        if recipe.cursor + c.gen_batch_size > available:
            raise ValueError(f"the data loader ran out (trainer.total_epochs {c.total_epochs} x "
                             f"{available // c.total_epochs} prompts) after {num_gen_batches} generation batches of "
                             f"step {step + 1}, {kept} of data.train_batch_size {c.train_batch_size} prompts kept: "
                             "VeRL's DAPO recipe ends its training loop there without that step, which this engine "
                             "does not; raise trainer.total_epochs or lower trainer.total_training_steps")
        r = recipe._round(step, num_gen_batches, c.gen_batch_size)
        num_gen_batches += 1
        scores.append(r.scores)
        if not c.filter_groups:  # the generation batch is the train batch (gen_batch_size == train_batch_size)
            parts.append(r.with_groups(0, c.n))
            kept = len(r) // c.n
            break
        keep = kept_groups(r.extra["filter_metric"], c.n)
        parts.append(r.select(keep.repeat_interleave(c.n)).with_groups(kept, c.n))
        kept += int(keep.sum())
        if kept >= c.train_batch_size:
            break
        if 0 < c.max_gen_rounds <= num_gen_batches:
            raise ValueError(f"num_gen_batches={num_gen_batches} >= max_num_gen_batches={c.max_gen_rounds}. Generated "
                             "too many. Please check if your data are too difficult. You could also try set "
                             "max_num_gen_batches=0 to enable endless trials. (VeRL's DAPO recipe; step "
                             f"{step + 1}: {kept} of data.train_batch_size {c.train_batch_size} prompts kept)")
    batch = Rollouts.cat(parts)
    batch = batch.select(torch.arange(min(len(batch), c.train_batch_size * c.n), device=batch.scores.device))
    metrics = step_metrics(batch, scores, num_gen_batches, kept)
    metrics["train/num_gen_batches"] = float(num_gen_batches)  # RayDAPOTrainer.fit's own metric
    return batch, metrics


def data_left(recipe) -> str | None:
    """Why the recipe's training loop ends after a step: its data loader has no batch left."""
    c = recipe.cfg
    per_epoch = loader_rows(len(c.records), c.gen_batch_size)
    if recipe.cursor + c.gen_batch_size > c.total_epochs * per_epoch:
        batches = per_epoch // c.gen_batch_size
        return (f"the data loader is exhausted (trainer.total_epochs {c.total_epochs} x {batches} batches of "
                f"data.gen_batch_size {c.gen_batch_size}): VeRL's DAPO recipe ends its training loop")
    return None
