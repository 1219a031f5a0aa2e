"""Qwen2.5-VL's parallel setup in backends.mm, applied from outside the model by backends.common.parallel on
the blocks the model declares (`parts()`: the text decoder; `vision_parts()`: the vision encoder).

    apply_recompute(vl, parts)                   recompute per part, as model.json / the Megatron flags set it
    apply_tensor_parallel(vl, tp_mesh, sp)       TP (+ SP) of the text decoder; the vision parts replicated
    attach_pipeline(vl, cfg, par, rt)            PP over the parts as pipeline_num_layers splits them
"""

from __future__ import annotations

import logging

from backends.common.parallel import recompute
from backends.mm.config import ConfigError

log = logging.getLogger("backends.mm")


def apply_recompute(vl, parts, chunks: dict | None = None) -> dict[str, int]:
    """Full / selective recompute of the vision encoder's and the text decoder's blocks, each by its own
    setting -> checkpoints made per part. chunks: part -> its blocks per pipeline stage of this rank."""
    made = {}
    for name in ("vision_encoder", "text_decoder"):
        part = parts[name]
        if part.recompute == "none" or (name == "vision_encoder" and not hasattr(vl, "visual")):
            continue  # (a pipeline stage without the vision encoder)
        declared = vl.vision_parts() if name == "vision_encoder" else vl.parts()
        try:
            made[name] = recompute.apply_recompute(declared, part.recompute, method=part.recompute_method,
                                                   num_layers=part.recompute_num_layers,
                                                   chunks=(chunks or {}).get(name))
        except ValueError as err:
            raise ConfigError(f"{name} recompute: {err}") from None
        log.info("recompute %s of the %s: %d checkpoints", part.recompute, name, made[name])
    return made


# ------------------------------------------------------------------------------------------ tensor parallel


