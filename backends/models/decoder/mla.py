"""DeepSeek multi-head latent attention (V2 / V2-Lite / V3), as transformers' DeepseekV2/V3Attention.

q: q_proj (no q_lora_rank, V2-Lite) or q_a_proj -> q_a_layernorm -> q_b_proj; per head [nope | rope].
kv: kv_a_proj_with_mqa -> [latent kv_lora_rank | shared k_rope], latent -> kv_a_layernorm -> kv_b_proj
-> per head [k_nope | v]. Only the rope dims rotate; k_rope is one head broadcast to all.
"""

from __future__ import annotations

import torch
from torch import nn

from backends import kernels
from backends.kernels.rotary import yarn_mscale

from .config import ModelConfig
from .layers import RMSNorm, attend


def mla_softmax_scale(cfg: ModelConfig) -> float:
    a = cfg.mla
    scale = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling or {}
    # HF (and DeepSeek's code) multiply by mscale(factor, mscale_all_dim)^2 for any scaled rope
    if rs.get("rope_type", rs.get("type", "default")) != "default" and rs.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"])) ** 2
    return scale


def attend_mla(q, k, v, cu_seqlens, scale, pad_v: bool, core=attend):
    """attend() with v narrower than q/k (128 vs 192). flash-attn and npu_fusion_attention want one
    head dim, so off the CPU v is zero-padded to it and the output sliced back (as HF's FA2 path
    does); the CPU reference takes the narrow v as is."""
    dv, dqk = v.shape[-1], q.shape[-1]
    if not pad_v or dv == dqk:
        return core(q, k, v, cu_seqlens, scale)
    out = core(q, k, torch.nn.functional.pad(v, (0, dqk - dv)), cu_seqlens, scale)
    return out[..., :dv]


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a, h = cfg.mla, cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope = a.qk_nope_head_dim, a.qk_rope_head_dim
        self.v_dim, self.kv_rank = a.v_head_dim, a.kv_lora_rank
        qk = self.nope + self.rope
        bias = cfg.qkv_bias
        self.q_lora_rank = a.q_lora_rank
        if a.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, a.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank)  # HF builds these two norms with the default eps
            self.q_b_proj = nn.Linear(a.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, a.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank)
        self.kv_b_proj = nn.Linear(a.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=cfg.o_proj_bias)
        self.interleaved = a.rope_interleave
        self.scale = mla_softmax_scale(cfg)
        self.core_attention = attend  # context parallel swaps in its attention, selective recompute wraps it

    def forward(self, x, cos, sin, cu_seqlens=None):
        b, s, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(b, s, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        # Interleaved: rotate adjacent pairs in place. HF de-interleaves q and k alike instead; the
        # q.k products, hence the outputs, are the same.
        q_rot = kernels.apply_rotary(q_rot, cos, sin, interleaved=self.interleaved)
        k_rot = kernels.apply_rotary(k_rot.view(b, s, 1, self.rope), cos, sin, interleaved=self.interleaved)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(b, s, self.num_heads, self.rope)), dim=-1)
        out = attend_mla(q, k, v.contiguous(), cu_seqlens, self.scale, x.device.type != "cpu", self.core_attention)
        return self.o_proj(out.reshape(b, s, -1))
