"""Mixture-of-experts routing, dispatch and expert matmuls in plain PyTorch (the reference).

Dispatch layout (the one torch_npu's npu_moe_token_permute uses, so the NPU op is a drop-in):
  permuted   [T*k, H]  rows grouped by expert (stable: token order inside an expert)
  row_map    [T*k]     row_map[t*k + j] = row of `permuted` holding (token t, slot j)
  tokens_per_expert [E] rows per expert, in expert order
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    n_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    normalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing -> (weights [T,k] fp32, expert_ids [T,k] int64).

    softmax (Mixtral, Qwen3-MoE): softmax over experts, top-k, optional renormalisation.
    sigmoid (DeepSeek-V3): sigmoid scores; `correction_bias` is added for *selection only*;
    with n_group, experts are chosen inside the `topk_group` groups with the best sum of their
    top-2 biased scores; weights are the unbiased scores, normalised, times `scaling_factor`.
    """
    logits = logits.reshape(-1, logits.shape[-1])
    num_tokens, num_experts = logits.shape
    if score == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    elif score == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group is not None and n_group > 1:
        if num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
        if topk_group is None:
            raise ValueError("n_group needs topk_group")
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        expert_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    else:
        expert_ids = torch.topk(choice, k=top_k, dim=-1)[1]
    weights = scores.gather(1, expert_ids)
    if normalize:
        # sigmoid scores can all be tiny; the epsilon is DeepSeek-V3's.
        denom = weights.sum(dim=-1, keepdim=True)
        weights = weights / (denom + 1e-20 if score == "sigmoid" else denom)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return weights, expert_ids


def moe_aux_loss(
    probs: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int | None = None,
    *,
    token_mask: torch.Tensor | None = None,
    group=None,
) -> torch.Tensor:
    """Switch / Mixtral load-balancing loss: num_experts * sum_i f_i * P_i.

    probs [T,E] router probabilities, expert_ids [T,k] chosen experts; f_i = top-k assignments
    to expert i per token, P_i = mean router probability of expert i (over unmasked tokens).
    group: the process group over which one batch's tokens are split (context- or expert-parallel
    ranks); the value is then that whole batch's (see _split_batch_aux_loss).
    """
    if group is not None:
        return _split_batch_aux_loss(probs, expert_ids, num_experts or probs.shape[-1], group, token_mask)
    probs = probs.reshape(-1, probs.shape[-1]).float()
    num_experts = num_experts or probs.shape[-1]
    ids = expert_ids.reshape(probs.shape[0], -1)
    if token_mask is None:
        mask = torch.ones(probs.shape[0], dtype=torch.float32, device=probs.device)
    else:
        mask = token_mask.reshape(-1).to(device=probs.device, dtype=torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
    counts = counts.scatter_add(0, ids.reshape(-1), mask.repeat_interleave(ids.shape[1]))
    total = mask.sum()
    prob_mean = (probs * mask[:, None]).sum(dim=0) / total
    return num_experts * torch.sum(counts / total * prob_mean)


def _split_batch_aux_loss(probs: torch.Tensor, ids: torch.Tensor, num_experts: int, group,
                          token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The aux loss of a batch whose tokens are split over `group`: f_i and the token total are
    all-reduced, P_i's numerator is local. Every rank returns the whole batch's value; its gradient is
    group-size × this rank's share, so the gradient averaged over the group (DDP's mean) is the whole
    batch's (Megatron's global aux). `token_mask` (bool [T]) leaves out positions that are not part of
    the batch (CP padding)."""
    import torch.distributed as dist

    e = num_experts
    probs = probs.reshape(-1, probs.shape[-1]).float()
    ids = ids.reshape(probs.shape[0], -1)
    if token_mask is not None:
        keep = token_mask.reshape(-1).to(probs.device).bool()
        probs, ids = probs[keep], ids[keep]
    stats = torch.zeros(e + 1, dtype=torch.int64, device=probs.device)
    stats[:e] = torch.bincount(ids.reshape(-1), minlength=e)
    stats[e] = probs.shape[0]
    dist.all_reduce(stats, group=group)  # global top-k counts and token total (exact ints)
    total = stats[e].to(torch.float32)
    share = e * torch.sum(stats[:e].to(torch.float32) / total * (probs.sum(dim=0) / total))
    value = share.detach().clone()
    dist.all_reduce(value, group=group)
    scaled = share * dist.get_world_size(group)
    return scaled + (value - scaled).detach()


def moe_permute(
    hidden: torch.Tensor, expert_ids: torch.Tensor, num_experts: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    top_k = expert_ids.shape[-1]
    flat = expert_ids.reshape(-1)
    num_experts = num_experts if num_experts is not None else int(flat.max()) + 1
    order = torch.argsort(flat, stable=True)  # permuted row -> flat (token, slot)
    row_map = torch.empty_like(order)
    row_map[order] = torch.arange(order.numel(), device=order.device)
    permuted = hidden.index_select(0, order // top_k)
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)
    return permuted, row_map, tokens_per_expert


def moe_unpermute(permuted_out: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * permuted_out[row_map[t*k + j]]  ->  [T, H] in permuted_out's dtype."""
    rows = permuted_out.index_select(0, row_map.long())
    rows = rows.view(weights.shape[0], weights.shape[1], permuted_out.shape[-1])
    return (rows * weights.unsqueeze(-1)).sum(dim=1).to(permuted_out.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Rows of x are grouped by expert (tokens_per_expert[e] rows each); row block e @ w[e]."""
    counts = [int(c) for c in tokens_per_expert.tolist()]
    if sum(counts) != x.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {sum(counts)} but x has {x.shape[0]} rows")
    if len(counts) != w.shape[0]:
        raise ValueError(f"tokens_per_expert has {len(counts)} entries but w has {w.shape[0]} experts")
    parts = [xe @ w[e] for e, xe in enumerate(torch.split(x, counts))]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return F.silu(gate) * up
