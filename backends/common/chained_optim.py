"""Several sharded optimizers stepped, clipped and checkpointed as one (Megatron's ChainedOptimizer).

Expert parallel with the distributed optimizer needs two ShardedAdamW (backends.common.zero): the
dense parameters' over dp × cp and the experts' over the expert-data-parallel group. The global grad
norm is the sum of both squared norms (each reduced over its own groups) under one root, and one
clip coefficient scales both.

It is a torch.optim.Optimizer whose param_groups are the children's own group dicts, in order, so
an LR scheduler writing group["lr"] drives every child, and torch.distributed.checkpoint
(get_state_dict / set_state_dict) sees one optimizer: state_dict() numbers the parameters across the
children in that order.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = ["ChainedOptimizer"]


class ChainedOptimizer(torch.optim.Optimizer):
    """`optimizers`: ShardedAdamW-like (grad_norm_power / scale_grads / state_bytes), disjoint params."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise ValueError("ChainedOptimizer got no optimizers")
        # the children's group dicts themselves (add_param_group keeps the dict it is given)
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})
        self._built = True
        self._sync_state()

    def _sync_state(self) -> None:
        # non-empty state marks "initialised" for torch.distributed.checkpoint, as in each child
        self.state.clear()
        for o in self.optimizers:
            self.state.update(o.state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        self._sync_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, groups=(), uncounted=()) -> torch.Tensor:
        """The global norm over every child's parameters; one coefficient clips them all. Collective."""
        powers = [o.grad_norm_power(norm_type, groups=groups, uncounted=uncounted) for o in self.optimizers]
        if math.isinf(float(norm_type)):
            total = torch.stack(powers).max()
        else:
            total = torch.stack(powers).sum() ** (1.0 / float(norm_type))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for o in self.optimizers:
            o.scale_grads(coef)
        return total

    def state_bytes(self) -> int:
        return sum(o.state_bytes() for o in self.optimizers)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError("ChainedOptimizer's groups are its children's; add to a child before chaining")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The children's state dicts with the parameters numbered on across them (collective)."""
        state, groups, offset = {}, [], 0
        for o in self.optimizers:
            sd = o.state_dict()
            state.update({offset + k: v for k, v in sd["state"].items()})
            groups.extend({**g, "params": [offset + k for k in g["params"]]} for g in sd["param_groups"])
            offset += sum(len(g["params"]) for g in o.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each child reads its own param groups (in order) and the states they name."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved)} param groups, the chained optimizers "
                             f"{len(self.param_groups)}")
        at = 0
        for o in self.optimizers:
            n = len(o.param_groups)
            o.load_state_dict({"state": state_dict["state"], "param_groups": saved[at:at + n]})
            at += n
        self._sync_state()
