"""Every model family, free of engines and parallelism (torchtitan's models/ folder). Each family is
config, modules, a parts() declaration, its HF state-dict adapter, its TP plan and per-rank loading:

    decoder      the text decoders: qwen2, qwen3, llama, glm, glm4, mixtral, qwen3_moe, deepseek_v2/v3
    qwen2_5_vl   Qwen2.5-VL: vision tower, merger, M-RoPE text decoder

Engines import models; models import backends.kernels and common's layers / loading helpers, never
an engine.

    from_pretrained(path, dtype)   the native model of whatever family an HF directory holds
    family_of(path)                which of the packages above reads it
"""

from __future__ import annotations

import os
from typing import Any

FAMILY_PACKAGES = ("decoder", "qwen2_5_vl")
_VL_MODEL_TYPES = ("qwen2_5_vl",)


def family_of(path: str | os.PathLike) -> str:
    """The package (one of FAMILY_PACKAGES) whose model an HF directory's config.json describes."""
    from backends.common.checkpoint.hf_io import read_config

    return "qwen2_5_vl" if read_config(path).get("model_type") in _VL_MODEL_TYPES else "decoder"


def from_pretrained(path: str | os.PathLike, dtype=None, device: Any = "cpu"):
    """An HF model directory (config.json + safetensors) as our native model of its family, weights
    cast to dtype (float32 by default), text decoder or vision-language."""
    import importlib

    import torch

    package = importlib.import_module(f"backends.models.{family_of(path)}")
    return package.from_pretrained(path, dtype=dtype or torch.float32, device=device)
