"""The native decoders' parallel setup (torchtitan's per-model parallelize): the layout checked, the
mesh built, then context parallel, tensor parallel (backends/models/decoder/tp_plan.py), expert parallel,
the pipeline cut and recompute applied from outside the model, each by backends.common.parallel on
the blocks the model's ModelParts declares. `shard_batch` gives a CP rank its part of a micro-batch.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from backends.common import kit
from backends.common.parallel import expert_parallel
from backends.common.parallel.data_parallel import Parallel
from backends.common.parallel.recompute import apply_recompute
from backends.llm.config import ConfigError, LLMConfig

log = logging.getLogger("backends.llm")


def setup(cfg: LLMConfig, decoder: torch.nn.Module, rt) -> Parallel:
    c, p = decoder.config, cfg.parallel
    experts = c.moe.num_experts if c.moe is not None else 0
    # the planner's rules (backends.contract.layout), for an engine started by hand with any flags
    par = kit.parallel(rt, ConfigError, fsdp=p.fsdp, distributed_optimizer=p.distributed_optimizer, cp_algo=p.cp_algo,
                       heads=c.num_attention_heads, layers=c.num_layers, experts=experts,
                       kv_heads=c.num_kv_heads if c.mla is None else c.num_attention_heads, tp=p.tp, pp=p.pp,
                       vpp_layers=p.vpp_layers, pp_layers=p.pp_layers, cp=p.cp, ulysses_degree=p.ulysses_degree,
                       ep=p.ep, sp=p.sp, seq_len=cfg.data.seq_len, micro_batch=cfg.train.micro_batch,
                       global_batch=cfg.train.global_batch)
    if rt.world > 1:
        _parallelize(decoder, cfg, par, rt)
    _recompute(decoder, p, par)  # last: it wraps the attention CP swapped in
    return par


def _recompute(decoder, p, par: Parallel) -> None:
    """Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers (full without a
    method: every layer, uniform 1); a method or layer count means nothing to selective recompute."""
    if p.recompute != "full" and (p.recompute_method or p.recompute_num_layers):
        raise ConfigError("--recompute-method / --recompute-num-layers apply to --recompute-granularity full "
                          f"only (granularity is {p.recompute}); drop them or use full")
    chunks = [list(m.layers.values()) for m in par.pipeline.modules] if par.pipeline is not None else None
    try:
        apply_recompute(decoder.parts(), p.recompute, method=p.recompute_method, num_layers=p.recompute_num_layers,
                        chunks=chunks, fsdp=p.fsdp)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _parallelize(decoder, cfg: LLMConfig, par: Parallel, rt) -> None:
    layout, mesh = par.layout, par.mesh
    if layout.cp > 1:
        _apply_context_parallel(decoder, par, cfg)
    if layout.tp > 1:
        from backends.models.decoder.tp_plan import apply_tensor_parallel

        apply_tensor_parallel(decoder, mesh["tp"], sequence_parallel=cfg.parallel.sp, experts_elsewhere=layout.ep > 1)
        if layout.ep > 1:  # each tp rank's MoE layers see a sequence shard: the aux loss spans cp × tp
            _set_aux_group(decoder, mesh["cp", "tp"]._flatten("cp_tp").get_group())
    if layout.ep > 1:
        par.ep_mesh, par.edp_group = expert_parallel.build_groups(mesh, layout, rt.device.type)
        # "local": the engine's single-process aux is the mean of per-micro-batch auxes
        expert_parallel.apply_expert_parallel(decoder, par.ep_mesh, aux_loss="local")
    if layout.pp > 1:  # after TP / CP, which see the whole model; then each rank keeps its stages
        _attach_pipeline(decoder, cfg, par, rt)


def _cp_attend(q, k, v, cu_seqlens, scale, *, groups, algo):
    from backends.common.parallel.context_parallel import cp_attention

    if cu_seqlens is None:
        return cp_attention(q, k, v, algo=algo, groups=groups, causal=True, scale=scale)
    return cp_attention(q[0], k[0], v[0], algo=algo, groups=groups, causal=True, cu_seqlens=cu_seqlens,
                        scale=scale).unsqueeze(0)


def _apply_context_parallel(decoder, par: Parallel, cfg: LLMConfig) -> None:
    from backends.common.parallel.context_parallel import make_cp_groups

    mesh = par.mesh
    # every rank builds every CP group (new_group is collective over the world), then keeps its own
    cp_dim = mesh.mesh_dim_names.index("cp")
    ranks = mesh.mesh.movedim(cp_dim, -1).reshape(-1, par.layout.cp).tolist()
    u = (cfg.parallel.ulysses_degree or 1) if cfg.parallel.cp_algo == "hybrid" else 1
    par.cp_groups = make_cp_groups(ranks, ulysses_degree=u)
    attend = partial(_cp_attend, groups=par.cp_groups, algo=cfg.parallel.cp_algo)
    parts = decoder.parts()
    for block in parts.block_list():
        block.get_submodule(parts.attention).core_attention = attend
    _set_aux_group(decoder, par.cp_groups.cp)


def _set_aux_group(decoder, group) -> None:
    """The ranks holding parts of one micro-batch's tokens: the MoE aux loss is the whole micro-batch's."""
    for block in expert_parallel.moe_blocks(decoder):
        block.aux_group = group


def _attach_pipeline(decoder, cfg: LLMConfig, par: Parallel, rt) -> None:
    """Prune the decoder to this rank's stages and hang the runner and the pp groups on `par`."""
    from backends.common.parallel.pipeline import PipelineRunner, plan_pipeline, prune_to_rank, tied_embedding_groups

    p, c = cfg.parallel, decoder.config
    mesh = par.mesh
    par.pp_rank = mesh["pp"].get_local_rank()
    par.pp_group = mesh["pp"].get_group()
    plan = plan_pipeline(c.num_layers, p.pp, par.pp_rank, vpp_layers=p.vpp_layers, pp_layers=p.pp_layers)
    layers = [i for s in plan.stage_ids for i in plan.layers[s]]
    parts = decoder.parts()
    par.tied_group = tied_embedding_groups(mesh, p.pp) if parts.tied else None
    prune_to_rank(parts, layers, first=plan.first_rank, last=plan.last_rank)
    log.info("pipeline: pp=%d, %d virtual stages (%s), this rank runs stages %s = layers %s", p.pp, plan.n_virtual,
             "interleaved 1F1B" if len(plan.stage_ids) > 1 else "1F1B", plan.stage_ids, layers)
    par.pipeline = PipelineRunner(parts, plan, pp_group=par.pp_group, device=rt.device, carry_aux=c.moe is not None,
                                  tp_mesh=mesh["tp"] if par.layout.tp > 1 else None,
                                  sequence_parallel=cfg.parallel.sp, precision=cfg.train.precision)


def shard_batch(mb: dict, par: Parallel) -> dict:
    """This CP rank's part of a micro-batch: head/tail sequence chunks with their global positions."""
    if par.layout.cp == 1:
        return mb
    from backends.common.parallel.context_parallel import shard_for_cp

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
    out["mb_tokens"] = mb["n_tokens"]   # the whole micro-batch's: Megatron's per-micro-batch mean divides by it
    # metrics only: split the real-token count so the CP ranks add up to the micro-batch's
    total = int(mb.get("n_input", mb["input_ids"].numel()))
    share, extra = divmod(total, par.layout.cp)
    out["n_input"] = torch.tensor(share + (extra if par.cp_rank == 0 else 0))
    return out
