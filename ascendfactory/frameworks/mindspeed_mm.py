"""MindSpeed-MM: Megatron-style training of vision-language models, backends.mm.

Renders MindSpeed-MM's three files as its examples/qwen2.5vl/ holds them: the Megatron flags
(mindspeed_mm_args.sh), `--mm-data data.json` and `--mm-model model.json`, plus engine.yaml."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ascendfactory.frameworks.base import Adapter, FeatureUse, flags_from_template, megatron_tracker_warnings

# Qwen2.5-VL's token ids (its tokenizer), for a card without a model directory
QWEN_VL_TOKENS = {"image_token_id": 151655, "vision_start_token_id": 151652}


def vision_facts(job, model_id: str, arch: dict[str, Any]) -> dict[str, Any]:
    """The vision tower, M-RoPE and token facts model.json states: model_path's config.json, else the card."""
    from ascendfactory import catalog

    if job.model_path and (Path(job.model_path).expanduser() / "config.json").is_file():
        cfg = json.loads((Path(job.model_path).expanduser() / "config.json").read_text(encoding="utf-8"))
        v = dict(cfg.get("vision_config") or {})
        text = dict(cfg.get("text_config") or cfg)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        tokens = {k: cfg.get(k, QWEN_VL_TOKENS[k]) for k in QWEN_VL_TOKENS}
        eps, mrope = text.get("rms_norm_eps", 1e-6), rope.get("mrope_section", [16, 24, 24])
    else:
        card = catalog.models()[model_id]
        v = dict(card.get("vision") or {})
        v.setdefault("intermediate_size", v.get("ffn_hidden_size"))
        tokens, eps = dict(QWEN_VL_TOKENS), card["arch"].get("rms_norm_eps", 1e-6)
        mrope = card["arch"].get("mrope_section", [16, 24, 24])
    vision = {"depth": v.get("depth"), "hidden_size": v.get("hidden_size"),
              "intermediate_size": v.get("intermediate_size"), "num_heads": v.get("num_heads"),
              "out_hidden_size": v.get("out_hidden_size", arch.get("hidden_size")),
              "in_channels": v.get("in_channels", 3), "patch_size": v.get("patch_size", 14),
              "spatial_merge_size": v.get("spatial_merge_size", 2), "temporal_patch_size": v.get("temporal_patch_size", 2),
              "tokens_per_second": v.get("tokens_per_second", 2), "window_size": v.get("window_size", 112),
              "fullatt_block_indexes": list(v.get("fullatt_block_indexes", [7, 15, 23, 31]))}
    return {"vision": vision, "rms_norm_eps": eps, "mrope_section": list(mrope), **tokens}


class MindSpeedMM(Adapter):
    name = "mindspeed-mm"
    engine_module = "backends.mm"
    stages = ("pt", "sft")
    columns = {"pretrain_full": "flag", "sptd": "flag", "distributed_optimizer": "flag", "recompute": "flag"}
    template = "engines/mindspeed-mm.args.j2"
    config_name = "mindspeed_mm_args.sh"
    sidecar_template = "engines/mindspeed-mm.engine.yaml.j2"
    cp_algos = ("ulysses",)
    finetuning_methods = ("full",)     # the matrix has no LoRA column for it
    reads_vision = True                # freezing per part and the pixel budget go to model.json / data.json

    def limits(self, job):
        p, out = job.parallel, []
        if p.zero:
            out.append(self.refuse("parallel.zero", "has no ZeRO stages",
                                   "use parallel.distributed_optimizer: true"))
        if p.fsdp:
            out.append(self.refuse("parallel.fsdp", "trains through its Megatron path here (FSDP2 is not built "
                                   "in backends.mm)", "use parallel.distributed_optimizer: true"))
        if p.ep > 1:
            out.append(self.refuse("parallel.ep", "has no expert parallel for its models", "set parallel.ep: 1"))
        if p.cp > 1:
            out.append(self.refuse("parallel.cp", "context parallel is not built in backends.mm", "set parallel.cp: 1"))
        if p.vpp > 1:
            out.append(self.refuse("parallel.vpp", "splits the parts per stage with pipeline_num_layers, no virtual "
                                   "stages", "set parallel.vpp: 1"))
        if job.data.format != "sharegpt":
            out.append(self.refuse("data.format", "reads MindSpeed-MM's mllm records (messages with <image> "
                                   "placeholders and an images list), data.format: sharegpt",
                                   "write the data as messages + images and set data.format: sharegpt"))
        if job.data.packing:
            out.append(self.refuse("data.packing", "trains variable-length batches (--variable-seq-lengths), not "
                                   "packed rows", "set data.packing: false"))
        if job.data.template and job.data.template.lower() not in ("qwen2vl", "qwen2_vl"):
            out.append(self.refuse("data.template", "has the template qwen2vl only", "leave data.template unset"))
        return out

    def no_effect(self, job):
        why = "its Qwen2.5-VL micro-batches are the samples packed into one row, unpadded (--variable-seq-lengths)"
        return {"data.dynamic_seq_len": why, "data.pad_to_multiple_of": why}

    def plan_warnings(self, job):
        return megatron_tracker_warnings(job)

    def features_used(self, job, distributed):
        p, uses = job.parallel, []
        if job.stage in self.stages:
            uses.append(FeatureUse("pretrain_full", f"stage: {job.stage}, finetuning: {job.finetuning}"))
        if p.cp > 1:
            distributed = distributed + [f"parallel.cp={p.cp}"]
        if distributed:
            uses.append(FeatureUse("sptd", ", ".join(distributed)))
        if p.distributed_optimizer:
            uses.append(FeatureUse("distributed_optimizer", "parallel.distributed_optimizer"))
        if p.recompute != "none":
            uses.append(FeatureUse("recompute", f"parallel.recompute={p.recompute}"))
        return uses

    def probe(self, job, row, feature, stage):
        job["data"]["format"] = "sharegpt"

    def starter_data(self, stage, default):
        return "data/mllm.json", "sharegpt"   # messages with <image> placeholders + images

    def _mm(self, context: dict[str, Any], job) -> dict[str, Any]:
        mm = vision_facts(job, context["model_id"], context["arch"])
        pp, vis = job.parallel.pp, job.vision
        stages = context["layout"].get("pp_layers") or [context["arch"]["num_layers"] // pp] * pp
        mm["pipeline"] = {"vision_encoder": [mm["vision"]["depth"]] + [0] * (pp - 1), "text_decoder": list(stages)}
        mm["freeze"] = {"vision_encoder": vis.freeze_tower if vis else True,
                        "vision_projector": vis.freeze_projector if vis else True,
                        "text_decoder": vis.freeze_language_model if vis else False}
        return mm

    def render_config(self, shell, yml, context, job, run_dir: Path):
        text, args = flags_from_template(shell, self.template, context)
        return "# MindSpeed-MM flags rendered by ascendfactory (one per line)\n" + text, args

    def extra_files(self, context, job) -> dict[str, str]:
        from ascendfactory.render import _environment

        yml = _environment("yaml")
        ctx = dict(context, mm=self._mm(context, job))
        out = {}
        for name, template in (("data.json", "engines/mindspeed-mm.data.json.j2"),
                               ("model.json", "engines/mindspeed-mm.model.json.j2")):
            tree = json.loads(yml.get_template(template).render(ctx))  # rendered JSON must parse
            out[name] = json.dumps(tree, indent=4) + "\n"
        return out


ADAPTER = MindSpeedMM()
