"""A Hugging Face causal LM as LLaMA-Factory trains it: loaded through transformers, routed through
backends.kernels, made trainable by full, freeze or LoRA tuning, with its loss computed from the
final hidden states by the chunked linear cross entropy (full logits are never materialised).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from backends.lf.config import LFConfig, LFConfigError

# LLaMA-Factory's composite-model keys (model/model_utils/visual.py), matched as substrings of names as there
VL_KEYS = {
    "qwen2_vl": {"projector": ["visual.merger"], "vision": ["visual.patch_embed", "visual.blocks"],
                 "language": ["language_model", "lm_head"], "lora_conflict": ["patch_embed"]},
    "gemma3": {"projector": ["multi_modal_projector"], "vision": ["vision_tower"],
               "language": ["language_model", "lm_head"], "lora_conflict": []},
}
VL_KEYS["qwen2_5_vl"] = VL_KEYS["qwen2_vl"]


def attention_override(flash_attn: str) -> dict[str, str]:
    """LLaMA-Factory's flash_attn → the kernel choice for attention (auto: the best for the device)."""
    if flash_attn in ("sdpa", "disabled"):
        return {"attention": "reference"}
    return {}


def hf_attention(flash_attn: str) -> str | None:
    """LLaMA-Factory's flash_attn → transformers' attn_implementation (None: transformers' default, SDPA),
    for the attention the kernel patch leaves to transformers (Gemma3, vision towers). fa2 / fa3 without
    the flash-attn package fall back to the default with a warning, as LLaMA-Factory does."""
    if flash_attn == "disabled":
        return "eager"
    if flash_attn == "sdpa":
        return "sdpa"
    if flash_attn in ("fa2", "fa3"):
        from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

        if (is_flash_attn_2_available if flash_attn == "fa2" else is_flash_attn_3_available)():
            return "flash_attention_2" if flash_attn == "fa2" else "flash_attention_3"
        import logging

        logging.getLogger("backends.lf").warning("flash_attn %s: the flash-attn package is not installed; "
                                                 "transformers' default attention (SDPA) runs instead", flash_attn)
    return None


