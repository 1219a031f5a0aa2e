"""Attention visibility rules shared by every implementation.

Window convention (transformers' and flash-attn's): with `window=w`, a causal token attends to
itself and the previous w-1 tokens (flash-attn window_size=(w-1, 0)); without causality it sees
w-1 tokens on each side. Causal attention with fewer queries than keys is bottom-right aligned
(query i sits at key position i + Skv - Sq), as in flash-attn >= 2.1 and NPU sparse_mode 3.
"""

from __future__ import annotations

import torch


def allowed(
    q_len: int, kv_len: int, *, causal: bool, window: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """Boolean [q_len, kv_len] (True = may attend), or None when everything is visible."""
    if not causal and window is None:
        return None
    qpos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    kpos = torch.arange(kv_len, device=device)[None, :]
    return visible(qpos, kpos, causal=causal, window=window)


def visible(qpos: torch.Tensor, kpos: torch.Tensor, *, causal: bool, window: int | None) -> torch.Tensor:
    """Boolean [Q, K] for query positions qpos [Q, 1] and key positions kpos [1, K] (True = may attend)."""
    ok = torch.ones(qpos.shape[0], kpos.shape[1], dtype=torch.bool, device=qpos.device)
    if causal:
        ok &= kpos <= qpos
    if window is not None:
        ok &= kpos > qpos - window
        if not causal:
            ok &= kpos < qpos + window
    return ok


def doc_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of each packed token."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def packed_allowed(cu_seqlens: torch.Tensor, total: int, *, causal: bool, window: int | None) -> torch.Tensor:
    """Block-diagonal [T, T] visibility for packed documents (plus causal / window inside each)."""
    doc = doc_ids(cu_seqlens, total)
    ok = doc[:, None] == doc[None, :]
    inner = allowed(total, total, causal=causal, window=window, device=cu_seqlens.device)
    return ok if inner is None else ok & inner
