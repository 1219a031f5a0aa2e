"""Which ranks share data, tokens and gradients, and how the gradients meet: the `Parallel` record an
engine's setup fills, the data-parallel wrap (DDP, or FSDP2 over the model's declared blocks), the
optimizer (AdamW, or the distributed optimizer sharded over dp × cp), the gradient sync after
backward and the clip.

Gradients of replicated parameters are reduced over dp × cp (CP ranks hold different tokens of the
same samples); the loss's token count is summed over the same ranks. Expert parallel carves its
groups from those ranks and keeps the expert weights out of that reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backends.contract.layout import Layout
from backends.common.parallel import expert_parallel
from backends.common.parallel.parts import ModelParts


@dataclass
class Parallel:
    layout: Layout
    mesh: Any                 # DeviceMesh ("pp", "dp", "cp", "tp") or None on one process
    dp_rank: int
    cp_rank: int
    grad_group: Any           # process group of dp × cp (None: the default group / one process)
    grad_world: int           # its size
    grad_mesh: Any = None     # the same ranks as a 1-D DeviceMesh (FSDP2 shards over it)
    fsdp: bool = False        # FSDP2 over dp × cp
    distributed_optimizer: bool = False   # ZeRO-1 over dp × cp (it reduce-scatters the grads itself)
    cp_groups: Any = None     # context_parallel.CPGroups when cp > 1
    cp_algo: str = "ring"
    pp_rank: int = 0
    pp_group: Any = None      # the ranks holding the other stages of this rank's pipeline
    pipeline: Any = None      # pipeline.PipelineRunner when pp > 1
    tied_group: Any = None    # first + last stage ranks sharing a tied embedding (pp > 1)
    ep_mesh: Any = None       # 1-D DeviceMesh of this rank's ep group (ep > 1; the experts' DTensor mesh)
    edp_group: Any = None     # ranks holding the same experts (ep > 1)


def single_process(layout: Layout) -> Parallel:
    return Parallel(layout, None, 0, 0, None, 1)


def from_mesh(layout: Layout, mesh, *, fsdp: bool = False, distributed_optimizer: bool = False,
              cp_algo: str = "ring") -> Parallel:
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    return Parallel(layout, mesh, mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank(), dp_cp.get_group(),
                    dp_cp.size(), grad_mesh=dp_cp, fsdp=fsdp, distributed_optimizer=distributed_optimizer,
                    cp_algo=cp_algo)


def wrap_data_parallel(model: torch.nn.Module, parts: ModelParts, par: Parallel, device: torch.device) -> torch.nn.Module:
    if par.grad_world == 1 or par.distributed_optimizer:
        return model  # the sharded optimizer reduce-scatters the grads itself (it replaces DDP)
    if par.fsdp:
        return fully_shard_blocks(model, parts, par)
    if par.layout.tp > 1 or par.layout.pp > 1:
        # DTensor parameters / stage modules the schedule calls directly: grad_sync() averages the
        # gradients over dp × cp instead of a wrapper
        return model
    from torch.nn.parallel import DistributedDataParallel

    if par.layout.ep > 1:
        expert_parallel.ignore_in_ddp(model)
    return DistributedDataParallel(model, process_group=par.grad_group,
                                   device_ids=None if device.type == "cpu" else [device.index])


def fully_shard_blocks(model: torch.nn.Module, parts: ModelParts, par: Parallel) -> torch.nn.Module:
    """FSDP2 over dp × cp: one unit per declared block, the rest in a root unit (the whole model, or
    with pp each stage module, which the schedule calls directly). TP DTensors become 2-D (dp_cp, tp);
    expert-parallel weights stay out (already sharded over ep; their replicas are summed by grad_sync)."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(expert_parallel.expert_parameters(model)) or None
    for block in parts.block_list():
        fully_shard(block, mesh=par.grad_mesh, ignored_params=ignored)
    if par.pipeline is None:
        return fully_shard(model, mesh=par.grad_mesh, ignored_params=ignored)
    for stage in par.pipeline.modules:  # roots: unsharded for their forward and the loss after it
        fully_shard(stage, mesh=par.grad_mesh, ignored_params=ignored)
    return model


