"""Reference implementations: plain PyTorch, the definition every other backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import masks, rotary, tiled_attention
from .loss import linear_cross_entropy  # noqa: F401  (portable: same code on every backend)
from .moe import grouped_mm, moe_permute, moe_route, moe_unpermute, swiglu  # noqa: F401

IMPL_NAMES = {
    "attention": "reference (sdpa+mask; packed: per document; with lse: tiled)",
    "attention_backward": f"reference (tiled, blocks of <= {tiled_attention.BLOCK} rows)",
    "rms_norm": "reference (torch fp32)",
    "apply_rotary": "reference (torch)",
    "swiglu": "reference (torch)",
    "moe_route": "reference (torch)",
    "moe_permute": "reference (argsort+index_select)",
    "moe_unpermute": "reference (index_select+sum)",
    "grouped_mm": "reference (per-expert loop)",
    "linear_cross_entropy": "reference (chunked torch)",
}


def impl_name(op: str) -> str:
    return IMPL_NAMES[op]


# ---------------------------------------------------------------- attention


def sdpa_batched(q, k, v, *, causal, window, scale, dropout, enable_gqa=True):
    """q [B,Sq,H,D], k/v [B,Skv,Hkv,D] -> [B,Sq,H,D] through SDPA (explicit mask only when needed)."""
    sq, skv = q.shape[1], k.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = enable_gqa and q.shape[2] != k.shape[2]
    if causal and window is None and sq == skv:
        out = F.scaled_dot_product_attention(
            qt, kt, vt, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        mask = masks.allowed(sq, skv, causal=causal, window=window, device=q.device)
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
        )
    return out.transpose(1, 2)


def explicit_attention(q, k, v, *, causal, window, scale, dropout):
    """Softmax attention written out, returning (out, lse [B,H,Sq] fp32). GQA by head grouping (no repeat)."""
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    scale = d**-0.5 if scale is None else scale
    qf = q.float().reshape(b, sq, hkv, g, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale
    mask = masks.allowed(sq, skv, causal=causal, window=window, device=q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if dropout:
        probs = F.dropout(probs, p=dropout)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float()).reshape(b, sq, h, v.shape[-1])
    return out.to(q.dtype), lse.reshape(b, h, sq)


def _per_document(fn, q, k, v, cu_seqlens, **kw):
    # Packed input runs one document at a time. On CPU this beats one SDPA call with a
    # block-diagonal mask by ~10x at T=1-2k with 8 documents: the mask forces SDPA's math path
    # over the full T x T scores, while each document uses the fused is_causal kernel on L x L.
    bounds = [int(x) for x in cu_seqlens.tolist()]
    outs, lses = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        res = fn(q[None, start:end], k[None, start:end], v[None, start:end], **kw)
        if isinstance(res, tuple):
            outs.append(res[0][0])
            lses.append(res[1][0])
        else:
            outs.append(res[0])
    out = torch.cat(outs) if outs else q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    if lses:
        return out, torch.cat(lses, dim=-1)
    return out


def _tiled_with_lse(q, k, v, cu, *, causal, window, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return tiled_attention.TiledAttention.apply(q, k, v, cu, causal, window, scale, None)


def attention(q, k, v, *, causal, cu_seqlens=None, window=None, scale=None, dropout=0.0, return_lse=False):
    kw = dict(causal=causal, window=window, scale=scale, dropout=dropout)
    # With lse (the ring's forward): flash-style tiles, so no [H, n, n] scores; dropout and
    # more keys than queries keep the explicit path.
    tiled = return_lse and not dropout
    if cu_seqlens is None:
        if tiled and q.shape[1] == k.shape[1]:
            b, s = q.shape[:2]
            out, lse = _tiled_with_lse(*(x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)),
                                       [i * s for i in range(b + 1)], causal=causal, window=window, scale=scale)
            return out.reshape(b, s, *out.shape[1:]), lse.reshape(lse.shape[0], b, s).transpose(0, 1)
        if return_lse:
            return explicit_attention(q, k, v, **kw)
        return sdpa_batched(q, k, v, **kw)
    if tiled:
        return _tiled_with_lse(q, k, v, [int(x) for x in cu_seqlens.tolist()], causal=causal, window=window,
                               scale=scale)
    fn = explicit_attention if return_lse else sdpa_batched
    return _per_document(fn, q, k, v, cu_seqlens, **kw)


def attention_backward(q, k, v, out, dout, lse, *, causal, cu_seqlens=None, scale=None, block=None):
    cu = [0, q.shape[0]] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return tiled_attention.backward(q, k, v, out, dout, lse, cu, causal=causal, window=None, scale=scale, block=block)


# ---------------------------------------------------------------- norms, rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # Hugging Face semantics: normalise in fp32, cast back to the input dtype, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf.to(x.dtype)
    return y if weight is None else weight * y


def rotate(x, cos, sin, interleaved):
    return rotary.rotate(x, cos, sin, interleaved)
