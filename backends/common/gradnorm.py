"""The global gradient norm when ranks hold different parameters (pipeline stages, expert shards).

torch's clip_grad_norm_ sees one rank's parameters. With pipeline parallel each stage holds other
layers (and with expert parallel each ep rank other experts), so the squared norms are summed over
that group first (Megatron's get_grad_norm_fp32 with its model-parallel group). Data-parallel
replicas hold the same reduced gradient and are counted once, i.e. not summed over.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist


def _square_norm(grad: torch.Tensor) -> torch.Tensor:
    sq = torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
    return sq.full_tensor() if hasattr(sq, "full_tensor") else sq  # DTensor grads: sum over their mesh


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, *, groups: Sequence = (),
                    counted: Callable[[torch.Tensor], bool] = lambda p: True,
                    device: torch.device | None = None) -> torch.Tensor:
    """Clip in place to `max_norm` (inf: measure only) and return the global norm (fp32 scalar).

    `groups`: process groups whose ranks hold different parameters (e.g. the pp group); the
    squared norm is summed over each. DTensor gradients (TP shards, Shard(0) expert weights) count
    their whole tensor already (full_tensor of the local square sums). Every rank must call this
    with the same groups (the all-reduces are collective), whether or not it holds any gradient.
    Parameters not `counted` (a second copy of a tied weight) are clipped but add nothing to the norm."""
    params = [p for p in params if p.grad is not None]
    if device is None:
        device = params[0].grad.device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if counted(p):
            total += _square_norm(p.grad).to(device)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    norm = total.sqrt()
    if max_norm != float("inf"):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.device))
    return norm