def _text_block_plan(layer, mesh, sp: bool) -> dict:
    """A TextLayer's styles (Megatron's layout, as backends/llm/tp_plan.py gives the native decoders): q/k/v
    column parallel by heads, o_proj row parallel; gate/up column, down row; the norms replicated (on sequence
    shards with SP, so their gradients are summed over tp)."""
    from backends.common.parallel.tensor_parallel import RegionEntry, colwise, replicated, rowwise

    tp, attn = mesh.size(), layer.self_attn
    plan = {"input_layernorm": replicated(partial_grad=sp), "post_attention_layernorm": replicated(partial_grad=sp),
            "self_attn.q_proj": colwise(), "self_attn.k_proj": colwise(), "self_attn.v_proj": colwise(),
            "self_attn.o_proj": rowwise(mesh, sp),
            "self_attn": RegionEntry(sp, attrs={"num_heads": attn.num_heads // tp,
                                                "num_kv_heads": attn.num_kv_heads // tp}),
            "mlp.gate_proj": colwise(), "mlp.up_proj": colwise(), "mlp.down_proj": rowwise(mesh, sp),
            "mlp": RegionEntry(sp)}
    return plan


def check_tensor_parallel(text, tp: int) -> None:
    problems = [f"{what} {n} does not split over tp={tp}" for what, n in (
        ("text_decoder.num_attention_heads", text.num_attention_heads),
        ("text_decoder.num_query_groups", text.num_kv_heads), ("text_decoder.ffn_hidden_size", text.ffn_hidden_size),
        ("text_decoder.vocab_size", text.vocab_size)) if n % tp]
    if problems:
        raise ConfigError("tensor parallel: " + "; ".join(problems))


def apply_tensor_parallel(vl, tp_mesh, sequence_parallel: bool) -> None:
    """Shard the text decoder over `tp_mesh` in place (embedding vocab-parallel, blocks by _text_block_plan, lm_head
    vocab-parallel for the loss); the vision encoder and merger stay whole on every tp rank (replicated DTensor
    parameters computed locally, so every parameter is a DTensor on one mesh for clipping, the optimizers and
    checkpoints). The embeddings stay whole until the image features are scattered into them; with SP a
    pre-hook of the decoder then cuts them to this rank's sequence shard (backward: all-gather of the grads)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from backends.common.parallel.tensor_parallel import parallelize, replicated

    tp, sp = tp_mesh.size(), bool(sequence_parallel)
    check_tensor_parallel(vl.config.text, tp)
    parallelize(vl, tp_mesh, vl.parts(), lambda layer: _text_block_plan(layer, tp_mesh, sp), sequence_parallel=sp,
                embedding_sp=False)
    owners = [name for name, m in vl.visual.named_modules() if any(True for _ in m.parameters(recurse=False))]
    parallelize_module(vl.visual, tp_mesh, {name: replicated(partial_grad=False) for name in owners})

    def to_sequence_shard(mod, args):
        embeds, *rest = args
        if embeds.shape[1] % tp:
            raise ValueError(f"sequence parallel: sequence length {embeds.shape[1]} does not split over tp={tp}")
        local = DTensor.from_local(embeds, tp_mesh, [Replicate()], run_check=False).redistribute(
            tp_mesh, [Shard(1)]).to_local()
        return (local, *rest)

    if sp:
        vl.model.register_forward_pre_hook(to_sequence_shard)


def sequence_shard(embeds, tp_mesh):
    """This tp rank's sequence shard of whole [B, S, H] embeddings; backward all-gathers the gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = tp_mesh.size()
    if embeds.shape[1] % tp:
        raise ValueError(f"sequence parallel: sequence length {embeds.shape[1]} does not split over tp={tp}")
    return DTensor.from_local(embeds, tp_mesh, [Replicate()], run_check=False).redistribute(
        tp_mesh, [Shard(1)]).to_local()


# ------------------------------------------------------------------------------------------ pipeline parallel


def check_pipeline_split(parts, pp: int) -> list[int]:
    """The text decoder's layers per stage; the whole vision encoder (and the merger) on the first stage, as
    MindSpeed-MM's published layouts put it ([32, 0, 0, 0])."""
    vision, text = parts["vision_encoder"].pipeline_num_layers, parts["text_decoder"].pipeline_num_layers
    if any(vision[1:]):
        raise ConfigError(f"model.json image_encoder.vision_encoder.pipeline_num_layers = {vision}: vision layers on "
                          "stages after the first are not built in backends.mm; put them all on the first stage")
    if min(text) < 1:
        raise ConfigError(f"model.json text_decoder.pipeline_num_layers = {text}: every stage needs at least one "
                          "text decoder layer in backends.mm")
    return list(text)


def _first_stage_class():
    from backends.common.parallel.pipeline import StageModule

    class VLFirstStage(StageModule):
        """The first stage: the vision tower on this micro-batch's images (handed over out of band, in
        micro-batch order: the schedule runs the first stage's forwards in that order), the image features
        scattered into the embeddings, then its text layers. The hidden states leave it as the other stages'."""

        def __init__(self, vl, parts, layers, *, last: bool, tp_mesh=None, sp: bool = False):
            super().__init__(parts, layers, first=True, last=last, carry_aux=False)
            self.visual = vl.visual
            self._embed = vl.embed
            self.tp_mesh, self.sp = tp_mesh, sp
            self.images: list = []

        def forward(self, x, aux=None, *, position_ids, doc_ids=None):
            from backends.common.parallel.pipeline import _cu_seqlens

            pixel_values, grid = self.images.pop(0)
            hidden = self._embed(x, pixel_values, grid)
            if self.sp:
                hidden = sequence_shard(hidden, self.tp_mesh)
            cu_seqlens = _cu_seqlens(doc_ids) if doc_ids is not None else None
            inputs = self.block_inputs(position_ids, hidden.dtype)
            for layer in self.layers.values():
                hidden, _ = layer(hidden, *inputs, cu_seqlens)
            if self.last:
                hidden = self.norm(hidden)
            return hidden

    return VLFirstStage


def attach_pipeline(vl, cfg, par, rt) -> list[int]:
    """Prune the model to this rank's stage (the vision parts stay on the first) and hang the runner and the
    pp groups on `par` (backends.common.parallel.pipeline, one stage per rank, 1F1B) -> this rank's layers.
    The blocks take M-RoPE tables: position ids travel as [B, 3, S] (the schedule splits dim 0)."""
    import dataclasses

    from backends.common.parallel.pipeline import (PipelineConfigError, PipelineRunner, plan_pipeline, prune_to_rank,
                                                   tied_embedding_groups)

    p, mesh = cfg.parallel, par.mesh
    text_split = check_pipeline_split(cfg.parts, p.pp)
    par.pp_rank = mesh["pp"].get_local_rank()
    par.pp_group = mesh["pp"].get_group()
    try:
        plan = plan_pipeline(vl.config.text.num_layers, p.pp, par.pp_rank, pp_layers=text_split)
    except PipelineConfigError as err:
        raise ConfigError(str(err)) from None
    layers = [i for s in plan.stage_ids for i in plan.layers[s]]
    rotary = vl.model.rotary
    parts = dataclasses.replace(vl.parts(), block_inputs=lambda pos, dtype: rotary(pos.transpose(0, 1), dtype))
    par.tied_group = tied_embedding_groups(mesh, p.pp) if parts.tied else None
    prune_to_rank(parts, layers, first=plan.first_rank, last=plan.last_rank)
    tp_mesh = mesh["tp"] if par.layout.tp > 1 else None
    runner = PipelineRunner(parts, plan, pp_group=par.pp_group, device=rt.device, carry_aux=False, tp_mesh=tp_mesh,
                            sequence_parallel=p.sp and tp_mesh is not None, precision=cfg.train.precision)
    if plan.first_rank:
        runner.modules[0] = _first_stage_class()(vl, parts, plan.layers[0], last=plan.last_rank, tp_mesh=tp_mesh,
                                                 sp=p.sp and tp_mesh is not None)
    else:
        del vl.visual  # the vision encoder and merger live on the first stage only
    par.pipeline = runner
    log.info("pipeline: pp=%d, this rank runs text layers %s%s", p.pp, layers,
             " and the vision encoder" if plan.first_rank else "")
    return layers
