"""Distributed optimizer (ZeRO-1, Megatron's --use-distributed-optimizer): AdamW whose states are
sharded over the data-parallel group, communicated in bounded buckets and checkpointed sharded.

Layout (a function of each parameter's own local shape, dp and the bucket size only). Every
parameter's local tensor (a DTensor's `to_local()`) is cut, in its flat row-major order, into pieces
of at most B elements (B = bucket_elems rounded down to a multiple of dp). A piece of m elements is
split over dp as evenly as possible (ranks below m % dp get one element more); dp rank r owns the
r-th part. Consecutive pieces of one dtype are grouped into buckets of at most B padded elements
(each piece padded to dp · ceil(m / dp)). A rank keeps, for the elements it owns only: exp_avg and
exp_avg_sq in fp32, an fp32 master copy when any parameter is bf16 / fp16, and the reduced fp32
gradient. Parameters stay full (replicated over dp) on every rank (ZeRO-1).

Why per-parameter pieces and not one flat index space cut in dp slices: an element's owner then
does not depend on the parameters before it, so ranks that hold the same parameter outside this
dp group (a replicated norm weight on every tp rank, even when the tp shards before it are uneven)
own exactly the same pieces of it. Their checkpoint chunks coincide and DCP writes them once
(deduplicated by offset), which its plan validation (no overlapping chunks, full cover) needs.

Step (the extra memory is one B-element fp32 staging buffer plus B elements of gather buffer per
parameter dtype, allocated once and reused; never a model-size buffer):
  1. per bucket: copy the grads into the staging buffer as dp rows (rank r's parts in row r), and
     reduce-scatter it into this rank's slot of the reduced-grad shard; with grad_reduce="mean"
     (default) divided by dp. The optimizer replaces DDP's all-reduce, so do not wrap the model in
     DDP. Grads are reduced in fp32 whatever the parameter dtype: for fp32 that is the parameters'
     own dtype; bf16 / fp16 partial sums rounded to 8 / 11 bits (and fp16's overflow) would change
     the update, and the staging buffer is bounded, so fp32 costs only the bucket. A parameter
     whose grad is None on a rank counts as zero there;
  2. AdamW on the owned elements, bit for bit torch.optim.AdamW's single-tensor update (per-parameter
     step counts; a parameter with no grad on any rank is skipped, as torch does); fp32 parameters
     are updated in place in their own storage, lower precision ones through the fp32 master;
  3. per bucket: all-gather the updated parts in the parameters' dtype (exact: the gathered values
     are the very roundings every rank writes) and copy them into the parameters.
Clipping needs the global norm: call `optimizer.clip_grad_norm_(max_norm)` after backward and before
step() (it reduces the grads and computes the norm over all shards); do not clip the parameters'
.grad with torch.nn.utils.clip_grad_norm_ — those are the local, unreduced grads.

Checkpoints (torch.distributed.checkpoint; backends.common.checkpoint.save_checkpoint /
load_checkpoint through get_state_dict / set_state_dict):
  * state_dict() gathers nothing. It has torch.optim.AdamW's structure ({"state": {i: {"step",
    "exp_avg", "exp_avg_sq"[, "master"]}}, "param_groups"}), every parameter listed (a fixed key set
    for DCP), and each moment is a ShardState: a tensor of the parameter's global shape whose data
    are views of this rank's own state buffers. The piece a rank owns of a parameter is a flat
    contiguous range of its local shard; in the parameter's global N-D coordinates (the DTensor
    offset added) that range is a few rectangles (a partial row, a block of full rows, a partial
    row, recursively). ShardState gives them to DCP through the protocol its planner helpers check
    (__create_write_items__, __create_chunk_list__, __get_tensor_shard__, torch 2.13's
    planner_helpers / utils.find_tensor_shard), so each rank writes only its elements, each element
    once, and on load reads exactly the elements it owns now, straight into its buffers, from
    whatever chunks were saved: a checkpoint moves between dp sizes, tp sizes and bucket sizes
    (elements are named by their global position in the parameter). A checkpoint of full tensors
    (the earlier gathered format) loads the same way. Why not DTensor / ShardedTensor: a DTensor
    can only say "dim-0 chunk" (balance by rows, a dp × tp mesh per optimizer), and ShardedTensor
    validates a global shard list that replicated-over-tp parameters would overlap.
  * load_state_dict() takes that (the states DCP just filled in place, or another optimizer's of
    the same pieces), or torch.optim.AdamW's format with full tensors / DTensors (sliced for this
    rank, no communication).
  * full_state_dict(): an explicit export (collective over dp, one bucket at a time): torch's AdamW
    format with full tensors (DTensor states of the parameter's layout for DTensor parameters). It
    is never used to save or resume.
  * sharded_state_dict() / load_sharded_state_dict(): this rank's buffers as they are (torch.save one
    file per rank); resuming needs the same dp size, bucket size and parameters.

DTensor parameters (tensor parallel; expert parallel's Shard(0) experts): the layout, the grads, the
update and the write-back use each rank's local shard, so one ShardedAdamW runs per tp (or ep)
coordinate over that coordinate's data-parallel group, whose members hold the same local shapes.
The clip norm sums a Shard-placed parameter's part over its mesh's group and counts a replicated one
once.

With expert parallelism the expert weights are not data-parallel over dp: they get their own
ShardedAdamW over the expert-data-parallel group and the other parameters this one over dp × cp,
stepped and clipped together by backends.common.chained_optim.ChainedOptimizer (one global norm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["ShardedAdamW", "ShardState", "build_sharded_optimizer", "DEFAULT_BUCKET_ELEMS"]

DEFAULT_BUCKET_ELEMS = 40_000_000  # Megatron's default DDP bucket (elements)
_ADAMW_FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                    fused=None, decoupled_weight_decay=True)
_SHARD_FORMAT = "backends.common.zero/shard-v2"
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: a DTensor's local shard (under no_grad the live storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_groups(p: torch.Tensor) -> tuple:
    """The process groups over which a DTensor parameter's local pieces differ (its Shard mesh dims);
    () for plain and replicated parameters, whose pieces are the same on every such rank."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(p.device_mesh.get_group(d) for d, pl in enumerate(p.placements) if pl.is_shard())


