"""Qwen2.5-VL's parallel setup in backends.mm, applied from outside the model by backends.common.parallel on
the blocks the model declares (`parts()`: the text decoder; `vision_parts()`: the vision encoder).

    setup(vl, cfg, rt)                           the checked layout and mesh, then TP, PP and recompute below
    apply_recompute(vl, parts)                   recompute per part, as model.json / the Megatron flags set it
    check_tensor_parallel(vl, tp)                what must split over tp, named by model.json's keys (the plan:
                                                 backends/models/qwen2_5_vl/tp_plan.py)
    attach_pipeline(vl, cfg, par, rt)            PP over the parts as pipeline_num_layers splits them (vision first)
"""

from __future__ import annotations

import logging

from backends.common import kit
from backends.common.parallel import recompute
from backends.mm.config import ConfigError
from backends.models.qwen2_5_vl.tp_plan import apply_tensor_parallel, sequence_shard

log = logging.getLogger("backends.mm")


def setup(vl, cfg, rt):
    """The layout checked by the planner's rules (a stage's layers are both parts': the vision tower's on the
    first stages), the mesh, then TP (it sees the whole model), the pipeline cut (each rank keeps its stage)
    and recompute last (it wraps what TP hooked) -> the Parallel."""
    t, text = cfg.train, vl.config.text
    layers, pnl = text.num_layers, None
    if cfg.parallel.pp > 1:
        check_pipeline_split(cfg.parts, cfg.parallel.pp)
        per_part = [cfg.parts[name].pipeline_num_layers for name in ("vision_encoder", "text_decoder")]
        layers, pnl = vl.config.vision.depth + text.num_layers, [v + n for v, n in zip(*per_part)]
    par = kit.parallel(rt, ConfigError, distributed_optimizer=cfg.parallel.distributed_optimizer,
                       heads=text.num_attention_heads, layers=layers, kv_heads=text.num_kv_heads, tp=cfg.parallel.tp,
                       pp=cfg.parallel.pp, pp_layers=pnl, seq_len=cfg.data.seq_len, micro_batch=t.micro_batch,
                       global_batch=t.global_batch)
    if par.layout.tp > 1:
        check_tensor_parallel(vl, par.layout.tp)
        apply_tensor_parallel(vl, par.mesh["tp"], cfg.parallel.sp)
    chunks = None
    if par.layout.pp > 1:
        attach_pipeline(vl, cfg, par, rt)
        chunks = {"text_decoder": [list(m.layers.values()) for m in par.pipeline.modules]}
    apply_recompute(vl, cfg.parts, chunks)
    return par


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


def check_tensor_parallel(vl, tp: int) -> None:
    text, vision = vl.config.text, vl.config.vision
    enc, proj = "image_encoder.vision_encoder", "image_encoder.vision_projector"
    problems = [f"{what} {n} does not split over tp={tp}" for what, n in (
        ("text_decoder.num_attention_heads", text.num_attention_heads),
        ("text_decoder.num_query_groups", text.num_kv_heads), ("text_decoder.ffn_hidden_size", text.ffn_hidden_size),
        ("text_decoder.vocab_size", text.vocab_size), (f"{enc}.num_attention_heads", vision.num_heads),
        (f"{enc}.ffn_hidden_size", vision.intermediate_size),
        (f"{proj}.ffn_hidden_size", vision.hidden_size * vision.merge_unit)) if n % tp]
    if problems:
        raise ConfigError("tensor parallel: " + "; ".join(problems))



# ------------------------------------------------------------------------------------------ pipeline parallel


class StageSplit:
    """model.json's pipeline_num_layers, vision first: the vision tower's layers on stages 0..merger_stage (the
    merger and the text embedding on the stage of the last vision layer), the text decoder's after it, starting
    on that stage or the next. vision / text: the layer indices of every stage."""

    def __init__(self, parts, pp: int):
        vision, text = parts["vision_encoder"].pipeline_num_layers, parts["text_decoder"].pipeline_num_layers
        where = ("model.json image_encoder.vision_encoder.pipeline_num_layers = {} and text_decoder."
                 "pipeline_num_layers = {}").format(vision, text)
        self.pp = pp
        self.merger_stage = m = max(i for i, n in enumerate(vision) if n)
        if not all(vision[:m + 1]):
            raise ConfigError(f"{where}: stage {vision.index(0)} holds no vision layer while a later one does; the "
                              "vision tower's layers fill the first stages, one after another")
        if any(text[:m]):
            raise ConfigError(f"{where}: text decoder layers on stage {min(i for i in range(m) if text[i])}, before "
                              f"the vision tower ends on stage {m}; the vision layers come first (the text decoder "
                              "needs the image features), so text layers start on that stage or later")
        empty = [i for i in range(m + 1, pp) if not text[i]]
        if empty:
            raise ConfigError(f"{where}: stage {empty[0]} holds no layer; give every stage at least one")
        if m and parts["vision_encoder"].freeze:  # (the optimizer of a stage with nothing to train has no work)
            held = "stage 0 holds" if m == 1 else f"stages 0-{m - 1} hold"
            raise ConfigError(f"{where}: {held} only vision layers, and model.json image_encoder."
                              "vision_encoder.freeze is true, so they would train nothing; put the frozen vision tower "
                              "on fewer stages (all on stage 0 with the merger) or train it")
        self.vision, self.text = self._ranges(vision), self._ranges(text)

    @staticmethod
    def _ranges(counts):
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        return [list(range(bounds[i], bounds[i + 1])) for i in range(len(counts))]


