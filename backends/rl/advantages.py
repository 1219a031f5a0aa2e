"""A step's advantages from its rollouts: the token rewards (the score on each response's last token, the KL
penalty per token when it is in the reward), then GRPO / DAPO's group-normalised outcome advantages or PPO's
GAE whitened over the whole global batch (mean and variance all-reduced over the dp ranks)."""

from __future__ import annotations

import torch

from backends.common.distributed import all_reduce_sum

from . import algos
from .batches import Rollouts
from .config import RLConfig


def token_rewards(r: Rollouts, index: torch.Tensor, cfg: RLConfig, kl_in_reward: bool) -> torch.Tensor:
    """[rows, R]: the score on each response's last token, minus the KL penalty per token when the config puts
    it in the reward (and there is a reference)."""
    lens = r.response_lens[index]
    rewards = torch.zeros(len(index), r.responses.shape[1], device=index.device)
    rewards[torch.arange(len(index), device=index.device), (lens - 1).clamp(min=0)] = r.scores[index].float()
    if cfg.use_kl_in_reward and kl_in_reward:
        kl = algos.kl_penalty(r.extra["old_logp"][index], r.extra["ref_logp"][index], cfg.kl_penalty)
        rewards = rewards - cfg.kl_in_reward_coef * kl * r.response_mask(index)
    return rewards


def compute(r: Rollouts, mine: list[int], cfg: RLConfig, group, kl_in_reward: bool) -> None:
    """r.extra["advantages"] (and PPO's "returns"), [N, R], on this rank's rows `mine`; `group`: the dp ranks."""
    index = torch.tensor(mine, dtype=torch.long, device=r.responses.device)
    mask = r.response_mask(index)
    rewards = token_rewards(r, index, cfg, kl_in_reward)
    full = torch.zeros(r.responses.shape, device=index.device)
    if cfg.algorithm in ("grpo", "dapo"):
        # outcome advantages need each response's summed reward: gather them into the global vector
        totals = torch.zeros(len(r), dtype=torch.float64, device=index.device)
        totals[index] = rewards.double().sum(-1)
        totals = all_reduce_sum(totals, group).float()
        adv, _ = algos.grpo_advantages(totals[:, None], torch.ones_like(totals)[:, None], r.groups,
                                       norm_by_std=cfg.norm_adv_by_std)
        r.extra["advantages"] = full.index_put((index,), adv[index] * mask)
        return
    adv, ret = algos.gae(rewards, r.extra["values"][index].float(), mask, cfg.gamma, cfg.lam)
    valid = adv.double()[mask]
    stats = torch.stack([torch.tensor(float(valid.numel()), dtype=torch.float64, device=index.device),
                         valid.sum(), (valid ** 2).sum()])
    n, total, squares = all_reduce_sum(stats, group).tolist()
    if n < 2:
        raise ValueError("PPO whitens the advantages over the batch: it needs at least two response tokens")
    mean = total / n
    var = (squares / n - mean * mean) * n / (n - 1)
    r.extra["advantages"] = full.index_put((index,), (adv - mean) * (var + 1e-8) ** -0.5 * mask)
    r.extra["returns"] = full.index_put((index,), ret * mask)