def _global_offset(p: torch.Tensor) -> tuple[int, ...]:
    if not isinstance(p, DTensor):
        return (0,) * p.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(offset)


def _rectangles(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat row-major range [a, b) of a tensor of `shape` as rectangles (offsets, sizes, flat
    start), each contiguous in the flat order: a partial row, a block of full rows, a partial row."""
    if a >= b:
        return []
    if not shape:
        return [((), (), a)]
    row = math.prod(shape[1:])
    first, last = a // row, (b - 1) // row
    if first == last:  # inside one index of dim 0
        return [((first, *o), (1, *s), first * row + f) for o, s, f in _rectangles(shape[1:], a - first * row,
                                                                                 b - first * row)]
    out = []
    if a % row:
        out += _rectangles(shape, a, (first + 1) * row)
        first += 1
    full_end = b // row
    if full_end > first:
        out.append(((first, *[0] * (len(shape) - 1)), (full_end - first, *shape[1:]), first * row))
    if b % row and full_end >= first:
        out += _rectangles(shape, full_end * row, b)
    return out


class ShardState(torch.Tensor):
    """One state (exp_avg, ...) of one parameter as this rank holds it: a tensor of the parameter's
    global shape for torch.distributed.checkpoint, whose data are rectangles in global coordinates,
    each a view of the optimizer's own buffer. It holds no other data: DCP writes these views and
    reads into them; no tensor operation runs on it (use ShardedAdamW.full_state_dict() for values)."""

    @staticmethod
    def __new__(cls, global_shape, chunks, device):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=torch.float32, device=device)

    def __init__(self, global_shape, chunks, device):
        # chunks: [(global offsets, view)], the views shaped as their rectangles
        self.chunks = [(torch.Size(o), v) for o, v in chunks]
        self._by_offset = {o: v for o, v in self.chunks}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise TypeError(f"ShardState (a ZeRO optimizer state shard for checkpointing) does not run {func}; "
                        "use ShardedAdamW.full_state_dict() for the values")

    def __repr__(self):
        return f"ShardState(shape={tuple(self.shape)}, chunks={[(tuple(o), tuple(v.shape)) for o, v in self.chunks]})"

    def owned_numel(self) -> int:
        return sum(v.numel() for _, v in self.chunks)

    # ---- the torch.distributed.checkpoint protocol (planner_helpers._create_write_items /
    # _create_chunk_list, utils.find_tensor_shard)
    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                           TensorProperties)
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=v.shape),
                                                      properties=TensorProperties.create_from_tensor(v),
                                                      size=self.shape))
                for o, v in self.chunks]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=o, sizes=v.shape) for o, v in self.chunks]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        view = self._by_offset.get(torch.Size(index.offset)) if index.offset is not None else None
        if view is None:
            raise ValueError(f"ShardState of {index.fqn}: no chunk at offset {index.offset}")
        return view


@dataclass
class _Piece:
    param: int          # index into the optimizer's parameters
    lo: int             # the piece: [lo, hi) of the parameter's local flat view
    hi: int
    slot: int           # ceil(m / dp): each rank's row length for this piece in its bucket
    col: int            # the piece's column in its bucket's dp × S layout
    owned: int          # start in this rank's state buffers
    grad_at: int        # start in this rank's reduced-grad shard (bucket slot base + col)

    def part(self, rank: int, world: int) -> tuple[int, int]:
        """[a, b) of the parameter's flat view that dp rank `rank` owns."""
        m = self.hi - self.lo
        base, extra = divmod(m, world)
        a = self.lo + rank * base + min(rank, extra)
        return a, a + base + (rank < extra)


@dataclass
class _Bucket:
    dtype: torch.dtype
    pieces: list
    width: int = 0      # S: elements of each rank's row (sum of the pieces' slots)
    grad_base: int = 0  # this bucket's start in the reduced-grad shard


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW with ZeRO-1 state sharding over `dp_group` (a ProcessGroup or 1-D DeviceMesh; None: the
    default group; without an initialised process group it runs unsharded, dp = 1), communicating
    in buckets of at most `bucket_elems` elements. See the module docstring.

    param_groups work as usual (lr / weight_decay / betas / eps per group; LR schedulers write
    group["lr"]). amsgrad / maximize are not supported."""

    def __init__(self, params: Iterable, dp_group=None, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, grad_reduce: str = "mean",
                 bucket_elems: int = DEFAULT_BUCKET_ELEMS, **unsupported):
        for key in ("amsgrad", "maximize"):
            if unsupported.pop(key, False):
                raise ValueError(f"ShardedAdamW does not implement {key}=True")
        for key in ("foreach", "fused", "capturable", "differentiable"):
            unsupported.pop(key, None)  # implementation switches of torch's AdamW: no meaning here
        if unsupported:
            raise TypeError(f"ShardedAdamW got unexpected arguments: {', '.join(sorted(unsupported))}")
        if grad_reduce not in ("mean", "sum"):
            raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {grad_reduce!r}")
        if int(bucket_elems) < 1:
            raise ValueError(f"bucket_elems must be a positive number of elements, got {bucket_elems!r}")
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
        devices = {p.device for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        self._device = devices.pop()
        for p in self._params:
            if not _local(p).is_contiguous():
                raise ValueError(f"ShardedAdamW needs contiguous parameters (local shards); got one of shape "
                                 f"{tuple(p.shape)} with strides {_local(p).stride()}")
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._numels = [_local(p).numel() for p in self._params]
        self.numel = sum(self._numels)
        self.bucket_elems = max(self.dp_world, int(bucket_elems) // self.dp_world * self.dp_world)
        self._buckets, self._pieces_of = self._layout()
        self.owned = sum(b - a for pc in self._all_pieces() for a, b in [pc.part(self.dp_rank, self.dp_world)])
        self._norm_sets, self._norm_set_of = self._norm_layout()
        self.has_master = any(p.dtype in _LOW_PRECISION for p in self._params)
        f32 = dict(dtype=torch.float32, device=self._device)
        self.exp_avg = torch.zeros(self.owned, **f32)
        self.exp_avg_sq = torch.zeros(self.owned, **f32)
        self.master = self._owned_params() if self.has_master else None
        # reused buffers: the reduced grads of my parts (one slot per bucket), the staging buffer of
        # one bucket's reduce-scatter, and per dtype one bucket's all-gather (send and receive)
        self._grad_shard = torch.zeros(sum(b.width for b in self._buckets), **f32)
        self._stage = torch.empty(max(b.width for b in self._buckets) * self.dp_world, **f32) \
            if self.dp_world > 1 else None
        self._gather_bufs: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._steps = [0] * len(self._params)
        self._reduced = False  # the grad shard holds this step's reduced grads (after reduce_grads)
        self._grad_mask: list[bool] | None = None

    # ------------------------------------------------------------------ layout

    def _layout(self) -> tuple[list[_Bucket], list[list[_Piece]]]:
        world, cap = self.dp_world, self.bucket_elems
        buckets: list[_Bucket] = []
        pieces_of: list[list[_Piece]] = [[] for _ in self._params]
        owned = 0
        for i, (p, n) in enumerate(zip(self._params, self._numels)):
            for lo in range(0, n, cap):
                hi = min(lo + cap, n)
                slot = -(-(hi - lo) // world)
                if not buckets or buckets[-1].dtype != p.dtype or (buckets[-1].width + slot) * world > cap:
                    base = buckets[-1].grad_base + buckets[-1].width if buckets else 0
                    buckets.append(_Bucket(p.dtype, [], 0, base))
                bucket = buckets[-1]
                piece = _Piece(i, lo, hi, slot, bucket.width, owned, bucket.grad_base + bucket.width)
                a, b = piece.part(self.dp_rank, world)
                owned += b - a
                bucket.width += slot
                bucket.pieces.append(piece)
                pieces_of[i].append(piece)
        return buckets, pieces_of

    def _all_pieces(self):
        return (pc for b in self._buckets for pc in b.pieces)

    def _mine(self, pc: _Piece) -> tuple[int, int]:
        return pc.part(self.dp_rank, self.dp_world)

    def _flat(self, i: int) -> torch.Tensor:
        return _local(self._params[i]).detach().view(-1)

    def _owned_params(self) -> torch.Tensor:
        out = torch.empty(self.owned, dtype=torch.float32, device=self._device)
        for pc in self._all_pieces():
            a, b = self._mine(pc)
            out[pc.owned:pc.owned + b - a] = self._flat(pc.param)[a:b]
        return out

    def _norm_layout(self) -> tuple[list[tuple], list[int]]:
        """The distinct shard-group sets of the parameters (first: none, the replicated ones) and each
        parameter's set. From every parameter, so all ranks run the same norm collectives."""
        sets, keys, set_of = [()], [()], []
        for p in self._params:
            groups = _shard_groups(p)
            key = tuple(tuple(dist.get_process_group_ranks(g)) for g in groups)
            if key not in keys:
                keys.append(key)
                sets.append(groups)
            set_of.append(keys.index(key))
        return sets, set_of

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (moments, master)."""
        tensors = [self.exp_avg, self.exp_avg_sq] + ([self.master] if self.master is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def buffer_bytes(self) -> int:
        """Bytes of the reused communication buffers (bucket staging and gathers), beyond the state
        and the reduced grads of the owned elements."""
        bufs = ([self._stage] if self._stage is not None else []) + [t for pair in self._gather_bufs.values()
                                                                     for t in pair]
        return sum(t.numel() * t.element_size() for t in bufs)

    # ------------------------------------------------------------------ grads

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Reduce-scatter the parameters' grads into this rank's shard, bucket by bucket (idempotent
        until zero_grad / step)."""
        if self._reduced:
            return
        has = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32, device=self._device)
        world = self.dp_world
        flats = []
        for p in self._params:
            grad = None if p.grad is None else _local(p.grad)
            if grad is not None and grad.is_sparse:
                raise RuntimeError("ShardedAdamW does not support sparse gradients")
            flats.append(None if grad is None else grad.reshape(-1))
        for bucket in self._buckets:
            out = self._grad_shard[bucket.grad_base:bucket.grad_base + bucket.width]
            if world == 1:
                for pc in bucket.pieces:
                    dst = self._grad_shard[pc.grad_at:pc.grad_at + pc.hi - pc.lo]
                    dst.copy_(flats[pc.param][pc.lo:pc.hi]) if flats[pc.param] is not None else dst.zero_()
                continue
            stage = self._stage[:world * bucket.width].view(world, bucket.width)
            stage.zero_()
            for pc in bucket.pieces:
                flat = flats[pc.param]
                if flat is None:
                    continue
                for r in range(world):
                    a, b = pc.part(r, world)
                    stage[r, pc.col:pc.col + b - a] = flat[a:b]
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            fn(out, stage.view(-1), group=self.dp_group)
        if world > 1:
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.dp_group)
            if self.grad_reduce == "mean":
                self._grad_shard.div_(world)
        self._reduced = True
        self._grad_mask = [bool(v) for v in has.tolist()]

    def _grad_of(self, pc: _Piece) -> torch.Tensor:
        a, b = self._mine(pc)
        return self._grad_shard[pc.grad_at:pc.grad_at + b - a]

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
        norm_type = float(norm_type)
        inf = math.isinf(norm_type)
        skip = {id(p) for p in uncounted}
        local = torch.zeros(len(self._norm_sets), dtype=torch.float32, device=self._device)
        for pc in self._all_pieces():  # piece by piece: temporaries of one piece's part at most
            if id(self._params[pc.param]) in skip:
                continue
            g = self._grad_of(pc)
            if not g.numel():
                continue
            k = self._norm_set_of[pc.param]
            if inf:
                local[k] = torch.maximum(local[k], g.abs().max())
            else:
                local[k] += (g.abs() ** norm_type).sum()
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        if self.dp_world > 1:  # dp_group None is the default group
            dist.all_reduce(local, op=op, group=self.dp_group)
        total = local[0:1].clone()
        for k in range(1, len(self._norm_sets)):
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
        """Multiply the reduced grads of my parts (the clip coefficient)."""
        self.reduce_grads()
        self._grad_shard.mul_(coef)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._reduced = False
        self._grad_mask = None

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_grads()
        mask = self._grad_mask
        stepped = [i for i, has in enumerate(mask) if has]
        for i in stepped:
            self._steps[i] += 1
        for bucket in self._buckets:
            for pc in bucket.pieces:
                if mask[pc.param]:
                    self._update(pc)
            self._write_back(bucket)
        self._reduced = False  # the next step reduces the grads again (even without zero_grad)
        self._grad_mask = None
        for i in stepped:  # non-empty self.state marks "initialised" for torch.distributed.checkpoint
            self.state[self._params[i]] = {"step": torch.tensor(float(self._steps[i]))}
        return loss

    def _work(self, pc: _Piece) -> torch.Tensor:
        """The fp32 values AdamW updates for my part of a piece: the master, or the parameter itself."""
        a, b = self._mine(pc)
        if self.master is not None:
            return self.master[pc.owned:pc.owned + b - a]
        return self._flat(pc.param)[a:b]

    def _update(self, pc: _Piece) -> None:
        a, b = self._mine(pc)
        if a == b:
            return
        i = pc.param
        group = self.param_groups[self._group_of[i]]
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        wd, eps = group["weight_decay"], group["eps"]
        s, e = pc.owned, pc.owned + b - a
        param, grad = self._work(pc), self._grad_of(pc)
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

    def _gather_buffers(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._gather_bufs:
            width = max(b.width for b in self._buckets)
            self._gather_bufs[dtype] = (torch.empty(width, dtype=dtype, device=self._device),
                                        torch.empty(width * self.dp_world, dtype=dtype, device=self._device))
        return self._gather_bufs[dtype]

    def _gather_bucket(self, bucket: _Bucket, mine, dtype: torch.dtype, dst) -> None:
        """All-gather one bucket: `mine(piece)` gives my part's values, `dst(param index)` the flat
        tensor the gathered pieces land in (collective over dp)."""
        world = self.dp_world
        if world == 1:
            for pc in bucket.pieces:
                dst(pc.param)[pc.lo:pc.hi].copy_(mine(pc))
            return
        send, recv = self._gather_buffers(dtype)
        send, recv = send[:bucket.width], recv[:world * bucket.width]
        for pc in bucket.pieces:
            a, b = self._mine(pc)
            send[pc.col:pc.col + b - a] = mine(pc)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(recv, send, group=self.dp_group)
        rows = recv.view(world, bucket.width)
        for pc in bucket.pieces:
            out = dst(pc.param)
            for r in range(world):
                a, b = pc.part(r, world)
                out[a:b] = rows[r, pc.col:pc.col + b - a]

    def _write_back(self, bucket: _Bucket) -> None:
        if self.master is None and self.dp_world == 1:
            return  # updated in place
        self._gather_bucket(bucket, self._work, bucket.dtype, self._flat)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_params"):
            raise RuntimeError("ShardedAdamW fixes its layout at construction; build a new one instead")
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

    def _buffers(self) -> dict[str, torch.Tensor]:
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master is not None:
            out["master"] = self.master
        return out

    def _shard_state(self, i: int, buffer: torch.Tensor) -> ShardState:
        p = self._params[i]
        shape, offset = tuple(_local(p).shape), _global_offset(p)
        chunks = []
        for pc in self._pieces_of[i]:
            a, b = self._mine(pc)
            for o, sizes, start in _rectangles(shape, a, b):
                at = pc.owned + start - a
                view = buffer[at:at + math.prod(sizes)].view(sizes)
                chunks.append((tuple(x + y for x, y in zip(o, offset)), view))
        return ShardState(p.shape, chunks, buffer.device)

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's structure with ShardState moments: views of this rank's own elements,
        in the parameters' global coordinates, for DCP. No communication, no copy."""
        state = {}
        for i in range(len(self._params)):  # every parameter, stepped or not: a fixed set of keys for DCP
            entry = {"step": torch.tensor(float(self._steps[i]))}
            for key, buffer in self._buffers().items():
                entry[key] = self._shard_state(i, buffer)
            state[i] = entry
        return {"state": state, "param_groups": self._group_dicts()}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Any]:
        """Export: torch.optim.AdamW's state dict with full tensors (DTensors of the parameter's layout
        for DTensor parameters), gathered bucket by bucket. Collective over dp. Not for resuming
        (state_dict() is): it holds every element of every state on every rank."""
        state = {}
        for key, buffer in self._buffers().items():
            fulls = [torch.zeros(n, dtype=torch.float32, device=self._device) for n in self._numels]

            def mine(pc, buffer=buffer):
                a, b = self._mine(pc)
                return buffer[pc.owned:pc.owned + b - a]

            for bucket in self._buckets:
                self._gather_bucket(bucket, mine, torch.float32, fulls.__getitem__)
            for i, p in enumerate(self._params):
                entry = state.setdefault(i, {"step": torch.tensor(float(self._steps[i]))})
                local = fulls[i].view(_local(p).shape)
                entry[key] = local if not isinstance(p, DTensor) else DTensor.from_local(
                    local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        return {"state": state, "param_groups": self._group_dicts()}

    @staticmethod
    def _local_value(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A full-format state tensor as this rank's local piece of `p`: a DTensor of p's layout gives
        its local shard; a plain full tensor (another layout, e.g. saved at tp1) is sliced like p."""
        if isinstance(value, DTensor):
            if (isinstance(p, DTensor) and value.device_mesh == p.device_mesh
                    and tuple(value.placements) == tuple(p.placements)):
                return value.to_local()
            value = value.full_tensor()  # another layout: collective over value's mesh
        if isinstance(p, DTensor) and tuple(value.shape) == tuple(p.shape):
            local_shape = tuple(_local(p).shape)
            offset = _global_offset(p)
            return value[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
        return value

    def _load_into(self, i: int, key: str, name: str, target: torch.Tensor, value) -> None:
        """Parameter i's state `name` (a ShardState, a full tensor / DTensor, or None: zeros) into my
        part of `target`."""
        if isinstance(value, ShardState):
            mine = self._shard_state(i, target)
            theirs = value._by_offset
            for o, view in mine.chunks:
                src = theirs.get(o)
                if src is None or src.shape != view.shape:
                    raise ValueError(f"state of parameter {key}: {name} is a ShardState of other pieces (another dp "
                                     "or bucket size); resume through DCP (load_checkpoint) or load a "
                                     "full_state_dict()")
                if src.data_ptr() != view.data_ptr():
                    view.copy_(src)
            return
        p = self._params[i]
        if value is not None:
            value = self._local_value(p, value)
            local_shape = tuple(_local(p).shape)
            if tuple(value.shape) != local_shape:
                raise ValueError(f"state of parameter {key}: {name} shape {tuple(value.shape)} != "
                                 f"{local_shape} (this rank's piece of {tuple(p.shape)})")
            value = value.detach().reshape(-1)
        for pc in self._pieces_of[i]:
            a, b = self._mine(pc)
            dst = target[pc.owned:pc.owned + b - a]
            dst.zero_() if value is None else dst.copy_(value[a:b])

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """state_dict()'s form (from DCP: already in place) or torch.optim.AdamW's full format (any dp
        size; sliced for this rank), or a sharded_state_dict()."""
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
            for name in _MOMENTS:
                self._load_into(i, key, name, getattr(self, name), entry[name] if entry is not None else None)
            if self.master is not None:
                master = entry.get("master") if entry is not None else None
                self._load_into(i, key, "master", self.master, master if master is not None else _local(p).detach())
            if entry is not None:
                self.state[p] = {"step": torch.tensor(float(self._steps[i]))}
            else:
                self.state.pop(p, None)
        for saved, mine in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params" and k not in _ADAMW_FLAGS:
                    mine[k] = tuple(v) if k == "betas" else v
        self._reduced = False

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's buffers (no communication); load them at the same dp size, bucket size and layout."""
        out = {"format": _SHARD_FORMAT, "dp_world": self.dp_world, "dp_rank": self.dp_rank, "numel": self.numel,
               "bucket_elems": self.bucket_elems, "steps": list(self._steps),
               "param_groups": self._group_dicts()}
        out.update({k: v.clone() for k, v in self._buffers().items()})
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        for key, mine in (("dp_world", self.dp_world), ("dp_rank", self.dp_rank), ("numel", self.numel),
                          ("bucket_elems", self.bucket_elems)):
            if sd.get(key) != mine:
                raise ValueError(f"sharded optimizer state was saved with {key}={sd.get(key)}, this run has {mine}; "
                                 "resume through DCP (state_dict / load_checkpoint) to change the layout")
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
        self._reduced = False


def build_sharded_optimizer(params, dp_group=None, **adamw_kwargs) -> ShardedAdamW:
    """ShardedAdamW over `dp_group`. `params` may be an nn.Module: then Megatron's groups are used
    (matrices decayed with weight_decay, biases / norms not; backends.common.optim.param_groups)."""
    if isinstance(params, torch.nn.Module):
        from backends.common.optim import param_groups

        params = param_groups(params, adamw_kwargs.get("weight_decay", 1e-2))
    return ShardedAdamW(params, dp_group, **adamw_kwargs)
