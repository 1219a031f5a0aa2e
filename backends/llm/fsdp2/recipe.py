"""MindSpeed-LLM's FSDP2 backend (train_fsdp2.py) on the shared trainer: a Hugging Face causal LM built by
transformers (from model_name_or_path, or from its config with train_from_scratch) with the kernel layer
patched in, FSDP2 units over the modules `parallel.fsdp_modules` names, recompute of
`parallel.recompute_modules`, upstream's AdamW (every parameter decayed), its LambdaLR schedules with
min_lr, its step count, and its SFT loss: the token sum over the global batch divided by
num_items_in_batch (labels != -100 of every micro-batch of the step on every rank, before the shift),
the FSDP gradient mean undone by the data-parallel size — the global token mean.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch

from backends.common import kit
from backends.common.trainer import Loss, Part, Recipe, Settings, seed_everything
from backends.llm.fsdp2.config import FSDP2Config, FSDP2ConfigError

log = logging.getLogger("backends.llm.fsdp2")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def module_pattern(glob: str) -> re.Pattern:
    """upstream's module globs: `{*}` one layer index, `*` anything, matched against whole module names."""
    parts = [re.escape(p).replace(r"\*", ".*") for p in glob.split("{*}")]
    return re.compile(r"\d+".join(parts) + r"\Z")


def matching(model: torch.nn.Module, globs: list[str]) -> list[tuple[str, torch.nn.Module]]:
    pats = [module_pattern(g) for g in globs]
    return [(n, m) for n, m in model.named_modules() if n and any(p.match(n) for p in pats)]


def lr_lambda(style: str, warmup: int, total: float, min_ratio: float):
    """SchedulerFactory's constant / linear / cosine (num_cycles 0.5, down to min_lr) after a linear warmup."""
    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if style == "constant":
            return 1.0
        progress = float(step - warmup) / float(max(1, total - warmup))
        if style == "linear":
            return max(0.0, 1.0 - progress)
        if step > total:
            return min_ratio
        return 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)) * (1.0 - min_ratio) + min_ratio
    return factor


