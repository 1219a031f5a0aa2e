"""A Hugging Face causal LM as LLaMA-Factory trains it: loaded through transformers, routed through
backends.kernels, made trainable by full, freeze or LoRA tuning, with its loss computed from the
final hidden states by the chunked linear cross entropy (full logits are never materialised).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from backends import kernels
from backends.common.parallel.parts import ModelParts
from backends.lf.config import LFConfig, LFConfigError


class HFCausalLMWithLoss(nn.Module):
    """The HF model plus its loss, as one module (under FSDP2 the root unit holds the embedding, final
    norm and head, unsharded for exactly this forward)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def body(self) -> nn.Module:
        return self.hf.get_decoder() if hasattr(self.hf, "get_decoder") else self.hf.model

    def forward(self, input_ids, labels, position_ids=None, logps: bool = False):
        """(summed token loss, token count); logps: per-row sums of the label tokens' log-probabilities
        and their counts, [B] each (DPO; one forward, so FSDP2's root unit gathers for it too)."""
        hidden = self.body()(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        head = self.hf.get_output_embeddings()
        if logps:
            logits = head(hidden).float()
            mask = labels != -100
            picked = torch.gather(logits.log_softmax(-1), -1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            return (picked * mask).sum(-1), mask.sum(-1)
        loss_sum, count = kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                                      labels.reshape(-1))
        return loss_sum, count

    def parts(self) -> ModelParts:
        body = "hf." + next(n for n, m in self.hf.named_modules() if m is self.body())
        head = self.hf.get_output_embeddings()
        tied = head.weight is self.hf.get_input_embeddings().weight
        head_name = "hf." + next(n for n, m in self.hf.named_modules() if m is head)
        return ModelParts(root=self, blocks=f"{body}.layers", embedding=f"{body}.embed_tokens", norm=f"{body}.norm",
                          head=None if tied else head_name, attention="self_attn", mlp="mlp",
                          hidden_size=int(self.hf.config.hidden_size))


def attention_override(flash_attn: str) -> dict[str, str]:
    """LLaMA-Factory's flash_attn → the kernel choice for attention (auto: the best for the device)."""
    if flash_attn in ("sdpa", "disabled"):
        return {"attention": "reference"}
    return {}


def load_hf_model(cfg: LFConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM

    path = cfg.model_name_or_path
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                     trust_remote_code=cfg.trust_remote_code)
    except OSError as err:
        raise LFConfigError(f"model_name_or_path: cannot load {path!r} as a local Hugging Face model ({err}); this "
                            "engine does not download: give a model directory") from None
    return model


def apply_kernels(model: nn.Module) -> dict:
    from backends.kernels.hf_patch import patch_hf_model

    return patch_hf_model(model)


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
    trained = []
    for name, p in model.named_parameters():
        p.requires_grad_(_freeze_trains(name.split("."), set(ids), modules, extra))
        if p.requires_grad:
            trained.append(name)
    return trained


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
    for p in model.parameters():
        p.requires_grad_(True)
    return [n for n, _ in model.named_parameters()]
