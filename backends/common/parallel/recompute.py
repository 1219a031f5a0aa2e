"""Activation recompute applied from outside the model, on the blocks its ModelParts declares.

  full       blocks are checkpointed (Megatron --recompute-granularity full), by `method`:
               uniform  consecutive groups of `num_layers` blocks, each group one checkpoint (only
                        each group's input is kept; default num_layers 1: every block)
               block    the first `num_layers` blocks of every chunk (pipeline stage or virtual
                        stage) one by one, the others not (default: all of them)
  selective  the calls the model names in ModelParts.selective (the attention core and the MLP
             activation) are checkpointed: their activations are recomputed in backward

Apply it last, after context parallel has swapped in its attention, so the recompute wraps that.
Grouping blocks needs their forwards called from the group's leader; FSDP2's per-block units
expect to see their own calls, so a group of several blocks is refused under FSDP2.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from backends.common.parallel.parts import ModelParts

MODES = ("none", "selective", "full")
METHODS = ("uniform", "block")


class Recomputed:
    """fn, checkpointed while gradients are on (no activations kept; recomputed in backward)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        import torch

        if torch.is_grad_enabled():
            return checkpoint(self.fn, *args, use_reentrant=False, **kwargs)
        return self.fn(*args, **kwargs)


class _Group:
    """A leader block's forward that runs its whole group (block(hidden, *rest) -> (hidden, aux))."""

    def __init__(self, forwards):
        self.forwards = forwards

    def __call__(self, hidden, *rest):
        total = None
        for forward in self.forwards:
            hidden, aux = forward(hidden, *rest)
            if aux is not None:
                total = aux if total is None else total + aux
        return hidden, total


def _passthrough(hidden, *rest):
    return hidden, None  # a group member its leader already ran


def _already(block: nn.Module) -> bool:
    return isinstance(block.__dict__.get("forward"), (Recomputed, type(_passthrough)))


def apply_recompute(parts: ModelParts, mode: str, *, method: str | None = None, num_layers: int | None = None,
                    chunks: list[list[nn.Module]] | None = None, fsdp: bool = False) -> int:
    """Checkpoint the declared blocks (full) or calls (selective) in place; returns how many checkpoints
    were made. chunks: the blocks of each pipeline (virtual) stage, in order (default: one chunk)."""
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(MODES)}")
    if method is not None and method not in METHODS:
        raise ValueError(f"recompute method {method!r} is not one of {', '.join(METHODS)}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"recompute num_layers must be at least 1, got {num_layers}")
    if mode == "none":
        return 0
    if mode == "selective":
        return _selective(parts)
    blocks = parts.block_list()
    if any(_already(b) for b in blocks):
        raise RuntimeError("recompute is already applied to this model")
    if method == "block":
        wrapped = 0
        for chunk in chunks or [blocks]:
            for block in chunk[:num_layers or len(chunk)]:
                block.forward = Recomputed(block.forward)
                wrapped += 1
        return wrapped
    n = num_layers or 1
    if n > 1 and fsdp:
        raise ValueError(f"recompute method uniform with {n} layers per group checkpoints several blocks as one, "
                         "which FSDP2's per-block units do not allow; use num_layers 1 or method block")
    wrapped = 0
    for chunk in chunks or [blocks]:  # groups never span two stages
        for start in range(0, len(chunk), n):
            group = chunk[start:start + n]
            group[0].forward = Recomputed(_Group([b.forward for b in group]) if len(group) > 1 else group[0].forward)
            for member in group[1:]:
                member.forward = _passthrough
            wrapped += 1
    return wrapped


def _selective(parts: ModelParts) -> int:
    wrapped = 0
    for block in parts.block_list():
        for module in block.modules():
            for attr in parts.selective:
                fn = module.__dict__.get(attr)
                if isinstance(fn, Recomputed):
                    raise RuntimeError("recompute is already applied to this model")
                if callable(fn):
                    setattr(module, attr, Recomputed(fn))
                    wrapped += 1
    return wrapped