def build_optimizer(model: torch.nn.Module, par: Parallel, *, lr: float, betas=(0.9, 0.999),
                    weight_decay: float = 0.0, eps: float = 1e-8):
    """AdamW, or the distributed optimizer (ZeRO-1) sharded over dp × cp (under tp one per tp rank, on
    the local shards); with expert parallel the experts get their own over the expert-data-parallel
    group, chained with the dense one (one clip norm, one checkpoint)."""
    if not par.distributed_optimizer:
        from backends.common.optim import build_optimizer as adamw

        return adamw(model, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    from backends.common.zero import ShardedAdamW, build_sharded_optimizer

    kw = dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
    if par.layout.ep == 1:
        return build_sharded_optimizer(model, par.grad_group, **kw)
    from backends.common.chained_optim import ChainedOptimizer
    from backends.common.optim import param_groups

    groups = param_groups(model, weight_decay)

    def split(expert: bool) -> list[dict]:
        parts = [{**g, "params": [p for p in g["params"] if expert_parallel.is_expert_parameter(p) == expert]}
                 for g in groups]
        return [g for g in parts if g["params"]]

    # expert grads arrive only scaled by 1/(dp·cp) (grad_sync): this reduce-scatter sums the replicas.
    # Shown as the one optimizer's groups, so checkpoints move between ep and no ep.
    return ChainedOptimizer([ShardedAdamW(split(False), par.grad_group, **kw),
                             ShardedAdamW(split(True), par.edp_group, grad_reduce="sum", **kw)],
                            groups=[dict(g) for g in groups])


def grad_sync(model: torch.nn.Module, par: Parallel):
    """What runs after backward, before clipping, or None: the tied embedding's two stage copies summed
    (pp); the mean over dp × cp where no wrapper reduces (tp or pp without FSDP2 or the distributed
    optimizer, which reduce themselves); the expert grads summed over their replicas (ep)."""
    steps = []
    if par.pipeline is not None:
        from backends.common.parallel.pipeline import sync_tied_embedding

        steps.append(lambda: sync_tied_embedding(model, par))
    reduced_elsewhere = par.distributed_optimizer or par.fsdp or (par.layout.tp == 1 and par.layout.pp == 1)  # DDP
    if par.grad_world > 1 and not reduced_elsewhere:
        dense = [p for p in model.parameters() if not expert_parallel.is_expert_parameter(p)]
        steps.append(lambda: _mean_over_dp(dense, par))
    if par.layout.ep > 1:
        # the distributed optimizer sums the expert replicas in its reduce-scatter over edp (build_optimizer)
        edp = None if par.distributed_optimizer else par.edp_group
        steps.append(expert_parallel.grad_finalizer(model, par.grad_world, edp))
    if not steps:
        return None

    def sync() -> None:
        for step in steps:
            step()

    return sync


def _mean_over_dp(params: list, par: Parallel) -> None:
    mean_grads(params, par.grad_group, par.grad_world)


def mean_grads(params: list, group, divisor: int, missing_as_zero: bool = False) -> None:
    """The gradients of `params` summed over `group` and divided by `divisor` (a model no wrapper reduces; a
    DTensor's local shard). A parameter without a gradient is skipped, or with missing_as_zero takes part as
    zeros (a rank that had no micro-batch this step, while its peers did: every rank must send the same
    tensors)."""
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            if not (missing_as_zero and p.requires_grad):
                continue
            p.grad = torch.zeros_like(p)
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(local, group=group)
        local.div_(divisor)


def grad_clip(model: torch.nn.Module, optimizer, par: Parallel):
    """The trainer's clip(limit) -> norm where ranks hold different parameters (pipeline stages,
    expert shards), else None (the plain clip)."""
    if par.pipeline is not None:
        from backends.common.parallel.pipeline import pipeline_clip

        return pipeline_clip(model, optimizer, par)
    if par.layout.ep > 1 and not par.distributed_optimizer:  # that one clips its reduced grads
        return expert_parallel.clipper(model)
    return None
