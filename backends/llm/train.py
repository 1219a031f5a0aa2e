"""The MindSpeed-LLM-style recipe: pre-training and fine-tuning (full or LoRA) of a native decoder.

Composed from backends.common pieces: runtime → model (+ LoRA, recompute) → data → data
parallel wrap → optimizer / schedule → resume → steps → checkpoints → HF export → loss plot.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
from pathlib import Path

import torch

from backends import kernels
from backends.common.distributed import barrier, gather_floats, init_runtime, peak_memory_mib
from backends.common.loop import finite_or_raise, take, train_step
from backends.common.metrics import MetricsWriter, read_metrics
from backends.common.optim import build_scheduler
from backends.llm import parallelize
from backends.llm.config import ConfigError, LLMConfig, parse_args

log = logging.getLogger("backends.llm")


class CausalLMWithLoss(torch.nn.Module):
    """The decoder plus its loss, as one module: under FSDP2 the root unit (embedding, final norm,
    head) is unsharded for exactly this forward, so the chunked loss can read the head weight."""

    def __init__(self, decoder: torch.nn.Module):
        from backends.llm.models.moe import MoE

        super().__init__()
        self.decoder = decoder
        # found once (after parallelize.setup swapped in the EP blocks), not on every forward
        self._moe_blocks = [m for m in decoder.modules() if isinstance(m, MoE)]

    def forward(self, input_ids, labels, position_ids=None, cu_seqlens=None, aux_mask=None):
        for block in self._moe_blocks:  # CP padding of this micro-batch stays out of the aux loss
            block.aux_token_mask = aux_mask
        hidden = self.decoder(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, return_hidden=True)
        if getattr(self.decoder, "tp_info", None) is not None:  # vocab-parallel: no full-vocab logits
            from backends.llm.parallel.tensor_parallel import tp_loss

            loss_sum, count = tp_loss(self.decoder, hidden, labels)
        else:
            loss_sum, count = kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]),
                                                          self.decoder.output_weight(), labels.reshape(-1))
        return loss_sum, count, getattr(self.decoder, "aux_loss", None)


def _loss_fn(model, mb):
    return model(mb["input_ids"], mb["labels"], mb.get("position_ids"), mb.get("cu_seqlens"), mb.get("aux_mask"))


def job_fields(cfg: LLMConfig) -> dict[str, object]:
    """The job-file fields (dotted) these flags came from, as capabilities.UNBUILT names them."""
    p, d = cfg.parallel, cfg.data
    return {"parallel.tp": p.tp, "parallel.sp": p.sp, "parallel.pp": p.pp, "parallel.cp": p.cp, "parallel.ep": p.ep,
            "parallel.fsdp": p.fsdp, "parallel.distributed_optimizer": p.distributed_optimizer,
            "parallel.moe_dispatcher": p.moe_dispatcher, "finetuning": "lora" if cfg.lora else "full",
            "data.packing": d.packing, "data.dynamic_seq_len": d.dynamic, "train.precision": cfg.train.precision}


def _refuse_unbuilt_parallelism(cfg: LLMConfig) -> None:
    """The settings and combinations capabilities.LIMITS / UNBUILT say this build cannot run (the
    orchestrator's `run` checks the same tables before launching)."""
    from backends.llm.capabilities import LIMITS, unbuilt

    p = cfg.parallel
    asked = [f"{field}={getattr(p, field.split('.')[1])} (this build runs up to {limit})"
             for field, limit in LIMITS["mindspeed-llm"].items() if getattr(p, field.split(".")[1]) > limit]
    if asked:
        raise ConfigError("this build of backends.llm does not implement: " + ", ".join(asked))
    refused = unbuilt("mindspeed-llm", job_fields(cfg))
    if refused:
        raise ConfigError("this build of backends.llm does not combine " + "; ".join(refused)
                          + ". Change one of those settings")


def _kernel_overrides(cfg: LLMConfig) -> dict[str, str]:
    """--use-flash-attn / --use-fused-* off means the plain-PyTorch ops, as in MindSpeed;
    explicit --kernel-override entries win."""
    out = {}
    if not cfg.flash_attention:
        out["attention"] = "reference"
    if not cfg.fused_ops:
        out.update(rms_norm="reference", apply_rotary="reference", swiglu="reference")
    return {**out, **cfg.kernel_overrides}


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def build_decoder(cfg: LLMConfig) -> torch.nn.Module:
    from backends.llm import models

    if cfg.model.load_hf:
        model = models.from_pretrained(cfg.model.load_hf, dtype=torch.float32)
        have = model.config
        for key, value in cfg.model.overrides.items():
            # the shape numbers every family spells the same way; the rest is the config's business
            if key not in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size") or not hasattr(have, key):
                continue
            if getattr(have, key) != value:
                raise ConfigError(f"--load-hf {cfg.model.load_hf}: config.json has {key}={getattr(have, key)!r} "
                                  f"but the flags say {value!r}; re-render the job from this model directory")
        return model
    overrides = {k: v for k, v in cfg.model.overrides.items()}
    return models.from_card(cfg.model.model_id, **overrides)


def _build_data(cfg: LLMConfig, rt, par, tokenizer_dir: str | None):
    from backends.common.data import MicroBatchLoader, load_tokenizer, pad_id, preprocess

    d = cfg.data
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    cache_root = Path(d.prefix).parent
    source = d.input or d.prefix
    # rank 0 tokenizes and writes the cache; the others wait, then read the same files
    if rt.is_main:
        dataset = preprocess(source, d.fmt, tokenizer, d.template, d.seq_len, cache_root, max_samples=d.max_samples)
    barrier()
    if not rt.is_main:
        dataset = preprocess(source, d.fmt, tokenizer, d.template, d.seq_len, cache_root, max_samples=d.max_samples)
    mode = "packed" if d.packing else "dynamic" if d.dynamic else "padded"
    loader = MicroBatchLoader(dataset, mode=mode, micro_batch=cfg.train.micro_batch, seq_len=d.seq_len,
                              dp_rank=par.dp_rank, dp_world=par.layout.dp, seed=cfg.train.seed, shuffle=d.shuffle,
                              pad_id=pad_id(tokenizer) if tokenizer is not None else 0,
                              pad_to_multiple_of=d.pad_to_multiple_of)
    log.info("data: %s; %s batches%s", dataset.summary(), mode,
             f", {loader.packing.rows} packed rows, padding waste {loader.packing.waste_pct:.1f}%" if getattr(loader, "packing", None) else "")
    return tokenizer, dataset, loader


def _total_steps(cfg: LLMConfig, loader) -> int:
    if cfg.train.steps:
        return cfg.train.steps
    rows = loader.n_units  # samples, or packed rows
    return max(1, math.ceil(cfg.train.epochs * rows / cfg.train.global_batch))


def _model_state_mib(model: torch.nn.Module, optimizer) -> float:
    """MiB of parameters + optimizer states held by this rank (local shards of DTensors)."""
    def local_bytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(local_bytes(p) for p in model.parameters())
    if hasattr(optimizer, "state_bytes"):
        total += optimizer.state_bytes()
    else:
        total += sum(local_bytes(v) for st in optimizer.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0)
    return total / 2**20


def _to_device(mb: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in mb.items()}


def _resume_path(cfg: LLMConfig) -> Path | None:
    """--load is the checkpoints root (resume: auto), a step_N checkpoint, or absent (never)."""
    from backends.common.checkpoint.resume import MARKER, resolve_resume

    if not cfg.load:
        return None
    path = Path(cfg.load)
    explicit = path.name.startswith("step_") or (path / MARKER).exists()
    return resolve_resume(cfg.load if explicit else "auto", path)


def _gather_stages(full: dict, par) -> dict | None:
    """Rank 0 gets the union of the stages' full state dicts (the other ranks None)."""
    import torch.distributed as dist

    if par.dp_rank or par.cp_rank or (par.layout.tp > 1 and par.mesh["tp"].get_local_rank()):
        return None  # rank 0's pipeline is the dp = cp = tp = 0 one
    parts = [None] * par.layout.pp if dist.get_rank() == 0 else None
    dist.gather_object(full, parts, dst=0, group=par.pp_group)
    return {k: v for part in parts for k, v in part.items()} if parts else None


def _export(cfg: LLMConfig, model: torch.nn.Module, decoder: torch.nn.Module, rt, tokenizer_dir: str | None,
            par) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from backends.common.checkpoint.hf_io import write_hf_dir
    from backends.llm import models

    # every rank takes part in gathering the full state dict; rank 0 writes it
    staged = par.pipeline is not None
    # cpu_offload keeps the values on global rank 0 only; with stages every stage's first rank needs them
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not staged))
    if staged:  # each stage holds its own layers: rank 0's pipeline collects them
        full = _gather_stages({k: v.cpu() for k, v in full.items()}, par)
    if not rt.is_main:
        return
    full = {k.removeprefix("decoder."): v for k, v in full.items()}
    # a plain, unsharded copy on the CPU to hold the gathered weights (the live one may be FSDP-sharded)
    with torch.device("meta"):
        plain = models.build_model(decoder.config)
    if cfg.lora:
        from backends.common.lora import inject_lora

        inject_lora(plain, r=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, targets=cfg.lora.targets)
    plain.load_state_dict(full, assign=True)
    out = Path(cfg.export_hf)
    if cfg.lora:
        from backends.common.lora import merge_lora, save_peft_adapter

        save_peft_adapter(plain, out / "adapter", base_model_name_or_path=cfg.model.load_hf or cfg.model.model_id,
                          r=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                          target_modules=cfg.lora.targets, collective=False)  # `plain` lives on rank 0 only
        if cfg.lora.merge_on_export:
            merge_lora(plain)
            write_hf_dir(out / "merged", models.hf_state_dict(plain), plain.config.to_hf(), tokenizer_dir=tokenizer_dir)
        return
    write_hf_dir(out, models.hf_state_dict(plain), plain.config.to_hf(), tokenizer_dir=tokenizer_dir)


