"""Native Qwen2.5-VL of the MindSpeed-MM-style engine, with Hugging Face parameter names and checkpoint I/O.

    from_pretrained(hf_dir, dtype)     a transformers Qwen2_5_VLForConditionalGeneration directory
    build_model(cfg)                   random init like HF (normal(0, initializer_range), biases 0, norms 1)
    hf_state_dict(model)               our parameters under their on-disk names (they are the same names), in the
                                       model's layout (the vision qkv per head; save_pretrained writes HF's order)
    save_pretrained(model, out_dir)    config.json + safetensors that transformers loads back
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.common.layers import RMSNorm

from .config import ConfigError, TextConfig, VisionConfig, VLConfig
from .model import Qwen2_5_VL, TextDecoder, TextLayer, VisionBlock, VisionTower, qkv_from_hf, qkv_to_hf

__all__ = ["ConfigError", "Qwen2_5_VL", "TextConfig", "TextDecoder", "TextLayer", "VLConfig", "VisionBlock",
           "VisionConfig", "VisionTower", "build_model", "from_pretrained", "hf_state_dict", "init_weights",
           "load_hf_state_dict", "save_pretrained", "to_hf_layout"]


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv3d)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def build_model(cfg: VLConfig) -> Qwen2_5_VL:
    model = Qwen2_5_VL(cfg)
    if next(model.parameters()).device.type != "meta":
        init_weights(model, cfg.text.initializer_range)
    return model


def _is_vision_qkv(name: str) -> bool:
    return name.startswith("visual.") and name.endswith((".attn.qkv.weight", ".attn.qkv.bias"))


def to_hf_layout(model: Qwen2_5_VL, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors in the model's layout -> HF's (the vision qkv rows back to [q | k | v])."""
    heads = model.config.vision.num_heads
    return {n: qkv_to_hf(t, heads) if _is_vision_qkv(n) else t for n, t in tensors.items()}


def load_hf_state_dict(model: Qwen2_5_VL, tensors) -> None:
    """Copy an on-disk state dict in; every parameter must be there, and nothing unknown may be left
    (a tied model ignores a stored lm_head.weight, as transformers does)."""
    own = dict(model.named_parameters())
    missing = [n for n in own if n not in tensors]
    if missing:
        raise ConfigError(f"the checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}; is it a "
                          "Qwen2.5-VL checkpoint of this shape?")
    unknown = [n for n in tensors.keys() if n not in own and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
    if unknown:
        raise ConfigError(f"the checkpoint holds {len(unknown)} tensors this model has no place for, e.g. {unknown[:3]}")
    with torch.no_grad():
        for name, p in own.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(f"{name}: checkpoint shape {tuple(t.shape)}, model shape {tuple(p.shape)}")
            if _is_vision_qkv(name):
                t = qkv_from_hf(t, model.config.vision.num_heads)
            p.copy_(t.to(p.dtype))


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                    cls: type[Qwen2_5_VL] = Qwen2_5_VL) -> Qwen2_5_VL:
    """cls: Qwen2_5_VL or a subclass with its own forward (the RL engine's policy)."""
    from backends.common.checkpoint.hf_io import read_config, read_safetensors

    cfg = VLConfig.from_hf(read_config(path))
    with torch.device("meta"):
        model = cls(cfg)
    model.to_empty(device=device)
    model.to(dtype)
    load_hf_state_dict(model, read_safetensors(path))
    return model


def hf_state_dict(model: Qwen2_5_VL) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def save_pretrained(model: Qwen2_5_VL, out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None,
                    dtype: torch.dtype | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a transformers-loadable directory (atomic; the tokenizer / processor files copied along).
    tensors: the whole tensors to write in the model's layout (a sharded model's, gathered), default
    hf_state_dict(model)."""
    import shutil

    from backends.common.checkpoint.hf_io import write_hf_dir

    tensors = to_hf_layout(model, tensors if tensors is not None else hf_state_dict(model))
    out = write_hf_dir(out_dir, tensors, model.config.to_hf(),
                       tokenizer_dir=tokenizer_dir, dtype=dtype)
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "preprocessor_config.json").is_file():
        shutil.copy2(Path(tokenizer_dir) / "preprocessor_config.json", out / "preprocessor_config.json")
    return out
