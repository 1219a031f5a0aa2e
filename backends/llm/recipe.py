"""The MindSpeed-LLM-style recipe on the shared trainer: pre-training and fine-tuning (full or LoRA)
of a native decoder. It builds the model (+ LoRA, recompute), the parallel layout, the data and the
optimizer, says how a micro-batch's loss is computed, and exports the result to HF format; the loop
itself is backends.common.trainer's.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from backends import kernels
from backends.common import kit
from backends.common.parallel import data_parallel
from backends.common.trainer import (Loss, Recipe, Settings, logged_micro_means, micro_batch_tokens, micro_mean_scales,
                                     seed_everything)
from backends.llm import parallelize
from backends.llm.config import ConfigError, LLMConfig, lora_targets, parse_args, prompt_template

log = logging.getLogger("backends.llm")


class CausalLMWithLoss(torch.nn.Module):
    """The decoder plus its loss, as one module: under FSDP2 the root unit (embedding, final norm,
    head) is unsharded for exactly this forward, so the chunked loss can read the head weight."""

    def __init__(self, decoder: torch.nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids, labels, position_ids=None, cu_seqlens=None, aux_mask=None):
        # aux_mask: CP padding of this micro-batch stays out of the MoE aux loss
        hidden = self.decoder(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, return_hidden=True,
                              aux_mask=aux_mask)
        if getattr(self.decoder, "tp_info", None) is not None:  # vocab-parallel: no full-vocab logits
            from backends.common.parallel.tensor_parallel import tp_loss

            loss_sum, count = tp_loss(self.decoder, hidden, labels)
        else:
            loss_sum, count = kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]),
                                                          self.decoder.output_weight(), labels.reshape(-1))
        return loss_sum, count, getattr(self.decoder, "aux_loss", None)


def causal_lm_loss(model: CausalLMWithLoss, mb: dict, aux_coeff: float = 0.0, topk: int = 1,
                   cp: int | None = 1, log_means: bool = False) -> Loss:
    """The summed next-token loss of a micro-batch, reduced as Megatron reduces it: without
    --calculate-per-token-loss (`cp` the context-parallel size) each micro-batch's token mean, averaged over
    micro-batches and replicas (schedules.forward_step: loss / num_tokens × cp / num_microbatches); with it
    (`cp` None) the token mean of the global batch. Plus Megatron's MoE load-balancing loss (× its
    coefficient) when asked. `log_means`: log the mean of the micro-batch means (MindSpeed-LLM's SFT trainer). The model's aux loss is transformers' (Mixtral) E·Σ f_i·P_i, f_i the share of
    tokens routed to expert i; Megatron's switch_load_balancing_loss_func takes f_i as a share of the top-k
    assignments: 1/topk."""
    loss_sum, _, aux = model(mb["input_ids"], mb["labels"], mb.get("position_ids"), mb.get("cu_seqlens"),
                             mb.get("aux_mask"))
    micro_mean = None if cp is None else loss_sum * (cp / micro_batch_tokens(mb))
    log = micro_mean is not None and log_means
    if aux is None or not aux_coeff:
        return Loss(loss_sum, micro_mean=micro_mean, log_micro_mean=log)
    aux = aux / topk
    return Loss(loss_sum, extra=aux * aux_coeff, metrics={"aux_loss": aux.detach()}, micro_mean=micro_mean,
                log_micro_mean=log)


def job_fields(cfg: LLMConfig) -> dict[str, object]:
    """The job-file fields (dotted) these flags came from, as capabilities.UNBUILT names them."""
    p, d = cfg.parallel, cfg.data
    return {"parallel.tp": p.tp, "parallel.sp": p.sp, "parallel.pp": p.pp, "parallel.cp": p.cp, "parallel.ep": p.ep,
            "parallel.fsdp": p.fsdp, "parallel.distributed_optimizer": p.distributed_optimizer,
            "parallel.moe_dispatcher": p.moe_dispatcher, "finetuning": "lora" if cfg.lora else "full",
            "data.packing": d.packing, "data.dynamic_seq_len": d.dynamic, "train.precision": cfg.train.precision}


def refuse_unbuilt_parallelism(cfg: LLMConfig) -> None:
    """The settings and combinations capabilities.LIMITS / UNBUILT say this build cannot run (the
    orchestrator's `run` checks the same tables before launching)."""
    from backends.llm import capabilities

    kit.refuse_unbuilt(capabilities, "mindspeed-llm", job_fields(cfg), ConfigError, "backends.llm")


def apply_lora(cfg: LLMConfig, decoder) -> None:
    """--lora-r and friends: MindSpeed-LLM's module names -> this decoder's HF linears (the HF export names
    those too), adapters injected in place."""
    from backends.common.lora import inject_lora, linear_names

    cfg.lora.targets = lora_targets(cfg.lora.targets, linear_names(decoder))
    adapted = inject_lora(decoder, r=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                          targets=cfg.lora.targets)
    log.info("LoRA r=%d on %d linear layers", cfg.lora.rank, len(adapted))


def kernel_overrides(cfg: LLMConfig) -> dict[str, str]:
    """--use-flash-attn / --use-fused-* / --moe-grouped-gemm / --moe-permute-fusion off means the
    plain-PyTorch ops, as in MindSpeed; engine.yaml's kernels.overrides win."""
    out = {}
    if not cfg.flash_attention:
        out["attention"] = "reference"
    if not cfg.fused_ops:
        out.update(rms_norm="reference", apply_rotary="reference", swiglu="reference")
    grouped_gemm, permute_fusion = cfg.moe_fusions  # --moe-grouped-gemm / --moe-permute-fusion off: plain PyTorch
    if not grouped_gemm:
        out["grouped_mm"] = "reference"
    if not permute_fusion:
        out.update(moe_permute="reference", moe_unpermute="reference")
    return {**out, **cfg.kernel_overrides}


# the flags the checked shape numbers come from
_ARCH_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads":
               "--num-attention-heads", "num_kv_heads": "--num-query-groups", "head_dim": "--kv-channels",
               "vocab_size": "--padded-vocab-size", "rope_theta": "--rotary-base"}


def build_decoder(cfg: LLMConfig) -> torch.nn.Module:
    """The decoder on the meta device (no memory yet): the parallel plans are applied to it, then
    backends.models.decoder.loading.materialize gives each rank its own slices (read from engine.yaml's load_hf,
    a Megatron checkpoint, or the layout-invariant seeded init)."""
    from backends.models import decoder as models
    from backends.models.decoder import loading

    from backends.llm.config import MODEL_TYPE_HF, check_model_facts

    if cfg.model.from_flags is not None:  # a Megatron checkpoint's model, as Megatron builds it from the flags
        from backends.llm.megatron_load import flags_config

        config = flags_config(cfg)
        check_model_facts(config, cfg.checks, "the model the flags describe")
        return loading.meta_decoder(config)
    if not cfg.model.load_hf:
        card = models.card_config(cfg.model.model_id, **cfg.model.overrides)
        check_model_facts(card, cfg.checks, f"model card {cfg.model.model_id}")
        return loading.meta_decoder(card)
    from backends.common.checkpoint.hf_io import read_config

    if not (Path(cfg.model.load_hf) / "config.json").is_file():
        flag = "--load (with --enable-hf2mg-convert)" if cfg.hf2mg else "load_hf (engine.yaml)"
        raise ConfigError(f"{flag} {cfg.model.load_hf}: no config.json there; give a Hugging Face model directory")
    have = models.ModelConfig.from_hf(read_config(cfg.model.load_hf))
    if cfg.model_type_hf and have.family not in MODEL_TYPE_HF[cfg.model_type_hf]:
        raise ConfigError(f"--model-type-hf {cfg.model_type_hf}: {cfg.model.load_hf} holds a {have.family} model; "
                          f"give the --model-type-hf of that model")
    check_model_facts(have, cfg.checks, cfg.model.load_hf)
    for key, value in cfg.model.overrides.items():
        # the shape numbers every family spells the same way; the rest is the config's business
        if key not in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
                       "rope_theta") or not hasattr(have, key):
            continue
        if getattr(have, key) != value:
            raise ConfigError(f"{_ARCH_FLAGS.get(key, key)} {value!r}: config.json in {cfg.model.load_hf} has "
                              f"{key}={getattr(have, key)!r}; make the flag match the model (or re-render the job "
                              f"from this model directory)")
    return loading.meta_decoder(have)


