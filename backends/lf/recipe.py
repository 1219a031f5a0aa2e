"""The LLaMA-Factory-style recipe on the shared trainer: stages pt, sft, rm, dpo and kto of a Hugging
Face causal LM (full, freeze or LoRA), data parallel with ZeRO 0-3, as `llamafactory-cli
train <file>.yaml` runs it. HF Trainer's rules are kept where they change the numbers: the step
count per epoch, the schedulers (transformers' own), warmup from warmup_steps or warmup_ratio, the
per-device batch and gradient accumulation. The loop itself is backends.common.trainer's.
"""

from __future__ import annotations

import json
import logging
import math
import time
from datetime import timedelta
from pathlib import Path

import torch

from backends import kernels
from backends.common import kit
from backends.common.trainer import Loss, Recipe, Settings, seed_everything
from backends.lf.config import LFConfig, LFConfigError, parse_config
from backends.common.hf_model import HFCausalLMWithLoss, apply_kernels
from backends.lf.outputs import TrainerOutputs

log = logging.getLogger("backends.lf")

TRAINER_LOG = "trainer_log.jsonl"
# files whose presence makes output_dir a finished model (LLaMA-Factory refuses to train over one)
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "adapter_model.safetensors",
               "adapter_model.bin")


def steps_per_epoch(cfg: LFConfig, batches_per_epoch: int) -> int:
    """HF Trainer (transformers 5): ceil(per-rank micro-batches / accumulation), the last step of an epoch
    taking the micro-batches left."""
    return max(-(-batches_per_epoch // cfg.gradient_accumulation_steps), 1)


def total_steps(cfg: LFConfig, batches_per_epoch: int) -> int:
    """HF Trainer's count: max_steps when given, else ceil(epochs × optimizer steps per epoch)."""
    if cfg.max_steps > 0:
        return int(cfg.max_steps)
    return max(1, math.ceil(cfg.num_train_epochs * steps_per_epoch(cfg, batches_per_epoch)))


def interval_steps(value: float, total: int) -> int:
    """logging_steps / save_steps as HF's TrainerState reads them: below 1 a fraction of the run (rounded up)."""
    return math.ceil(total * value) if value < 1 else int(value)


def warmup_steps(cfg: LFConfig, total: int) -> int:
    """warmup_steps (a count, or below 1 a fraction of the run), else ceil(warmup_ratio × steps)."""
    w = cfg.warmup_steps
    if w >= 1:
        return int(w)
    if w > 0:
        return math.ceil(w * total)
    return math.ceil((cfg.warmup_ratio or 0.0) * total)


def build_scheduler(optimizer, cfg: LFConfig, total: int):
    """transformers' own scheduler of that name (the one LLaMA-Factory's trainer builds)."""
    from transformers import get_scheduler

    kwargs = dict(cfg.lr_scheduler_kwargs or {})
    if cfg.lr_scheduler_type == "cosine_with_min_lr" and not ({"min_lr", "min_lr_rate"} & set(kwargs)):
        raise LFConfigError("lr_scheduler_type cosine_with_min_lr needs lr_scheduler_kwargs with min_lr or "
                            "min_lr_rate")
    try:
        return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(cfg, total),
                             num_training_steps=total, scheduler_specific_kwargs=kwargs or None)
    except TypeError as err:
        raise LFConfigError(f"lr_scheduler_kwargs {kwargs}: {cfg.lr_scheduler_type} does not take them ({err})") \
            from None


def job_fields(cfg: LFConfig) -> dict[str, object]:
    """The job-file fields (dotted) LLaMA-Factory's keys came from, as capabilities.LIMITS / UNBUILT name them."""
    return {"stage": cfg.stage, "finetuning": cfg.finetuning_type, "data.packing": bool(cfg.packing),
            "train.precision": precision(cfg)}


def tokens_seen_mode(value) -> str:
    """include_num_input_tokens_seen as TrainingArguments reads it: all, non_padding or no (booleans: all / no)."""
    return {True: "all", False: "no"}.get(value, value) if isinstance(value, bool) else value


def precision(cfg: LFConfig) -> str:
    """bf16 / fp16 (LLaMA-Factory's switches), else fp32."""
    return "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"


def resume_setting(cfg: LFConfig, save_dir: Path) -> str | None:
    """LLaMA-Factory's rule: resume_from_checkpoint when given; else the newest checkpoint in
    output_dir unless overwrite_output_dir; a finished model there without checkpoints is refused.
    Stage rm with full / freeze tuning never resumes there (nor checks output_dir)."""
    from backends.common.checkpoint.resume import list_checkpoints

    if cfg.stage == "rm" and cfg.finetuning_type != "lora":  # LF: "Cannot resume from checkpoint in current stage."
        if cfg.resume_from_checkpoint:
            log.warning("resume_from_checkpoint: LLaMA-Factory does not resume stage rm with %s tuning; ignored",
                        cfg.finetuning_type)
        return None
    if cfg.resume_from_checkpoint:
        return cfg.resume_from_checkpoint
    if cfg.overwrite_output_dir:
        return None
    out = Path(cfg.output_dir)
    if not (save_dir.is_dir() and list_checkpoints(save_dir)) and any((out / n).is_file() for n in MODEL_FILES):
        raise LFConfigError(f"output_dir {out} already holds a trained model and no checkpoint to resume; set "
                            "overwrite_output_dir: true, or choose another output_dir")
    return "auto"


class TrainerLog:
    """output_dir/trainer_log.jsonl as LLaMA-Factory's LogCallback writes it (rank 0): a line per Trainer log
    (the log_history entry's loss, learning rate, epoch, DPO's accuracy), and one without them for the closing
    metrics; throughput / total_tokens once the Trainer counts input tokens (include_num_input_tokens_seen)."""

    def __init__(self, path: Path, total: int, first_step: int):
        self.path, self.total, self.first_step = path, total, first_step
        self.start = time.time()
        if not first_step and path.exists():
            path.unlink()  # a fresh run starts a fresh log, as LogCallback does

    def write(self, step: int, entry: dict, tokens_seen: int = 0) -> None:
        """A log_history entry's line: a training log, an evaluation's (eval_loss, as LogCallback writes it) or
        the closing one; with the Trainer counting input tokens, their throughput and total."""
        elapsed = time.time() - self.start
        remaining = (self.total - step) * elapsed / max(step - self.first_step, 1)
        logs = {"current_steps": step, "total_steps": self.total, "loss": entry.get("loss"),
                "eval_loss": entry.get("eval_loss"), "reward": entry.get("reward"),
                "accuracy": entry.get("rewards/accuracies"), "lr": entry.get("learning_rate"),
                "epoch": entry.get("epoch"), "percentage": round(step / self.total * 100, 2) if self.total else 100,
                "elapsed_time": str(timedelta(seconds=int(elapsed))),
                "remaining_time": str(timedelta(seconds=int(remaining)))}
        if tokens_seen:
            logs.update(throughput=round(tokens_seen / max(elapsed, 1e-9), 2), total_tokens=tokens_seen)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({k: v for k, v in logs.items() if v is not None}) + "\n")


