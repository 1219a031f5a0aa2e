"""A model's declaration of its parts, which is all the parallel code knows of it (torchtitan keeps
the same facts in each model's parallelize function; here they are data).

A model exposes `parts() -> ModelParts`. Names are module paths under the model (`get_submodule`).
Blocks are the repeated units: FSDP2 shards one unit per block, the pipeline cuts between them, full
recompute checkpoints each. A block is called `block(hidden, *block_inputs(position_ids, dtype),
cu_seqlens)` and returns `(hidden, aux loss or None)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass
class ModelParts:
    root: nn.Module
    blocks: str                 # the ModuleList (or, once pipeline-pruned, ModuleDict) of blocks
    embedding: str              # the token embedding
    norm: str                   # the final norm
    head: str | None            # the output projection; None when it is tied to the embedding
    attention: str              # the attention module inside a block
    mlp: str                    # the MLP / MoE module inside a block
    block_norms: tuple[str, ...] = ()   # norms inside a block
    # per-forward tensors every block takes after the hidden states (rotary tables): (position_ids, dtype)
    block_inputs: Callable | None = None
    # attributes (callables) of a block's modules that selective recompute checkpoints
    selective: tuple[str, ...] = ()
    hidden_size: int = 0

    @property
    def tied(self) -> bool:
        return self.head is None

    def get(self, name: str) -> nn.Module:
        return self.root.get_submodule(name)

    def has(self, name: str) -> bool:
        try:
            self.root.get_submodule(name)
        except AttributeError:
            return False
        return True

    def block_list(self) -> list[nn.Module]:
        blocks = self.get(self.blocks)
        return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)

    def output_module(self) -> nn.Module:
        return self.get(self.embedding if self.tied else self.head)

    def output_weight(self):
        return self.output_module().weight