def _build_data(cfg: LLMConfig, rt, par):
    from backends.common.data import MicroBatchLoader, load_tokenizer, pad_id, preprocess

    d = cfg.data
    tokenizer = load_tokenizer(cfg.model.tokenizer, use_fast=cfg.tokenizer_use_fast) if cfg.model.tokenizer else None
    cache_root = Path(d.prefix).parent
    source = d.input or d.prefix
    template = prompt_template(d.template, tokenizer, cfg.enable_thinking) if d.fmt != "text" else d.template
    dataset = kit.rank_zero_first(rt.is_main, lambda: preprocess(source, d.fmt, tokenizer, template, d.seq_len,
                                                                 cache_root, max_samples=d.max_samples))
    if dataset.kind == "text":
        return dataset, _megatron_samples(cfg, dataset, tokenizer, par)
    mode = "packed" if d.packing else "dynamic" if d.dynamic else "padded"
    samples = dataset.open(d.seq_len)
    rows = _rows(cfg, dataset, samples) if mode == "packed" else None
    if rows is None and len(samples) != len(samples.tokens):
        raise ConfigError(f"--data-path {d.prefix}: its rows were packed by preprocess_data.py --neat-pack, and "
                          f"without --reset-attention-mask MindSpeed-LLM trains each row as one sequence, its "
                          f"documents attending to each other (not built); add --reset-attention-mask --neat-pack "
                          f"(each document apart, as the published pack scripts train them)")
    index, epoch, order = _mindspeed_order(cfg, len(rows) if rows is not None else len(samples))
    loader = MicroBatchLoader(samples, mode=mode, micro_batch=cfg.train.micro_batch, seq_len=d.seq_len,
                              dp_rank=par.dp_rank, dp_world=par.layout.dp, seed=cfg.train.seed, shuffle=d.shuffle,
                              pad_id=pad_id(tokenizer) if tokenizer is not None else 0,
                              pad_to_multiple_of=d.pad_to_multiple_of, rows=rows, index=index, sampler=d.sampler)
    loader.epoch_units = epoch
    packing = getattr(loader, "packing", None)
    log.info("data: %s; %s batches%s; %s", dataset.summary(), mode,
             f", {packing.rows} packed rows, padding waste {packing.waste_pct:.1f}%" if packing else "", order)
    return dataset, loader