def load_hf_model(cfg: LFConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from backends.lf.mm_plugin import is_vl

    path = cfg.model_name_or_path
    auto = AutoModelForImageTextToText if is_vl(path) else AutoModelForCausalLM  # LF's loader picks it so too
    impl = hf_attention(cfg.flash_attn)
    try:
        model = auto.from_pretrained(path, dtype=dtype, local_files_only=True, trust_remote_code=cfg.trust_remote_code,
                                     **({"attn_implementation": impl} if impl else {}))
    except OSError as err:
        raise LFConfigError(f"model_name_or_path: cannot load {path!r} as a local Hugging Face model ({err}); this "
                            "engine does not download: give a model directory") from None
    return model.train()  # from_pretrained leaves eval mode; HF's Trainer trains with dropout (LoRA's too) on


def _num_layers(model: nn.Module) -> int:
    config = getattr(model.config, "text_config", model.config)
    n = getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers", None)
    if not n:
        raise LFConfigError("finetuning_type freeze: this model does not say its number of layers")
    return int(n)


def setup_freeze(model: nn.Module, cfg: LFConfig) -> list[str]:
    """LLaMA-Factory's freeze tuning: the last n layers (first |n| when negative) train, only their
    `freeze_trainable_modules` (all: whole layers), plus `freeze_extra_modules` outside the layers."""
    n, layers = cfg.freeze_trainable_layers, _num_layers(model)
    ids = range(max(0, layers - n), layers) if n > 0 else range(min(-n, layers))
    names = [name for name, _ in model.named_parameters()]
    hidden = {name.split(".0.")[-1].split(".")[0] for name in names if ".0." in name}
    outside = {name.split(".")[-2] for name in names if re.search(r"\.\d+\.", name) is None and "." in name}
    modules = cfg.names("freeze_trainable_modules")
    for module in modules:
        if module != "all" and module not in hidden:
            raise LFConfigError(f"freeze_trainable_modules: {module!r} is not a module of the layers "
                                f"(choose from {', '.join(sorted(hidden))}, or all)")
    extra = cfg.names("freeze_extra_modules")
    for module in extra:
        if module not in outside:
            raise LFConfigError(f"freeze_extra_modules: {module!r} is not a module outside the layers "
                                f"(choose from {', '.join(sorted(outside))})")
    keys = VL_KEYS.get(model.config.model_type)
    projector = keys["projector"] if keys and not cfg.freeze_multi_modal_projector else []
    forbidden = forbidden_modules(model, cfg)
    trained = []
    for name, p in model.named_parameters():
        trains = _freeze_trains(name.split("."), set(ids), modules, extra) or any(k in name for k in projector)
        p.requires_grad_(trains and not any(k in name for k in forbidden))
        if p.requires_grad:
            trained.append(name)
    return trained


def forbidden_modules(model: nn.Module, cfg: LFConfig) -> set[str]:
    """LLaMA-Factory's get_forbidden_modules: the VL parts freeze_vision_tower / freeze_multi_modal_projector /
    freeze_language_model keep frozen (substrings of parameter names; none for a text model)."""
    keys = VL_KEYS.get(getattr(model.config, "model_type", None))
    if keys is None:
        return set()
    out = set()
    for flag, part in (("freeze_vision_tower", "vision"), ("freeze_multi_modal_projector", "projector"),
                       ("freeze_language_model", "language")):
        if getattr(cfg, flag):
            out.update(keys[part])
    return out


def vl_lora_targets(model: nn.Module, cfg: LFConfig, targets: list[str]) -> list[str]:
    """LLaMA-Factory's VL LoRA targets: 'all' = the leaf names of every linear outside lm_head, the projector
    and (freeze_vision_tower) the vision tower; then every linear whose name contains a target and none of
    the forbidden modules (patch_target_modules, lora_conflict_keys included)."""
    keys = VL_KEYS[model.config.model_type]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if [t.lower() for t in targets] in ([], ["all"]):
        skip = {"lm_head", *keys["projector"], *(keys["vision"] if cfg.freeze_vision_tower else [])}
        targets = sorted({n.rsplit(".", 1)[-1] for n in linears if not any(k in n for k in skip)})
    forbidden = forbidden_modules(model, cfg) | set(keys["lora_conflict"])
    chosen = [n for n in linears if any(t in n for t in targets) and not any(k in n for k in forbidden)]
    if not chosen:
        raise LFConfigError(f"lora_target: {', '.join(targets)} selects no linear layer outside the frozen "
                            "vision-language parts")
    return chosen


def _freeze_trains(parts: list[str], ids: set[int], modules: list[str], extra: list[str]) -> bool:
    """Whole-name matching: LLaMA-Factory tests substrings, so there `norm` also trains every layer's
    input_layernorm; here a module name must be a whole component of the parameter's path."""
    for i, part in enumerate(parts[:-1]):
        if part.isdigit() and int(part) in ids and ("all" in modules or parts[i + 1] in modules):
            return True
    return any(module in parts[:-1] for module in extra)


def setup_lora(model: nn.Module, cfg: LFConfig) -> list[str]:
    from backends.common.lora import inject_lora, linear_names

    targets = cfg.names("lora_target")
    if getattr(model.config, "model_type", None) in VL_KEYS:
        return inject_lora(model, r=cfg.lora_rank, alpha=float(cfg.lora_alpha), dropout=cfg.lora_dropout,
                           targets=vl_lora_targets(model, cfg, targets))
    if [t.lower() for t in targets] != ["all"]:
        leaves = {n.rsplit(".", 1)[-1] for n in linear_names(model)}
        missing = [t for t in targets if t not in leaves]
        if missing:
            raise LFConfigError(f"lora_target: {', '.join(missing)} is not a linear layer of this model "
                                f"(it has {', '.join(sorted(leaves))}, or all)")
    return inject_lora(model, r=cfg.lora_rank, alpha=float(cfg.lora_alpha), dropout=cfg.lora_dropout,
                       targets=targets if targets else ["all"])


def make_trainable(model: nn.Module, cfg: LFConfig) -> list[str]:
    """Set requires_grad as the finetuning_type says; returns what trains (names, or LoRA modules)."""
    if cfg.finetuning_type == "lora":
        return setup_lora(model, cfg)
    if cfg.finetuning_type == "freeze":
        return setup_freeze(model, cfg)
    forbidden = forbidden_modules(model, cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(not any(k in name for k in forbidden))
    return [n for n, p in model.named_parameters() if p.requires_grad]
