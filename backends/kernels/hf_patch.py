"""Route transformers models through backends.kernels.

Per-instance patches (never global monkey-patching, so unpatched models are untouched):
  * RMSNorm.forward            -> rms_norm
  * decoder attention.forward  -> same projections / q,k norms / cache, apply_rotary from here,
                                  then the attention function that config._attn_implementation
                                  selects; we register "af_kernels" and select it
  * rotary embedding.forward   -> rotary_cos_sin / M-RoPE tables (default/linear/llama3 only)
  * SwiGLU MLP.forward         -> swiglu
  * MoE router / experts       -> moe_route, moe_permute -> grouped_mm -> swiglu -> grouped_mm -> moe_unpermute
Written against transformers 5.x module names (checked on 5.24).
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from . import apply_rotary, attention, grouped_mm, moe_permute, moe_route, moe_unpermute, rms_norm, swiglu
from .registry import log_once
from .rotary import cos_sin_from_inv_freq

ATTN_IMPLEMENTATION = "af_kernels"

RMSNORM_CLASSES = {
    "LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "MixtralRMSNorm",
    "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm",
}
# Gemma's RMSNorm keeps w and scales by (1 + w), in fp32 before casting back (Llama casts first)
OFFSET_RMSNORM_CLASSES = {"Gemma3RMSNorm"}
ATTENTION_CLASSES = {
    "LlamaAttention", "Qwen2Attention", "Qwen3Attention", "Qwen3MoeAttention", "MixtralAttention",
    "Qwen2VLAttention", "Qwen2_5_VLAttention",
}
MLP_CLASSES = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "MixtralMLP", "Qwen2_5_VLMLP"}
ROTARY_CLASSES = {
    "LlamaRotaryEmbedding", "Qwen2RotaryEmbedding", "Qwen3RotaryEmbedding", "Qwen3MoeRotaryEmbedding",
    "MixtralRotaryEmbedding",
}
MROPE_CLASSES = {"Qwen2VLRotaryEmbedding", "Qwen2_5_VLRotaryEmbedding"}
# router class -> whether HF casts the routing weights back to the logits dtype
_KERNEL_SUFFIXES = ("RMSNorm", "Attention", "MLP", "Mlp", "RotaryEmbedding")
ROUTER_CLASSES = {"MixtralTopKRouter": False, "Qwen3MoeTopKRouter": True}
EXPERTS_CLASSES = {"MixtralExperts", "Qwen3MoeExperts"}


# ---------------------------------------------------------------- attention function


def _doc_starts_from_positions(position_ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor | None:
    """cu_seqlens over the flattened [B*S] tokens when position ids restart inside a row, else None."""
    pos = position_ids.expand(batch, -1).reshape(-1)
    start = torch.ones_like(pos, dtype=torch.bool)
    start[1:] = pos[1:] != pos[:-1] + 1
    start[::seq] = True  # every row starts a document
    if int(start.sum()) == batch:
        return None
    idx = start.nonzero().flatten().to(torch.int32)
    return torch.cat([idx, idx.new_tensor([batch * seq])])


def _sdpa_with_mask(query, key, value, mask, dropout, scaling):
    # Decoding over a padded cache or a custom 4-D mask: correct, unfused.
    log_once("hf-masked-sdpa", "af_kernels attention: explicit-mask case -> torch SDPA with the mask")
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=groups > 1
    )
    return out.transpose(1, 2)


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers AttentionInterface function: query/key/value [B,H,S,D] -> ([B,S,H,D], None)."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("af_kernels attention supports neither softcap nor attention sinks")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, _, sq, _ = query.shape
    skv = key.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    common = dict(causal=causal, window=sliding_window, scale=scaling, dropout=dropout)

    if attention_mask is not None and attention_mask.dim() == 4:
        return _sdpa_with_mask(query, key, value, attention_mask, dropout, scaling), None
    if attention_mask is not None and not bool(attention_mask.all()):
        pad = attention_mask.bool()
        if sq != skv:
            allowed = pad[:, None, None, :].clone()
            from .masks import allowed as visible

            band = visible(sq, skv, causal=causal, window=sliding_window, device=query.device)
            if band is not None:
                allowed = allowed & band
            return _sdpa_with_mask(query, key, value, allowed, dropout, scaling), None
        # Padding: unpad to packed documents (one per row), run varlen attention, scatter back.
        keep = pad.reshape(-1).nonzero().flatten()
        lengths = pad.sum(dim=1, dtype=torch.int32)
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
        flat = lambda t: t.reshape(batch * t.shape[1], t.shape[2], t.shape[3]).index_select(0, keep)  # noqa: E731
        out_p = attention(flat(q), flat(k), flat(v), cu_seqlens=cu, **common)
        out = out_p.new_zeros(batch * sq, out_p.shape[1], out_p.shape[2]).index_copy(0, keep, out_p)
        return out.view(batch, sq, out_p.shape[1], out_p.shape[2]), None

    given_cu = kwargs.get("cu_seq_lens_q")
    if given_cu is not None and batch == 1 and sq == skv:  # DataCollatorWithFlattening-style inputs
        out = attention(q[0], k[0], v[0], cu_seqlens=given_cu.to(torch.int32), **common)
        return out.unsqueeze(0), None
    position_ids = kwargs.get("position_ids")
    # af_whole_rows: the caller's rows are attended whole though their position ids restart (LLaMA-Factory's
    # packing without neat_packing)
    if position_ids is not None and sq == skv and sq > 1 and position_ids.dim() == 2 and \
            not kwargs.get("af_whole_rows"):
        cu = _doc_starts_from_positions(position_ids, batch, sq)
        if cu is not None:  # packed documents with reset position ids
            flat = lambda t: t.reshape(batch * sq, t.shape[2], t.shape[3])  # noqa: E731
            out = attention(flat(q), flat(k), flat(v), cu_seqlens=cu, **common)
            return out.view(batch, sq, out.shape[1], out.shape[2]), None
    return attention(q, k, v, **common), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_attention_forward)
    # Like flash attention we want the 2-D padding mask (or None), never a dense 4-D one.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attention_mask)


# ---------------------------------------------------------------- module forwards


def _rmsnorm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _offset_rmsnorm_forward(self, hidden_states):
    return rms_norm(hidden_states.float(), 1.0 + self.weight.float(), self.eps).type_as(hidden_states)


def _mlp_forward(self, x):
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _attention_module_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                              **kwargs):
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape)
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape)
    if getattr(self, "q_norm", None) is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q = apply_rotary(q, cos, sin).transpose(1, 2)  # rotary on [B,S,H,D]: cos [B,S,D] broadcasts over heads
    k = apply_rotary(k, cos, sin).transpose(1, 2)
    v = v.transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(self).__module__], "eager_attention_forward", None)
    attention_fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    out, weights = attention_fn(
        self, q, k, v, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=_module_window(self),
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _module_window(module) -> int | None:
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    if type(module).__name__ == "MixtralAttention":  # Mixtral reads it from the config
        return getattr(module.config, "sliding_window", None)
    return None


def _rotary_forward(self, x, position_ids):
    return cos_sin_from_inv_freq(position_ids, self.inv_freq, x.dtype)


def _mrope_forward(self, x, position_ids):
    position_ids = position_ids.expand(3, -1, -1)
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    chunks = freqs.split(list(self.mrope_section), dim=-1)
    merged = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
    emb = torch.cat((merged, merged), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _router_forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    weights, ids = moe_route(logits, self.top_k, score="softmax", normalize=getattr(self, "norm_topk_prob", True))
    if self._af_cast_weights:
        weights = weights.to(logits.dtype)
    return logits, weights, ids


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    permuted, row_map, counts = moe_permute(hidden_states, top_k_index, num_experts=self.num_experts)
    gate_up = grouped_mm(permuted, self.gate_up_proj.transpose(1, 2), counts)  # [N, 2I]: gate | up
    out = grouped_mm(swiglu(gate_up), self.down_proj.transpose(1, 2), counts)
    return moe_unpermute(out, row_map, top_k_weights).to(hidden_states.dtype)


def _is_silu(module) -> bool:
    act = getattr(module, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def _rope_patchable(module) -> bool:
    rope_type = getattr(module, "rope_type", "default")
    return rope_type in ("default", "linear", "llama3") and float(getattr(module, "attention_scaling", 1.0)) == 1.0


def patch_hf_model(model: torch.nn.Module) -> dict[str, Any]:
    """Patch `model` in place; returns {"patched": {kind: count}, "classes": {...}, "skipped": [...],
    "attn_implementation": name}."""
    _register_attention()
    if getattr(model, "use_kernels", False) and hasattr(model, "set_use_kernels"):
        # With the `kernels` package installed transformers turns use_kernels on and re-kernelizes on every
        # train() / eval(), putting its own forwards back over these patches: switch that off first.
        model.set_use_kernels(False)
    patched: Counter[str] = Counter()
    classes: dict[str, set[str]] = {}
    skipped: list[str] = []
    unknown: Counter[str] = Counter()

    def mark(kind: str, module: torch.nn.Module, fn) -> None:
        module.forward = types.MethodType(fn, module)
        patched[kind] += 1
        classes.setdefault(kind, set()).add(type(module).__name__)

    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in RMSNORM_CLASSES:
            mark("rms_norm", module, _rmsnorm_forward)
        elif cls in OFFSET_RMSNORM_CLASSES:
            mark("rms_norm", module, _offset_rmsnorm_forward)
        elif cls in ATTENTION_CLASSES:
            mark("attention", module, _attention_module_forward)
        elif cls in MLP_CLASSES:
            if _is_silu(module):
                mark("swiglu_mlp", module, _mlp_forward)
            else:
                skipped.append(f"{name} ({cls}: activation is not SiLU)")
        elif cls in ROTARY_CLASSES or cls in MROPE_CLASSES:
            if _rope_patchable(module):
                mark("rotary_table", module, _mrope_forward if cls in MROPE_CLASSES else _rotary_forward)
            else:
                skipped.append(f"{name} ({cls}: rope_type {getattr(module, 'rope_type', '?')} kept as HF computes it)")
        elif cls in ROUTER_CLASSES:
            module._af_cast_weights = ROUTER_CLASSES[cls]
            mark("moe_router", module, _router_forward)
        elif cls in EXPERTS_CLASSES:
            if _is_silu(module):
                mark("moe_experts", module, _experts_forward)
            else:
                skipped.append(f"{name} ({cls}: activation is not SiLU)")
        elif cls.endswith(_KERNEL_SUFFIXES):
            unknown[cls] += 1
    # Classes that look like a kernel's but are not listed run as transformers computes them (Gemma3's
    # attention masks image tokens bidirectionally and its MLP is GeGLU; vision towers differ).
    skipped += [f"{cls} x{n} (not a class this patch knows: kept as transformers computes it)"
                for cls, n in sorted(unknown.items())]

    if patched["attention"]:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:
            model.config._attn_implementation = ATTN_IMPLEMENTATION
    return {
        "patched": dict(patched),
        "classes": {kind: sorted(names) for kind, names in classes.items()},
        "skipped": skipped,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
