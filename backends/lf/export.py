"""The end of a run as LLaMA-Factory leaves it: the trained model (full / freeze) or the PEFT adapter
(LoRA) and the tokenizer in output_dir, next to the logs and checkpoints already there; a reward
model's value head beside them (value_head.safetensors, as LF's fix_valuehead_checkpoint writes it).
With the sidecar's lora.merge_on_export the merged model (and value head) also goes to output_dir/merged.

Every rank takes part (FSDP2 gathers one parameter at a time); rank 0 writes a complete directory
under a temporary name, then moves its files into output_dir, config last.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn

from backends.lf.config import LFConfig

log = logging.getLogger("backends.lf")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _inner(model: nn.Module) -> nn.Module:
    """The HFCausalLMWithLoss under DDP (module) or itself (FSDP2 shards in place)."""
    return getattr(model, "module", model)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _state(hf: nn.Module, skip_lora: bool = True):
    """(HF name, full tensor) one at a time; every rank walks the same order (the gathers are collective)."""
    transient = _non_persistent(hf)
    for name, t in list(hf.named_parameters()) + [(n, b) for n, b in hf.named_buffers()
                                                   if n.rsplit(".", 1)[-1] not in transient]:
        if skip_lora and (".lora_A." in name or ".lora_B." in name):
            continue
        yield name.replace(".base_layer.", "."), _full(t.detach())


def _non_persistent(hf: nn.Module) -> set[str]:
    out = set()
    for m in hf.modules():
        out |= set(getattr(m, "_non_persistent_buffers_set", ()))
    return out


def _move_into(tmp: Path, out: Path) -> None:
    """tmp's files into out (replacing same-named ones), config.json / adapter_config.json last."""
    names = sorted(p.name for p in tmp.iterdir())
    last = [n for n in names if n in ("config.json", "adapter_config.json")]
    for name in [n for n in names if n not in last] + last:
        os.replace(tmp / name, out / name)
    shutil.rmtree(tmp, ignore_errors=True)


# what a vision-language model's processor reads besides the tokenizer (LLaMA-Factory saves the processor)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def _save_tokenizer(tokenizer, source: str, out: Path) -> None:
    """The tokenizer, and the base model's processor files, so the export loads with AutoProcessor too."""
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, out / name)


def _write_model(stream, config: dict, out: Path, tokenizer, is_main: bool, source: str) -> None:
    from backends.common.checkpoint.hf_io import write_hf_dir

    if not is_main:
        for _ in stream:
            pass
        return
    tmp = out / f".export-{uuid.uuid4().hex[:8]}"
    write_hf_dir(tmp, stream, config)
    _save_tokenizer(tokenizer, source, tmp)
    _move_into(tmp, out)


def export(model: nn.Module, cfg: LFConfig, tokenizer) -> None:
    from backends.common.distributed import barrier
    from backends.common.lora import lora_modules, save_peft_adapter

    inner = _inner(model)
    hf = inner.hf
    out = Path(cfg.output_dir)
    is_main = _rank() == 0
    config = hf.config.to_dict()
    config.pop("_attn_implementation_autoset", None)
    config.pop("_name_or_path", None)  # the training machine's path of the base model means nothing elsewhere
    if config.get("_attn_implementation") not in (None, "eager", "sdpa", "flash_attention_2"):
        config.pop("_attn_implementation", None)  # our kernel name means nothing to a reader of the export
    if cfg.finetuning_type == "lora" and lora_modules(hf):
        save_peft_adapter(hf, out, base_model_name_or_path=cfg.model_name_or_path, r=cfg.lora_rank,
                          alpha=float(cfg.lora_alpha), dropout=cfg.lora_dropout, target_modules=cfg.names("lora_target"))
        if is_main:
            _save_tokenizer(tokenizer, cfg.model_name_or_path, out)
        if cfg.engine.get("lora.merge_on_export"):
            if is_main:
                (out / "merged").mkdir(parents=True, exist_ok=True)
            _write_model(_merged_stream(hf), config, out / "merged", tokenizer, is_main, cfg.model_name_or_path)
        log.info("LoRA adapter written to %s", out)
    else:
        _write_model(_state(hf), config, out, tokenizer, is_main, cfg.model_name_or_path)
        log.info("model written to %s", out)
    if hasattr(inner, "v_head"):
        from backends.lf.rm import save_value_head

        merged = cfg.finetuning_type == "lora" and cfg.engine.get("lora.merge_on_export")
        for folder in (out, out / "merged") if merged else (out,):
            save_value_head(inner, folder, is_main)
    barrier()


def _merged_stream(hf: nn.Module):
    """The base weights with each adapter's delta folded in (gathered adapters are r-wide, small)."""
    from backends.common.lora import lora_delta, lora_modules

    mods = lora_modules(hf)
    deltas = {}
    for name, m in mods.items():
        a, b = _full(m.lora_A.weight.detach()), _full(m.lora_B.weight.detach())
        deltas[f"{name}.weight"] = lora_delta(a, b, m.scaling)
    for name, full in _state(hf):
        if name in deltas:
            full = (full.float() + deltas[name]).to(full.dtype)
        yield name, full