def run(cfg: LLMConfig) -> int:
    from backends.common.checkpoint.resume import load_checkpoint, save_checkpoint

    _refuse_unbuilt_parallelism(cfg)
    rt = init_runtime(os.environ.get("AF_DEVICE", "auto"))
    logging.basicConfig(level=logging.INFO, format=f"[rank{rt.rank}] %(asctime)s %(message)s", stream=sys.stdout)
    kernels.configure(default=cfg.kernel_backend, overrides=_kernel_overrides(cfg) or None)
    _seed_everything(cfg.train.seed)

    decoder = build_decoder(cfg)
    if cfg.lora:
        from backends.common.lora import inject_lora

        adapted = inject_lora(decoder, r=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                              targets=cfg.lora.targets)
        log.info("LoRA r=%d on %d linear layers", cfg.lora.rank, len(adapted))
    if cfg.parallel.recompute != "none":
        decoder.set_recompute(cfg.parallel.recompute)
    decoder.to(rt.device)
    trainable = sum(p.numel() for p in decoder.parameters() if p.requires_grad)
    total = sum(p.numel() for p in decoder.parameters())
    log.info("model: %s, %.2f M parameters (%.2f M trainable), kernels %s", decoder.config.family, total / 1e6,
             trainable / 1e6, kernels.describe())

    par = parallelize.setup(cfg, decoder, rt)
    tokenizer_dir = cfg.model.tokenizer
    tokenizer, dataset, loader = _build_data(cfg, rt, par, tokenizer_dir)
    t = cfg.train
    dp = par.layout.dp
    accum, rem = divmod(t.global_batch, t.micro_batch * dp)
    if rem or accum < 1:
        raise ConfigError(f"--global-batch-size {t.global_batch} is not a multiple of micro-batch {t.micro_batch} "
                          f"× data-parallel size {dp}")
    total_steps = _total_steps(cfg, loader)

    model = parallelize.wrap_data_parallel(CausalLMWithLoss(decoder), cfg, par, rt)
    optimizer = parallelize.build_optimizer(model, cfg, par)
    sync = parallelize.grad_sync(model, cfg, par)
    clip, forward_backward = parallelize.grad_clip(model, cfg, par), None
    if par.pipeline is not None:
        from backends.llm.parallel.pipeline import pipeline_clip

        clip, forward_backward = pipeline_clip(model, optimizer, par), par.pipeline.forward_backward
    scheduler = build_scheduler(optimizer, lr=t.lr, min_lr=t.min_lr, warmup=t.warmup, total=total_steps,
                                style=t.schedule)
    scaler = torch.amp.GradScaler(rt.device.type) if t.precision == "fp16" else None

    step = 0
    resume = _resume_path(cfg)
    if resume is not None:
        step, extra = load_checkpoint(resume, model, optimizer, scheduler)
        loader.load_state_dict(extra["loader"])
        log.info("resumed from %s at step %d", resume, step)

    metrics = MetricsWriter(cfg.metrics_file, enabled=rt.is_main)
    metrics.event("start", total_steps=total_steps, world=rt.world, grad_accum=accum, resumed_step=step,
                  samples=dataset.stats.get("samples"), parameters=total, trainable=trainable)
    batches = iter(loader)
    run_dir = Path(cfg.metrics_file).parent if cfg.metrics_file else None
    while step < total_steps:
        micro = [parallelize.shard_batch(_to_device(mb, rt.device), par) for mb in take(batches, accum)]
        result = train_step(model, optimizer, micro, _loss_fn, device=rt.device, dp_world=par.grad_world,
                            precision=t.precision, grad_clip=t.grad_clip, aux_coeff=t.moe_aux_loss_coeff,
                            scaler=scaler, group=par.grad_group, after_backward=sync, clip=clip,
                            forward_backward=forward_backward)
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()
        step += 1
        finite_or_raise(step, result)
        if step % t.log_interval == 0 or step == total_steps:
            record = {"step": step, "total_steps": total_steps, "loss": round(result.loss, 6), "lr": lr,
                      "grad_norm": round(result.grad_norm, 6),
                      "tokens_per_s": round(result.tokens / result.seconds, 1),
                      # effective: real (non-pad) tokens; padding_waste: share of positions that were pad
                      "effective_tokens_per_s": round(result.real_tokens / result.seconds, 1),
                      "padding_waste": round(1 - result.real_tokens / max(result.tokens, 1), 4),
                      "trained_tokens": result.valid_tokens,
                      "elapsed_s": round(metrics.elapsed(), 3)}
            if result.aux_loss is not None:
                record["aux_loss"] = round(result.aux_loss, 6)
            metrics.write(record)
            log.info("step %d/%d loss %.4f lr %.3g grad_norm %.3f %.0f tok/s", step, total_steps, result.loss, lr,
                     result.grad_norm, result.real_tokens / result.seconds)
        exiting = bool(t.exit_interval) and step % t.exit_interval == 0 and step < total_steps
        if cfg.save and ((t.save_interval and step % t.save_interval == 0) or step == total_steps or exiting):
            # LoRA: the frozen base comes back from --load-hf, so only adapters + optimizer are saved
            save_checkpoint(cfg.save, step, model, optimizer, scheduler, extra={"loader": loader.state_dict()},
                            trainable_only=cfg.lora is not None)
        if exiting:
            log.info("--exit-interval %d: stopping after step %d; resume continues from here", t.exit_interval, step)
            metrics.event("exit", step=step)
            barrier()  # the process group goes with the process (see __main__)
            return 0
    if cfg.export_hf:
        _export(cfg, model, decoder, rt, tokenizer_dir, par)
    if rt.is_main and run_dir is not None and cfg.metrics_file and Path(cfg.metrics_file).exists():
        from backends.common.plot import plot_loss

        plot_loss(read_metrics(cfg.metrics_file), run_dir / "training_loss.png",
                  title=f"{decoder.config.family} · {total_steps} steps")
    # per-rank peak memory, as MindSpeed logs it: each rank in its log, all of them in metrics.jsonl;
    # model_state_mib: the parameters and optimizer states this rank holds (what sharding divides)
    held = gather_floats(_model_state_mib(model, optimizer), rt.device)
    peaks = gather_floats(peak_memory_mib(rt.device), rt.device)
    log.info("peak memory %.0f MiB on rank %d", peaks[rt.rank], rt.rank)
    metrics.event("end", step=step, peak_memory_mib=[round(x, 1) for x in peaks],
                  model_state_mib=[round(x, 1) for x in held])
    barrier()  # the process group goes with the process (see __main__)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad input (flags, files, data, checkpoints) ends in one message and exit code 2."""
    from backends.common.checkpoint.resume import CheckpointError

    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        return run(cfg)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as err:
        if os.environ.get("AF_DEBUG"):
            raise
        print(f"backends.llm: error: {err}", file=sys.stderr)
        print("(set AF_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