def _rows(cfg: LLMConfig, dataset, samples) -> list[list[int]]:
    """The packed rows: as MindSpeed-LLM's preprocess_data.py wrote them (a --neat-pack row's documents kept
    apart), or, for records this engine tokenized with --pack / --neat-pack, packed here as preprocess_data.py
    --pack would (best fit, rather than its greedy order)."""
    from backends.common.data import best_fit_decreasing

    if dataset.source == "records" and cfg.data.pack_rows:
        return best_fit_decreasing(samples.lengths, cfg.data.seq_len)
    return samples.file_rows()


def _mindspeed_order(cfg: LLMConfig, n_rows: int):
    """DecoderPackedMTFDataset's shuffle index over the train split of the rows, for train_iters x global batch
    samples (or the epochs engine.yaml asks for); (index, one epoch's samples, what the log says of it)."""
    from backends.common.data.mtf_order import epoch_rows, legacy_split, shuffle_index

    d, t = cfg.data, cfg.train
    begin, end = legacy_split(d.split, n_rows)[:2]
    if end <= begin:
        raise ConfigError(f"--split {d.split}: the train split holds none of the {n_rows} rows of {d.prefix}")
    epoch = len(epoch_rows(begin, end - begin, t.global_batch, d.padded_samples))
    num_samples = t.steps * t.global_batch if t.steps else math.ceil(t.epochs * epoch / t.global_batch) * t.global_batch
    index = shuffle_index(begin, end - begin, num_samples, t.seed, t.global_batch, d.shuffle, d.padded_samples)
    if len(index) and int(index.max()) >= n_rows:   # upstream's MTFDataset fails on such an index too
        raise ConfigError(f"--padded-samples: an epoch of {end - begin} rows needs rows 0..{int(index.max())} to "
                          f"fill its last global batch of {t.global_batch}, and {d.prefix} has {n_rows}; use a "
                          f"smaller --global-batch-size, or drop --padded-samples")
    order = (f"MindSpeed-LLM's order: train rows {begin}..{end - 1}, {len(index) // epoch} epoch(s) of {epoch} "
             f"samples{' (--padded-samples)' if epoch > end - begin else ''}, "
             f"{'shuffled with seed ' + str(t.seed) if d.shuffle else 'in file order'}, {d.sampler} sampler")
    return index, epoch, order


