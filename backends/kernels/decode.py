"""Attention of new queries against a KV cache whose rows hold different numbers of real keys
(batched generation: prompts of different lengths, one decode step at a time).

Row b's cache holds key_lengths[b] real keys at columns 0.. (the Sq new ones last among them);
columns past that are stale or empty. Query i of row b sits at position key_lengths[b] - Sq + i and
sees the keys at or before it: causal, bottom-right aligned per row. One SDPA call with a boolean
[B, 1, Sq, Skv] mask, the same on every device (SDPA picks its fused kernel where one takes a mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """q [B,Sq,H,D], k [B,Skv,Hkv,D], v [B,Skv,Hkv,Dv], key_lengths [B] -> [B,Sq,H,Dv]."""
    b, sq, h = q.shape[:3]
    skv, hkv = k.shape[1], k.shape[2]
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or key_lengths.shape != (b,):
        raise ValueError(f"cache_attention expects q [B,Sq,H,D], k/v [B,Skv,Hkv,*], key_lengths [B]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(key_lengths.shape)}")
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} kv heads")
    lengths = key_lengths.to(device=q.device, dtype=torch.long)
    qpos = lengths[:, None] - sq + torch.arange(sq, device=q.device)[None, :]          # [B, Sq]
    mask = torch.arange(skv, device=q.device)[None, None, :] <= qpos[:, :, None]      # [B, Sq, Skv]
    mask[..., 0] = True  # a query before every real key (never read) must not make a NaN row
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale, enable_gqa=h != hkv)
    return out.transpose(1, 2)
