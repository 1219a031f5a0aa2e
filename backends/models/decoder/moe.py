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
from .layers import MLP


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
        self.act = kernels.swiglu  # selective recompute wraps it from outside

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, weights=None) -> torch.Tensor:
        """weights: (gate_up, down) to use instead of the parameters (expert parallel's local shards)."""
        gate_up, down = weights if weights is not None else (self.gate_up_proj, self.down_proj)
        h = kernels.grouped_mm(x, gate_up, tokens_per_expert)
        return kernels.grouped_mm(self.act(h), down, tokens_per_expert)


def group_limited_greedy(probs: torch.Tensor, top_k: int, n_group: int, topk_group: int):
    """DeepSeek-V2's group_limited_greedy: keep the topk_group groups with the largest single
    expert probability, then top-k inside them. (kernels.moe_route's groups rank by the top-2 sum,
    V3's rule, so V2's variant is this small selection step.)"""
    t, e = probs.shape
    group_best = probs.view(t, n_group, e // n_group).amax(dim=-1)
    keep = torch.zeros_like(group_best).scatter_(1, group_best.topk(topk_group, dim=-1)[1], 1.0).bool()
    masked = probs.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), 0.0)
    return masked.topk(top_k, dim=-1)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # set from outside by the parallel code and the engine, never by the model itself:
        self.aux_group = None         # ranks holding parts of one batch's tokens (the aux is that batch's)
        self.aux_token_mask = None    # bool [T] of the current micro-batch: False on CP padding
        self.token_dispatcher = None  # expert parallel: runs the experts on the ranks that own them
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
        return kernels.moe_aux_loss(probs, ids, self.m.num_experts, token_mask=self.aux_token_mask,
                                    group=self.aux_group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids, probs = self.route(self.gate(flat))
        aux = self.aux_loss(probs, ids)
        permuted, row_map, tokens_per_expert = kernels.moe_permute(flat, ids, self.m.num_experts)
        if self.token_dispatcher is None:
            routed = self.experts(permuted, tokens_per_expert)
        else:
            routed = self.token_dispatcher(self.experts, permuted, tokens_per_expert)
        out = kernels.moe_unpermute(routed, row_map, weights)
        out = out.view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, aux