def _megatron_samples(cfg: LLMConfig, dataset, tokenizer, par):
    """Pre-training as MindSpeed-LLM trains it: Megatron's GPTDataset over the text documents (their
    train split of --split), train_iters x global batch samples, read in order."""
    from backends.common.data import eod_id
    from backends.common.data.gpt_dataset import GPTDataset, MegatronBatches

    d, t = cfg.data, cfg.train
    if tokenizer is None:
        raise ConfigError("pre-training data needs the tokenizer's EOD id (Megatron's tokenizer.eod): give "
                          "--tokenizer-name-or-path")
    eod = eod_id(tokenizer)
    # MindSpeed-LLM's tokenizer.pad: the pad token, else EOS; GPTDataset masks labels equal to it
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eod

    def build(num_samples):
        try:
            return GPTDataset(dataset.ids_prefix, d.seq_len, t.seed, eod, split=d.split, which="train",
                              num_samples=num_samples, pad_id=pad, reset_position_ids=d.reset_position_ids,
                              reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss)
        except ValueError as err:
            raise ConfigError(f"--data-path {d.prefix}: {err}") from None

    if t.steps:
        samples = build(t.steps * t.global_batch)
        epoch = len(samples)
    else:   # train_epochs (engine file): the steps that pass over one epoch's samples that often
        samples = build(None)
        epoch = len(samples)
        samples = build(math.ceil(t.epochs * epoch / t.global_batch) * t.global_batch)
    loader = MegatronBatches(samples, cfg.train.micro_batch, par.dp_rank, par.layout.dp, sampler=d.sampler)
    loader.epoch_units = epoch
    log.info("data: %s; Megatron GPTDataset train split: documents %d..%d, %d samples of %d tokens over %d "
             "epoch(s), seed %d, %s sampler", dataset.summary(), int(samples.documents[0]),
             int(samples.documents[-1]), len(samples), d.seq_len, samples.epochs, t.seed, d.sampler)
    return loader


def resume_setting(cfg: LLMConfig) -> str | None:
    """Megatron's --load rule (kit.megatron_resume) for the engine's own checkpoints. Resuming restores everything:
    Megatron's partial loads (--finetune, --no-load-optim, --no-load-rng) of an engine checkpoint are not built and
    are refused. A Megatron checkpoint there is megatron_load's (its model only: those flags are natural)."""
    a = cfg.load_args
    partial = tuple(flag for flag, on in (("--finetune", a.finetune), ("--no-load-optim", a.no_load_optim),
                                          ("--no-load-rng", a.no_load_rng)) if on)
    return kit.megatron_resume(cfg.load, cfg.save, exit_on_missing=a.exit_on_missing, partial=partial,
                               error=ConfigError, reads_megatron=True)


