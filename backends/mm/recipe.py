"""The MindSpeed-MM-style recipe on the shared trainer: Qwen2.5-VL pre-training / fine-tuning of the native
model (backends.models.qwen2_5_vl) on MindSpeed-MM's mllm data, with per-part freezing (model.json `freeze`) and
recompute (backends/mm/parallelize.py), data parallel (DDP, or the distributed optimizer) through
backends.common.parallel; the loop, resume, metrics, plot and HF export are backends.common.trainer's.
"""

from __future__ import annotations

import logging
import math

import torch

from backends import kernels
from backends.common import kit
from backends.common.parallel import data_parallel
from backends.common.trainer import (Loss, Recipe, Settings, logged_micro_means, micro_batch_tokens, micro_mean_scales,
                                     seed_everything)
from backends.mm import parallelize
from backends.mm.config import ConfigError, MMConfig, parse_args

log = logging.getLogger("backends.mm")

# model.json part -> the module paths of the native model it holds
PART_MODULES = {"vision_encoder": ("visual.patch_embed", "visual.blocks"), "vision_projector": ("visual.merger",),
                "text_decoder": ("model", "lm_head")}


class VLWithLoss(torch.nn.Module):
    """The model plus its summed next-token loss, as one module (what DDP wraps)."""

    def __init__(self, vl: torch.nn.Module):
        super().__init__()
        self.vl = vl

    def forward(self, input_ids, labels, cu_seqlens, pixel_values=None, image_grid_thw=None):
        hidden = self.vl(input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw, cu_seqlens=cu_seqlens,
                         return_hidden=True)
        if getattr(self.vl, "tp_info", None) is not None:  # vocab-parallel CE on the lm_head shard
            from backends.common.parallel.tensor_parallel import tp_loss

            return tp_loss(self.vl, hidden, labels)[0]
        loss_sum, _ = kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.vl.output_weight(),
                                                   labels.reshape(-1))
        return loss_sum


def pad_for_sequence_parallel(mb: dict, tp: int, pad_id: int = 0) -> dict:
    """A packed [1, T] micro-batch padded to a multiple of tp (see pad_packed)."""
    t = mb["input_ids"].shape[1]
    return pad_packed(mb, t + (-t % tp), pad_id)


def pad_packed(mb: dict, length: int, pad_id: int = 0) -> dict:
    """A packed [1, T] micro-batch padded to `length` tokens: the padding is one more document (its own
    attention, no labels), so the real tokens' numbers do not change."""
    t = mb["input_ids"].shape[1]
    extra = length - t
    if extra < 0:
        raise ValueError(f"a micro-batch of {t} tokens does not fit {length}")
    if not extra:
        return mb
    out = dict(mb)
    out["input_ids"] = torch.nn.functional.pad(mb["input_ids"], (0, extra), value=pad_id)
    out["labels"] = torch.nn.functional.pad(mb["labels"], (0, extra), value=-100)
    cu = mb["cu_seqlens"]
    out["cu_seqlens"] = torch.cat([cu, cu.new_tensor([t + extra])])
    out["n_positions"] = torch.tensor(t + extra)
    return out


def freeze_parts(model: torch.nn.Module, parts) -> list[str]:
    frozen = []
    for name, part in parts.items():
        if not part.freeze:
            continue
        for path in PART_MODULES[name]:
            if path == "lm_head" and not hasattr(model, "lm_head"):
                continue
            for p in model.get_submodule(path).parameters():
                p.requires_grad_(False)
        frozen.append(name)
    return frozen


def job_fields(cfg: MMConfig) -> dict[str, object]:
    """The job-file fields (dotted) these flags came from, as capabilities.LIMITS / UNBUILT name them."""
    p = cfg.parallel
    return {"parallel.tp": p.tp, "parallel.sp": p.sp, "parallel.pp": p.pp,
            "parallel.distributed_optimizer": p.distributed_optimizer, "train.precision": cfg.train.precision}


def refuse_unbuilt(cfg: MMConfig) -> None:
    from backends.mm import capabilities

    kit.refuse_unbuilt(capabilities, "mindspeed-mm", job_fields(cfg), ConfigError, "backends.mm")


def build_model(cfg: MMConfig):
    from backends.models import qwen2_5_vl as models

    if cfg.load_hf:
        return models.from_pretrained(cfg.load_hf)
    return models.build_model(models.VLConfig.from_hf(cfg.arch))


