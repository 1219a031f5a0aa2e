"""The collectives the parallel code shares: one differentiable all-to-all and group queries.

`all_to_all` exchanges rows (dim 0) with any splits; its backward is the reverse exchange. Expert
parallel sends each rank its tokens (uneven splits); Ulysses CP turns sequence shards into head
shards with equal splits (`split_heads` / `gather_heads` below).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def group_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None) -> torch.Tensor:
    """Differentiable all_to_all_single: rows x[sum(input_splits[:r]) : ...] go to rank r of `group`;
    the result holds output_splits[s] rows from each rank s, in rank order."""
    return _AllToAll.apply(x, list(map(int, output_splits)), list(map(int, input_splits)), group)


def split_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[T, H, ...] rows of this rank -> [u·T, H/u, ...]: every member's rows (member-major) of this
    rank's share of the heads (Ulysses' sequence -> head sharding)."""
    u = group_size(group)
    t, h = x.shape[:2]
    if h % u:
        raise ValueError(f"{h} heads do not split over a group of {u}")
    send = x.reshape(t, u, h // u, *x.shape[2:]).transpose(0, 1).reshape(u * t, h // u, *x.shape[2:])
    return all_to_all(send, [t] * u, [t] * u, group)


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of split_heads: [u·T, H/u, ...] -> [T, H, ...] (this rank's rows, every head)."""
    u = group_size(group)
    t = x.shape[0] // u
    recv = all_to_all(x, [t] * u, [t] * u, group)  # block j: member j's heads of my rows
    return recv.reshape(u, t, *x.shape[1:]).transpose(0, 1).reshape(t, u * x.shape[1], *x.shape[2:])
