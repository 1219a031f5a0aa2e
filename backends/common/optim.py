"""AdamW with Megatron's parameter groups and learning-rate schedule."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr: float, min_lr: float, warmup: float, total: int, style: str) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr.

    Megatron's OptimizerParamScheduler as its training loop steps it (held against megatron-core 0.12.1 in
    tests/common/test_trainer_step.py), and VeRL's and transformers' warm-up alike: step s trains at
    lr·s/warmup (the first at 0), lr from step `warmup` on; `warmup` may be fractional (Megatron counts it
    in samples: --lr-warmup-fraction of the decay steps). Cosine and linear decay run from lr to min_lr over
    the steps after warm-up; constant stays at lr.
    """
    if warmup > 0 and step < warmup:
        return lr * step / warmup
    if style == "constant":
        return lr
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr decay style {style!r}; choose cosine, linear or constant")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm weights (1-D) are not decayed, as in Megatron."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float = 1e-8) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters (is everything frozen?)")
    params = [p for g in groups for p in g["params"]]
    if _fused_ok(params):
        # one pass over each parameter and its two moments, no temporaries: what transformers' Trainer
        # (and so LLaMA-Factory) uses by default ("adamw_torch_fused"); the per-tensor loop below
        # makes ~10 passes and allocates two parameter-sized temporaries per tensor
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    # foreach=False keeps DTensor (FSDP2) parameters and plain tensors on the same code path
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


_FUSED_DEVICES = ("cpu", "cuda")  # where torch's fused AdamW kernel is built and tested here


def _fused_ok(params: list[torch.Tensor]) -> bool:
    """Fused AdamW for plain floating-point tensors on one CPU or CUDA device (not DTensors)."""
    devices = {p.device for p in params}
    return (len(devices) == 1 and next(iter(devices)).type in _FUSED_DEVICES
            and all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point() for p in params))


def build_scheduler(optimizer: torch.optim.Optimizer, *, lr: float, min_lr: float, warmup: float, total: int,
                    style: str) -> torch.optim.lr_scheduler.LambdaLR:
    lr_at(0, lr=lr, min_lr=min_lr, warmup=warmup, total=total, style=style)  # reject a bad style up front
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, lr=lr, min_lr=min_lr, warmup=warmup, total=total, style=style) / lr)
