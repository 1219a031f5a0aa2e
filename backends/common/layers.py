"""Decoder building blocks shared by the engines' native models: RMSNorm, SwiGLU MLPs, grouped-query
attention (backends.llm's decoders, backends.mm's Qwen2.5-VL text decoder).

Every fused op goes through backends.kernels. Layouts: hidden [B,S,H]; q/k/v [B,S,heads,D]; in packed
mode B == 1 and attention runs on [T,heads,D] with cu_seqlens. Rotary tables cos/sin [B,S,rotary_dim]
are computed once per forward by the model and passed down.

`Attention(cfg)` reads these attributes of any config object: hidden_size, head_dim,
num_attention_heads, num_kv_heads, qkv_bias, o_proj_bias, qk_norm, rms_norm_eps, rotary_dim,
rotary_interleaved.
"""

from __future__ import annotations

import torch
from torch import nn

from backends import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU MLP with HF's gate_proj / up_proj / down_proj (dense layers, shared experts; biased in the
    Qwen2.5-VL vision blocks)."""

    def __init__(self, hidden: int, inner: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act = kernels.swiglu  # selective recompute wraps it from outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class FusedMLP(nn.Module):
    """GLM-4's MLP: one gate_up_proj (gate first, then up) and down_proj."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act = kernels.swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def attend(q, k, v, cu_seqlens, scale):
    """Causal attention on [B,S,heads,D]; packed (B == 1, cu_seqlens) documents stay separate."""
    if cu_seqlens is None:
        return kernels.attention(q, k, v, causal=True, scale=scale)
    return kernels.attention(q[0], k[0], v[0], causal=True, cu_seqlens=cu_seqlens, scale=scale).unsqueeze(0)


class Attention(nn.Module):
    """Grouped-query attention: optional q/k/v bias (Qwen2, GLM-4), per-head q/k RMSNorm (Qwen3),
    partial and interleaved rotary (GLM-4)."""

    def __init__(self, cfg):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary_dim, self.interleaved = cfg.rotary_dim, cfg.rotary_interleaved
        self.scale = d**-0.5
        # context parallel swaps in its ring / Ulysses attention, selective recompute wraps it
        self.core_attention = attend

    def forward(self, x, cos, sin, cu_seqlens=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = kernels.apply_rotary(q, cos, sin, interleaved=self.interleaved, rotary_dim=self.rotary_dim)
        k = kernels.apply_rotary(k, cos, sin, interleaved=self.interleaved, rotary_dim=self.rotary_dim)
        out = self.core_attention(q, k, v, cu_seqlens, self.scale)
        return self.o_proj(out.reshape(b, s, -1))