def step_counts(t, batches_per_epoch: int) -> tuple[float, int, int]:
    """(the schedule's train_steps, the steps the loop runs, optimizer steps per epoch) as train_fsdp2.py and
    Trainer.train count them: ceil(batches / accumulation) a epoch, max_steps or that × num_train_epochs,
    the loop running int(num_train_epochs) epochs at most."""
    per_epoch = -(-batches_per_epoch // t.gradient_accumulation_steps)
    total = t.max_steps if t.max_steps > 0 else per_epoch * t.num_train_epochs
    return total, min(math.ceil(total), per_epoch * int(t.num_train_epochs)), per_epoch


class FSDP2Recipe(Recipe):
    name = "backends.llm"

    def __init__(self, cfg: FSDP2Config):
        self.cfg = cfg
        self.done = 0  # optimizer steps taken (a checkpoint's global_step)

    def build(self, rt) -> Settings:
        cfg, t, p = self.cfg, self.cfg.training, self.cfg.parallel
        for line in cfg.notices:
            log.info("notice: %s", line)
        seed_everything(t.seed)
        self.rt = rt
        hf = self._hf_model()
        from backends.common.hf_model import HFCausalLMWithLoss

        # on its device before expert parallel: .to() would rebuild the experts' DTensor parameters unflagged
        model = HFCausalLMWithLoss(hf, error=FSDP2ConfigError).to(rt.device)
        text = hf.config
        heads = int(text.num_attention_heads)
        if rt.world % p.fsdp_size:
            raise FSDP2ConfigError(f"parallel.fsdp_size: {p.fsdp_size} does not divide the {rt.world} processes")
        par = self.par = kit.parallel(
            rt, FSDP2ConfigError, fsdp=True, heads=heads, kv_heads=int(getattr(text, "num_key_value_heads", heads)),
            layers=int(text.num_hidden_layers), seq_len=cfg.data.cutoff_len, ep=p.ep_size,
            experts=int(getattr(text, "num_experts", 0) or 0),
            micro_batch=t.per_device_train_batch_size,
            global_batch=t.per_device_train_batch_size * t.gradient_accumulation_steps * rt.world)
        if p.fsdp_size != par.grad_world:  # upstream replicates over world / fsdp_size groups (HSDP)
            log.info("parallel.fsdp_size %d: the parameters are sharded over all %d data-parallel ranks here (the "
                     "same numbers)", p.fsdp_size, par.grad_world)
        self.expert_modules = self._expert_parallel(hf, rt) if p.ep_size > 1 else 0
        self.recomputed = self._recompute(hf) if p.recompute else 0
        self.dataset, self.loader = self._data(rt, par)
        total, self.total_steps, self.steps_per_epoch = step_counts(t, len(self.loader))
        model = self.model = self._wrap(model, hf)
        optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=t.lr,
                                      betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon,
                                      weight_decay=t.weight_decay)
        warmup = int(total * t.warmup_ratio)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(t.lr_scheduler_type, warmup, total, t.min_lr / t.lr if t.lr > 0 else 0.0))
        from backends.common.parallel import data_parallel

        # under FSDP2 the parameter dtype is its MixedPrecisionPolicy; one process computes under autocast
        precision = "fp32" if par.grad_world > 1 else p.param_dtype
        self.parts = {"model": Part(model, optimizer, schedule, grad_group=par.grad_group, grad_world=par.grad_world,
                                    precision=precision, grad_clip=t.max_grad_norm,
                                    after_backward=data_parallel.grad_sync(model, par),
                                    clip=data_parallel.grad_clip(model, optimizer, par))}
        self._batches = iter(self.loader)
        out = Path(t.output_dir)
        if rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
        log.info("fsdp2: %s, %d FSDP2 units, %d recomputed, %d expert-parallel; %d steps (%d a epoch), warmup %d",
                 hf.config.model_type, self.units, self.recomputed, self.expert_modules, self.total_steps,
                 self.steps_per_epoch, warmup)
        return Settings(total_steps=self.total_steps, save_dir=str(out / "checkpoints"),
                        save_interval=t.save_steps if t.save_steps > 0 else None,
                        resume=t.resume_from_checkpoint, log_interval=t.logging_steps,
                        metrics_file=str(out / "metrics.jsonl"), keep_last=t.save_total_limit)

    def _hf_model(self):
        from transformers import AutoConfig, AutoModelForCausalLM

        from backends.common.hf_model import apply_kernels

        m = self.cfg.model
        path = m.model_name_or_path
        try:
            if m.train_from_scratch:
                config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=m.trust_remote_code)
                hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                      trust_remote_code=m.trust_remote_code)
            else:
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                          trust_remote_code=m.trust_remote_code)
        except (OSError, ValueError) as err:
            raise FSDP2ConfigError(f"model.model_name_or_path: cannot load {path!r} as a local Hugging Face causal "
                                   f"LM ({err}); this engine does not download") from None
        if m.model_id is not None and m.model_id != hf.config.model_type:
            raise FSDP2ConfigError(f"model.model_id: {m.model_id} names another model than {path} "
                                   f"(model_type {hf.config.model_type})")
        patched = apply_kernels(hf)
        log.info("model: %s, %.2f M parameters; kernels patched %s", hf.config.model_type,
                 sum(q.numel() for q in hf.parameters()) / 1e6, patched)
        return hf.train()

    def _expert_parallel(self, hf, rt) -> int:
        from backends.llm.fsdp2 import experts

        found = matching(hf, self.cfg.parallel.ep_modules)
        if not found:
            raise FSDP2ConfigError(f"parallel.ep_modules: {', '.join(self.cfg.parallel.ep_modules)} names no module "
                                   "of this model")
        return experts.apply(hf, found, self.par, rt.device.type, FSDP2ConfigError)

    def _recompute(self, hf) -> int:
        from backends.common.parallel.recompute import Recomputed

        found = matching(hf, self.cfg.parallel.recompute_modules)
        if not found:
            raise FSDP2ConfigError(f"parallel.recompute_modules: {', '.join(self.cfg.parallel.recompute_modules)} "
                                   "names no module of this model")
        for _name, module in found:
            module.forward = Recomputed(module.forward)
        return len(found)

    def _wrap(self, model, hf):
        """FSDP2 units over the modules fsdp_modules names, deepest first, then the root. The output head
        stays in the root unit: the chunked loss reads its weight outside its forward (same numbers)."""
        p = self.cfg.parallel
        found = matching(hf, p.fsdp_modules)
        if not found:
            raise FSDP2ConfigError(f"parallel.fsdp_modules: {', '.join(p.fsdp_modules)} names no module of this model")
        head = hf.get_output_embeddings()
        units = [(n, m) for n, m in found if m is not head and all(x is not head.weight for x in m.parameters())]
        self.units = len(units) + 1
        if self.par.grad_world == 1:
            return model
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {"mesh": self.par.grad_mesh, "reshard_after_forward": p.reshard_after_forward,
              "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[p.param_dtype], reduce_dtype=DTYPES[p.reduce_dtype])}
        from backends.common.parallel import expert_parallel

        kw["ignored_params"] = set(expert_parallel.expert_parameters(model)) or None  # sharded over ep already
        for _name, module in sorted(units, key=lambda nm: -nm[0].count(".")):
            fully_shard(module, **kw)
        return fully_shard(model, **kw)

    def _data(self, rt, par):
        from backends.common.data import load_tokenizer, pad_id, preprocess
        from backends.common.data.dataset_info import read_entries, write_canonical
        from backends.common.data.templates import TemplateError, resolve_template
        from backends.contract.prompts import LF_TEMPLATES
        from backends.llm.fsdp2.data import SamplerBatches

        cfg, d, t = self.cfg, self.cfg.data, self.cfg.training
        if d.dataset is None:
            raise FSDP2ConfigError("data.dataset: required (names in dataset_dir's dataset_info.json)")
        if isinstance(d.dataset, dict):
            raise FSDP2ConfigError("data.dataset: a dataset configuration mapping is not built here; name the "
                                   "datasets of dataset_info.json, comma-separated")
        tokenizer = load_tokenizer(cfg.model.tokenizer_name_or_path or cfg.model.model_name_or_path,
                                   use_fast=cfg.model.use_fast_tokenizer)
        if d.template is not None and d.template not in LF_TEMPLATES:
            raise FSDP2ConfigError(f"data.template: {d.template!r} is not a template this engine implements (it has "
                                   f"{', '.join(LF_TEMPLATES)})")
        try:
            template = resolve_template(LF_TEMPLATES.get(d.template), tokenizer, enable_thinking=d.enable_thinking)
        except TemplateError as err:
            raise FSDP2ConfigError(f"data.template: {err}") from None
        names = [n.strip() for n in d.dataset.split(",") if n.strip()]
        entries = read_entries(names, d.dataset_dir, "data.dataset", FSDP2ConfigError)
        cache = Path(t.output_dir) / "data"

        def encode():
            records, fmt = write_canonical(entries, "sft", cache, None, d.max_samples, FSDP2ConfigError)
            return preprocess(records, fmt, tokenizer, template, d.cutoff_len, cache,
                              lf_rules={"train_on_prompt": d.train_on_prompt, "mask_history": d.mask_history})

        dataset = kit.rank_zero_first(rt.is_main, encode)
        loader = SamplerBatches(dataset, micro_batch=t.per_device_train_batch_size, dp_rank=par.dp_rank,
                                dp_world=par.layout.dp, seed=t.seed, shuffle=not t.disable_shuffling,
                                drop_last=t.dataloader_drop_last, pad_id=pad_id(tokenizer), seq_len=d.cutoff_len)
        log.info("data: %s; %d batches a epoch on each rank", dataset.summary(), len(loader))
        return dataset, loader

    def next_micro_batches(self) -> list[dict]:
        """gradient_accumulation_steps micro-batches, the epoch's last step what is left of it."""
        count = min(self.cfg.training.gradient_accumulation_steps, self.loader.left_in_epoch())
        device = self.rt.device
        return [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in next(self._batches).items()}
                for _ in range(count)]

    def loss(self, model, mb: dict) -> Loss:
        loss_sum, _count = model(mb["input_ids"], mb["labels"], mb.get("position_ids"))
        return Loss(loss_sum)

    def step(self, trainer, step: int):
        result = super().step(trainer, step)
        self.done = step + 1
        return result

    def state_dict(self) -> dict:
        return {"global_step": self.done}

    def load_state_dict(self, state: dict) -> None:
        """Trainer.train's resume: the data position follows from the step alone (the epochs done, then
        steps x gradient_accumulation_steps batches of this one skipped), so any layout can resume."""
        epochs, within = divmod(int(state["global_step"]), self.steps_per_epoch)
        self.loader.position = epochs * len(self.loader) + within * self.cfg.training.gradient_accumulation_steps

    def start_info(self) -> dict:
        t = self.cfg.training
        return {"grad_accum": t.gradient_accumulation_steps, "samples": self.dataset.stats.get("samples"),
                "fsdp_units": self.units}

    def plot_title(self, total_steps: int) -> str:
        return f"training loss of {self.cfg.training.output_dir}"


def main(argv: list[str] | None = None) -> int:
    from backends.common import trainer
    from backends.llm.fsdp2.config import parse_command

    return trainer.main("backends.llm", lambda args: FSDP2Recipe(parse_command(args)), argv,
                        user_errors=(FSDP2ConfigError,))
