"""Packed documents as a few padded batches: documents grouped by length into buckets, each bucket
one [B, L, H, D] batch (documents at row start, padding at the end), so packed attention is a few
fused SDPA calls instead of one per document.

Why not one call per document: with hundreds of short documents the per-call work (slicing,
autograd nodes, each slice's backward writing a full-size zero gradient) dominates; why not one
padded batch: with long, uneven documents the padding's quadratic scores dominate. The bucket
plan minimises a cost model of both (bucket_tops()) and is cached per set of lengths; moving
tokens in and out is one index_select and one index_copy_ per bucket (no Python work per document).
When every document has the same length (a vision tower's equal windows, one image size) the one
bucket is the packed tensor itself, viewed as [B, L, ...]: no gather, no scatter, no key mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

# Cost model, in padded score elements per head: one bucket (an SDPA forward + backward, its gathers)
# costs CALL_COST fixed plus B·L·(L + ROW_COST) (scores, and the per-row softmax and copies). On a CPU
# (H8/2, D64; bench/kernels.py's short-document case) the time is flat for CALL_COST between 64² and
# 256²; accelerators, where a call costs more next to its scores, favour the larger end.
CALL_COST = 128 * 128
ROW_COST = 64
MAX_CANDIDATES = 128  # distinct lengths the O(m²) plan looks at; beyond, lengths round up to a grid


@dataclass(frozen=True)
class Plan:
    """Bucket b holds sizes[b] documents padded to tops[b] tokens, as B·L rows. Per bucket: src, the
    packed token each row reads (padding rows read their document's first token: any finite value
    does, no real query attends them and their outputs are dropped); dst, the token each row's output
    goes to (padding rows: T, a scratch row); pad, the padding rows; key_lengths, the documents' lengths."""

    tops: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int
    src: tuple[torch.Tensor, ...]
    dst: tuple[torch.Tensor, ...]
    pad: tuple[torch.Tensor, ...]
    key_lengths: tuple[torch.Tensor, ...]

    @property
    def rows(self) -> int:
        return sum(b * t for b, t in zip(self.sizes, self.tops))

    @property
    def whole(self) -> bool:
        """One bucket without padding: its rows are the packed tokens in order."""
        return len(self.tops) == 1 and self.rows == self.total

    def padded(self, b: int) -> bool:
        return self.pad[b].numel() > 0


def bucket_tops(lengths: list[int]) -> list[int]:
    """Ascending bucket maxima: a document goes to the first top >= its length (documents of length 0
    excluded). Minimises Σ_buckets CALL_COST + B·top·(top + ROW_COST) over splits of the sorted lengths."""
    nonzero = torch.tensor(lengths, dtype=torch.int64)
    nonzero = nonzero[nonzero > 0]
    if not len(nonzero):
        return []
    values, number = torch.unique(nonzero, return_counts=True)
    counts = dict(zip(values.tolist(), number.tolist()))
    cand = sorted(counts)
    if len(cand) > MAX_CANDIDATES:  # round up to a geometric grid so the plan stays O(MAX_CANDIDATES²)
        lo, hi = cand[0], cand[-1]
        ratio = (hi / lo) ** (1 / (MAX_CANDIDATES - 1))
        grid = sorted({min(hi, math.ceil(lo * ratio**i)) for i in range(MAX_CANDIDATES)} | {hi})
        merged: dict[int, int] = {}
        j = 0
        for n in cand:
            while grid[j] < n:
                j += 1
            merged[grid[j]] = merged.get(grid[j], 0) + counts[n]
        counts, cand = merged, sorted(merged)
    m = len(cand)
    before = [0] * (m + 1)  # documents with length among cand[:i]
    for i, n in enumerate(cand):
        before[i + 1] = before[i] + counts[n]
    best, cut = [0.0] + [float("inf")] * m, [0] * (m + 1)
    for j in range(1, m + 1):  # best[j]: the cheapest plan of the j shortest distinct lengths
        top = cand[j - 1]
        per_doc = top * (top + ROW_COST)
        for i in range(j):
            cost = best[i] + CALL_COST + (before[j] - before[i]) * per_doc
            if cost < best[j]:
                best[j], cut[j] = cost, i
    tops, j = [], m
    while j:
        tops.append(cand[j - 1])
        j = cut[j]
    tops.reverse()
    # A grid top may exceed every length of its bucket: pad only to the longest document in it.
    idx = torch.searchsorted(torch.tensor(tops, dtype=torch.int64), nonzero)
    longest = torch.zeros(len(tops), dtype=torch.int64).scatter_reduce(0, idx, nonzero, "amax")
    return [int(x) for x in longest if x > 0]


