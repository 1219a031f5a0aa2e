"""FSDP2 sharding of the RL models over the data-parallel ranks (VeRL's actor strategy fsdp / fsdp2).

The actor, the critic and the frozen reference are each sharded with the engine core's FSDP2-over-
blocks wrap (one unit per decoder block, the rest in the root), so a rank holds 1/world of their
parameters, gradients and optimizer states. Three things follow for the RL step:

- Rollout and the forward-only passes (old / reference log-probs, values) run inside `gathered`:
  every unit is all-gathered once and kept whole until the window closes. Generation stops at a
  different token count on each rank; with per-block gathers each decode step would be a
  collective every rank must join, so gathering once up front is both correct and far cheaper
  (two collectives per unit per rollout instead of two per unit per token). The peak is the whole
  model per rank for that window, as VeRL's hybrid engine holds it for vLLM.
- Updates run FSDP2's per-block gathers and reduce-scatters, so every rank must run the same number
  of forward / backward passes: `lockstep` pads a rank's micro-batch list with passes that
  contribute zero loss and zero gradients.
- The output projection is read after the root's forward (kernels.linear_logprobs), which works
  because FSDP2 keeps the root unit gathered from its forward to its backward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from backends.common.parallel import data_parallel
from backends.common.parallel.parts import ModelParts


def shard(model: nn.Module, parts: ModelParts, par: data_parallel.Parallel,
          reshard_after_forward: bool = True) -> nn.Module:
    """`model` sharded in place (parts: where its blocks are; the root is `model` itself).
    reshard_after_forward False keeps each block gathered from its forward to its backward
    (VeRL's fsdp_config.reshard_after_forward); the root always stays gathered (FSDP2's default)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in getattr(model, "vision_blocks", list)():  # a VL model's vision blocks: units of their own
        fully_shard(block, mesh=par.grad_mesh)
    model = data_parallel.fully_shard_blocks(model, parts, par)
    units = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            keep = reshard_after_forward if module is not model else False
            module.set_reshard_after_forward(keep, recurse=False)
            units.append((module, keep))
    model.rl_fsdp_units = units  # what `gathered` opens and restores
    return model


def is_sharded(model: nn.Module) -> bool:
    return bool(getattr(model, "rl_fsdp_units", None))


@contextlib.contextmanager
def gathered(model: nn.Module):
    """The whole model gathered on every rank for the duration (collective on entry and exit; nothing
    collective inside, so ranks may run different numbers of forward passes there). Not between a
    forward with gradients and its backward: the exit frees the gathered weights that graph holds."""
    units = getattr(model, "rl_fsdp_units", None)
    if not units:
        yield model
        return
    for unit, _ in units:
        unit.set_reshard_after_forward(False, recurse=False)  # forwards inside leave it gathered
        unit.unshard()
    try:
        yield model
    finally:
        for unit, keep in units:
            unit.reshard()
            unit.set_reshard_after_forward(keep, recurse=False)


def lockstep(micro: list[dict], device) -> list[dict]:
    """This rank's micro-batches padded to the most any rank has, with copies of its first one
    marked `padding` (the loss turns them into zero loss and zero gradients) and counting nothing."""
    count = torch.tensor([len(micro)], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    missing = int(count) - len(micro)
    if missing <= 0:
        return micro
    pad = {**micro[0], "mask": torch.zeros_like(micro[0]["mask"]), "n_tokens": 0, "n_positions": 0,
           "padding": True}
    return micro + [pad] * missing


def zero_touch(*tensors: torch.Tensor) -> torch.Tensor:
    """0 x the sum of tensors that depend on every trained parameter: a backward that reduce-scatters
    zero gradients for all of them (FSDP2 needs the same parameters to have gradients on every rank)."""
    return sum(t.float().sum() for t in tensors) * 0.0
