"""A small transformer that is not backends.llm's (LayerNorm, GELU MLP, its own attention), declaring
its parts, so tests can hold the shared parallel code to "any model that declares its parts"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.common.parallel.parts import ModelParts

VOCAB, HIDDEN, HEADS, LAYERS = 48, 32, 4, 4


def _attend(q, k, v, cu_seqlens, scale):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          scale=scale).transpose(1, 2)


class ToyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HIDDEN // HEADS
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.o = nn.Linear(HIDDEN, HIDDEN)
        self.core_attention = _attend

    def forward(self, x, cu_seqlens=None):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, self.num_heads, self.head_dim) for proj in (self.q, self.k, self.v))
        return self.o(self.core_attention(q, k, v, cu_seqlens, self.head_dim ** -0.5).reshape(b, s, -1))


class ToyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        self.act = F.gelu

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(HIDDEN), ToyAttention(), ToyMLP()

    def forward(self, hidden, cu_seqlens=None):
        hidden = hidden + self.attn(self.norm(hidden), cu_seqlens)
        return hidden + self.mlp(hidden), None


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(ToyBlock() for _ in range(LAYERS))
        self.final = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def parts(self) -> ModelParts:
        return ModelParts(self, blocks="blocks", embedding="embed", norm="final", head="head", attention="attn",
                          mlp="mlp", block_norms=("norm",), selective=("core_attention", "act"), hidden_size=HIDDEN)

    def forward(self, ids):
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden, _ = block(hidden)
        return self.final(hidden)


def toy_batch(batch: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels[0, :2] = -100
    return ids, labels
