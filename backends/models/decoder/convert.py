"""Hugging Face on-disk tensor names <-> our parameters.

Our names are HF's everywhere except the stacked routed experts: `<p>.experts.gate_up_proj`
[E,H,2I] / `<p>.experts.down_proj` [E,I,H] stand for HF's per-expert `<p>.experts.{e}.gate_proj /
up_proj / down_proj.weight` (Mixtral: w1 / w3 / w2). A tied model has no lm_head (HF writes none).

A glm checkpoint may also be in the original ChatGLM layout (THUDM/glm-4-9b-chat: `transformer.encoder.
layers.N.self_attention.query_key_value` fused [q; k; v] rows, `mlp.dense_h_to_4h` = [gate; up]); the
checkpoint is then read through ChatGLMCheckpoint, which shows those tensors under our names. Exports
always write transformers' native form.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<which>gate_up_proj|down_proj)$")
# tensors a checkpoint may carry that the model does not use
_IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq$"), re.compile(r"^transformer\.rotary_pos_emb\.inv_freq$"))
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


CHATGLM_EMBED = "transformer.embedding.word_embeddings.weight"


class ChatGLMCheckpoint:
    """A checkpoint in the original ChatGLM layout seen under the glm model's names (same
    `names()` / `in` / `shape` / `read(name, region)` as the checkpoint): q/k/v are row ranges of
    the fused query_key_value, read region by region, so a tensor-parallel rank reads its rows only.
    Tensors with no place in the model keep their own names (check_all_used names them)."""

    def __init__(self, checkpoint, cfg):
        self.checkpoint = checkpoint
        self._map: dict[str, tuple[str, int, int]] = {}  # ours -> (theirs, first row, row count or -1: all)
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self._fused_rows = q + 2 * kv
        self._add("model.embed_tokens.weight", CHATGLM_EMBED)
        self._add("model.norm.weight", "transformer.encoder.final_layernorm.weight")
        self._add("lm_head.weight", "transformer.output_layer.weight")
        for i in range(cfg.num_layers):
            ours, theirs = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                self._add(f"{ours}{norm}.weight", f"{theirs}{norm}.weight")
            for kind in ("weight", "bias"):
                fused = f"{theirs}self_attention.query_key_value.{kind}"
                for proj, start, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                    self._add(f"{ours}self_attn.{proj}.{kind}", fused, start, rows)
            self._add(f"{ours}self_attn.o_proj.weight", f"{theirs}self_attention.dense.weight")
            self._add(f"{ours}mlp.gate_up_proj.weight", f"{theirs}mlp.dense_h_to_4h.weight")  # [gate; up] as ours
            self._add(f"{ours}mlp.down_proj.weight", f"{theirs}mlp.dense_4h_to_h.weight")
        self._claimed = {theirs for theirs, _, _ in self._map.values()}

    def _add(self, ours: str, theirs: str, start: int = 0, rows: int = -1) -> None:
        self._map[ours] = (theirs, start, rows)

    def stored_name(self, name: str) -> str:
        theirs, start, rows = self._map.get(name, (name, 0, -1))
        return theirs if rows < 0 else f"{theirs}[{start}:{start + rows}]"

    def names(self) -> list[str]:
        present = [ours for ours, (theirs, _, _) in self._map.items() if theirs in self.checkpoint]
        return present + [n for n in self.checkpoint.names() if n not in self._claimed]

    def __contains__(self, name) -> bool:
        if name in self._map:
            return self._map[name][0] in self.checkpoint
        return name not in self._claimed and name in self.checkpoint

    def shape(self, name: str) -> tuple[int, ...]:
        theirs, start, rows = self._map.get(name, (name, 0, -1))
        have = tuple(self.checkpoint.shape(theirs))
        if rows < 0:
            return have
        if have[0] != self._fused_rows:
            raise ValueError(f"tensor {theirs!r} has {have[0]} rows but the config expects {self._fused_rows} "
                             "(num_attention_heads + 2 * multi_query_group_num) * kv_channels; check that "
                             "config.json belongs to these weights")
        return (rows, *have[1:])

    def read(self, name: str, region):
        theirs, start, rows = self._map.get(name, (name, 0, -1))
        if rows >= 0:
            (a, b), rest = region[0], tuple(region[1:])
            region = ((a + start, b + start), *rest)
        return self.checkpoint.read(theirs, region)


def checkpoint_view(checkpoint, cfg):
    """The checkpoint as our names see it: a glm model's ChatGLM-layout checkpoint through
    ChatGLMCheckpoint, any other as it is."""
    if cfg.family == "glm" and CHATGLM_EMBED in checkpoint:
        return ChatGLMCheckpoint(checkpoint, cfg)
    return checkpoint


class Leaves:
    """The leaf factory hf_source takes over a checkpoint (`names`, `shape(name)`, `read(name, region)`),
    seen through checkpoint_view(checkpoint, cfg): a clear error on a missing tensor or one whose
    shape disagrees with the config; `used` collects every tensor asked for, `names()` lists the
    checkpoint's tensors as check_all_used compares them."""

    def __init__(self, checkpoint, cfg=None):
        self.checkpoint = checkpoint if cfg is None else checkpoint_view(checkpoint, cfg)
        self.used: set[str] = set()

    def names(self) -> list[str]:
        return list(self.checkpoint.names())

    def __call__(self, key: str, want: tuple[int, ...], needed_for: str):
        from backends.common.checkpoint.slices import Tensor

        stored = getattr(self.checkpoint, "stored_name", str)(key)  # its name on disk
        if key not in self.checkpoint:
            raise ValueError(f"checkpoint has no tensor {stored!r} (needed for {needed_for}); the weights do not "
                             "match this config.json / family")
        have = tuple(self.checkpoint.shape(key))
        if have != tuple(want):
            raise ValueError(f"tensor {stored!r} has shape {have} but the config expects {tuple(want)} "
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

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key: str, region) -> torch.Tensor:
        return self.tensors[key][tuple(slice(a, b) for a, b in region)]


def load_hf_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named tensors (any dtype; cast to the parameters') into model, stacking experts
    (a glm model also takes the ChatGLM layout).

    Raises ValueError naming the tensor on a missing key, a shape that disagrees with the config,
    or tensors the model has no place for (MTP layers past num_layers and rotary caches are skipped)."""
    cfg = model.config
    leaves = Leaves(_InMemory(tensors), cfg)
    with torch.no_grad():
        for name, target in model.state_dict().items():
            target.copy_(hf_source(name, tuple(target.shape), cfg.family, leaves).full())
    check_all_used(leaves.names(), leaves.used, cfg)


def _ignorable(key: str, cfg) -> bool:
    if any(p.match(key) for p in _IGNORED):
        return True
    if key == "lm_head.weight" and cfg.tie_word_embeddings:
        return True  # some tied checkpoints still carry the head; the embedding is authoritative
    m = _LAYER.match(key)
    return m is not None and int(m[1]) >= cfg.num_layers  # DeepSeek MTP modules live past the last layer