@lru_cache(maxsize=16)
def plan(lengths: tuple[int, ...], device: str) -> Plan:
    """The bucket plan of these document lengths, its index tensors on `device` (cached: every layer of
    a step sees the same documents)."""
    tops = bucket_tops(list(lengths))
    nb = len(tops)
    n = torch.tensor(lengths, dtype=torch.int64)
    total = int(n.sum())
    if not nb:
        return Plan((), (), total, (), (), (), ())
    top_t = torch.tensor(tops, dtype=torch.int64)
    bucket = torch.where(n > 0, torch.searchsorted(top_t, n), nb)  # length-0 documents own no token: bucket nb
    sizes = torch.bincount(bucket, minlength=nb + 1)[:nb].tolist()
    order = torch.argsort(bucket, stable=True)  # documents bucket by bucket, packed order inside
    first = [0]
    for b in sizes:
        first.append(first[-1] + b)
    start = torch.cumsum(n, 0) - n
    src, dst, pad, key_lengths = [], [], [], []
    for b, top, f in zip(sizes, tops, first):  # one iteration per bucket, vectorised over its rows
        docs = order[f:f + b]
        pos = torch.arange(top).repeat(b)
        real = pos < n[docs].repeat_interleave(top)
        tok = start[docs].repeat_interleave(top) + pos
        src.append(torch.where(real, tok, start[docs].repeat_interleave(top)).to(device))
        dst.append(torch.where(real, tok, total).to(device))
        pad.append(torch.nonzero(~real)[:, 0].to(device))
        key_lengths.append(n[docs].to(device))
    return Plan(tuple(tops), tuple(sizes), total, tuple(src), tuple(dst), tuple(pad), tuple(key_lengths))


class _ToBuckets(torch.autograd.Function):
    """Packed [T, ...] -> one [B, L, ...] batch per bucket: one gather each; the backward writes every
    bucket's real rows back into one gradient (each token has exactly one; padding rows go to a scratch
    row and carry exact zeros anyway, see _FromBuckets)."""

    @staticmethod
    def forward(ctx, x, p):
        ctx.p, ctx.shape = p, x.shape
        return tuple(x.index_select(0, s).view(b, t, *x.shape[1:]) for s, b, t in zip(p.src, p.sizes, p.tops))

    @staticmethod
    def backward(ctx, *grads):
        p, shape = ctx.p, ctx.shape
        g = grads[0].new_empty(shape[0] + 1, *shape[1:])
        for d, gb, b, t in zip(p.dst, grads, p.sizes, p.tops):
            g.index_copy_(0, d, gb.reshape(-1, *shape[1:]) if gb is not None else g.new_zeros(b * t, *shape[1:]))
        return g[: shape[0]], None


class _FromBuckets(torch.autograd.Function):
    """[B, L, ...] per bucket -> packed [T, ...], padding rows dropped (written to a scratch row). Their
    gradient is exactly zero, so a padding query row adds nothing to the key / value gradients."""

    @staticmethod
    def forward(ctx, p, *outs):
        ctx.p, ctx.shape = p, outs[0].shape[2:]
        out = outs[0].new_empty(p.total + 1, *ctx.shape)
        for d, o in zip(p.dst, outs):
            out.index_copy_(0, d, o.reshape(-1, *ctx.shape))
        return out[: p.total]

    @staticmethod
    def backward(ctx, g):
        p = ctx.p
        return (None, *(g.index_select(0, s).index_fill_(0, pad, 0).view(b, t, *ctx.shape)
                        for s, pad, b, t in zip(p.src, p.pad, p.sizes, p.tops)))


def to_buckets(x: torch.Tensor, p: Plan) -> tuple[torch.Tensor, ...]:
    if p.whole:
        return (x.view(p.sizes[0], p.tops[0], *x.shape[1:]),)
    return _ToBuckets.apply(x, p)


def from_buckets(outs, p: Plan) -> torch.Tensor:
    if p.whole:
        return outs[0].reshape(p.total, *outs[0].shape[2:])
    return _FromBuckets.apply(p, *outs)
