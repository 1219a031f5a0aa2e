"""The decoder: CausalLM(model=DecoderModel(embed_tokens, layers, norm), lm_head), HF's module tree.

Layers are independent (no cross-layer state): the rotary tables are computed once per forward
and passed to every layer, and each layer returns its MoE aux loss, so FSDP2 can shard per layer
and a pipeline splitter can cut `model.model.layers`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends import kernels
from backends.common.parallel.parts import ModelParts

from .config import ModelConfig
from .layers import MLP, Attention, FusedMLP, RMSNorm
from .mla import MLAttention
from .moe import MoE

def mlp_attr(cfg: ModelConfig) -> str:
    """Where the MLP / MoE block lives in a layer (Mixtral's checkpoints say block_sparse_moe)."""
    return "block_sparse_moe" if cfg.family == "mixtral" else "mlp"


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            block = MoE(cfg)
        elif cfg.family in ("glm", "glm4"):
            block = FusedMLP(cfg.hidden_size, cfg.ffn_hidden_size)
        else:
            block = MLP(cfg.hidden_size, cfg.ffn_hidden_size)
        self.mlp_name = mlp_attr(cfg)
        setattr(self, self.mlp_name, block)
        self.sandwich = cfg.family == "glm4"  # GLM-4 also norms each sub-block's output
        if self.sandwich:
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, cos, sin, cu_seqlens=None, aux_mask=None):
        """-> (hidden, aux loss or None). `aux_mask` (bool [T], False on context-parallel padding) keeps padding out
        of the MoE aux loss; an argument, so a recomputed forward sees its own micro-batch's mask."""
        if self.is_moe:
            getattr(self, self.mlp_name).aux_token_mask = aux_mask
        h = self.self_attn(self.input_layernorm(hidden), cos, sin, cu_seqlens)
        if self.sandwich:
            h = self.post_self_attn_layernorm(h)
        hidden = hidden + h
        h = getattr(self, self.mlp_name)(self.post_attention_layernorm(hidden))
        aux = None
        if self.is_moe:
            h, aux = h
        if self.sandwich:
            h = self.post_mlp_layernorm(h)
        return hidden + h, aux


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[1,T] positions restarting at 0 at every document start."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return (torch.arange(total, device=cu.device) - starts).unsqueeze(0)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype):
        c = self.cfg
        cos, sin = kernels.rotary_cos_sin(position_ids, c.rotary_dim, theta=c.rope_theta, scaling=c.rope_scaling)
        return cos.to(dtype), sin.to(dtype)  # HF casts the tables to the activations' dtype

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, aux_mask=None):
        """-> (final-norm hidden [B,S,H], summed aux loss or None)."""
        b, s = input_ids.shape
        if cu_seqlens is not None:
            if b != 1:
                raise ValueError(f"packed input (cu_seqlens) must be [1,T], got input_ids {tuple(input_ids.shape)}")
            cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
            if position_ids is None:
                position_ids = positions_from_cu_seqlens(cu_seqlens, s)
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids.to(input_ids.device), hidden.dtype)
        total_aux = None
        for layer in self.layers:
            hidden, aux = layer(hidden, cos, sin, cu_seqlens, aux_mask)
            if aux is not None:
                total_aux = aux if total_aux is None else total_aux + aux
        return self.norm(hidden), total_aux


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.aux_loss: torch.Tensor | None = None

    def output_weight(self) -> torch.Tensor:
        """The output projection [V,H]: lm_head, or the embedding when tied."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, return_hidden=False, aux_mask=None):
        """Logits [B,S,V] in the parameters' dtype, or with return_hidden the final-norm hidden
        states [B,S,H] (for kernels.linear_cross_entropy). Sets self.aux_loss (None for dense models)."""
        hidden, self.aux_loss = self.model(input_ids, position_ids, cu_seqlens, aux_mask)
        if return_hidden:
            return hidden
        if self.config.tie_word_embeddings:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def parts(self) -> ModelParts:
        """Where the parallel code finds the blocks, attention, MLP, embedding and head."""
        c = self.config
        norms = ("input_layernorm", "post_attention_layernorm")
        if c.family == "glm4":
            norms += ("post_self_attn_layernorm", "post_mlp_layernorm")
        return ModelParts(self, blocks="model.layers", embedding="model.embed_tokens", norm="model.norm",
                          head=None if c.tie_word_embeddings else "lm_head", attention="self_attn",
                          mlp=mlp_attr(c), block_norms=norms, block_inputs=self.model.rotary,
                          selective=("core_attention", "act"), hidden_size=c.hidden_size)
