"""--load of a Megatron checkpoint, as MindSpeed-LLM's converter (HF -> mcore) or Megatron's save_checkpoint
writes it (legacy torch format or torch_dist; backends.common.checkpoint.megatron_checkpoint): its weights
go through the per-rank loading under HF names, so it loads at any tp / pp / dp / ep.

    megatron_start(cfg, resume)     the checkpoint to start from and the iteration, by Megatron's rules, or None
    flags_config(cfg)               the model Megatron builds from the flags (no model card, no HF directory)
    checkpoint_reader(start, dec)   the checkpoint under the decoder's HF names, held against the model

Megatron's rules (megatron/training/checkpointing.py load_checkpoint): the tracker file names the checkpoint;
--finetune or a release checkpoint starts at iteration 0 and reads the model only; otherwise the run continues
at the saved iteration and reads the optimizer (unless --no-load-optim) and the rng state (unless
--no-load-rng), exiting when the checkpoint lacks them. Continuing with a fresh optimizer and scheduler (what
--no-load-optim gives) is built; restoring Megatron's optimizer, rng or data position is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.common.checkpoint.megatron_checkpoint import (
    MegatronCheckpoint, MegatronCheckpointError, is_megatron, open_checkpoint,
)
from backends.llm.config import ConfigError, LLMConfig


@dataclass
class MegatronStart:
    ckpt: MegatronCheckpoint
    start_step: int     # the iteration the run continues from (0: a fresh start from its weights)


def megatron_start(cfg: LLMConfig, resume: str | None) -> MegatronStart | None:
    """The Megatron checkpoint under --load to take the weights from, unless the engine resumes its own."""
    from backends.common.checkpoint.resume import list_checkpoints

    load = cfg.load
    if not load or not is_megatron(load) or resume not in (None, "auto") or list_checkpoints(load):
        return None   # nothing there, or the engine's own checkpoints (newer: a resume of this run) win
    if cfg.model.load_hf:
        raise ConfigError(f"--load {load} holds a Megatron checkpoint and load_hf {cfg.model.load_hf} names a "
                          f"Hugging Face model: two sets of weights; keep one")
    a = cfg.load_args
    try:
        ckpt = open_checkpoint(load)
    except MegatronCheckpointError as err:
        raise ConfigError(f"--load {load}: {err}") from None
    if ckpt.format == "torch_dist" and a.ckpt_format == "torch":
        raise ConfigError(f"--load {load}: {ckpt.directory.name} is a torch_dist checkpoint and --ckpt-format torch "
                          f"reads legacy ones only (Megatron: 'Detected load from a distributed checkpoint'); give "
                          f"--ckpt-format torch_dist")
    start = 0 if a.finetune or ckpt.release else ckpt.iteration
    if start:
        wrong = []
        for what, flag in (("optimizer", "--no-load-optim"), ("rng", "--no-load-rng")):
            if getattr(a, flag[2:].replace("-", "_")):
                continue
            wrong.append(f"restoring Megatron's {what} state is not built; give {flag}" if what in ckpt.holds else
                         f"it holds no {what} state (Megatron exits: 'Unable to load {what} ... from checkpoint'); "
                         f"give {flag}")
        consumed = getattr(ckpt.args, "consumed_train_samples", 0) or 0
        if consumed:
            wrong.append(f"continuing Megatron's data position ({consumed} samples consumed) is not built")
        if wrong:
            raise ConfigError(f"--load {load}: iteration {start}, which the run continues from without --finetune: "
                              + "; ".join(wrong) + " (or --finetune: its weights from iteration 0)")
    return MegatronStart(ckpt, start)


def flags_config(cfg: LLMConfig):
    """The ModelConfig of the flags (config.flags_model), its vocabulary padded from the tokenizer's as Megatron
    pads it when no flag gives it; the architecture facts the flags state (--norm-topk-prob ...) set on it."""
    from backends.models.decoder.config import ConfigError as ModelError
    from backends.models.decoder.config import ModelConfig

    spec = cfg.model.from_flags
    arch = dict(spec.arch)
    if arch["vocab_size"] is None:
        if not cfg.model.tokenizer:
            raise ConfigError("the vocabulary size: give --padded-vocab-size, or --tokenizer-name-or-path (Megatron "
                              "pads the tokenizer's)")
        from backends.common.data import load_tokenizer

        size = len(load_tokenizer(cfg.model.tokenizer, use_fast=cfg.tokenizer_use_fast))
        arch["vocab_size"] = -(-size // spec.vocab_multiple) * spec.vocab_multiple
    try:
        config = ModelConfig.from_card(arch, spec.family)
    except (ModelError, TypeError) as err:
        raise ConfigError(f"the model these flags describe ({spec.family}): {err}") from None
    for path, value in cfg.checks.values():
        _set(config, path, value)
    return config


def _set(config, path: str, value) -> None:
    *owners, leaf = path.split(".")
    obj = config
    for part in owners:
        obj = getattr(obj, part, None) if not isinstance(obj, dict) else obj.get(part)
        if obj is None:
            return   # a fact about a block this model lacks: check_model_facts names it
    if isinstance(obj, dict):
        obj[leaf] = value
    elif not isinstance(getattr(type(obj), leaf, None), property):
        setattr(obj, leaf, value)


def checkpoint_reader(start: MegatronStart, decoder):
    """The checkpoint under the decoder's HF names (megatron_view.MegatronView), after holding every tensor's name
    and shape against the model the flags (or card) describe: one error naming what differs."""
    from backends.common.checkpoint.megatron_view import MegatronView, MlaDims, Naming
    from backends.models.decoder.config import GLM_FAMILIES
    from backends.models.decoder.convert import expert_names, to_hf
    from backends.models.decoder.loading import meta_decoder, persistent_buffers
    from backends.models.decoder.model import mlp_attr

    cfg, load = decoder.config, start.ckpt.load
    _check_args(start.ckpt, cfg)
    a = cfg.mla
    naming = Naming(cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim, mlp=mlp_attr(cfg),
                    experts=expert_names(cfg.family), fused_gate_up=cfg.family in GLM_FAMILIES,
                    mla=a and MlaDims(a.q_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim))
    try:
        view = MegatronView(start.ckpt, naming)
    except MegatronCheckpointError as err:
        raise ConfigError(f"--load {load}: {err}") from None
    model = meta_decoder(cfg)
    want = {name: tuple(t.shape) for n, p in [*model.named_parameters(), *persistent_buffers(model)]
            for name, t in to_hf(n, p, cfg.family)}   # buffers: DeepSeek-V3's routing bias
    wrong = [f"no {name}" for name in want if name not in view]
    wrong += [f"{view.stored_name(name)} gives {name} of shape {view.shape(name)}, the model needs {shape}"
              for name, shape in want.items() if name in view and view.shape(name) != shape]
    extra = [name for name in view.names() if name not in want and not (name == "lm_head.weight" and
                                                                        cfg.tie_word_embeddings)]
    if extra:
        wrong.append(f"{len(extra)} tensor(s) the {cfg.family} model has no place for: " + ", ".join(extra[:4]))
    if wrong:
        shown = "; ".join(wrong[:4]) + (f" (+{len(wrong) - 4} more)" if len(wrong) > 4 else "")
        raise ConfigError(f"--load {load} is not the model the flags describe: {shown}. Megatron builds the model "
                          f"from the flags: make them describe the checkpoint")
    return view


def _check_args(ckpt: MegatronCheckpoint, cfg) -> None:
    """Megatron's check_checkpoint_args: the saved architecture numbers equal the run's."""
    wrong = [f"{flag} {getattr(cfg, ours)} (it was saved with {getattr(ckpt.args, theirs)})"
             for flag, ours, theirs in (("--num-layers", "num_layers", "num_layers"),
                                        ("--hidden-size", "hidden_size", "hidden_size"),
                                        ("--num-attention-heads", "num_attention_heads", "num_attention_heads"))
             if isinstance(getattr(ckpt.args, theirs, None), int) and getattr(ckpt.args, theirs) != getattr(cfg, ours)]
    if wrong:
        raise ConfigError(f"--load {ckpt.load} is not the model the flags describe: " + "; ".join(wrong))
