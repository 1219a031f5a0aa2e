"""Reference implementations: plain PyTorch, the definition every other backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import buckets, masks, rotary, tiled_attention
from .loss import linear_cross_entropy  # noqa: F401  (portable: same code on every backend)
from .gated_delta import chunk_gated_delta_rule  # noqa: F401
from .ssm import causal_conv1d, rms_norm_gated, ssd_chunk_scan  # noqa: F401
from .moe import grouped_mm, moe_permute, moe_route, moe_unpermute, swiglu  # noqa: F401

IMPL_NAMES = {
    "attention": "reference (sdpa+mask; packed: length-bucketed padded batches; with lse: tiled)",
    "attention_backward": f"reference (tiled, blocks of <= {tiled_attention.BLOCK} rows)",
    "rms_norm": "reference (torch fp32)",
    "apply_rotary": "reference (torch)",
    "swiglu": "reference (torch)",
    "moe_route": "reference (torch)",
    "moe_permute": "reference (argsort+index_select)",
    "moe_unpermute": "reference (index_select+sum)",
    "grouped_mm": "reference (per-expert loop)",
    "linear_cross_entropy": "reference (chunked torch)",
    "chunk_gated_delta_rule": "reference (chunked torch, WY transform, chunks of 64)",
    "causal_conv1d": "reference (torch conv1d over documents with their history)",
    "ssd_chunk_scan": "reference (chunked torch SSD, blocks of <= 128 tokens)",
    "rms_norm_gated": "reference (torch fp32)",
}


def impl_name(op: str) -> str:
    return IMPL_NAMES[op]


# ---------------------------------------------------------------- attention


def sdpa_batched(q, k, v, *, causal, window, scale, dropout, enable_gqa=True, key_lengths=None):
    """q [B,Sq,H,D], k/v [B,Skv,Hkv,D] -> [B,Sq,H,D] through SDPA (explicit mask only when needed).

    key_lengths [B]: row b's keys from key_lengths[b] on are padding, never attended by its real queries."""
    sq, skv = q.shape[1], k.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = enable_gqa and q.shape[2] != k.shape[2]
    if causal and window is None and sq == skv and key_lengths is None:
        out = F.scaled_dot_product_attention(
            qt, kt, vt, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        mask = _with_key_lengths(masks.allowed(sq, skv, causal=causal, window=window, device=q.device), key_lengths,
                                 sq, skv)
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
        )
    return out.transpose(1, 2)


def _with_key_lengths(mask, key_lengths, sq, skv):
    """[Sq, Skv] mask (or None) and key_lengths [B] -> [B, 1, Sq, Skv] with the padded keys of real
    queries masked, or mask as is. Padding query rows (dropped later) keep their keys: a row masked
    everywhere would give NaN, and NaN times their zero gradient would still reach dk and dv."""
    if key_lengths is None:
        return mask
    lens = key_lengths[:, None, None]
    keep = (torch.arange(skv, device=lens.device)[None, None, :] < lens) | (
        torch.arange(sq, device=lens.device)[None, :, None] >= lens)
    return (keep if mask is None else keep & mask)[:, None]


def explicit_attention(q, k, v, *, causal, window, scale, dropout, key_lengths=None):
    """Softmax attention written out, returning (out, lse [B,H,Sq] fp32). GQA by head grouping (no repeat).
    key_lengths as for sdpa_batched."""
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    scale = d**-0.5 if scale is None else scale
    qf = q.float().reshape(b, sq, hkv, g, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale
    mask = _with_key_lengths(masks.allowed(sq, skv, causal=causal, window=window, device=q.device), key_lengths, sq,
                             skv)
    if mask is not None:  # [Sq, Skv] or [B, 1, Sq, Skv]; scores are [B, Hkv, g, Sq, Skv]
        scores = scores.masked_fill(~(mask if mask.dim() == 2 else mask[:, :, None]), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if dropout:
        probs = F.dropout(probs, p=dropout)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float()).reshape(b, sq, h, v.shape[-1])
    return out.to(q.dtype), lse.reshape(b, h, sq)


def _bucketed(fn, q, k, v, cu_seqlens, **kw):
    # Packed input as a few padded batches of similar-length documents (buckets.py): one fused call
    # per bucket. Not one SDPA call with a block-diagonal [T, T] mask: that forces SDPA's math path
    # over all T² scores (~8x slower on a CPU at T=2k with 8 documents, bench/RESULTS.md).
    bounds = cu_seqlens.tolist()
    p = buckets.plan(tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])), str(q.device))
    if not p.tops:
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        return (out, out.new_zeros(q.shape[1], 0, dtype=torch.float32)) if fn is explicit_attention else out
    outs, lses = [], []
    for i, (qb, kb, vb) in enumerate(zip(buckets.to_buckets(q, p), buckets.to_buckets(k, p),
                                         buckets.to_buckets(v, p))):
        # Causal: a document's queries never reach the padding after it, so no key mask is needed;
        # nor in a bucket without padding (then SDPA can take its unmasked kernel).
        lens = p.key_lengths[i] if not kw["causal"] and p.padded(i) else None
        res = fn(qb, kb, vb, key_lengths=lens, **kw)
        if isinstance(res, tuple):
            outs.append(res[0])
            lses.append(res[1].transpose(1, 2))  # [B, L, H]: token-major like the outputs
        else:
            outs.append(res)
    out = buckets.from_buckets(outs, p)
    if lses:
        return out, buckets.from_buckets(lses, p).t()
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
    return _bucketed(fn, q, k, v, cu_seqlens, **kw)


def attention_backward(q, k, v, out, dout, lse, *, causal, cu_seqlens=None, scale=None, block=None):
    cu = [0, q.shape[0]] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return tiled_attention.backward(q, k, v, out, dout, lse, cu, causal=causal, window=None, scale=scale, block=block)


# ---------------------------------------------------------------- norms, rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # Hugging Face semantics: normalise in fp32, cast back to the input dtype, then scale.
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return _RMSNorm.apply(x, weight, eps)
    return _rms_norm_forward(x, weight, eps)[0]


def _rms_norm_forward(x, weight, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * rstd).to(x.dtype)
    return (y if weight is None else weight * y), rstd


class _RMSNorm(torch.autograd.Function):
    """HF's RMSNorm forward, op for op, with its backward written out: it saves x and the [.., 1]
    rstd (autograd of the forward keeps the normalised x too), and its backward is 8 passes over
    the activation where autograd's is about 12:
        dx = rstd * (g - y * mean(g * y)),  g = d(out)/dy,  y = x * rstd (fp32),  dw = sum(dout * y)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = _rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.has_weight = weight is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.has_weight and ctx.needs_input_grad[1]
        yf = x.float() * rstd
        grad_x = grad_w = None
        if need_w:
            dims = tuple(range(dout.dim() - weight.dim()))
            grad_w = (dout * yf.to(x.dtype)).sum(dims).to(weight.dtype)  # as the product's backward reduces it
        if need_x:
            g = (dout * weight if ctx.has_weight else dout).to(x.dtype).float()
            dot = (g * yf).sum(-1, keepdim=True)
            grad_x = torch.addcmul(g, yf, dot, value=-1.0 / x.shape[-1]).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None


def rotate(x, cos, sin, interleaved):
    return rotary.rotate(x, cos, sin, interleaved)
