"""MindSpeed-LLM's LoRA target names, stdlib only.

MindSpeed-LLM names a decoder layer's linears by their Megatron modules and --lora-target-modules
takes those names. A Megatron module may hold several Hugging Face linears (linear_qkv is q, k and v
fused; with MLA, the down-projections; linear_fc1 is gate + up), so LoRA adapts them together. The
orchestrator turns a job's lora.targets into these names (ascendfactory.frameworks.mindspeed_llm)
and backends.llm turns them back into the linears of its native decoders: both read this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Megatron's module names in layer order
MODULES = ("linear_qkv", "linear_qb", "linear_kvb", "linear_proj", "linear_fc1", "linear_fc2")
# module → the HF linears it holds: dense attention and the MLP (MLA's attention: lora_groups)
_DENSE = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",)}
_MLP = {"linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
# HF linears some checkpoints keep fused that stand for a whole module (GLM-4: gate and up)
FUSED_ALIASES = {"gate_up_proj": "linear_fc1"}


def lora_groups(arch: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """{MindSpeed-LLM module: the HF linears it holds} for one architecture (a model card's arch; its
    `mla` block for multi-latent attention, DeepSeek-V2/V3), in layer order."""
    mla = arch.get("mla")
    if not mla:
        return {**_DENSE, **_MLP}
    # MLA: linear_qkv holds the down-projections (q's only with q_lora_rank; without, q is one projection)
    groups = {"linear_qkv": ("q_a_proj" if mla.get("q_lora_rank") else "q_proj", "kv_a_proj_with_mqa")}
    if mla.get("q_lora_rank"):
        groups["linear_qb"] = ("q_b_proj",)
    return {**groups, "linear_kvb": ("kv_b_proj",), "linear_proj": ("o_proj",), **_MLP}


def _any_architecture() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for arch in ({}, {"mla": {"q_lora_rank": 1}}, {"mla": {"q_lora_rank": None}}):
        for module, names in lora_groups(arch).items():
            out.setdefault(module, [])
            out[module] += [n for n in names if n not in out[module]]
    for alias, module in FUSED_ALIASES.items():
        out[module].append(alias)
    return {module: tuple(out[module]) for module in MODULES}


# module → every HF linear it stands for in any native decoder (dense, MLA with or without q_lora_rank,
# fused gate_up): what backends.llm adapts for a name; a linear this model lacks matches nothing, as in PEFT
MODULE_LINEARS = _any_architecture()