def check_pipeline_split(parts, pp: int) -> StageSplit:
    return StageSplit(parts, pp)


def _stage_class():
    import torch
    import torch.nn.functional as F
    from torch import nn

    from backends.common.parallel.pipeline import _cu_seqlens

    class VLStage(nn.Module):
        """One pipeline stage of Qwen2.5-VL: its vision blocks (the patch embedding first on stage 0, the merger
        and the scatter of the image features into the text embeddings on the merger stage), then its text
        layers. A micro-batch's input_ids and images come out of band (`batches`, in micro-batch order: the
        schedule runs a stage's forwards in that order). What leaves a stage before the merger is the patches'
        hidden states, padded to `carry_rows` (the schedule sends fixed shapes); after it, the text hidden states."""

        def __init__(self, vl, parts, split: StageSplit, stage: int, *, tp_mesh=None, sp: bool = False):
            super().__init__()
            self.stage, self.merger_stage, self.last = stage, split.merger_stage, stage == split.pp - 1
            self.visual = vl.visual if stage <= split.merger_stage else None
            blocks = parts.get(parts.blocks)
            self.layers = nn.ModuleDict({str(i): blocks[str(i)] for i in split.text[stage]})
            self.norm = parts.get(parts.norm) if self.last else None
            self.output = parts.output_module() if self.last else None
            self.block_inputs = parts.block_inputs
            self._embed_with = vl.embed_with
            self.tp_mesh, self.sp = tp_mesh, sp
            self.batches: list[dict] = []
            self.carry_rows = 0

        def forward(self, x, *, position_ids, doc_ids=None):
            mb = self.batches.pop(0)
            if self.visual is not None:
                hidden = self._vision(x, mb)
                if self.stage < self.merger_stage:
                    return hidden
            else:
                hidden = x
            cu_seqlens = _cu_seqlens(doc_ids) if doc_ids is not None else None
            inputs = self.block_inputs(position_ids, hidden.dtype)
            for layer in self.layers.values():
                hidden, _ = layer(hidden, *inputs, cu_seqlens)
            return self.norm(hidden) if self.last else hidden

        def _vision(self, x, mb):
            visual, grid, features = self.visual, mb["image_grid_thw"], None
            dtype = next(iter(visual.blocks.values())).norm1.weight.dtype
            if grid is not None:
                vi = visual.inputs(grid, dtype, x.device)
                if self.stage == 0:
                    h = visual.begin(mb["pixel_values"], vi)
                else:
                    h = x[:vi.rows // (visual.sequence.size if visual.sequence else 1)].to(dtype)
                h = visual.run(h, vi)
                if self.stage < self.merger_stage:
                    return F.pad(h.float(), (0, 0, 0, self.carry_rows - h.shape[0]))
                features = visual.end(h, vi)
            elif self.stage < self.merger_stage:  # no image in this micro-batch: nothing to carry
                return torch.zeros(self.carry_rows, visual.cfg.hidden_size, device=x.device)
            hidden = self._embed_with(mb["input_ids"], features)
            return sequence_shard(hidden, self.tp_mesh) if self.sp else hidden

    return VLStage


def _runner_class():
    from backends.common.parallel.pipeline import PipelineRunner

    class VLPipelineRunner(PipelineRunner):
        """The shared runner (schedule, loss on the last stage, tied embedding) with VLStage modules and the
        tensors that cross each boundary: the patches' hidden states [carry rows, vision hidden] inside the
        vision tower, the text hidden states after the merger stage. The patches are at most the micro-batch's
        tokens × merge_unit (every image token is merge_unit patches), so that bound is the fixed carry."""

        def __init__(self, vl, parts, plan, split: StageSplit, *, tp_mesh, sp: bool, **kw):
            super().__init__(parts, _no_stages(plan), tp_mesh=tp_mesh, sequence_parallel=sp, carry_aux=False, **kw)
            self.plan, self.split, self.vision_hidden = plan, split, vl.config.vision.hidden_size
            self.merge_unit = vl.config.vision.merge_unit
            self.modules = [_stage_class()(vl, parts, split, s, tp_mesh=tp_mesh, sp=sp) for s in plan.stage_ids]

        def _build(self, n_micro: int, mb_shape: tuple[int, int], dtype) -> None:
            import torch
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            b, s = mb_shape
            tp = self.tp_mesh.size() if self.tp_mesh is not None else 1
            rows = b * s * self.merge_unit // (tp if self.sp else 1)
            vision = self._meta((rows, self.vision_hidden), dtype)
            text = self._meta((b, s // tp if self.sp else s, self.hidden_size), dtype)
            (sid,), (module,) = self.plan.stage_ids, self.modules
            module.carry_rows = rows
            inputs = self._meta((b, s), torch.long) if sid == 0 else (
                vision if sid - 1 < self.split.merger_stage else text)
            output = vision if sid < self.split.merger_stage else text
            stage = PipelineStage(module, sid, self.plan.n_virtual, self.device, input_args=(inputs,),
                                  output_args=(output,), group=self.pp_group)
            self.stages = [stage]
            self.schedule = Schedule1F1B(stage, n_micro, loss_fn=self._loss, scale_grads=False)
            self._shape = (n_micro, mb_shape)

        def forward_backward(self, micro_batches, token_scale, aux_scale):
            keys = ("input_ids", "pixel_values", "image_grid_thw")
            self.modules[0].batches = [{k: mb.get(k) for k in keys} for mb in micro_batches]
            return super().forward_backward(micro_batches, token_scale, aux_scale)

    return VLPipelineRunner


def _no_stages(plan):
    import dataclasses

    return dataclasses.replace(plan, stage_ids=[])


def _tied_groups(mesh, embed_stage: int, pp: int):
    """A tied model's pairs of the embedding stage's and the last stage's ranks (same dp/cp/tp coordinate):
    this rank's group, or None. Collective: every rank builds every group."""
    import torch.distributed as dist

    ranks, mine, me = mesh.mesh, None, dist.get_rank()
    for a, b in zip(ranks[embed_stage].reshape(-1).tolist(), ranks[pp - 1].reshape(-1).tolist()):
        group = dist.new_group([a, b])
        if me in (a, b):
            mine = group
    return mine


def _prune_vision(visual, layers: list[int], *, first: bool, merger: bool) -> None:
    from torch import nn

    visual.blocks = nn.ModuleDict({str(i): visual.blocks[i] for i in layers})
    if not first:
        del visual.patch_embed
    if not merger:
        del visual.merger


def attach_pipeline(vl, cfg, par, rt) -> list[int]:
    """Prune the model to this rank's stage and hang the runner and the pp groups on `par`
    (backends.common.parallel.pipeline's schedule, one stage per rank, 1F1B) -> this rank's text layers.
    The blocks take M-RoPE tables: position ids travel as [B, 3, S] (the schedule splits dim 0)."""
    import dataclasses

    from backends.common.parallel.pipeline import PipelineLayout, prune_to_rank

    p, mesh = cfg.parallel, par.mesh
    split = check_pipeline_split(cfg.parts, p.pp)
    par.pp_rank = rank = mesh["pp"].get_local_rank()
    par.pp_group = mesh["pp"].get_group()
    m = split.merger_stage
    plan = PipelineLayout(pp=p.pp, pp_rank=rank, stage_ids=[rank], n_virtual=p.pp, layers=split.text,
                          first_rank=rank == 0, last_rank=rank == p.pp - 1)
    rotary = vl.model.rotary
    parts = dataclasses.replace(vl.parts(), block_inputs=lambda pos, dtype: rotary(pos.transpose(0, 1), dtype))
    par.tied_group = _tied_groups(mesh, m, p.pp) if parts.tied and m < p.pp - 1 else None
    prune_to_rank(parts, split.text[rank], first=rank == m, last=plan.last_rank)
    if rank <= m:
        _prune_vision(vl.visual, split.vision[rank], first=rank == 0, merger=rank == m)
    else:
        del vl.visual
    tp_mesh = mesh["tp"] if par.layout.tp > 1 else None
    par.pipeline = _runner_class()(vl, parts, plan, split, tp_mesh=tp_mesh, sp=p.sp and tp_mesh is not None,
                                   pp_group=par.pp_group, device=rt.device, precision=cfg.train.precision)
    what = [f"vision layers {split.vision[rank]}"] if rank <= m else []
    what += ["the merger"] if rank == m else []
    what += [f"text layers {split.text[rank]}"] if split.text[rank] else []
    log.info("pipeline: pp=%d, this rank runs %s", p.pp, ", ".join(what))
    return split.text[rank]
