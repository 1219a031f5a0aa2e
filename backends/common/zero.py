"""Distributed optimizer (ZeRO-1, Megatron's --use-distributed-optimizer): AdamW whose states are
sharded over the data-parallel group as contiguous slices of the flattened parameters.

Layout. The trainable parameters, in param-group order, are laid end to end in one flat index
space of N elements, padded to a multiple of dp; dp rank r owns the elements
[r*S, (r+1)*S), S = ceil(N / dp), whatever parameter boundaries fall inside (so the states are
balanced to within one element, unlike per-parameter partitioning). A rank keeps, for its slice
only: exp_avg and exp_avg_sq in fp32, plus an fp32 master copy when any parameter is of lower
precision (bf16 / fp16). Parameters themselves stay full (replicated) on every rank (ZeRO-1).

Step:
  1. reduce-scatter the flattened grads (fp32) over dp; with grad_reduce="mean" (default) the sum is
     divided by dp — the optimizer replaces DDP's all-reduce, so do not wrap the model in DDP
     (or use DDP's no_sync everywhere); grads of a parameter that is None on a rank count as zero;
  2. AdamW on the owned slice, bit for bit torch.optim.AdamW's single-tensor update (per-parameter
     step counts; a parameter with no grad on any rank is skipped, as torch does);
  3. all-gather the updated slices and copy them into the parameters.
Clipping needs the global norm: call `optimizer.clip_grad_norm_(max_norm)` after backward and before
step() (it reduce-scatters the grads and computes the norm over all shards); do not clip the
parameters' .grad with torch.nn.utils.clip_grad_norm_ — those are the local, unreduced grads.

Checkpoints:
  * state_dict() (collective: every dp rank must call it) gathers the shards into a regular
    torch.optim.AdamW state dict ({"state": {i: {"step", "exp_avg", "exp_avg_sq"[, "master"]}},
    "param_groups": [...]}), identical on every rank. It loads into torch.optim.AdamW and back, and
    load_state_dict() re-shards it for the current dp size, so a run saved at dp=2 resumes at dp=4.
    torch.distributed.checkpoint: get_state_dict / set_state_dict (hence
    backends.common.checkpoint.save_checkpoint / load_checkpoint) work unchanged — the gathered
    tensors are replicated over dp (plain, or DTensors of the parameter's tp / ep layout: see below),
    DCP writes them once (deduplicated) and any world size reads them back. The price is one full
    copy of this rank's parameters' states while saving/loading.
  * sharded_state_dict() / load_sharded_state_dict(): this rank's shard only, no communication
    (torch.save one file per rank); resuming needs the same dp size and parameter layout.

DTensor parameters (tensor parallel; expert parallel's Shard(0) experts): the flat layout, the grads,
the update and the write-back use each rank's local shard (`to_local()`), so one ShardedAdamW runs per
tp (or ep) coordinate over that coordinate's data-parallel group, whose members hold the same local
shapes. The clip norm sums a Shard-placed parameter's part over its mesh's group and counts a
replicated one once. state_dict() returns, for such a parameter, DTensor states with the parameter's
mesh and placements (DCP then writes each piece under the one name and reshards on load, e.g. a
tp2 checkpoint into tp1); load_state_dict() takes those or plain full tensors (sliced like the
parameter).

With expert parallelism the expert weights are not data-parallel over dp: they get their own
ShardedAdamW over the expert-data-parallel group and the other parameters this one over dp × cp,
stepped and clipped together by backends.common.chained_optim.ChainedOptimizer (one global norm).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["ShardedAdamW", "build_sharded_optimizer"]

_ADAMW_FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                    fused=None, decoupled_weight_decay=True)
_SHARD_FORMAT = "backends.common.zero/shard-v1"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: a DTensor's local shard (under no_grad the live storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_groups(p: torch.Tensor) -> tuple:
    """The process groups over which a DTensor parameter's local pieces differ (its Shard mesh dims);
    () for plain and replicated parameters, whose pieces are the same on every such rank."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(p.device_mesh.get_group(d) for d, pl in enumerate(p.placements) if pl.is_shard())


