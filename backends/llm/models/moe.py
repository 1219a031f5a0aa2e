"""Mixture-of-experts block: router -> dropless permute -> grouped_mm -> unpermute (+ shared experts).

Routed expert weights are stacked the way kernels.grouped_mm reads them, x @ w[e]:
  experts.gate_up_proj [E, hidden, 2 * moe_ffn]  (gate columns first, then up)
  experts.down_proj    [E, moe_ffn, hidden]
On disk (Hugging Face) they are per-expert nn.Linear weights; convert.py maps between the two.

Aux loss (Switch / Mixtral load balancing, unscaled), per MoE layer:
  E * sum_i f_i * P_i,  f_i = top-k assignments to expert i / tokens,  P_i = mean router probability
of expert i (softmax; DeepSeek-V3's sigmoid scores are normalised to sum 1 first, as in its
sequence-wise balance loss). The model sums it over its MoE layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends import kernels

from .config import ModelConfig, MoEConfig
from .layers import MLP, maybe_checkpoint


class Router(nn.Linear):
    """HF's `gate`: weight [E, hidden] (logits in fp32, as HF keeps it); DeepSeek-V3 adds the
    e_score_correction_bias buffer that only steers selection (aux-loss-free balancing)."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool):
        super().__init__(hidden, num_experts, bias=False)
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inner: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inner))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.selective_recompute = False

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        h = kernels.grouped_mm(x, self.gate_up_proj, tokens_per_expert)
        h = maybe_checkpoint(self.selective_recompute, kernels.swiglu, h)
        return kernels.grouped_mm(h, self.down_proj, tokens_per_expert)


def group_limited_greedy(probs: torch.Tensor, top_k: int, n_group: int, topk_group: int):
    """DeepSeek-V2's group_limited_greedy: keep the topk_group groups with the largest single
    expert probability, then top-k inside them. (kernels.moe_route's groups rank by the top-2 sum,
    V3's rule, so V2's variant is this small selection step.)"""
    t, e = probs.shape
    group_best = probs.view(t, n_group, e // n_group).amax(dim=-1)
    keep = torch.zeros_like(group_best).scatter_(1, group_best.topk(topk_group, dim=-1)[1], 1.0).bool()
    masked = probs.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), 0.0)
    return masked.topk(top_k, dim=-1)


def split_batch_aux_loss(probs: torch.Tensor, ids: torch.Tensor, num_experts: int, group,
                         token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The aux loss of a batch whose tokens are split over `group` (context-parallel sequence halves,
    or expert-parallel ranks): f_i and the token total are all-reduced, P_i's numerator is local.
    Every rank returns the whole batch's value; its gradient is group-size × this rank's share, so
    the gradient averaged over the group (DDP's mean) is the whole batch's (Megatron's global aux).
    `token_mask` (bool [T]) leaves out positions that are not part of the batch (CP padding)."""
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


class MoE(nn.Module):
    # tokens of one micro-batch split over these ranks (context parallel): the aux loss is the whole
    # micro-batch's, as one process computes it (set by backends.llm.parallelize)
    aux_group = None
    aux_token_mask = None  # bool [T] of the current micro-batch: False on CP padding (set per forward)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m: MoEConfig = cfg.moe
        self.m = m
        self.gate = Router(cfg.hidden_size, m.num_experts, correction_bias=m.scoring_func == "sigmoid")
        self.experts = Experts(m.num_experts, cfg.hidden_size, m.moe_ffn_hidden_size)
        if m.shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, m.shared_experts * m.moe_ffn_hidden_size)
        else:
            self.shared_experts = None

    def route(self, logits: torch.Tensor):
        """(weights [T,k] fp32, expert_ids [T,k], probs [T,E] for the aux loss)."""
        m = self.m
        if m.scoring_func == "sigmoid":
            weights, ids = kernels.moe_route(
                logits, m.experts_per_token, score="sigmoid", n_group=m.n_group, topk_group=m.topk_group,
                correction_bias=self.gate.e_score_correction_bias, normalize=m.norm_topk_prob,
                scaling_factor=m.routed_scaling_factor)
            scores = torch.sigmoid(logits)
            return weights, ids, scores / scores.sum(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)
        if m.topk_method == "group_limited_greedy" and m.n_group and m.n_group > 1:
            weights, ids = group_limited_greedy(probs, m.experts_per_token, m.n_group, m.topk_group)
            if m.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights * m.routed_scaling_factor, ids, probs
        weights, ids = kernels.moe_route(logits, m.experts_per_token, score="softmax", normalize=m.norm_topk_prob,
                                         scaling_factor=m.routed_scaling_factor)
        return weights, ids, probs

    def aux_loss(self, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.aux_group is None:
            return kernels.moe_aux_loss(probs, ids, self.m.num_experts, token_mask=self.aux_token_mask)
        return split_batch_aux_loss(probs, ids, self.m.num_experts, self.aux_group, self.aux_token_mask)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids, probs = self.route(self.gate(flat))
        aux = self.aux_loss(probs, ids)
        permuted, row_map, tokens_per_expert = kernels.moe_permute(flat, ids, self.m.num_experts)
        out = kernels.moe_unpermute(self.experts(permuted, tokens_per_expert), row_map, weights)
        out = out.view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, aux