class LFRecipe(Recipe):
    name = "backends.lf"

    def __init__(self, cfg: LFConfig):
        self.cfg = cfg
        self._trainer_log: TrainerLog | None = None
        self._first_step: int | None = None  # this session's first step (0 unless resumed)
        self.evaluation = None   # backends.lf.eval.Evaluation when the run has eval sets
        self.eval_sets: dict = {}
        self.vision_model = False
        self.step_metrics: dict[str, float] = {}  # the stage metrics to log (rewards/*, kl, …)
        # dpo: (a step's metric means, its micro-batches) for each step since the last log
        self._dpo_interval: list[tuple[dict, int]] = []

    # ------------------------------------------------------------------ build
    def build(self, rt) -> Settings:
        from backends.lf import capabilities, parallel

        cfg = self.cfg
        kit.refuse_unbuilt(capabilities, "llamafactory", job_fields(cfg), LFConfigError, "backends.lf")
        seed_everything(cfg.seed)
        hf = self._hf_model()
        model = self._stage_model(hf)
        self.rt = rt
        par = self.par = parallel.setup(cfg, model, rt)
        self.checkpointed = parallel.recompute(cfg, model)
        self.dataset, self.loader, self.tokenizer = self._data(rt, par)
        steps = total_steps(cfg, len(self.loader))
        self.steps_per_epoch = steps_per_epoch(cfg, len(self.loader))
        model = parallel.wrap(model, cfg, par, rt.device)
        self.model = model
        self.reference = self._reference(par, rt) if cfg.stage in ("dpo", "kto") else None
        self.parts = {"model": kit.train_part(
            model, par, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay,
            eps=cfg.adam_epsilon, schedule=lambda optimizer: build_scheduler(optimizer, cfg, steps),
            precision=precision(cfg), grad_clip=cfg.max_grad_norm)}
        self._batches = iter(self.loader)
        self.outputs = self._outputs(hf, steps, par)
        if self.eval_sets:
            from backends.lf.eval import Evaluation, Schedule

            schedule = Schedule.of(cfg, steps, self.steps_per_epoch)
            self.evaluation = Evaluation(self, list(self.eval_sets.values()), schedule)
            self.evaluation.check()
        return self._settings(rt, steps)

    def _outputs(self, hf, steps: int, par) -> TrainerOutputs:
        """The Trainer's files; its FLOP count leaves the embeddings out (num_parameters(exclude_embeddings))."""
        cfg = self.cfg
        embeddings = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Embedding))
        # the Trainer's num_train_epochs: what max_steps makes of it, else the key
        epochs = math.ceil(steps / self.steps_per_epoch) if cfg.max_steps > 0 else cfg.num_train_epochs
        return TrainerOutputs(cfg.output_dir, max_steps=steps, batches_per_epoch=len(self.loader),
                              accumulation=cfg.gradient_accumulation_steps,
                              logging_steps=interval_steps(cfg.logging_steps, steps),
                              save_steps=interval_steps(cfg.save_steps, steps),
                              micro_batch=cfg.per_device_train_batch_size, num_train_epochs=epochs,
                              flops_params=0 if cfg.stage == "rm" else self.total - embeddings,
                              count_tokens=tokens_seen_mode(cfg.include_num_input_tokens_seen),
                              global_batch=cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
                              * par.grad_world)

    def _stage_model(self, hf):
        """The trained module: the LM with its loss (dropout off for dpo / kto, as trl's trainers turn it off),
        or for rm the LM with trl's value head (LF's, read from model_name_or_path when it holds one)."""
        from backends.lf import kto, rm

        if self.cfg.stage != "rm":
            model = HFCausalLMWithLoss(hf)
            if self.cfg.stage in ("dpo", "kto"):
                kto.disable_dropout(model)
            return model
        model = rm.RewardModel(hf)
        rm.freeze_unused_head(hf)
        rm.load_value_head(model, self.cfg.model_name_or_path)
        self.trainable, self.total = kit.count_parameters(model)
        return model

    def _hf_model(self):
        """The transformers model of model_name_or_path with the kernels patched in and the finetuning type's
        parameters trainable."""
        from backends.lf import model as lfmodel

        cfg = self.cfg
        overrides = {**lfmodel.attention_override(cfg.flash_attn), **cfg.engine.get("kernels.overrides", {})}
        kernels.configure(default=cfg.engine.get("kernels.backend"), overrides=overrides or None)
        hf = lfmodel.load_hf_model(cfg)
        patched = apply_kernels(hf)
        trained = lfmodel.make_trainable(hf, cfg)
        self.trainable, self.total = kit.count_parameters(hf)
        self.model_vocab = hf.get_output_embeddings().weight.shape[0]
        log.info("model: %s, %.2f M parameters (%.2f M trainable, %s %s), kernels %s; patched %s",
                 hf.config.model_type, self.total / 1e6, self.trainable / 1e6, cfg.finetuning_type,
                 len(trained), kernels.describe(), patched)
        return hf

    def _settings(self, rt, steps: int) -> Settings:
        """LLaMA-Factory's output_dir layout (checkpoints/, metrics.jsonl) and save / log / resume rules."""
        cfg = self.cfg
        out = Path(cfg.output_dir)
        save_dir = out / "checkpoints"
        resume = resume_setting(cfg, save_dir)
        metrics = cfg.engine.get("metrics_file") or str(out / "metrics.jsonl")
        if rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
        return Settings(total_steps=steps, save_dir=str(save_dir),
                        save_interval=interval_steps(cfg.save_steps, steps) if cfg.save_strategy == "steps" else None,
                        exit_interval=cfg.engine.get("exit_interval"), resume=resume,
                        log_interval=max(1, interval_steps(cfg.logging_steps, steps)),
                        log_first_step=bool(cfg.logging_first_step), metrics_file=metrics,
                        keep_last=cfg.save_total_limit, trainable_only=cfg.finetuning_type == "lora",
                        trackers=cfg.tracker_settings(self.steps_per_epoch))

    def _reference(self, par, rt):
        """The dpo / kto reference: none for orpo / simpo, the policy with its adapters off under LoRA, else a
        frozen copy of the starting model (sharded like the policy under ZeRO-3)."""
        from backends.lf import model as lfmodel
        from backends.lf import parallel
        from backends.lf.dpo import uses_reference

        cfg = self.cfg
        if (cfg.stage == "dpo" and not uses_reference(cfg.pref_loss)) or cfg.finetuning_type == "lora":
            return None
        hf = lfmodel.load_hf_model(cfg)
        apply_kernels(hf)
        hf.requires_grad_(False)
        ref = HFCausalLMWithLoss(hf).eval()
        ref.to(rt.device)
        return parallel.wrap(ref, cfg, par, rt.device, frozen=True)

    def _data(self, rt, par):
        from backends.common.data import load_tokenizer, pad_id
        from backends.lf.data import build_template, read_dataset_info
        from backends.lf import packing
        from backends.lf.feedback import FeedbackLoader, build_feedback
        from backends.lf.mm_plugin import is_vl
        from backends.lf.order import LFMicroBatchLoader, order_seed
        from backends.lf.pairs import PairLoader, build_pairs

        cfg = self.cfg
        tokenizer = load_tokenizer(cfg.model_name_or_path, use_fast=cfg.use_fast_tokenizer)
        entries, eval_entries = read_dataset_info(cfg), read_dataset_info(cfg, "eval_dataset")
        for line in cfg.notices():
            log.info("notice: %s", line)
        with_images = [e.name for e in entries + eval_entries if e.columns.get("images")]
        if with_images and cfg.template == "gemma":  # LF's gemma has gemma3's text format but no image plugin
            raise LFConfigError(f"template: gemma takes no images in LLaMA-Factory ({', '.join(with_images)} has an "
                                "images column); use template gemma3")
        cache = Path(cfg.output_dir) / "data"
        template = build_template(cfg, tokenizer)
        pairwise = cfg.stage in ("rm", "dpo")
        for key, named in (("dataset", entries), ("eval_dataset", eval_entries)):
            if pairwise and not all(e.ranking for e in named):
                raise LFConfigError(f"{key}: stage {cfg.stage} needs ranking datasets (ranking: true in "
                                    f"dataset_info.json); {', '.join(e.name for e in named if not e.ranking)} is not one")
            if not pairwise and any(e.ranking for e in named):
                raise LFConfigError(f"{key}: {', '.join(e.name for e in named if e.ranking)} is a ranking dataset, "
                                    f"which stage {cfg.stage} cannot train (stages rm and dpo do)")
        if cfg.stage == "kto" and not all(e.columns.get("kto_tag") for e in entries):
            raise LFConfigError(f"dataset: stage kto needs feedback datasets (a kto_tag column in dataset_info.json); "
                                f"{', '.join(e.name for e in entries if not e.columns.get('kto_tag'))} has none")
        if cfg.stage in ("rm", "kto") and (eval_entries or cfg.val_size):
            raise LFConfigError(f"{'eval_dataset' if eval_entries else 'val_size'}: evaluation of stage {cfg.stage} "
                                "is not built here (its pair accuracy / KTO metrics); train without it and evaluate "
                                "the exported model")

        vl_model = self.vision_model = is_vl(cfg.model_name_or_path)
        if vl_model and cfg.stage in ("rm", "kto"):
            raise LFConfigError(f"stage {cfg.stage}: not built for vision-language models here (text models only)")
        if with_images and not vl_model:
            raise LFConfigError(f"dataset: {', '.join(with_images)} has an images column, but "
                                f"{cfg.model_name_or_path} is not a vision-language model this engine trains "
                                "(qwen2_vl, qwen2_5_vl, gemma3)")
        if vl_model and cfg.packing:
            raise LFConfigError("packing / neat_packing: not built for vision-language models here (the HF model "
                                "computes M-RoPE positions and image attention per row, so packed documents would "
                                "see each other); set packing: false")
        if with_images and cfg.stage != "pt":
            return self._vl_data(rt, par, entries, eval_entries, tokenizer, template, cache)

        def encode(records, fmt):
            if pairwise:
                return build_pairs(records, tokenizer, template, cfg.cutoff_len, cache)
            if cfg.stage == "kto":
                return build_feedback(records, tokenizer, template, cfg.cutoff_len, cache,
                                      cfg.preprocessing_num_workers, cfg.preprocessing_batch_size)
            return packing.encode(cfg, records, fmt, tokenizer, template, cache)

        dataset, held = kit.rank_zero_first(rt.is_main, lambda: self._encode_sets(entries, eval_entries, encode))

        def batches(data, micro: int, shuffle: bool):
            kw = dict(dp_rank=par.dp_rank, dp_world=par.layout.dp, seed=order_seed(cfg), shuffle=shuffle,
                      pad_id=pad_id(tokenizer))
            if pairwise or cfg.stage == "kto":
                return (PairLoader if pairwise else FeedbackLoader)(data, micro, **kw)
            if isinstance(data, packing.Rows):  # pt's collator pads to the longest row, sft's to a multiple of 8
                kw["pad_id"] = packing.lf_pad_id(cfg.template, tokenizer)
                return packing.RowLoader(data, micro, neat=cfg.neat_packing,
                                         pad_to_multiple_of=1 if cfg.stage == "pt" else 8, **kw)
            return LFMicroBatchLoader(data, mode="dynamic", micro_batch=micro, seq_len=cfg.cutoff_len,
                                      pad_to_multiple_of=8, group_by_length=False, **kw)

        loader = batches(dataset, cfg.per_device_train_batch_size, not cfg.disable_shuffling)
        self._eval_loaders(held, batches)
        log.info("data: %s", dataset.summary())
        return dataset, loader, tokenizer

    def _encode_sets(self, entries, eval_entries, encode):
        """(the training set, the eval sets by name) tokenized by encode(records, format): max_samples per dataset,
        before merging (as LF's loader); the merged records all kept but those val_size holds out."""
        from backends.lf.data import media_dir, write_canonical
        from backends.lf.eval import held_out

        cfg = self.cfg

        def write(named):
            return write_canonical(named, cfg.stage, Path(cfg.output_dir) / "data", media_dir(cfg), cfg.max_samples)

        records, held = held_out(cfg, *write(entries), eval_entries, write)
        return encode(*records), {name: encode(*pair) for name, pair in held.items()}

    def _eval_loaders(self, held: dict, batches) -> None:
        """Each eval set's loader: in order, per_device_eval_batch_size samples a rank, rewound for every pass."""
        from backends.lf.eval import EvalSet

        def rewound(loader):
            loader.load_state_dict({**loader.state_dict(), "position": 0})
            return loader

        for name, data in held.items():
            loader = batches(data, self.cfg.per_device_eval_batch_size, False)
            self.eval_sets[name] = EvalSet(name, loader.n_units, lambda loader=loader: rewound(loader))
            log.info("eval data%s: %s", f" {name}" if name else "", data.summary())

    def _vl_data(self, rt, par, entries, eval_entries, tokenizer, template, cache):
        """Records with images: LF's mm plugin expansion, the VL cache and loader (backends.lf.vl_data)."""
        from backends.common.data import pad_id
        from backends.lf.mm_plugin import load_plugin
        from backends.lf.order import order_seed
        from backends.lf.vl_data import VLLoader, build_vl

        cfg = self.cfg
        plugin = load_plugin(cfg.model_name_or_path, tokenizer, cfg.image_max_pixels, cfg.image_min_pixels)

        # text datasets may come with the image ones (LF's mllm_demo,identity,alpaca_en_demo): their records are
        # samples without images; mixed formattings are all written as sharegpt
        def encode(records, fmt):
            return build_vl(records, fmt, tokenizer, template, plugin, cfg.cutoff_len, cache,
                            pairwise=cfg.stage == "dpo",
                            rules={"train_on_prompt": cfg.train_on_prompt, "mask_history": cfg.mask_history})

        def batches(data, micro: int, shuffle: bool):
            return VLLoader(data, plugin, micro, dp_rank=par.dp_rank, dp_world=par.layout.dp, seed=order_seed(cfg),
                            shuffle=shuffle, pad_id=pad_id(tokenizer))

        dataset, held = kit.rank_zero_first(rt.is_main, lambda: self._encode_sets(entries, eval_entries, encode))
        loader = batches(dataset, cfg.per_device_train_batch_size, not cfg.disable_shuffling)
        self._eval_loaders(held, batches)
        log.info("data: %s; dynamic batches with images (%s plugin)", dataset.summary(), plugin.kind)
        return dataset, loader, tokenizer

    # ------------------------------------------------------------------ steps
    def next_micro_batches(self) -> list[dict]:
        """gradient_accumulation_steps micro-batches, fewer at the end of an epoch (HF Trainer's last step of
        an epoch takes what is left of it)."""
        count = self.micro_count = min(self.cfg.gradient_accumulation_steps, self.loader.left_in_epoch())
        return [self.on_device(next(self._batches)) for _ in range(count)]

    def on_device(self, mb: dict) -> dict:
        """A loader's micro-batch as the model takes it, on this rank's device."""
        device = self.rt.device
        return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in mb.items()}

    def loss(self, model, mb: dict) -> Loss:
        cfg = self.cfg
        if cfg.stage == "dpo":
            return self._preference_loss(model, mb)
        # rm and kto: HF's Trainer divides each micro-batch's mean loss by the step's micro-batches
        # (LF sets model_accepts_loss_kwargs False there) and DDP averages the ranks
        share = 1.0 / (self.micro_count * self.par.grad_world)
        if cfg.stage == "rm":
            from backends.lf.rm import pair_scores, pairwise_loss

            chosen, rejected = pair_scores(model(mb["input_ids"], mb["position_ids"]), mb["lengths"])
            return Loss(mean=pairwise_loss(chosen, rejected) * share)
        if cfg.stage == "kto":
            from backends.lf.kto import micro_batch_loss

            return micro_batch_loss(model, self.reference, mb, beta=cfg.pref_beta, chosen_weight=cfg.kto_chosen_weight,
                                    rejected_weight=cfg.kto_rejected_weight, ftx=cfg.pref_ftx, share=share,
                                    group=self.par.grad_group, main=self.rt.is_main)
        loss_sum, _count = model(mb["input_ids"], mb["labels"], mb.get("position_ids"), **_vision(mb),
                                 **({"attention_mask": mb["attention_mask"]} if "attention_mask" in mb else {}))
        return Loss(loss_sum)

    def _preference_loss(self, model, mb: dict) -> Loss:
        """LLaMA-Factory's DPO step on one micro-batch of pairs (chosen rows first, then rejected)."""
        from backends.lf.dpo import adapters_disabled, pair_losses, split_logps, uses_reference

        cfg = self.cfg
        args = (mb["input_ids"], mb["labels"], mb.get("position_ids"))
        vision = _vision(mb)
        ref_c = ref_r = None
        if uses_reference(cfg.pref_loss):
            with torch.no_grad():
                if self.reference is not None:
                    sums, counts = self.reference(*args, logps=True, **vision)
                else:  # LoRA: the base model is the policy with its adapters off
                    with adapters_disabled(model):
                        sums, counts = model(*args, logps=True, **vision)
            ref_c, ref_r, _ = split_logps(sums, counts, cfg.pref_loss)
        rows, width = mb["input_ids"].shape
        # every logit of every position (padding too) summed per row, for LF's logits/* means
        sums, counts, logit_sums = model(*args, logps=True, lengths=torch.full((rows,), width), **vision)
        chosen, rejected, chosen_avg = split_logps(sums, counts, cfg.pref_loss)
        losses, r_chosen, r_rejected = pair_losses(cfg.pref_loss, cfg.pref_beta, chosen, rejected, ref_c, ref_r,
                                                   label_smoothing=cfg.dpo_label_smoothing,
                                                   simpo_gamma=cfg.simpo_gamma)
        if cfg.pref_ftx > 1e-6:
            losses = losses + cfg.pref_ftx * -chosen_avg
        metrics = dpo_metrics(losses.detach(), chosen.detach(), rejected.detach(), chosen_avg.detach(), r_chosen,
                              r_rejected, logit_sums / (width * self.model_vocab), cfg)
        return Loss(losses.sum(), metrics=metrics)

    def step(self, trainer, step: int):
        if self._first_step is None:
            self._first_step = step
        result = super().step(trainer, step)
        if self.cfg.stage == "kto":
            from backends.lf.kto import step_metrics

            result.metrics = step_metrics(result.metrics, self.micro_count)
        if self.cfg.stage == "dpo":  # LF logs the mean over every micro-batch since the last log
            self._dpo_interval.append((dict(result.metrics), self.micro_count))
            self.step_metrics = _weighted_mean(self._dpo_interval)
        else:
            self.step_metrics = dict(result.metrics)  # LF's Trainer logs them into log_history too
        self.outputs.stepped(step + 1, result.loss, result.tokens, result.real_tokens)
        return result

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict(), "outputs": self.outputs.state_dict(),
                **({"evaluation": self.evaluation.state_dict()} if self.evaluation else {})}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        if "outputs" in state:  # checkpoints written before trainer_state.json was kept
            self.outputs.load_state_dict(state["outputs"])
        if self.evaluation and "evaluation" in state:
            self.evaluation.load_state_dict(state["evaluation"])

    def start_info(self) -> dict:
        return {"grad_accum": self.cfg.gradient_accumulation_steps,
                "samples": self.dataset.stats.get("samples", self.dataset.stats.get("pairs")),
                "parameters": self.total, "trainable": self.trainable, "zero_stage": self.cfg.zero.stage}

    def logged(self, record: dict) -> None:
        # the Trainer logs the mean loss of the steps since its last log (trainer_log.jsonl reads that entry); the
        # shared loop also records the last step (HF does not) and a step it evaluated at, whose entries follow
        step = int(record["step"])
        if step % max(1, self.outputs.logging_steps) == 0 or (step == 1 and self.cfg.logging_first_step):
            entry = self.outputs.logged(step, record["lr"], record.get("grad_norm"), self.step_metrics)
            self._dpo_interval = []
            if self.rt.is_main:
                self.trainer_log().write(step, entry, self.outputs.tokens_seen)
        for entry in self.evaluation.flush() if self.evaluation else ():
            self.eval_logged(entry)

    def eval_logged(self, entry: dict, total: int | None = None) -> None:
        """An evaluation's log entry (trainer_state.json's log_history, a trainer_log.jsonl line)."""
        self.outputs.log_history.append(entry)
        if self.rt.is_main:
            self.trainer_log().write(int(entry["step"]), entry, self.outputs.tokens_seen)

    def trainer_log(self) -> TrainerLog:
        if self._trainer_log is None:
            self._trainer_log = TrainerLog(Path(self.cfg.output_dir) / TRAINER_LOG, self.outputs.max_steps,
                                           self._first_step or 0)
        return self._trainer_log

    def evaluate(self, trainer, step: int, start: bool = False) -> dict[str, float]:
        return self.evaluation.at(trainer, step, start) if self.evaluation else {}

    def should_stop(self) -> str | None:
        return "early stopping (early_stopping_steps)" if self.evaluation and self.evaluation.stop else None

    def plot_title(self, total_steps: int) -> str:
        return f"training loss of {self.cfg.output_dir}"

    # ------------------------------------------------------------------ export
    def export(self, trainer) -> None:
        from backends.lf.export import export

        if self.cfg.engine.get("export_hf", True):
            export(self.model, self.cfg, self.tokenizer)
        if self._first_step is None:  # nothing left to train after a resume
            self._first_step = trainer.step
        if self.rt.is_main:
            self.outputs.finish(trainer.step, **(self.evaluation.trainer_state() if self.evaluation else {}))
            self.trainer_log().write(trainer.step, self.outputs.log_history[-1],  # LogCallback on the closing log
                                     self.outputs.tokens_seen)
        if self.evaluation:
            self.evaluation.after_training(trainer)