def _reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, flat, group=group)


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, shard, group=group)


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW with ZeRO-1 flat-slice state sharding over `dp_group` (a ProcessGroup or 1-D DeviceMesh;
    None: the default group; without an initialised process group it runs unsharded, dp = 1).
    See the module docstring.

    param_groups work as usual (lr / weight_decay / betas / eps per group; LR schedulers write
    group["lr"]). amsgrad / maximize are not supported."""

    def __init__(self, params: Iterable, dp_group=None, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, grad_reduce: str = "mean", **unsupported):
        for key in ("amsgrad", "maximize"):
            if unsupported.pop(key, False):
                raise ValueError(f"ShardedAdamW does not implement {key}=True")
        for key in ("foreach", "fused", "capturable", "differentiable"):
            unsupported.pop(key, None)  # implementation switches of torch's AdamW: no meaning here
        if unsupported:
            raise TypeError(f"ShardedAdamW got unexpected arguments: {', '.join(sorted(unsupported))}")
        if grad_reduce not in ("mean", "sum"):
            raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {grad_reduce!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        if hasattr(dp_group, "get_group"):  # a 1-D DeviceMesh
            dp_group = dp_group.get_group()
        self.dp_group = dp_group
        if dist.is_available() and dist.is_initialized():
            self.dp_world, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        else:
            self.dp_world, self.dp_rank = 1, 0
        self.grad_reduce = grad_reduce
        self._params: list[torch.nn.Parameter] = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in self._params}) != len(self._params):
            raise ValueError("a parameter appears twice in the optimizer's param groups")
        if not self._params:
            raise ValueError("ShardedAdamW got no parameters")
        # DTensor parameters (tensor / expert parallel): the optimizer works on the local shards; every
        # member of dp_group must hold the same local shapes (the same tp / ep coordinate)
        devices = {p.device for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        self._device = devices.pop()
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._numels = [_local(p).numel() for p in self._params]
        self._offsets = [0]
        for n in self._numels:
            self._offsets.append(self._offsets[-1] + n)
        self.numel = self._offsets[-1]
        self.shard_size = math.ceil(self.numel / self.dp_world)
        self._lo = min(self.dp_rank * self.shard_size, self.numel)
        self._hi = min(self._lo + self.shard_size, self.numel)
        # pieces: (param index, start, end in the parameter's flat view, start in my shard)
        self._pieces: list[tuple[int, int, int, int]] = []
        for i, (off, n) in enumerate(zip(self._offsets, self._numels)):
            a, b = max(off, self._lo), min(off + n, self._hi)
            if a < b:
                self._pieces.append((i, a - off, b - off, a - self._lo))
        self._norm_sets, self._norm_ranges = self._norm_layout()
        dtypes = {p.dtype for p in self._params}
        self._gather_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.has_master = any(p.dtype in _LOW_PRECISION for p in self._params)
        owned = self._hi - self._lo
        f32 = dict(dtype=torch.float32, device=self._device)
        self.exp_avg = torch.zeros(owned, **f32)
        self.exp_avg_sq = torch.zeros(owned, **f32)
        self.master = self._shard_of_params(torch.float32) if self.has_master else None
        self._steps = [0] * len(self._params)
        self._grad_shard: torch.Tensor | None = None  # reduced grads of my slice (after reduce_grads)
        self._grad_mask: list[bool] | None = None

    # ------------------------------------------------------------------ layout helpers

    def _shard_of_params(self, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self._hi - self._lo, dtype=dtype, device=self._device)
        for i, a, b, s in self._pieces:
            out[s:s + b - a] = _local(self._params[i]).detach().reshape(-1)[a:b]
        return out

    def _norm_layout(self) -> tuple[list[tuple], list[list[tuple[int, int]]]]:
        """The distinct shard-group sets of the parameters (first: none, the replicated ones) and, for
        each, the ranges of my slice that belong to it. The sets come from every parameter, not just
        my pieces, so all ranks run the same norm collectives."""
        sets, keys, set_of = [()], [()], []
        for p in self._params:
            groups = _shard_groups(p)
            key = tuple(tuple(dist.get_process_group_ranks(g)) for g in groups)
            if key not in keys:
                keys.append(key)
                sets.append(groups)
            set_of.append(keys.index(key))
        ranges: list[list[tuple[int, int]]] = [[] for _ in sets]
        for i, a, b, s in self._pieces:
            spans = ranges[set_of[i]]
            if spans and spans[-1][1] == s:  # adjacent pieces of one set: one range
                spans[-1] = (spans[-1][0], s + b - a)
            else:
                spans.append((s, s + b - a))
        return sets, ranges

    def _padded(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.zeros(self.shard_size, dtype=dtype, device=self._device)
        buf[:shard.numel()] = shard
        return buf

    def _gather_flat(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """All my-slice tensors -> the full flat [N] tensor (collective)."""
        if self.dp_world == 1:
            return shard.to(dtype).clone()
        full = torch.empty(self.shard_size * self.dp_world, dtype=dtype, device=self._device)
        _all_gather(full, self._padded(shard, dtype), self.dp_group)
        return full[:self.numel]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (moments, master)."""
        tensors = [self.exp_avg, self.exp_avg_sq] + ([self.master] if self.master is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ grads

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Reduce-scatter the parameters' grads into this rank's slice (idempotent until zero_grad)."""
        if self._grad_shard is not None:
            return
        has = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32, device=self._device)
        flat = torch.zeros(self.shard_size * self.dp_world, dtype=torch.float32, device=self._device)
        for i, p in enumerate(self._params):
            if p.grad is not None:
                grad = _local(p.grad)
                if grad.is_sparse:
                    raise RuntimeError("ShardedAdamW does not support sparse gradients")
                flat[self._offsets[i]:self._offsets[i + 1]] = grad.reshape(-1)
        if self.dp_world > 1:
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.dp_group)
            shard = torch.empty(self.shard_size, dtype=torch.float32, device=self._device)
            _reduce_scatter(shard, flat, self.dp_group)
            if self.grad_reduce == "mean":
                shard.div_(self.dp_world)
        else:
            shard = flat
        self._grad_shard = shard[:self._hi - self._lo]
        self._grad_mask = [bool(v) for v in has.tolist()]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, groups=(), uncounted=()) -> torch.Tensor:
        """Global grad norm over all shards (of the reduced grads); scales them by
        max_norm / (norm + 1e-6) when that is below 1, as torch.nn.utils.clip_grad_norm_. Collective.
        `groups`: further process groups whose ranks hold other parameters (pipeline stages), summed
        over too; `uncounted`: parameters clipped but left out of the norm (a tied weight's 2nd copy).
        DTensor parameters count whole: see grad_norm_power."""
        power = self.grad_norm_power(norm_type, groups=groups, uncounted=uncounted)
        total = power if math.isinf(float(norm_type)) else power ** (1.0 / float(norm_type))
        self.scale_grads(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    @torch.no_grad()
    def grad_norm_power(self, norm_type: float = 2.0, *, groups=(), uncounted=()) -> torch.Tensor:
        """sum |g|^norm_type (max |g| for inf) over every element of the reduced grads, on every rank.
        Collective over dp, the shard groups of DTensor parameters (a Shard-placed parameter's local
        slice differs per tp / ep rank, so its part is summed over that group; a replicated one
        counts once) and `groups`. For combining several optimizers' norms (ChainedOptimizer)."""
        self.reduce_grads()
        g = self._grad_shard
        norm_type = float(norm_type)
        inf = math.isinf(norm_type)
        skip = {id(p) for p in uncounted}
        counted = g
        if skip:
            counted = g.clone()
            for i, a, b, s in self._pieces:
                if id(self._params[i]) in skip:
                    counted[s:s + b - a] = 0
        powered = counted.abs() if inf else counted.abs() ** norm_type
        zero = torch.zeros((), dtype=torch.float32, device=self._device)
        parts = []
        for spans in self._norm_ranges:
            values = torch.cat([powered[a:b] for a, b in spans]) if spans else zero.reshape(1)
            parts.append((values.max() if inf else values.sum()) if values.numel() else zero)
        local = torch.stack(parts)
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        if self.dp_world > 1:  # dp_group None is the default group
            dist.all_reduce(local, op=op, group=self.dp_group)
        total = local[0:1].clone()
        for k in range(1, len(parts)):
            part = local[k:k + 1].clone()
            for group in self._norm_sets[k]:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(part, op=op, group=group)
            total = torch.maximum(total, part) if inf else total + part
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, op=op, group=group)
        return total[0]

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        """Multiply the reduced grads of my slice (the clip coefficient)."""
        self.reduce_grads()
        self._grad_shard.mul_(coef)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._grad_shard = None
        self._grad_mask = None

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_grads()
        grads, mask = self._grad_shard, self._grad_mask
        work = self.master if self.master is not None else self._shard_of_params(torch.float32)
        stepped = [i for i, has in enumerate(mask) if has]
        for i in stepped:
            self._steps[i] += 1
        for i, a, b, s in self._pieces:
            if not mask[i]:
                continue
            group = self.param_groups[self._group_of[i]]
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            wd, eps = group["weight_decay"], group["eps"]
            e = s + b - a
            param, grad = work[s:e], grads[s:e]
            exp_avg, exp_avg_sq = self.exp_avg[s:e], self.exp_avg_sq[s:e]
            step = self._steps[i]
            # torch.optim.adamw._single_tensor_adamw, operation for operation
            param.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)
        self._write_params(work)
        self._grad_shard = None  # the next step reduces the grads again (even without zero_grad)
        self._grad_mask = None
        for i in stepped:  # non-empty self.state marks "initialised" for torch.distributed.checkpoint
            self.state[self._params[i]] = {"step": torch.tensor(float(self._steps[i]))}
        return loss

    def _write_params(self, work: torch.Tensor) -> None:
        full = self._gather_flat(work, self._gather_dtype)
        for i, p in enumerate(self._params):
            local = _local(p)
            local.copy_(full[self._offsets[i]:self._offsets[i + 1]].view(local.shape))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_params"):
            raise RuntimeError("ShardedAdamW fixes its flat layout at construction; build a new one instead")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ checkpoints

    def _group_dicts(self) -> list[dict]:
        out, index = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d.update({k: v for k, v in _ADAMW_FLAGS.items() if k not in d})
            d["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            out.append(d)
        return out

    @staticmethod
    def _like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """A state tensor in the parameter's layout: a DTensor with its mesh and placements (each
        tp / ep rank's piece under one name, as DCP needs), else the plain tensor."""
        if not isinstance(p, DTensor):
            return local
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    @staticmethod
    def _local_value(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A saved state tensor as this rank's local piece of `p`: a DTensor of p's layout gives its
        local shard; a plain full tensor (another layout, e.g. saved at tp1) is sliced like p."""
        if isinstance(value, DTensor):
            if (isinstance(p, DTensor) and value.device_mesh == p.device_mesh
                    and tuple(value.placements) == tuple(p.placements)):
                return value.to_local()
            value = value.full_tensor()  # another layout: collective over value's mesh
        if isinstance(p, DTensor) and tuple(value.shape) == tuple(p.shape):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            return value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        return value

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The full torch.optim.AdamW-format state dict (collective over dp; same on every dp rank).
        DTensor parameters get DTensor states of their layout (this rank's tp / ep piece)."""
        moments = {"exp_avg": self._gather_flat(self.exp_avg, torch.float32),
                   "exp_avg_sq": self._gather_flat(self.exp_avg_sq, torch.float32)}
        if self.master is not None:
            moments["master"] = self._gather_flat(self.master, torch.float32)
        state = {}
        for i, p in enumerate(self._params):  # every parameter, stepped or not: a fixed set of keys for DCP
            lo, hi = self._offsets[i], self._offsets[i + 1]
            entry = {"step": torch.tensor(float(self._steps[i]))}
            for key, flat in moments.items():
                entry[key] = self._like_param(p, flat[lo:hi].view(_local(p).shape).clone())
            state[i] = entry
        return {"state": state, "param_groups": self._group_dicts()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A full (torch.optim.AdamW-format, from any dp size) or a sharded state dict; re-shards it
        for this rank. No communication (but for a DTensor state of another layout than its
        parameter's, which is gathered whole first)."""
        if state_dict.get("format") == _SHARD_FORMAT:
            self.load_sharded_state_dict(state_dict)
            return
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups, the optimizer {len(self.param_groups)}")
        keys = []
        for saved, mine in zip(groups, self.param_groups):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError("state dict param groups do not match the optimizer's sizes")
            keys.extend(saved["params"])
        saved_state = state_dict["state"]
        for i, key in enumerate(keys):
            entry = saved_state.get(key)
            p = self._params[i]
            self._steps[i] = int(float(entry["step"])) if entry is not None else 0
            entry = entry if self._steps[i] else None
            local_shape = tuple(_local(p).shape)
            for name, target in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                value = self._local_value(p, entry[name]) if entry is not None else None
                if value is not None and tuple(value.shape) != local_shape:
                    raise ValueError(f"state of parameter {key}: {name} shape {tuple(value.shape)} != "
                                     f"{local_shape} (this rank's piece of {tuple(p.shape)})")
                self._load_piece(i, target, value)
            if self.master is not None:
                master = entry.get("master") if entry is not None else None
                master = self._local_value(p, master) if master is not None else _local(p).detach()
                self._load_piece(i, self.master, master)
            if entry is not None:
                self.state[p] = {"step": torch.tensor(float(self._steps[i]))}
            else:
                self.state.pop(p, None)
        for saved, mine in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params" and k not in _ADAMW_FLAGS:
                    mine[k] = tuple(v) if k == "betas" else v
        self._grad_shard = None

    def _load_piece(self, i: int, target: torch.Tensor, value: torch.Tensor | None) -> None:
        for j, a, b, s in self._pieces:
            if j != i:
                continue
            if value is None:
                target[s:s + b - a] = 0
            else:
                target[s:s + b - a] = value.detach().reshape(-1)[a:b].to(device=target.device, dtype=target.dtype)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard (no communication); load it at the same dp size and layout."""
        out = {"format": _SHARD_FORMAT, "dp_world": self.dp_world, "dp_rank": self.dp_rank, "numel": self.numel,
               "steps": list(self._steps), "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone(),
               "param_groups": self._group_dicts()}
        if self.master is not None:
            out["master"] = self.master.clone()
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        for key, mine in (("dp_world", self.dp_world), ("dp_rank", self.dp_rank), ("numel", self.numel)):
            if sd.get(key) != mine:
                raise ValueError(f"sharded optimizer state was saved with {key}={sd.get(key)}, this run has {mine}; "
                                 "save the full state_dict() to change the data-parallel size")
        self.exp_avg.copy_(sd["exp_avg"])
        self.exp_avg_sq.copy_(sd["exp_avg_sq"])
        if self.master is not None:
            if "master" not in sd:
                raise ValueError("sharded optimizer state holds no fp32 master weights but the parameters need them")
            self.master.copy_(sd["master"])
        self._steps = [int(s) for s in sd["steps"]]
        self.state.clear()
        for p, s in zip(self._params, self._steps):
            if s:
                self.state[p] = {"step": torch.tensor(float(s))}
        for saved, mine in zip(sd["param_groups"], self.param_groups):
            for k, v in saved.items():
                if k != "params" and k not in _ADAMW_FLAGS:
                    mine[k] = tuple(v) if k == "betas" else v
        self._grad_shard = None


def build_sharded_optimizer(params, dp_group=None, **adamw_kwargs) -> ShardedAdamW:
    """ShardedAdamW over `dp_group`. `params` may be an nn.Module: then Megatron's groups are used
    (matrices decayed with weight_decay, biases / norms not; backends.common.optim.param_groups)."""
    if isinstance(params, torch.nn.Module):
        from backends.common.optim import param_groups

        params = param_groups(params, adamw_kwargs.get("weight_decay", 1e-2))
    return ShardedAdamW(params, dp_group, **adamw_kwargs)
