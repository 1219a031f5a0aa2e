"""Parallel plans applied from outside the model (torchtitan's rule): the mesh, context parallel
attention, the data-parallel wrap, and which ranks share data / tokens / gradients.

Gradients of replicated parameters are reduced over dp × cp (CP ranks hold different tokens of the
same samples); the loss's token count is summed over the same ranks; the loader is sharded over dp.
Expert parallel (parallel/ep_engine.py) carves its groups from those dp × cp ranks and keeps the
expert weights out of that reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ascendfactory.layout import Layout, LayoutError
from ascendfactory.layout import check as check_layout
from backends.common.parallel.mesh import build_mesh
from backends.llm.config import ConfigError, LLMConfig


@dataclass
class Parallel:
    layout: Layout
    mesh: Any                 # DeviceMesh ("pp", "dp", "cp", "tp") or None on one process
    dp_rank: int
    cp_rank: int
    grad_group: Any           # process group of dp × cp (None: the default group / one process)
    grad_world: int           # its size
    grad_mesh: Any = None     # the same ranks as a 1-D DeviceMesh (FSDP2 shards over it)
    cp_groups: Any = None     # CPGroups when cp > 1
    cp_algo: str = "ring"
    pp_rank: int = 0
    pp_group: Any = None      # the ranks holding the other stages of this rank's pipeline
    pipeline: Any = None      # pipeline.PipelineRunner when pp > 1
    tied_group: Any = None    # first + last stage ranks sharing a tied embedding (pp > 1)
    ep_mesh: Any = None       # 1-D DeviceMesh of this rank's ep group (ep > 1; the experts' DTensor mesh)
    edp_group: Any = None     # ranks holding the same experts (ep > 1)


def setup(cfg: LLMConfig, decoder: torch.nn.Module, rt) -> Parallel:
    from backends.llm.parallel import ep_engine

    c, p = decoder.config, cfg.parallel
    experts = c.moe.num_experts if c.moe is not None else 0
    try:  # the planner's rules (ascendfactory.layout), for an engine started by hand with any flags
        layout = check_layout(
            world=rt.world, heads=c.num_attention_heads, layers=c.num_layers, experts=experts,
            kv_heads=c.num_kv_heads if c.mla is None else c.num_attention_heads, tp=p.tp, pp=p.pp,
            vpp_layers=p.vpp_layers, pp_layers=p.pp_layers, cp=p.cp, cp_algo=p.cp_algo,
            ulysses_degree=p.ulysses_degree, ep=p.ep, sp=p.sp, seq_len=cfg.data.seq_len,
            micro_batch=cfg.train.micro_batch, global_batch=cfg.train.global_batch)
    except LayoutError as err:
        raise ConfigError(str(err)) from None
    if rt.world == 1:
        return Parallel(layout, None, 0, 0, None, 1)
    mesh = build_mesh(layout, rt.device.type)
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    par = Parallel(layout, mesh, mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank(),
                   dp_cp.get_group(), dp_cp.size(), grad_mesh=dp_cp, cp_algo=p.cp_algo)
    if layout.cp > 1:
        _apply_context_parallel(decoder, par, cfg, rt)
    if layout.tp > 1:
        from backends.llm.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(decoder, mesh["tp"], sequence_parallel=cfg.parallel.sp, experts_elsewhere=layout.ep > 1)
        if layout.ep > 1:  # each tp rank's MoE layers see a sequence shard: the aux loss spans cp × tp
            _set_aux_group(decoder, mesh["cp", "tp"]._flatten("cp_tp").get_group())
    if layout.ep > 1:
        par.ep_mesh, par.edp_group = ep_engine.build_groups(mesh, layout, rt.device.type)
        ep_engine.apply(decoder, par.ep_mesh)
    if layout.pp > 1:  # after TP / CP, which see the whole model; then each rank keeps its stages
        from backends.llm.parallel.pipeline import attach_pipeline

        attach_pipeline(decoder, cfg, par, rt)
    return par


def _cp_attend(q, k, v, cu_seqlens, scale, *, groups, algo):
    from backends.llm.parallel.context_parallel import cp_attention

    if cu_seqlens is None:
        return cp_attention(q, k, v, algo=algo, groups=groups, causal=True, scale=scale)
    return cp_attention(q[0], k[0], v[0], algo=algo, groups=groups, causal=True, cu_seqlens=cu_seqlens,
                        scale=scale).unsqueeze(0)


def _apply_context_parallel(decoder, par: Parallel, cfg: LLMConfig, rt) -> None:
    from backends.llm.parallel.context_parallel import make_cp_groups

    mesh = par.mesh
    # every rank builds every CP group (new_group is collective over the world), then keeps its own
    cp_dim = mesh.mesh_dim_names.index("cp")
    ranks = mesh.mesh.movedim(cp_dim, -1).reshape(-1, par.layout.cp).tolist()
    u = (cfg.parallel.ulysses_degree or 1) if cfg.parallel.cp_algo == "hybrid" else 1
    par.cp_groups = make_cp_groups(ranks, ulysses_degree=u)
    attend = partial(_cp_attend, groups=par.cp_groups, algo=cfg.parallel.cp_algo)

    for module in decoder.modules():
        if hasattr(module, "core_attention"):
            module.core_attention = attend
    _set_aux_group(decoder, par.cp_groups.cp)


def _set_aux_group(decoder, group) -> None:
    """The ranks holding parts of one micro-batch's tokens: the MoE aux loss is the whole micro-batch's."""
    from backends.llm.models.moe import MoE

    for module in decoder.modules():
        if isinstance(module, MoE):
            module.aux_group = group


def shard_batch(mb: dict, par: Parallel) -> dict:
    """This CP rank's part of a micro-batch: head/tail sequence chunks with their global positions."""
    if par.layout.cp == 1:
        return mb
    from backends.llm.parallel.context_parallel import shard_for_cp

    shard = shard_for_cp({k: v for k, v in mb.items() if k not in ("n_tokens", "n_input", "position_ids")},
                         par.cp_rank, par.layout.cp, seq_dim=1)
    out = dict(shard.data)
    b = out["input_ids"].shape[0]
    out["position_ids"] = shard.positions.unsqueeze(0).expand(b, -1)
    if shard.cu_seqlens is None:
        out.pop("cu_seqlens", None)
    if not bool(shard.valid.all()):  # CP padding inside packed documents: not tokens of the batch
        out["aux_mask"] = shard.valid
    out["n_tokens"] = (out["labels"] != -100).sum()
    # metrics only: split the real-token count so the CP ranks add up to the micro-batch's
    total = int(mb.get("n_input", mb["input_ids"].numel()))
    share, extra = divmod(total, par.layout.cp)
    out["n_input"] = torch.tensor(share + (extra if par.cp_rank == 0 else 0))
    return out