def dpo_metrics(losses, chosen, rejected, chosen_avg, r_chosen, r_rejected, row_logits, cfg) -> dict[str, float]:
    """CustomDPOTrainer.get_batch_loss_metrics' metrics of a micro-batch: means over its pairs; logits/* the
    mean of every logit of the chosen (rejected) rows (row_logits: each row's mean); orpo adds sft_loss and
    odds_ratio_loss."""
    b = chosen.shape[0]
    out = {"rewards/chosen": r_chosen.mean(), "rewards/rejected": r_rejected.mean(),
           "rewards/accuracies": (r_chosen > r_rejected).float().mean(),
           "rewards/margins": (r_chosen - r_rejected).mean(),
           "logps/chosen": chosen.mean(), "logps/rejected": rejected.mean(),
           "logits/chosen": row_logits[:b].mean(), "logits/rejected": row_logits[b:].mean()}
    if cfg.pref_loss == "orpo":
        out["sft_loss"] = (-chosen_avg).mean()
        out["odds_ratio_loss"] = ((losses + chosen_avg) / cfg.pref_beta).mean()
    return {k: float(v) for k, v in out.items()}


def _weighted_mean(steps: list[tuple[dict, int]]) -> dict[str, float]:
    """The mean over every micro-batch of these steps, from each step's means and micro-batch count."""
    total = sum(n for _, n in steps)
    return {k: sum(m[k] * n for m, n in steps) / total for k in steps[-1][0]}


def _vision(mb: dict) -> dict:
    """A VL micro-batch's vision inputs (none for text)."""
    from backends.lf.vl_data import VISION_KEYS

    return {k: mb[k] for k in VISION_KEYS if k in mb}


def main(argv: list[str] | None = None) -> int:
    from backends.common import trainer

    return trainer.main("backends.lf", lambda args: LFRecipe(parse_command(args)), argv,
                        user_errors=(LFConfigError,))


def parse_command(args: list[str]) -> LFConfig:
    """`train <file>.yaml [key=value …]` (llamafactory-cli's form; overrides as it takes them)."""
    if not args or args[0] != "train" or len(args) < 2:
        raise LFConfigError("usage: python -m backends.lf train <file>.yaml [key=value …] (as llamafactory-cli "
                            "train); only the train command is built")
    from backends.lf.config import read_training_file

    return parse_config(read_training_file(args[1], args[2:]), source=args[1])
