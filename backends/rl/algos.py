"""The RL algorithms with VeRL 0.9.1's semantics (verl/trainer/ppo/core_algos.py).

Tensors are [batch, response_len]; `response_mask` is 1 on the real response tokens, 0 on padding.
`index` (any sequence of hashables, one per row) groups the responses sampled from one prompt.

    grpo_advantages   group-normalised outcome advantages (GRPO; norm_by_std=False is Dr.GRPO)
    gae_advantages    generalised advantage estimation, advantages whitened over the mask (PPO)
    policy_loss       dual-clip PPO surrogate with clip-higher; clip fraction and approx KL
    kl_penalty        k1 ("kl"), "abs", k2 ("mse"), k3 ("low_var_kl", clamped to [-10, 10])
    agg_loss          token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm
    value_loss        clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2)

Global aggregation: `agg_loss` (and the losses built on it) take the *global* token count
(`global_tokens`) or sequence count (`global_seqs`) of the mini-batch across micro-batches and
ranks, so that summing each micro-batch's result gives the mean over the whole mini-batch
(VeRL's batch_num_tokens / global_batch_size). Without them, the local counts are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of values where mask is set (NaN or inf outside the mask does not leak in)."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """VeRL's masked mean: sum / (count + 1e-8)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with the masked mean and the unbiased masked variance."""
    n = mask.sum()
    if n < 2:
        raise ValueError(f"whitening needs at least two valid tokens, got {int(n)}")
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask) * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


# ---------------------------------------------------------------------- advantages


def grpo_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
                    epsilon: float = 1e-6, norm_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: score_i = sum of row i's token rewards; within its group, A_i = (score_i - mean) /
    (std + epsilon) with the unbiased std (norm_by_std=False: score_i - mean). A group of one has
    mean 0 and std 1. The advantage is broadcast over the response tokens; returns == advantages."""
    if len(index) != token_level_rewards.shape[0]:
        raise ValueError(f"index has {len(index)} entries for {token_level_rewards.shape[0]} responses")
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        groups: dict[Any, list[int]] = {}
        for row, key in enumerate(index):
            groups.setdefault(_key(key), []).append(row)
        out = torch.empty_like(scores)
        for rows in groups.values():
            s = scores[rows]
            if len(rows) == 1:
                mean, std = torch.zeros((), dtype=s.dtype), torch.ones((), dtype=s.dtype)
            else:
                mean, std = s.mean(), s.std()
            out[rows] = (s - mean) / (std + epsilon) if norm_by_std else s - mean
        adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def _key(key):
    return key.item() if isinstance(key, torch.Tensor) else key


def gae(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE backwards over t: delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1},
    skipping masked positions (they carry V_{t+1} and A_{t+1} through) -> (advantages, returns = A + V),
    not whitened."""
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        last = torch.zeros_like(values[:, 0])
        adv = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            step = delta + gamma * lam * last
            m = mask[:, t]
            next_value = values[:, t] * m + (1 - m) * next_value
            last = step * m + (1 - m) * last
            adv[:, t] = last
    return adv, adv + values


def gae_advantages(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """VeRL's compute_gae_advantage_return: gae(), then the advantages whitened over the mask of this
    batch (the engine whitens over the whole global batch instead: recipe._advantages)."""
    adv, returns = gae(token_level_rewards, values, response_mask, gamma, lam)
    return masked_whiten(adv, response_mask), returns


# ---------------------------------------------------------------------- losses


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, *,
             global_tokens: float | torch.Tensor | None = None, global_seqs: float | torch.Tensor | None = None,
             norm_factor: float | None = None) -> torch.Tensor:
    """One scalar from a [batch, len] loss matrix.

    token-mean               sum over valid tokens / token count (global_tokens when given)
    seq-mean-token-sum       per-sequence token sums, mean over sequences with a valid token
    seq-mean-token-mean      per-sequence token means, mean over sequences with a valid token
    seq-mean-token-sum-norm  seq-mean-token-sum / norm_factor (default: the response length)
    The sequence means divide by global_seqs when given (a fully masked row counts for nothing)."""
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        denom = mask.sum() if global_tokens is None else global_tokens
        return masked_sum(loss_mat, mask) / denom
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens = mask.sum(dim=-1)
        seq = masked_sum(loss_mat, mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq = seq / (tokens + 1e-8)
        has = (tokens > 0).to(loss_mat.dtype)
        denom = has.sum() if global_seqs is None else global_seqs
        loss = masked_sum(seq, has) / denom
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if norm_factor is None else norm_factor)
        return loss
    raise ValueError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}; got {loss_agg_mode!r}")


def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                loss_agg_mode: str = "token-mean", **agg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dual-clip PPO surrogate (VeRL's "vanilla" policy loss).

    ratio = exp(clamp(logp - old, +-20)); L = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high));
    where A < 0, L = min(L, -A * clip_c). Metrics (masked means over this batch, detached):
    pg_clipfrac (the clipped term won), pg_clipfrac_lower (the dual clip bound won), ppo_kl
    (mean of old - logp, the approximate KL). `agg` goes to agg_loss (global counts)."""
    if clip_c <= 1.0:
        raise ValueError(f"the dual-clip bound clip_ratio_c must be > 1, got {clip_c}")
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_c
    dual = torch.minimum(loss3, clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    loss = agg_loss(losses, response_mask, loss_agg_mode, **agg)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(torch.gt(loss2, loss1).float(), response_mask),
            "pg_clipfrac_lower": masked_mean((torch.gt(clipped, loss3) & (advantages < 0)).float(), response_mask),
            "ppo_kl": masked_mean(-neg_kl, response_mask),
        }
    return loss, metrics


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (J. Schulman's estimators):
    kl / k1: logp - ref;  abs: |logp - ref|;  mse / k2: 0.5 (logp - ref)^2;
    low_var_kl / k3: exp(ref - logp) - (ref - logp) - 1 with ref - logp clamped to +-20 and the
    result clamped to [-10, 10]."""
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10.0, max=10.0)
    raise ValueError(f"kl penalty must be one of {', '.join(KL_KINDS)}; got {kind!r}")


def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
               cliprange_value: float, loss_agg_mode: str = "token-mean", **agg) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)) and the clip fraction (the
    clipped term was larger)."""
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss1 = (vpreds - returns) ** 2
    loss2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), response_mask, loss_agg_mode, **agg)
    with torch.no_grad():
        clipfrac = masked_mean(torch.gt(loss2, loss1).float(), response_mask)
    return loss, clipfrac
