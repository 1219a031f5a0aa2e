"""Shared by test_resume.py and the torchrun worker: a tiny model and a deterministic train loop.

The batch of every step is drawn with torch.randint / random / numpy from the global RNGs, so a
resumed run only matches the uninterrupted one when the RNG states were restored.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

DIM, N_SAMPLES, BATCH = 16, 64, 4


class TinyNet(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 32, n_layers: int = 3):
        super().__init__()
        self.inp = nn.Linear(dim, hidden)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(0.0)) for _ in range(n_layers)
        )
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h).squeeze(-1)


def dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, DIM, generator=g)
    y = torch.randn(N_SAMPLES, generator=g)
    return x, y


def build(seed: int = 0, hidden: int = 32, total_steps: int = 6):
    torch.manual_seed(seed)
    model = TinyNet(hidden=hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (total_steps + 1))
    return model, opt, sched


def make_optim(model, total_steps: int = 6):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (total_steps + 1))
    return opt, sched


def train_steps(model, opt, sched, n: int, data, position: int = 0):
    """n optimizer steps; returns (losses, new data position)."""
    x, y = data
    losses = []
    for _ in range(n):
        idx = torch.randint(0, N_SAMPLES, (BATCH,))  # depends on the torch RNG
        scale = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())  # python + numpy RNG
        loss = ((model(x[idx] * scale) - y[idx]) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach().clone())
        position += BATCH
    return losses, position


def seed_all(seed: int):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