class MMRecipe(Recipe):
    name = "backends.mm"

    def __init__(self, cfg: MMConfig):
        self.cfg = cfg

    def build(self, rt) -> Settings:
        cfg, t = self.cfg, self.cfg.train
        refuse_unbuilt(cfg)
        overrides = {} if cfg.flash_attention else {"attention": "reference"}
        kernels.configure(default=cfg.kernel_backend, overrides={**overrides, **cfg.kernel_overrides} or None)
        seed_everything(t.seed)
        vl = build_model(cfg).to(rt.device)
        frozen = freeze_parts(vl, cfg.parts)
        par = self.par = parallelize.setup(vl, cfg, rt)
        self.accum = par.layout.grad_accum
        self.trainable, self.total = kit.count_parameters(vl)
        log.info("model: qwen2_5_vl, %.2f M parameters (%.2f M trainable; frozen: %s), kernels %s",
                 self.total / 1e6, self.trainable / 1e6, ", ".join(frozen) or "nothing", kernels.describe())
        self.dataset, self.loader = self._data(vl, par)
        total_steps = t.steps or max(1, math.ceil(t.epochs * len(self.dataset) / t.global_batch))
        self.vl, self.rt = vl, rt
        model = data_parallel.wrap_data_parallel(VLWithLoss(vl), vl.parts(), par, rt.device)
        self.parts = {"model": kit.train_part(
            model, par, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay, schedule=kit.megatron_schedule(
                t, total_steps), precision=t.precision, grad_clip=t.grad_clip,
            forward_backward=self._pipeline_step if par.pipeline is not None else None)}
        return Settings(total_steps=total_steps, save_dir=cfg.save, save_interval=t.save_interval,
                        exit_interval=t.exit_interval, resume=self._resume(), log_interval=t.log_interval,
                        metrics_file=cfg.metrics_file, trackers=cfg.trackers)

    def _data(self, vl, par):
        """MindSpeed-MM's mllm data (data.json) through the model's processor, this rank's dp share."""
        from transformers import AutoImageProcessor, AutoTokenizer

        from backends.mm.data import Loader, MLLMDataset

        d, t = self.cfg.data, self.cfg.train
        tokenizer = AutoTokenizer.from_pretrained(d.processor_dir)
        processor = AutoImageProcessor.from_pretrained(d.processor_dir)
        dataset = MLLMDataset(d, tokenizer, processor, vl.config.vision.spatial_merge_size)
        return dataset, Loader(dataset, t.micro_batch, par.dp_rank, par.layout.dp, t.seed, d.shuffle)

    def _resume(self) -> str | None:
        return kit.megatron_resume(self.cfg.load, self.cfg.save, partial=self.cfg.partial_load, error=ConfigError)

    def next_micro_batches(self) -> list[dict]:
        dev, p = self.rt.device, self.cfg.parallel
        out = []
        for _ in range(self.accum):
            mb = next(self.loader)
            if p.pp > 1:  # the schedule's stages exchange fixed shapes: every micro-batch padded to one length
                length = self.cfg.data.seq_len * self.cfg.train.micro_batch
                mb = pad_packed(mb, length + (-length % p.tp if p.sp else 0))
                mb["position_ids"] = self.vl.positions(mb["input_ids"], mb["image_grid_thw"],
                                                       cu_seqlens=mb["cu_seqlens"]).transpose(0, 1)  # [1, 3, S]
            elif p.sp and p.tp > 1:
                mb = pad_for_sequence_parallel(mb, p.tp)
            out.append({k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in mb.items()})
        return out

    def _pipeline_step(self, micro_batches, scales):
        pipeline, per_token = self.par.pipeline, self.cfg.train.per_token_loss
        token = scales.token if per_token else micro_mean_scales(micro_batches, scales)
        loss_sum, _ = pipeline.forward_backward(micro_batches, token, scales.extra)
        if not per_token:   # logged as loss() logs it: the mean of the micro-batch means
            loss_sum = logged_micro_means(pipeline.micro_loss_sums, micro_batches, scales)
        return loss_sum, {}, 1.0

    def loss(self, model, mb: dict) -> Loss:
        """MindSpeed-MM's reduction (pretrain_vlm.loss_func): each micro-batch's token mean, averaged over the
        micro-batches and data-parallel replicas, and logged so (Megatron's training_log averages loss_dict
        over them); --calculate-per-token-loss the global batch's token mean."""
        loss_sum = model(mb["input_ids"], mb["labels"], mb["cu_seqlens"], mb["pixel_values"], mb["image_grid_thw"])
        if self.cfg.train.per_token_loss:
            return Loss(loss_sum)
        return Loss(loss_sum, micro_mean=loss_sum / micro_batch_tokens(mb), log_micro_mean=True)

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])

    def start_info(self) -> dict:
        return {"grad_accum": self.accum, "samples": len(self.dataset), "parameters": self.total,
                "trainable": self.trainable}

    def plot_title(self, total_steps: int) -> str:
        return f"qwen2_5_vl · {total_steps} steps"

    def export(self, trainer) -> None:
        if not self.cfg.export_hf:
            return
        from backends.models.qwen2_5_vl import hf_state_dict, save_pretrained

        tensors = hf_state_dict(self.vl)
        if getattr(self.vl, "tp_info", None) is not None:  # collective: every rank gathers, rank 0 writes
            from backends.common.parallel.tensor_parallel import full_tensors

            tensors = full_tensors(self.vl, tensors)
        if self.par.pipeline is not None:  # every stage's tensors to every pp rank (rank 0 writes)
            import torch.distributed as dist

            stages: list = [None] * self.par.layout.pp
            dist.all_gather_object(stages, {k: v.detach().cpu() for k, v in tensors.items()},
                                   group=self.par.pp_group)
            tensors = {k: v for stage in stages for k, v in stage.items()}
        if self.rt.is_main:
            save_pretrained(self.vl, self.cfg.export_hf, tokenizer_dir=self.cfg.data.processor_dir, tensors=tensors)


def main(argv: list[str] | None = None) -> int:
    from backends.common import trainer
    from backends.mm.data import DataError

    return trainer.main("backends.mm", lambda args: MMRecipe(parse_args(args)), argv,
                        user_errors=(ConfigError, DataError))