def wrap_data_parallel(model: torch.nn.Module, cfg: LLMConfig, par: Parallel, rt) -> torch.nn.Module:
    if par.grad_world == 1:
        return model
    if cfg.parallel.distributed_optimizer:
        return model  # the sharded optimizer reduce-scatters the grads itself (it replaces DDP)
    if cfg.parallel.fsdp:
        return _fully_shard(model, par)
    if par.layout.tp > 1 or par.layout.pp > 1:
        # DTensor parameters / stage modules the schedule calls directly: grad_sync() averages the
        # gradients over dp × cp instead of a wrapper
        return model
    from torch.nn.parallel import DistributedDataParallel

    if par.layout.ep > 1:
        from backends.llm.parallel import ep_engine

        ep_engine.ignore_in_ddp(model)
    return DistributedDataParallel(model, process_group=par.grad_group,
                                   device_ids=None if rt.device.type == "cpu" else [rt.device.index])


def build_optimizer(model: torch.nn.Module, cfg: LLMConfig, par: Parallel):
    """AdamW, or with --use-distributed-optimizer its ZeRO-1 form sharded over dp × cp (under tp one per
    tp rank, on the local shards); with expert parallel the experts get their own over the
    expert-data-parallel group, chained with the dense one (one clip norm, one checkpoint)."""
    t = cfg.train
    if cfg.parallel.distributed_optimizer:
        from backends.common.zero import ShardedAdamW, build_sharded_optimizer

        kw = dict(lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        if par.layout.ep == 1:
            return build_sharded_optimizer(model, par.grad_group, **kw)
        from backends.common.chained_optim import ChainedOptimizer
        from backends.common.optim import param_groups
        from backends.llm.parallel.expert_parallel import is_expert_parameter

        groups = param_groups(model, t.weight_decay)

        def split(expert: bool) -> list[dict]:
            parts = [{**g, "params": [p for p in g["params"] if is_expert_parameter(p) == expert]} for g in groups]
            return [g for g in parts if g["params"]]

        # expert grads arrive only scaled by 1/(dp·cp) (grad_sync): this reduce-scatter sums the replicas.
        # Shown as the one optimizer's groups, so checkpoints move between ep and no ep.
        return ChainedOptimizer([ShardedAdamW(split(False), par.grad_group, **kw),
                                 ShardedAdamW(split(True), par.edp_group, grad_reduce="sum", **kw)],
                                groups=[{k: v for k, v in g.items()} for g in groups])
    from backends.common.optim import build_optimizer as adamw

    return adamw(model, lr=t.lr, weight_decay=t.weight_decay, betas=t.betas)


def _fully_shard(model: torch.nn.Module, par: Parallel) -> torch.nn.Module:
    """FSDP2 over dp × cp: one unit per layer, the rest in a root unit (the whole model, or with pp each
    stage module, which the schedule calls directly). TP DTensors become 2-D (dp_cp, tp); expert-parallel
    weights stay out (already sharded over ep; their replicas are summed by grad_sync)."""
    from torch.distributed.fsdp import fully_shard

    from backends.llm.parallel.expert_parallel import expert_parameters

    ignored = set(expert_parameters(model)) or None
    layers = model.decoder.model.layers
    for layer in (layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers):
        fully_shard(layer, mesh=par.grad_mesh, ignored_params=ignored)
    if par.pipeline is None:
        return fully_shard(model, mesh=par.grad_mesh, ignored_params=ignored)
    for stage in par.pipeline.modules:  # roots: unsharded for their forward and the loss after it
        fully_shard(stage, mesh=par.grad_mesh, ignored_params=ignored)
    return model


def grad_sync(model: torch.nn.Module, cfg: LLMConfig, par: Parallel):
    """What runs after backward, before clipping, or None: the tied embedding's two stage copies summed
    (pp); the mean over dp × cp where no wrapper reduces (tp or pp without FSDP2 or the distributed
    optimizer, which reduce themselves); the expert grads summed over their replicas (ep)."""
    from backends.llm.parallel.expert_parallel import is_expert_parameter

    steps = []
    if par.pipeline is not None:
        from backends.llm.parallel.pipeline import sync_tied_embedding

        steps.append(lambda: sync_tied_embedding(model, par))
    reduced_elsewhere = cfg.parallel.distributed_optimizer or cfg.parallel.fsdp or \
        (par.layout.tp == 1 and par.layout.pp == 1)  # DDP
    if par.grad_world > 1 and not reduced_elsewhere:
        dense = [p for p in model.parameters() if not is_expert_parameter(p)]
        steps.append(lambda: _mean_over_dp(dense, par))
    if par.layout.ep > 1:
        from backends.llm.parallel import ep_engine

        # the distributed optimizer sums the expert replicas in its reduce-scatter over edp (build_optimizer)
        edp = None if cfg.parallel.distributed_optimizer else par.edp_group
        steps.append(ep_engine.grad_finalizer(model, par.grad_world, edp))
    if not steps:
        return None

    def sync() -> None:
        for step in steps:
            step()

    return sync


def _mean_over_dp(params: list, par: Parallel) -> None:
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            continue
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(local, group=par.grad_group)
        local.div_(par.grad_world)


def grad_clip(model: torch.nn.Module, cfg: LLMConfig, par: Parallel):
    """train_step's clip(limit) -> norm where ranks hold different parameters (expert shards), else None
    (pipeline stages bring their own, pipeline.pipeline_clip)."""
    if par.layout.ep > 1 and not cfg.parallel.distributed_optimizer:  # that one clips its reduced grads
        from backends.llm.parallel import ep_engine

        return ep_engine.clipper(model)
    return None
