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


def to_hf(name: str, t: torch.Tensor, family: str) -> list[tuple[str, torch.Tensor]]:
    """One of our full tensors under its HF on-disk name(s): stacked experts split back per expert."""
    m = _STACKED.match(name)
    if m is None:
        return [(name, t)]
    gate, up, down = expert_names(family)
    p, out = m["prefix"], []
    for e in range(t.shape[0]):
        if m["which"] == "gate_up_proj":
            g, u = t[e].chunk(2, dim=-1)
            out += [(f"{p}.{e}.{gate}.weight", g.t().contiguous()), (f"{p}.{e}.{up}.weight", u.t().contiguous())]
        else:
            out.append((f"{p}.{e}.{down}.weight", t[e].t().contiguous()))
    return out


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters and buffers under HF on-disk names (experts split back per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        out.update(to_hf(name, _full(t), model.config.family))
    return out


def hf_source(name: str, shape: tuple[int, ...], family: str, leaf):
    """How our tensor `name` of `shape` is made from HF tensors, as a slices.Source: the one mapping
    both the whole-checkpoint load and the per-rank region reads go through.

    leaf(hf_name, hf_shape, needed_for) -> the Source of one checkpoint tensor (it checks that the
    tensor exists with that shape)."""
    from backends.common.checkpoint.slices import Concat, Stack, Transposed

    m = _STACKED.match(name)
    if m is None:
        return leaf(name, tuple(shape), name)
    gate, up, down = expert_names(family)
    p, (num, rows, cols) = m["prefix"], shape
    if m["which"] == "gate_up_proj":  # [E, H, 2I] = per expert [gate^T | up^T]
        inner = cols // 2
        return Stack([Concat(1, [Transposed(leaf(f"{p}.{e}.{w}.weight", (inner, rows), name)) for w in (gate, up)])
                      for e in range(num)])
    return Stack([Transposed(leaf(f"{p}.{e}.{down}.weight", (cols, rows), name)) for e in range(num)])


class Leaves:
    """The leaf factory hf_source takes over a checkpoint (`names`, `shape(name)`, `read(name, region)`):
    a clear error on a missing tensor or one whose shape disagrees with the config; `used` collects
    every tensor asked for."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self.used: set[str] = set()

    def __call__(self, key: str, want: tuple[int, ...], needed_for: str):
        from backends.common.checkpoint.slices import Tensor

        if key not in self.checkpoint:
            raise ValueError(f"checkpoint has no tensor {key!r} (needed for {needed_for}); the weights do not match "
                             "this config.json / family")
        have = tuple(self.checkpoint.shape(key))
        if have != tuple(want):
            raise ValueError(f"tensor {key!r} has shape {have} but the config expects {tuple(want)} "
                             f"(for {needed_for}); check that config.json belongs to these weights")
        self.used.add(key)
        return Tensor(self.checkpoint, key, want)


def check_all_used(names, used: set[str], cfg) -> None:
    """Raise when the checkpoint holds tensors the model has no place for (MTP layers past
    num_layers, rotary caches and a tied checkpoint's head are fine)."""
    extra = [k for k in names if k not in used and not _ignorable(k, cfg)]
    if extra:
        shown = ", ".join(sorted(extra)[:5]) + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
        raise ValueError(f"checkpoint has {len(extra)} tensor(s) the {cfg.family} model has no place for: {shown}; "
                         "the weights do not match this config.json (quantized checkpoints must be dequantized)")


class _InMemory:
    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def __contains__(self, key) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key: str, region) -> torch.Tensor:
        return self.tensors[key][tuple(slice(a, b) for a, b in region)]


def load_hf_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named tensors (any dtype; cast to the parameters') into model, stacking experts.

    Raises ValueError naming the tensor on a missing key, a shape that disagrees with the config,
    or tensors the model has no place for (MTP layers past num_layers and rotary caches are skipped)."""
    cfg = model.config
    leaves = Leaves(_InMemory(tensors))
    with torch.no_grad():
        for name, target in model.state_dict().items():
            target.copy_(hf_source(name, tuple(target.shape), cfg.family, leaves).full())
    check_all_used(tensors, leaves.used, cfg)


def _ignorable(key: str, cfg) -> bool:
    if any(p.match(key) for p in _IGNORED):
        return True
    if key == "lm_head.weight" and cfg.tie_word_embeddings:
        return True  # some tied checkpoints still carry the head; the embedding is authoritative
    m = _LAYER.match(key)
    return m is not None and int(m[1]) >= cfg.num_layers  # DeepSeek MTP modules live past the last layer
