"""A tiny model that splits into pipeline-like stages (test_stage_resume.py and its torchrun worker).

Blocks sit in a ModuleDict keyed by their global index, so a stage's parameter names are the whole model's
(as the engines' pruned stages keep them). Each stage has a loss of its own on batches drawn from the step
number, so the whole model trained on the sum of the two losses takes the same steps as the two stages.
"""

from __future__ import annotations

import torch
from torch import nn

from backends.common.optim import build_optimizer, build_scheduler

DIM, BLOCKS = 8, 4


class StagedNet(nn.Module):
    def __init__(self, blocks=range(BLOCKS), first: bool = True, last: bool = True):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every layout
        whole = {"inp": nn.Linear(DIM, DIM), "blocks": [nn.Linear(DIM, DIM) for _ in range(BLOCKS + 1)],
                 "out": nn.Linear(DIM, 1)}
        self.inp = whole["inp"] if first else None
        self.blocks = nn.ModuleDict({str(i): whole["blocks"][i] for i in blocks})
        self.out = whole["out"] if last else None

    def stage_losses(self, step: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x, h_in, y = torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g), torch.randn(4, generator=g)
        out = []
        if self.inp is not None:  # the first stage: its blocks' output pulled towards zero
            h = self.inp(x)
            for i in ("0", "1"):
                h = h + torch.tanh(self.blocks[i](h))
            out.append(h.pow(2).mean())
        if self.out is not None:  # the last stage: regression from a given hidden state
            h = h_in
            for i in ("2", "3"):
                h = h + torch.tanh(self.blocks[i](h))
            out.append((self.out(h).squeeze(-1) - y).pow(2).mean())
        return out


def optimizer_and_schedule(model: nn.Module):
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    return opt, build_scheduler(opt, lr=1e-2, min_lr=1e-3, warmup=2, total=8, style="cosine")


def stage_steps(model: StagedNet, opt, sched, start: int, n: int) -> list[torch.Tensor]:
    """Optimizer steps start+1 .. start+n -> the summed loss of each."""
    losses = []
    for step in range(start + 1, start + n + 1):
        loss = sum(model.stage_losses(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach().clone())
    return losses
