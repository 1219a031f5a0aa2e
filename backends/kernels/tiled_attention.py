"""Flash-attention-style tiled attention in plain PyTorch over a packed token stream: the forward
with its log-sum-exp, and the backward from a given log-sum-exp (FlashAttention-2's formulas).

Queries and keys are cut into tiles of `block` rows of the packed stream, not per document. A
(query tile, key tile) pair is computed only if the tiles share a document (and, causal, if some key
does not follow every query; with a window, if some key lies inside it), and the document / causal /
window mask is built for that pair alone (not at all when both tiles sit inside one document below
the diagonal). Many short documents thus cost about two tile pairs per query tile, a document of n
tokens (n/block)²/2, and the memory beyond the outputs is O(H·block²) (score tiles, inputs cast
to fp32 tile by tile): never an [H, n, n] matrix.

BLOCK = 256: with 32 heads one fp32 score tile is 8 MiB and at most three are alive, while each tile's
matmuls ([g·256, D] × [D, 256] per KV head) are large enough that the Python work per tile (~20 torch
calls) stays a small share of the time on a CPU; 128 doubles the tile count, 512 quadruples the tile
memory for little speed. When every document is short the tile shrinks to the longest one (rounded
up to a power of two, at least 64; `block_for`), so masked-out scores do not dominate.

Heads: H query heads share Hkv key/value heads (GQA), query head h uses KV head h // (H/Hkv), as in
attention(); the score tiles are [Hkv, block·g, block] (no repeat of K/V).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

import torch

from .masks import doc_ids, visible

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
    return doc_ids(torch.tensor(list(cu), device=device), cu[-1])


def _mask(doc, q0, q1, k0, k1, causal, window):
    """Boolean [q1-q0, k1-k0]: True where query q may attend key k (same document, causal, window)."""
    ok = doc[q0:q1, None] == doc[None, k0:k1]
    if causal or window is not None:
        qpos = torch.arange(q0, q1, device=doc.device)[:, None]
        ok &= visible(qpos, torch.arange(k0, k1, device=doc.device)[None, :], causal=causal, window=window)
    return ok


class _Tiles:
    """Row tiles of the packed tensors in fp32, KV-head-major (query head h = kv·g + j, as attention())."""

    def __init__(self, q, k):
        self.h, self.hkv = q.shape[1], k.shape[1]
        self.g = self.h // self.hkv

    def q_rows(self, x, a, b):  # [T, H, D] rows a..b -> [Hkv, (b-a)·g, D]
        return x[a:b].float().reshape(b - a, self.hkv, self.g, -1).permute(1, 0, 2, 3).reshape(
            self.hkv, (b - a) * self.g, -1)

    def kv_rows(self, x, a, b):  # [T, Hkv, D] rows a..b -> [Hkv, b-a, D]
        return x[a:b].float().permute(1, 0, 2)

    def stat_rows(self, x, a, b):  # per-head statistics [H, T] -> [Hkv, (b-a)·g]
        return x[:, a:b].float().reshape(self.hkv, self.g, b - a).transpose(1, 2).reshape(self.hkv, -1)

    def to_tokens(self, x, a, b):  # [Hkv, (b-a)·g, D] -> [b-a, H, D]
        return x.reshape(self.hkv, b - a, self.g, -1).permute(1, 0, 2, 3).reshape(b - a, self.h, -1)

    def to_heads(self, x, a, b):  # [Hkv, (b-a)·g] -> [H, b-a]
        return x.reshape(self.hkv, b - a, self.g).transpose(1, 2).reshape(self.h, b - a)


def block_for(cu: Sequence[int]) -> int:
    """BLOCK, or less when every document is short: tiles of 256 rows over 32-token documents would
    compute 8x the scores they keep; the longest document rounded up to a power of two (at least 64)."""
    longest = max((b - a for a, b in zip(cu[:-1], cu[1:])), default=1)
    return min(BLOCK, max(64, 1 << max(longest - 1, 1).bit_length()))


def _masked_scores(tl: _Tiles, qt, kt, doc, q0, q1, k0, k1, needs_mask, causal, window):
    s = torch.matmul(qt, kt.transpose(1, 2))  # [Hkv, Bq·g, Bk]
    if needs_mask:
        keep = _mask(doc, q0, q1, k0, k1, causal, window)
        s.view(tl.hkv, q1 - q0, tl.g, k1 - k0).masked_fill_(~keep[:, None, :], float("-inf"))
    return s


def forward(q, k, v, cu: Sequence[int], *, causal: bool, window: int | None, scale: float, block: int | None = None):
    """Packed attention by online softmax over tiles: (out like q [T,H,Dv], lse fp32 [H,T])."""
    tl, doc = _Tiles(q, k), _doc_ids(cu, q.device)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for q0, q1, pairs in plan(cu, block or block_for(cu), causal, window):
        qt = tl.q_rows(q, q0, q1) * scale  # S = (q·scale) kᵀ
        m = torch.full(qt.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        l = torch.zeros_like(m)  # noqa: E741
        acc = torch.zeros(*qt.shape[:2], v.shape[-1], dtype=torch.float32, device=q.device)
        for k0, k1, needs_mask in pairs:
            s = _masked_scores(tl, qt, tl.kv_rows(k, k0, k1), doc, q0, q1, k0, k1, needs_mask, causal, window)
            m_new = torch.maximum(m, s.amax(-1))
            base = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # rows seeing nothing yet
            p = s.sub_(base[..., None]).exp_()
            corr = torch.exp(m - base)
            l = l * corr + p.sum(-1)  # noqa: E741
            acc = acc * corr[..., None] + torch.matmul(p, tl.kv_rows(v, k0, k1))
            m = m_new
        seen = l > 0
        safe_l = torch.where(seen, l, torch.ones_like(l))
        out[q0:q1] = tl.to_tokens(acc / safe_l[..., None], q0, q1).to(q.dtype)
        lse[:, q0:q1] = tl.to_heads(torch.where(seen, m + torch.log(safe_l), torch.full_like(m, float("-inf"))),
                                    q0, q1)
    return out, lse


def backward(q, k, v, out, dout, lse, cu: Sequence[int], *, causal: bool, window: int | None, scale: float,
             block: int | None = None):
    """(dq, dk, dv) fp32 of packed attention from out and its log-sum-exp lse [H,T].

    out and lse may be those of a larger attention this one is a block of (ring attention): every tile
    uses P = exp(S - lse) and dS = P∘(dP - rowsum(dO∘out)), so the gradients are this block's exact share.
    Beyond the fp32 gradients it returns, it holds only tiles (inputs are cast tile by tile).
    """
    tl, doc = _Tiles(q, k), _doc_ids(cu, q.device)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for q0, q1, pairs in plan(cu, block or block_for(cu), causal, window):
        qt, dot = tl.q_rows(q, q0, q1) * scale, tl.q_rows(dout, q0, q1)
        lse_t = tl.stat_rows(lse, q0, q1)
        lse_t = torch.where(torch.isfinite(lse_t), lse_t, torch.full_like(lse_t, float("inf")))  # rows: P = 0
        delta = (dout[q0:q1].float() * out[q0:q1].float()).sum(-1).t()  # [H, Bq]
        delta = tl.stat_rows(delta, 0, q1 - q0)
        dqt = torch.zeros_like(qt)
        for k0, k1, needs_mask in pairs:
            kt, vt = tl.kv_rows(k, k0, k1), tl.kv_rows(v, k0, k1)
            p = _masked_scores(tl, qt, kt, doc, q0, q1, k0, k1, needs_mask, causal, window)
            p.sub_(lse_t[..., None]).exp_()
            dv[k0:k1] += torch.matmul(p.transpose(1, 2), dot).transpose(0, 1)
            ds = torch.matmul(dot, vt.transpose(1, 2)).sub_(delta[..., None]).mul_(p)
            del p
            dqt += torch.matmul(ds, kt)
            dk[k0:k1] += torch.matmul(ds.transpose(1, 2), qt).transpose(0, 1)  # qt already carries the scale
        dq[q0:q1] = tl.to_tokens(dqt, q0, q1) * scale
    return dq, dk, dv


class TiledAttention(torch.autograd.Function):
    """forward() with backward() as its gradient (recomputed tiles, nothing O(n²) saved). lse has no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, cu, causal, window, scale, block=None):
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
