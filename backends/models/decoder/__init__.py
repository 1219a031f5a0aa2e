"""Native decoder models of the LLM engine: qwen2, qwen3, llama, glm, glm4, mixtral, qwen3_moe,
deepseek_v2, deepseek_v3, with Hugging Face parameter names and checkpoint I/O.

    build_model(cfg)                 random init like HF (normal(0, initializer_range), norms 1)
    from_pretrained(path, dtype)     an HF model directory (config.json + safetensors)
    from_card(model_id, **overrides) capability_matrix/models.yaml card (+ shape overrides)
    load_hf_state_dict / hf_state_dict   HF on-disk names <-> our parameters
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import FAMILIES, ConfigError, MLAConfig, ModelConfig, MoEConfig
from .convert import hf_state_dict, load_hf_state_dict
from .model import CausalLM, DecoderLayer
from .layers import RMSNorm
from .moe import Experts, Router

__all__ = [
    "FAMILIES", "CausalLM", "ConfigError", "DecoderLayer", "MLAConfig", "ModelConfig", "MoEConfig",
    "build_model", "card_config", "find_card", "from_card", "from_pretrained", "hf_state_dict",
    "init_rule", "init_weights", "load_hf_state_dict",
]


def init_rule(module: nn.Module, name: str, std: float = 0.02):
    """How HF's _init_weights fills `module`'s own parameter or buffer `name`: a function
    fill(tensor, generator=None), or None where it leaves it (linear / embedding / router / expert
    weights ~ N(0, std), biases and the routing correction bias 0, norms 1)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        if name == "weight":
            return lambda t, generator=None: t.normal_(0.0, std, generator=generator)
        if name in ("bias", "e_score_correction_bias"):
            return lambda t, generator=None: t.zero_()
    elif isinstance(module, Experts) and name in ("gate_up_proj", "down_proj"):
        return lambda t, generator=None: t.normal_(0.0, std, generator=generator)
    elif isinstance(module, RMSNorm) and name == "weight":
        return lambda t, generator=None: t.fill_(1.0)
    return None


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """HF's _init_weights on every module, drawing from the global RNG in module order."""
    with torch.no_grad():
        for module in model.modules():
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, t in own:
                if t is None:
                    continue
                fill = init_rule(module, name, std)
                if fill is not None:
                    fill(t)


def build_model(cfg: ModelConfig) -> CausalLM:
    """A randomly initialised model (on the current default device; torch.device('meta') works)."""
    model = CausalLM(cfg)
    if next(model.parameters()).device.type != "meta":
        init_weights(model, cfg.initializer_range)
    return model


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> CausalLM:
    """Load an HF model directory; weights are cast to dtype (the DeepSeek routing bias stays fp32)."""
    from backends.common.checkpoint.hf_io import read_config, read_safetensors

    cfg = ModelConfig.from_hf(read_config(path))
    tensors = read_safetensors(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, Router) and module.e_score_correction_bias is not None:
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    load_hf_state_dict(model, tensors)
    return model


# ---------------------------------------------------------------------- model cards


def _models_yaml() -> Path:
    # backends never import ascendfactory: find the data file by path (repo checkout, then installed wheel)
    here = Path(__file__).resolve().parents[3] / "capability_matrix" / "models.yaml"
    if here.is_file():
        return here
    for entry in sys.path:
        candidate = Path(entry or ".") / "ascendfactory" / "capability_matrix" / "models.yaml"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("capability_matrix/models.yaml not found next to backends/ nor in an installed "
                            "ascendfactory package")


def find_card(model_id: str) -> dict:
    """The card for a model id, display name or HF repo id (any case)."""
    import yaml

    cards = yaml.safe_load(_models_yaml().read_text(encoding="utf-8"))["models"]
    want = model_id.lower()
    for key, card in cards.items():
        if want in (key.lower(), str(card.get("name", "")).lower(), str(card.get("hf_repo", "")).lower()):
            return card
    raise ValueError(f"no model card {model_id!r} in capability_matrix/models.yaml")


def card_config(model_id: str, **overrides) -> ModelConfig:
    """ModelConfig of a card; overrides replace arch keys (moe= / mla= dicts merge into those blocks)."""
    card = find_card(model_id)
    arch = copy.deepcopy(card["arch"])
    for key, value in overrides.items():
        if key in ("moe", "mla") and isinstance(value, dict) and isinstance(arch.get(key), dict):
            arch[key].update(value)
        else:
            arch[key] = value
    return ModelConfig.from_card(arch, card["family"])


def from_card(model_id: str, **overrides) -> CausalLM:
    """A randomly initialised model with a card's architecture (and overrides, e.g. num_layers=2)."""
    return build_model(card_config(model_id, **overrides))
