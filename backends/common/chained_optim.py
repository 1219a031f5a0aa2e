"""Several sharded optimizers stepped, clipped and checkpointed as one (Megatron's ChainedOptimizer).

Expert parallel with the distributed optimizer needs two ShardedAdamW (backends.common.zero): the
dense parameters' over dp × cp and the experts' over the expert-data-parallel group. The global grad
norm is the sum of both squared norms (each reduced over its own groups) under one root, and one
clip coefficient scales both.

It is a torch.optim.Optimizer, so torch.distributed.checkpoint (get_state_dict / set_state_dict)
and an LR scheduler see one optimizer. Its param_groups are either the children's own group dicts
(an LR scheduler writing group["lr"] drives them directly), or `groups` given by the caller: the
groups one optimizer over the same model would have (the engine passes Megatron's decay / no-decay
groups). Then state_dict() is exactly that one optimizer's, so a checkpoint moves between a layout
with one optimizer (no ep) and one with two (ep), and the children's groups take their
hyperparameters from the shown group holding their parameters before every step.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = ["ChainedOptimizer"]


class ChainedOptimizer(torch.optim.Optimizer):
    """`optimizers`: ShardedAdamW-like (grad_norm_power / scale_grads / state_bytes), disjoint params.

    `groups`: the param groups to show (the scheduler, the state dict), e.g. the ones a single
    optimizer over the same model would have, so a checkpoint moves between layouts that split the
    parameters over one or several optimizers; each child group takes its hyperparameters from the
    shown group holding its parameters. None: the children's own groups."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], groups: list[dict] | None = None):
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise ValueError("ChainedOptimizer got no optimizers")
        own = [g for o in self.optimizers for g in o.param_groups]
        if groups is not None:
            shown = [q for g in groups for q in g["params"]]
            held = [q for g in own for q in g["params"]]
            if len(shown) != len(held) or {id(q) for q in shown} != {id(q) for q in held}:
                raise ValueError("ChainedOptimizer: the shown groups must hold exactly the children's parameters")
            where = {id(q): i for i, g in enumerate(groups) for q in g["params"]}
            if any(len({where[id(q)] for q in c["params"]}) > 1 for c in own):
                raise ValueError("ChainedOptimizer: a child's param group spans several shown groups")
            for g in groups:  # hyperparameters the caller left out: the child's
                first = next(c for c in own if any(q is g["params"][0] for q in c["params"]))
                for key, value in first.items():
                    g.setdefault(key, value)
        # the group dicts themselves (add_param_group keeps the dict it is given)
        super().__init__(own if groups is None else groups, {})
        self._built = True
        self._place = {}  # id(param) -> (child, its index in the child's state dict)
        for k, o in enumerate(self.optimizers):
            for j, q in enumerate(q for g in o.param_groups for q in g["params"]):
                self._place[id(q)] = (k, j)
        group_of = {id(q): g for g in self.param_groups for q in g["params"]}
        self._links = [(c, group_of[id(c["params"][0])]) for c in own if c["params"]]
        self._sync_state()

    def _sync_hyperparameters(self) -> None:
        for child, shown in self._links:
            if child is not shown:
                child.update({k: v for k, v in shown.items() if k != "params"})

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
        self._sync_hyperparameters()
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

    def _shown_params(self) -> list:
        return [q for g in self.param_groups for q in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """The children's states (ShardedAdamW: this rank's shards, for DCP), numbered as the shown
        groups list the parameters."""
        return self._combined([o.state_dict() for o in self.optimizers])

    def full_state_dict(self) -> dict[str, Any]:
        """Export: the children's full_state_dict() (gathered, collective), numbered as state_dict()."""
        return self._combined([o.full_state_dict() for o in self.optimizers])

    def _combined(self, sds: list[dict[str, Any]]) -> dict[str, Any]:
        self._sync_hyperparameters()
        state, groups, index = {}, [], 0
        for g in self.param_groups:
            ids = []
            for q in g["params"]:
                k, j = self._place[id(q)]
                if j in sds[k]["state"]:
                    state[index] = sds[k]["state"][j]
                ids.append(index)
                index += 1
            k, j = self._place[id(g["params"][0])]  # the child's group entries (its AdamW flags) first
            base = next(c for c in sds[k]["param_groups"] if j in c["params"])
            groups.append({**base, **{key: v for key, v in g.items() if key != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The shown groups' state dict: hyperparameters into the shown groups, each parameter's state
        to the child holding it."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or \
                [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"state dict has param groups of sizes {[len(g['params']) for g in saved]}, the "
                             f"chained optimizer {[len(g['params']) for g in self.param_groups]}")
        for mine, theirs in zip(self.param_groups, saved):
            mine.update({k: (tuple(v) if k == "betas" else v) for k, v in theirs.items() if k != "params"})
        self._sync_hyperparameters()
        per_child: list[dict] = [{} for _ in self.optimizers]
        for q, key in zip(self._shown_params(), (i for g in saved for i in g["params"])):
            k, j = self._place[id(q)]
            if key in state_dict["state"]:
                per_child[k][j] = state_dict["state"][key]
        for o, states in zip(self.optimizers, per_child):
            groups, index = [], 0
            for g in o.param_groups:
                groups.append({**{k: v for k, v in g.items() if k != "params"},
                               "params": list(range(index, index + len(g["params"])))})
                index += len(g["params"])
            o.load_state_dict({"state": states, "param_groups": groups})
        self._sync_state()
