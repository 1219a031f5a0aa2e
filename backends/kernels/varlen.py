"""Sequences (batched, or packed documents by cu_seqlens) as one padded [N, Lp, ...] batch for the
chunked scans: document n at row n, its tokens first, zero rows after, Lp a multiple of the chunk.

The scans make zero rows an identity step (no decay, no input), so a document's final state is the
state after its padded row, and documents never see each other: the state resets per row.
Moving tokens in and out is one index_select each way (no Python work per document).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    n: int  # documents (rows)
    padded_len: int  # Lp, a multiple of the chunk
    src: torch.Tensor  # [n*Lp] token each padded position reads; padding reads the zero row (index T)
    keep: torch.Tensor  # [T] padded position of each token, in token order
    tokens: int  # T

    @property
    def identity(self) -> bool:
        """Every row full (equal lengths, a multiple of the chunk): the tokens are the rows, as a view."""
        return self.n * self.padded_len == self.tokens


def lengths_of(cu_seqlens) -> list[int]:
    bounds = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def layout(lengths: list[int], chunk: int, device) -> Layout:
    total = sum(lengths)
    lp = max(chunk, -(-max(lengths, default=0) // chunk) * chunk)
    n = len(lengths)
    lens = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(lp)
    real = pos[None, :] < lens[:, None]
    src = torch.where(real, starts[:, None] + pos[None, :], torch.full_like(real, total, dtype=torch.long))
    keep = (torch.arange(n)[:, None] * lp + pos[None, :])[real]
    return Layout(n, lp, src.reshape(-1).to(device), keep.to(device), total)


def to_rows(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """[T, ...] tokens -> [N, Lp, ...] with zero padding."""
    if lay.identity:
        return x.reshape(lay.n, lay.padded_len, *x.shape[1:])
    src = torch.cat((x, x.new_zeros(1, *x.shape[1:])))
    return src.index_select(0, lay.src).reshape(lay.n, lay.padded_len, *x.shape[1:])


def from_rows(y: torch.Tensor, lay: Layout) -> torch.Tensor:
    """[N, Lp, ...] -> [T, ...] (padding dropped)."""
    if lay.identity:
        return y.reshape(lay.tokens, *y.shape[2:])
    return y.reshape(lay.n * lay.padded_len, *y.shape[2:]).index_select(0, lay.keep)


def flat_layout(batch: int, seqlen: int, cu_seqlens, chunk: int, device) -> Layout:
    """Layout of [B, S, ...] inputs flattened to [B*S, ...]: the documents of cu_seqlens (then B must
    be 1) or the B rows."""
    lengths = lengths_of(cu_seqlens) if cu_seqlens is not None else [seqlen] * batch
    return layout(lengths, chunk, device)


def check_cu_seqlens(cu_seqlens, batch: int, seqlen: int, what: str) -> None:
    if cu_seqlens is None:
        return
    if batch != 1:
        raise ValueError(f"{what}: packed inputs (cu_seqlens) must have batch size 1, got {batch}")
    bounds = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seqlen or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{what}: cu_seqlens must be non-decreasing from 0 to T={seqlen}, got {bounds}")


def doc_ids(cu_seqlens, device=None) -> torch.Tensor:
    """[0, 3, 5] -> int32 [[0, 0, 0, 1, 1]]: causal_conv1d's / mamba_ssm's seq_idx for packed [1, T] inputs."""
    lens = torch.tensor(lengths_of(cu_seqlens), device=device)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens).to(torch.int32)[None]
