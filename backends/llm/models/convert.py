"""Hugging Face on-disk tensor names <-> our parameters.

Our names are HF's everywhere except the stacked routed experts: `<p>.experts.gate_up_proj`
[E,H,2I] / `<p>.experts.down_proj` [E,I,H] stand for HF's per-expert `<p>.experts.{e}.gate_proj /
up_proj / down_proj.weight` (Mixtral: w1 / w3 / w2). A tied model has no lm_head (HF writes none).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<which>gate_up_proj|down_proj)$")
# tensors a checkpoint may carry that the model does not use
_IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq$"),)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def expert_names(family: str) -> tuple[str, str, str]:
    """HF names of one expert's (gate, up, down) projections."""
    return ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)  # an FSDP2 / TP DTensor
    return (full_tensor() if full_tensor is not None else t).detach()


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters and buffers under HF on-disk names (experts split back per expert)."""
    gate, up, down = expert_names(model.config.family)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = _full(t)
        m = _STACKED.match(name)
        if m is None:
            out[name] = t
            continue
        p = m["prefix"]
        for e in range(t.shape[0]):
            if m["which"] == "gate_up_proj":
                g, u = t[e].chunk(2, dim=-1)
                out[f"{p}.{e}.{gate}.weight"] = g.t().contiguous()
                out[f"{p}.{e}.{up}.weight"] = u.t().contiguous()
            else:
                out[f"{p}.{e}.{down}.weight"] = t[e].t().contiguous()
    return out


def _take(tensors: Mapping[str, torch.Tensor], key: str, want: tuple[int, ...], needed_for: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"checkpoint has no tensor {key!r} (needed for {needed_for}); the weights do not match "
                         "this config.json / family")
    t = tensors[key]
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"tensor {key!r} has shape {tuple(t.shape)} but the config expects {tuple(want)} "
                         f"(for {needed_for}); check that config.json belongs to these weights")
    return t


def load_hf_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named tensors (any dtype; cast to the parameters') into model, stacking experts.

    Raises ValueError naming the tensor on a missing key, a shape that disagrees with the config,
    or tensors the model has no place for (MTP layers past num_layers and rotary caches are skipped)."""
    cfg = model.config
    gate, up, down = expert_names(cfg.family)
    used: set[str] = set()
    with torch.no_grad():
        for name, target in model.state_dict().items():
            m = _STACKED.match(name)
            if m is None:
                target.copy_(_take(tensors, name, target.shape, name))
                used.add(name)
                continue
            p, (num, rows, cols) = m["prefix"], target.shape
            for e in range(num):
                if m["which"] == "gate_up_proj":
                    inner = cols // 2
                    keys = (f"{p}.{e}.{gate}.weight", f"{p}.{e}.{up}.weight")
                    parts = [_take(tensors, k, (inner, rows), name) for k in keys]
                    target[e, :, :inner].copy_(parts[0].t())
                    target[e, :, inner:].copy_(parts[1].t())
                else:
                    keys = (f"{p}.{e}.{down}.weight",)
                    target[e].copy_(_take(tensors, keys[0], (cols, rows), name).t())
                used.update(keys)
    extra = [k for k in tensors if k not in used and not _ignorable(k, cfg)]
    if extra:
        shown = ", ".join(sorted(extra)[:5]) + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
        raise ValueError(f"checkpoint has {len(extra)} tensor(s) the {cfg.family} model has no place for: {shown}; "
                         "the weights do not match this config.json (quantized checkpoints must be dequantized)")


def _ignorable(key: str, cfg) -> bool:
    if any(p.match(key) for p in _IGNORED):
        return True
    if key == "lm_head.weight" and cfg.tie_word_embeddings:
        return True  # some tied checkpoints still carry the head; the embedding is authoritative
    m = _LAYER.match(key)
    return m is not None and int(m[1]) >= cfg.num_layers  # DeepSeek MTP modules live past the last layer