class LLMRecipe(Recipe):
    name = "backends.llm"

    def __init__(self, cfg: LLMConfig):
        self.cfg = cfg

    def build(self, rt) -> Settings:
        from backends.llm.megatron_load import megatron_start

        cfg, t = self.cfg, self.cfg.train
        refuse_unbuilt_parallelism(cfg)
        resume = resume_setting(cfg)
        self.megatron = megatron_start(cfg, resume)
        kernels.configure(default=cfg.kernel_backend, overrides=kernel_overrides(cfg) or None)
        seed_everything(t.seed)
        decoder = build_decoder(cfg)
        if cfg.lora:
            apply_lora(cfg, decoder)
        self.trainable, self.total = kit.count_parameters(decoder)
        log.info("model: %s, %.2f M parameters (%.2f M trainable), kernels %s", decoder.config.family,
                 self.total / 1e6, self.trainable / 1e6, kernels.describe())

        par = self.par = parallelize.setup(cfg, decoder, rt)
        self.rt, self.decoder = rt, decoder
        self.dataset, self.loader = _build_data(cfg, rt, par)
        self.accum = par.layout.grad_accum  # backends.contract.layout checked the batch rule in setup
        if self.accum < 1:
            raise ConfigError(f"--global-batch-size {t.global_batch} must be at least micro-batch {t.micro_batch} "
                              f"× data-parallel size {par.layout.dp}")
        total_steps = t.steps or max(1, math.ceil(t.epochs * getattr(self.loader, "epoch_units", self.loader.n_units)
                                                      / t.global_batch))
        model = self._load(CausalLMWithLoss(decoder), par, rt)
        self.parts = {"model": kit.train_part(
            model, par, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay, schedule=kit.megatron_schedule(
                t, total_steps), precision=t.precision, grad_clip=t.grad_clip,
            forward_backward=self._pipeline_step if par.pipeline is not None else None)}
        self._batches = iter(self.loader)
        return Settings(total_steps=total_steps, save_dir=cfg.save, save_interval=t.save_interval,
                        exit_interval=t.exit_interval, resume=resume, log_interval=t.log_interval,
                        metrics_file=cfg.metrics_file, trainable_only=cfg.lora is not None,
                        start_step=self.megatron.start_step if self.megatron else 0, trackers=cfg.trackers)

    def _load(self, model: CausalLMWithLoss, par, rt) -> torch.nn.Module:
        """The data-parallel wrap and the weights: FSDP2 shards the meta model first, so each rank
        allocates and reads only its shard; DDP (which broadcasts at construction) wraps a loaded one."""
        from backends.models.decoder import loading

        cfg, parts = self.cfg, self.decoder.parts()
        reader = None
        if self.megatron is not None:  # its tensors under HF names, held against the model first
            from backends.llm.megatron_load import checkpoint_reader

            reader = checkpoint_reader(self.megatron, self.decoder)
            log.info("--load %s: Megatron %s checkpoint %s, from iteration %d", cfg.load, self.megatron.ckpt.format,
                     self.megatron.ckpt.directory.name, self.megatron.start_step)
        if par.fsdp:
            model = data_parallel.wrap_data_parallel(model, parts, par, rt.device)
        loading.materialize(model, self.decoder, rt.device, hf_dir=cfg.model.load_hf, seed=cfg.train.seed,
                            reader=reader)
        if not par.fsdp:
            model = data_parallel.wrap_data_parallel(model, parts, par, rt.device)
        return model

    def next_micro_batches(self) -> list[dict]:
        device = self.rt.device
        return [parallelize.shard_batch({k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
                                         for k, v in next(self._batches).items()}, self.par)
                for _ in range(self.accum)]

    def loss(self, model, mb: dict) -> Loss:
        return causal_lm_loss(model, mb, self.cfg.train.moe_aux_loss_coeff, self._topk(), self._micro_mean_cp(),
                              self.cfg.train.log_micro_means)

    def _micro_mean_cp(self) -> int | None:
        """Megatron's per-micro-batch reduction (the context-parallel size), or None for
        --calculate-per-token-loss (the global token mean)."""
        return None if self.cfg.train.per_token_loss else self.par.layout.cp

    def _pipeline_step(self, micro_batches, scales):
        coeff, topk = self.cfg.train.moe_aux_loss_coeff, self._topk()   # Megatron's aux: see causal_lm_loss
        cp = self._micro_mean_cp()
        token = scales.token if cp is None else micro_mean_scales(micro_batches, scales, cp)
        loss_sum, aux = self.par.pipeline.forward_backward(micro_batches, token, scales.extra * coeff / topk)
        if cp is not None and self.cfg.train.log_micro_means:
            loss_sum = logged_micro_means(self.par.pipeline.micro_loss_sums, micro_batches, scales, cp)
        return loss_sum, ({"aux_loss": aux / topk} if aux is not None and coeff else {}), 1.0  # this rank's mean

    def _topk(self) -> int:
        moe = self.decoder.config.moe
        return moe.experts_per_token if moe is not None else 1

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])

    def start_info(self) -> dict:
        info = {"grad_accum": self.accum, "samples": self.dataset.stats.get("samples"), "parameters": self.total,
                "trainable": self.trainable}
        if self.loader.mode == "megatron":   # pre-training: Megatron's GPTDataset samples
            info["gpt_dataset"] = self.loader.stats
        return info

    def plot_title(self, total_steps: int) -> str:
        return f"{self.decoder.config.family} · {total_steps} steps"

    def export(self, trainer) -> None:
        if self.cfg.export_hf:
            self._export_hf()

    def _export_hf(self) -> None:
        from backends.models.decoder import loading

        cfg = self.cfg
        # every rank takes part: one parameter gathered at a time, rank 0 writes the shards as they fill
        loading.export_hf(self.decoder, self.par, cfg.export_hf, tokenizer_dir=cfg.model.tokenizer, lora=cfg.lora,
                          base_model=cfg.model.load_hf or cfg.model.model_id)


def main(argv: list[str] | None = None) -> int:
    from backends.common import trainer

    return trainer.main("backends.llm", lambda args: LLMRecipe(parse_args(args)), argv, user_errors=(ConfigError,))
