"""Activation recompute applied from outside the model, on the blocks its ModelParts declares.

  full       every block's forward is checkpointed (Megatron --recompute-granularity full, uniform)
  selective  the calls the model names in ModelParts.selective (the attention core and the MLP
             activation) are checkpointed: their activations are recomputed in backward

Apply it last, after context parallel has swapped in its attention, so the recompute wraps that.
"""

from __future__ import annotations

from torch.utils.checkpoint import checkpoint

from backends.common.parallel.parts import ModelParts

MODES = ("none", "selective", "full")


class Recomputed:
    """fn, checkpointed while gradients are on (no activations kept; recomputed in backward)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        import torch

        if torch.is_grad_enabled():
            return checkpoint(self.fn, *args, use_reentrant=False, **kwargs)
        return self.fn(*args, **kwargs)


def apply_recompute(parts: ModelParts, mode: str) -> int:
    """Checkpoint the declared blocks (full) or calls (selective) in place; returns how many were wrapped."""
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(MODES)}")
    wrapped = 0
    for block in parts.block_list() if mode != "none" else ():
        if mode == "full":
            if isinstance(block.__dict__.get("forward"), Recomputed):
                raise RuntimeError("recompute is already applied to this model")
            block.forward = Recomputed(block.forward)
            wrapped += 1
            continue
        for module in block.modules():
            for attr in parts.selective:
                fn = module.__dict__.get(attr)
                if isinstance(fn, Recomputed):
                    raise RuntimeError("recompute is already applied to this model")
                if callable(fn):
                    setattr(module, attr, Recomputed(fn))
                    wrapped += 1
    return wrapped
