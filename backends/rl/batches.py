"""How one step's responses are laid out: the rollouts of a step, its mini-batches of whole prompt groups and each
data-parallel rank's share of them, padded token rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollouts:
    """This rank's responses, grouped by prompt (n consecutive rows per group)."""
    prompts: list[list[int]]          # per response
    responses: list[list[int]]
    scores: list[float]               # the scalar reward of each response
    groups: list[int]                 # global group index (the training order)
    extra: dict[str, list[float]]


def mini_batches(groups: list[int], mini_batch_size: int, world: int) -> list[list[int]]:
    """Rows (responses) of each mini-batch of mini_batch_size groups, in global order; a last mini-batch
    with fewer responses than ranks joins the one before it."""
    n_groups = max(groups, default=-1) + 1
    out = [[i for i, g in enumerate(groups) if first <= g < first + mini_batch_size]
           for first in range(0, n_groups, mini_batch_size)]
    if len(out) > 1 and len(out[-1]) < world:
        out[-2] += out.pop()
    return [rows for rows in out if len(rows) >= world]


def share(rows: list[int], world: int, rank: int) -> list[int]:
    """A rank's contiguous slice of a mini-batch's rows (near-equal slices, rank order)."""
    base, extra = divmod(len(rows), world)
    start = rank * base + min(rank, extra)
    return rows[start:start + base + (rank < extra)]


def pad(rows: list[list[int]], value: int = 0) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out
