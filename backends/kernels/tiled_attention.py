"""Flash-attention-style tiled attention in plain PyTorch over a packed token stream: the forward
with its log-sum-exp, and the backward from a given log-sum-exp (FlashAttention-2's formulas).

Queries and keys are cut into tiles of `block` rows of the packed stream, not per document. A
(query tile, key tile) pair is computed only if the tiles share a document (and, causal, if some key
does not follow every query; with a window, if some key lies inside it), and the document / causal /
window mask is built for that pair alone (not at all when both tiles sit inside one document below
the diagonal). Many short documents thus cost about two tile pairs per query tile, a document of n
tokens (n/block)²/2, and the extra memory is O(H·block²) for the score tiles plus fp32 copies of the
inputs (O(T·H·D)): never an [H, n, n] matrix.

BLOCK = 256: with 32 heads one fp32 score tile is 8 MiB and at most three are alive, while each tile's
matmuls ([g·256, D] × [D, 256] per KV head) are large enough that the Python work per tile (~15 torch
calls) stays a small share of the time on a CPU; 128 doubles the tile count, 512 quadruples the tile
memory for little speed.

Heads: H query heads share Hkv key/value heads (GQA), query head h uses KV head h // (H/Hkv), as in
attention(); the score tiles are [Hkv, block·g, block] (no repeat of K/V).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

import torch

BLOCK = 256


def plan(cu: Sequence[int], block: int, causal: bool, window: int | None):
    """[(q0, q1, [(k0, k1, needs_mask), ...]), ...]: the tile pairs worth computing, on one grid of `block` rows."""
    total = cu[-1]
    tiles = []
    for q0 in range(0, total, block):
        q1 = min(q0 + block, total)
        first, last = bisect_right(cu, q0) - 1, bisect_right(cu, q1 - 1) - 1  # documents of q0 and q1-1
        lo, hi = cu[first], cu[last + 1]  # the keys any of these queries may see
        if causal:
            hi = min(hi, q1)
        if window is not None:
            lo = max(lo, q0 - window + 1)
            if not causal:
                hi = min(hi, q1 + window - 1)
        pairs = []
        for k0 in range(lo // block * block, hi, block):
            k1 = min(k0 + block, total)
            one_doc = first == last and cu[first] <= k0 and k1 <= cu[first + 1]
            below = not causal or k1 - 1 <= q0
            pairs.append((k0, k1, window is not None or not (one_doc and below)))
        tiles.append((q0, q1, pairs))
    return tiles


def _doc_ids(cu: Sequence[int], device) -> torch.Tensor:
    lengths = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=cu[-1])


def _mask(doc, q0, q1, k0, k1, causal, window):
    """Boolean [q1-q0, k1-k0]: True where query q may attend key k (same document, causal, window)."""
    ok = doc[q0:q1, None] == doc[None, k0:k1]
    if causal or window is not None:
        qpos = torch.arange(q0, q1, device=doc.device)[:, None]
        kpos = torch.arange(k0, k1, device=doc.device)[None, :]
        if causal:
            ok &= kpos <= qpos
        if window is not None:
            ok &= kpos > qpos - window
            if not causal:
                ok &= kpos < qpos + window
    return ok


class _Heads:
    """q/k/v (and friends) in fp32, KV-head-major, so one tile is a view: q [Hkv,T,g,D], k/v [Hkv,T,D]."""

    def __init__(self, q, k, v, scale):
        self.t, self.h, self.hkv = q.shape[0], q.shape[1], k.shape[1]
        self.g = self.h // self.hkv
        self.q = self.by_kv_head(q.float() * scale)  # scaled once: S = (q·scale) kᵀ
        self.k = k.float().permute(1, 0, 2).contiguous()
        self.v = v.float().permute(1, 0, 2).contiguous()

    def by_kv_head(self, x):  # [T, H, D] -> [Hkv, T, g, D]
        return x.reshape(self.t, self.hkv, self.g, x.shape[-1]).permute(1, 0, 2, 3).contiguous()

    def rows(self, x, a, b):  # [Hkv, T, g, ...] -> rows a..b as [Hkv, (b-a)·g, ...]
        return x[:, a:b].reshape(self.hkv, (b - a) * self.g, *x.shape[3:])

    def lse_by_kv_head(self, lse):  # [H, T] -> [Hkv, T, g]
        return lse.float().reshape(self.hkv, self.g, self.t).transpose(1, 2).contiguous()

    def to_tokens(self, x):  # [Hkv, T, g, D] -> [T, H, D]
        return x.permute(1, 0, 2, 3).reshape(self.t, self.h, x.shape[-1])


def _masked_scores(hd: _Heads, qt, doc, q0, q1, k0, k1, needs_mask, causal, window):
    s = torch.matmul(qt, hd.k[:, k0:k1].transpose(1, 2))  # [Hkv, Bq·g, Bk]
    if needs_mask:
        keep = _mask(doc, q0, q1, k0, k1, causal, window)
        s.view(hd.hkv, q1 - q0, hd.g, k1 - k0).masked_fill_(~keep[:, None, :], float("-inf"))
    return s


def forward(q, k, v, cu: Sequence[int], *, causal: bool, window: int | None, scale: float, block: int = BLOCK):
    """Packed attention by online softmax over tiles: (out like q [T,H,Dv], lse fp32 [H,T])."""
    hd = _Heads(q, k, v, scale)
    doc = _doc_ids(cu, q.device)
    out = q.new_empty(hd.t, hd.h, v.shape[-1])
    lse = torch.full((hd.hkv, hd.t, hd.g), float("-inf"), dtype=torch.float32, device=q.device)
    for q0, q1, pairs in plan(cu, block, causal, window):
        qt = hd.rows(hd.q, q0, q1)
        rows = qt.shape[1]
        m = torch.full((hd.hkv, rows), float("-inf"), dtype=torch.float32, device=q.device)
        l = torch.zeros_like(m)  # noqa: E741
        acc = torch.zeros(hd.hkv, rows, v.shape[-1], dtype=torch.float32, device=q.device)
        for k0, k1, needs_mask in pairs:
            s = _masked_scores(hd, qt, doc, q0, q1, k0, k1, needs_mask, causal, window)
            m_new = torch.maximum(m, s.amax(-1))
            base = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # rows seeing nothing yet
            p = s.sub_(base[..., None]).exp_()
            corr = torch.exp(m - base)
            l = l * corr + p.sum(-1)  # noqa: E741
            acc = acc * corr[..., None] + torch.matmul(p, hd.v[:, k0:k1])
            m = m_new
        seen = l > 0
        o = torch.where(seen[..., None], acc / torch.where(seen, l, torch.ones_like(l))[..., None], torch.zeros_like(acc))
        out[q0:q1] = o.reshape(hd.hkv, q1 - q0, hd.g, -1).permute(1, 0, 2, 3).reshape(q1 - q0, hd.h, -1).to(q.dtype)
        lse[:, q0:q1] = torch.where(seen, m + torch.log(l), torch.full_like(m, float("-inf"))).reshape(
            hd.hkv, q1 - q0, hd.g)
    return out, lse.transpose(1, 2).reshape(hd.h, hd.t)


def backward(q, k, v, out, dout, lse, cu: Sequence[int], *, causal: bool, window: int | None, scale: float,
             block: int = BLOCK):
    """(dq, dk, dv) fp32 of packed attention from out and its log-sum-exp lse [H,T].

    out and lse may be those of a larger attention this one is a block of (ring attention): every tile
    uses P = exp(S - lse) and dS = P∘(dP - rowsum(dO∘out)), so the gradients are this block's exact share.
    """
    hd = _Heads(q, k, v, scale)
    doc = _doc_ids(cu, q.device)
    do = hd.by_kv_head(dout.float())
    delta = (dout.float() * out.float()).sum(-1)  # [T, H]
    delta = delta.reshape(hd.t, hd.hkv, hd.g).permute(1, 0, 2).contiguous()  # [Hkv, T, g]
    lse_kv = hd.lse_by_kv_head(lse)
    lse_kv = torch.where(torch.isfinite(lse_kv), lse_kv, torch.full_like(lse_kv, float("inf")))  # such rows get P = 0
    dq = torch.zeros_like(hd.q)
    dk = torch.zeros_like(hd.k)
    dv = torch.zeros_like(hd.v)
    for q0, q1, pairs in plan(cu, block, causal, window):
        qt, dot = hd.rows(hd.q, q0, q1), hd.rows(do, q0, q1)
        lse_t, delta_t = hd.rows(lse_kv, q0, q1), hd.rows(delta, q0, q1)
        dqt = hd.rows(dq, q0, q1)  # a view: accumulates into dq
        for k0, k1, needs_mask in pairs:
            p = _masked_scores(hd, qt, doc, q0, q1, k0, k1, needs_mask, causal, window)
            p.sub_(lse_t[..., None]).exp_()
            dv[:, k0:k1] += torch.matmul(p.transpose(1, 2), dot)
            ds = torch.matmul(dot, hd.v[:, k0:k1].transpose(1, 2)).sub_(delta_t[..., None]).mul_(p)
            del p
            dqt += torch.matmul(ds, hd.k[:, k0:k1])
            dk[:, k0:k1] += torch.matmul(ds.transpose(1, 2), qt)  # qt already carries the scale
    dq.mul_(scale)
    return hd.to_tokens(dq), dk.permute(1, 0, 2).contiguous(), dv.permute(1, 0, 2).contiguous()


class TiledAttention(torch.autograd.Function):
    """forward() with backward() as its gradient (recomputed tiles, nothing O(n²) saved). lse has no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, cu, causal, window, scale, block):
        out, lse = forward(q, k, v, cu, causal=causal, window=window, scale=scale, block=block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (cu, causal, window, scale, block)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cu, causal, window, scale, block = ctx.args
        dq, dk, dv = backward(q, k, v, out, dout, lse, cu, causal=causal, window=window, scale=scale, block=block)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
