"""Native Qwen2.5-VL with the Hugging Face checkpoint's module tree:

    Qwen2_5_VL
      visual            VisionTower: patch_embed (Conv3d over temporal × spatial patches, computed as one
                        matmul), blocks (RMSNorm, 2-D rotary window / full attention, gated MLP), merger
                        (RMSNorm, spatial_merge_size² patches -> one token through a GELU MLP)
      model             TextDecoder: embed_tokens, layers (Qwen2 decoder layers with M-RoPE), norm
      lm_head

so `state_dict()` names are the on-disk names of a transformers checkpoint. Attention, norms, rotary and
SwiGLU go through backends.kernels; the vision tower's window attention is packed varlen attention whose
documents are the windows (cu_seqlens), its full-attention blocks take one document per image frame.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends import kernels
from backends.common.layers import MLP, Attention, RMSNorm
from backends.common.parallel.parts import ModelParts

from . import positions as P
from .config import TextConfig, VisionConfig, VLConfig


# ---------------------------------------------------------------------------------- vision tower


class PatchConv(nn.Conv3d):
    """A stride = kernel Conv3d over one patch is a dot product with the flattened (C, t, p, p) kernel: computed
    as one matmul on the processor's flattened patches [N, C·t·p·p] (in its own forward, so hooks that hand
    a module its parameters, like tensor parallel's, see the call)."""

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return F.linear(pixels.reshape(-1, w[0].numel()).to(w.dtype), w.reshape(w.shape[0], -1))


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        k = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = PatchConv(v.in_channels, v.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels)


def vision_attend(q, k, v, cu_seqlens, scale):
    """Bidirectional packed attention on [T,heads,D]; each window / image frame is one document."""
    return kernels.attention(q, k, v, causal=False, cu_seqlens=cu_seqlens, scale=scale)


class VisionAttention(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = v.num_heads, v.head_dim
        # rows per head [H, 3, D] (Megatron's linear_qkv), not HF's [3, H, D]: a contiguous row shard is whole
        # heads, so tensor parallel shards it column-wise; checkpoint I/O permutes (qkv_from_hf / qkv_to_hf)
        self.qkv = nn.Linear(v.hidden_size, 3 * v.hidden_size, bias=True)
        self.proj = nn.Linear(v.hidden_size, v.hidden_size, bias=True)
        self.scale = self.head_dim ** -0.5
        self.core_attention = vision_attend  # selective recompute wraps it from outside

    def forward(self, x, cos, sin, cu_seqlens):
        """x [T, hidden] (or [1, T, hidden], as tensor parallel's sequence-parallel regions hand it)."""
        lead = x.shape[:-1]
        q, k, v = self.qkv(x).view(lead.numel(), -1, 3, self.head_dim).unbind(2)
        q = kernels.apply_rotary(q, cos, sin)
        k = kernels.apply_rotary(k, cos, sin)
        out = self.core_attention(q, k, v, cu_seqlens, self.scale)
        return self.proj(out.reshape(*lead, -1))


def qkv_from_hf(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A fused qkv weight / bias in HF's row order [3, H, D] -> the model's per-head [H, 3, D]."""
    return t.reshape(3, num_heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def qkv_to_hf(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    return t.reshape(num_heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


class VisionBlock(nn.Module):
    def __init__(self, v: VisionConfig, index: int):
        super().__init__()
        self.index = index
        self.full_attention = index in v.fullatt_block_indexes
        self.norm1 = RMSNorm(v.hidden_size, v.rms_norm_eps)
        self.norm2 = RMSNorm(v.hidden_size, v.rms_norm_eps)
        self.attn = VisionAttention(v)
        self.mlp = MLP(v.hidden_size, v.intermediate_size, bias=True)

    def forward(self, x, cos, sin, cu_full, cu_window):
        """-> (x, None): the block convention of backends.common.parallel (recompute groups blocks by it)."""
        cu = cu_full if self.full_attention else cu_window
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp(self.norm2(x)), None


class PatchMerger(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.hidden = v.hidden_size * v.merge_unit
        self.ln_q = RMSNorm(v.hidden_size, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, v.out_hidden_size))

    def forward(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden))


class VisionInputs:
    """What every vision block needs, computed once per forward from image_grid_thw. multiple: the patch
    sequence is padded to a multiple of it (sequence parallel splits it evenly over the tp ranks); the padding
    is one more document of zero rows, so the real patches' attention does not change."""

    def __init__(self, v: VisionConfig, grid_thw: torch.Tensor, dtype: torch.dtype, device, multiple: int = 1):
        grid_thw = grid_thw.to("cpu")
        order, cu_window = P.window_index(grid_thw, v.spatial_merge_size, v.window_size, v.patch_size)
        self.order = order.to(device)
        self.reverse = torch.argsort(order).to(device)
        unit = v.merge_unit
        pos = P.vision_positions(grid_thw, v.spatial_merge_size)
        pos = pos.view(-1, unit, 2)[order].reshape(-1, 2).to(device)
        inv = kernels.rotary_inv_freq(v.head_dim // 2, v.rope_theta).to(device)
        freqs = (pos[..., None].float() * inv).flatten(1)  # [N, head_dim/2]: h angles then w angles
        emb = torch.cat((freqs, freqs), dim=-1)
        cu_full = P.vision_cu_seqlens(grid_thw)
        self.patches = int(cu_full[-1])
        self.pad = -self.patches % multiple
        self.rows = self.patches + self.pad
        if self.pad:
            emb = F.pad(emb, (0, 0, 0, self.pad))
            cu_full, cu_window = (torch.cat([cu, cu.new_tensor([self.rows])]) for cu in (cu_full, cu_window))
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.cu_full = cu_full.to(device)
        self.cu_window = cu_window.to(device)
        self.unit = unit

    def to_window_order(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.unit, x.shape[-1])[self.order].reshape(-1, x.shape[-1])
        return F.pad(x, (0, 0, 0, self.pad)) if self.pad else x


class VisionTower(nn.Module):
    """forward = end(run(*begin(...))): a pipeline stage holding only some of the blocks runs the pieces.
    `sequence` (set by tensor parallel with SP): .size, .shard(x) to this rank's rows of the window-ordered
    patches, .gather(x) back to all of them before the merger."""

    sequence = None

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.cfg = v
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList(VisionBlock(v, i) for i in range(v.depth))
        self.merger = PatchMerger(v)

    def inputs(self, grid_thw: torch.Tensor, dtype: torch.dtype, device) -> VisionInputs:
        return VisionInputs(self.cfg, grid_thw, dtype, device, self.sequence.size if self.sequence else 1)

    def begin(self, pixel_values: torch.Tensor, vi: VisionInputs) -> torch.Tensor:
        """pixel_values [N, C·t·p·p] as the Qwen2-VL image processor lays them out -> patches in window order
        (this rank's rows of them under SP)."""
        if pixel_values.shape[0] != vi.patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but image_grid_thw says {vi.patches}")
        x = vi.to_window_order(self.patch_embed(pixel_values))
        return self.sequence.shard(x) if self.sequence else x

    def run(self, x: torch.Tensor, vi: VisionInputs) -> torch.Tensor:
        blocks = self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks
        for block in blocks:
            x, _ = block(x, vi.cos, vi.sin, vi.cu_full, vi.cu_window)
        return x

    def end(self, x: torch.Tensor, vi: VisionInputs) -> torch.Tensor:
        """-> image features [N/merge², out_hidden] in the images' order."""
        if self.sequence:
            x = self.sequence.gather(x)
        return self.merger(x[:vi.patches])[vi.reverse]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        vi = self.inputs(grid_thw, self.patch_embed.proj.weight.dtype, pixel_values.device)
        return self.end(self.run(self.begin(pixel_values, vi), vi), vi)


# ---------------------------------------------------------------------------------- text decoder


class TextLayer(nn.Module):
    def __init__(self, t: TextConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.self_attn = Attention(t)
        self.post_attention_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.mlp = MLP(t.hidden_size, t.ffn_hidden_size)

    def forward(self, hidden, cos, sin, cu_seqlens=None):
        """-> (hidden, None): the block convention of backends.common.parallel (no aux loss)."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, cu_seqlens)
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


class TextDecoder(nn.Module):
    def __init__(self, t: TextConfig):
        super().__init__()
        self.cfg = t
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        self.layers = nn.ModuleList(TextLayer(t, i) for i in range(t.num_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """M-RoPE tables [B,S,head_dim] from positions [3,B,S]."""
        t = self.cfg
        cos, sin = kernels.mrope_cos_sin(position_ids, t.head_dim, theta=t.rope_theta, mrope_section=t.mrope_section)
        return cos.to(dtype), sin.to(dtype)

    def forward(self, embeds, position_ids, cu_seqlens=None):
        cos, sin = self.rotary(position_ids, embeds.dtype)
        hidden = embeds
        for layer in self.layers:
            hidden, _ = layer(hidden, cos, sin, cu_seqlens)
        return self.norm(hidden)


# ---------------------------------------------------------------------------------- the whole model


class Qwen2_5_VL(nn.Module):
    def __init__(self, cfg: VLConfig):
        super().__init__()
        self.config = cfg
        self.visual = VisionTower(cfg.vision)
        self.model = TextDecoder(cfg.text)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None) -> torch.Tensor:
        """Token embeddings with the vision tower's outputs in the image placeholder tokens."""
        return self.embed_with(input_ids, None if pixel_values is None else self.visual(pixel_values, image_grid_thw))

    def embed_with(self, input_ids, image: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings with the image features `image` (the vision tower's output) in the placeholders."""
        embeds = self.model.embed_tokens(input_ids)
        is_image = input_ids == self.config.image_token_id
        n_tokens = int(is_image.sum())
        if image is None:
            if n_tokens:
                raise ValueError(f"{n_tokens} image tokens but no pixel_values")
            return embeds
        if image.shape[0] != n_tokens:
            raise ValueError(f"image features and image tokens do not match: {image.shape[0]} features, "
                             f"{n_tokens} tokens")
        return embeds.masked_scatter(is_image.unsqueeze(-1), image.to(embeds.dtype))

    def positions(self, input_ids, image_grid_thw=None, attention_mask=None, cu_seqlens=None) -> torch.Tensor:
        c = self.config
        merge = c.vision.spatial_merge_size
        if cu_seqlens is None:
            return P.rope_index(input_ids, image_grid_thw, c.image_token_id, merge, attention_mask)
        return P.rope_index_packed(input_ids[0], cu_seqlens, image_grid_thw, c.image_token_id, merge)

    def forward(self, input_ids, pixel_values=None, image_grid_thw=None, attention_mask=None, position_ids=None,
                cu_seqlens=None, return_hidden=False):
        """Logits [B,S,V] (or with return_hidden the final-norm hidden states). Batched input may carry an
        attention_mask (padding anywhere: the real tokens run packed, padded positions give zeros);
        packed input is [1,T] with cu_seqlens. position_ids [3,B,S] default to transformers' get_rope_index."""
        embeds = self.embed(input_ids, pixel_values, image_grid_thw)
        if position_ids is None:
            position_ids = self.positions(input_ids, image_grid_thw, attention_mask, cu_seqlens)
        position_ids = position_ids.to(embeds.device)
        if cu_seqlens is None and attention_mask is not None and not bool(attention_mask.all()):
            keep = attention_mask.bool()
            lengths = keep.sum(1)
            cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            packed = self.model(embeds[keep].unsqueeze(0), position_ids[:, keep].unsqueeze(1), cu)[0]
            hidden = embeds.new_zeros(embeds.shape).masked_scatter(keep.unsqueeze(-1), packed)
        else:
            if cu_seqlens is not None:
                cu_seqlens = cu_seqlens.to(device=embeds.device, dtype=torch.int32)
            hidden = self.model(embeds, position_ids, cu_seqlens)
        if return_hidden:
            return hidden
        return F.linear(hidden, self.output_weight())

    def vision_parts(self) -> ModelParts:
        """The vision encoder's blocks for backends.common.parallel (recompute); its patch embedding stands in
        the embedding's place and the merger in the head's."""
        return ModelParts(self, blocks="visual.blocks", embedding="visual.patch_embed", norm="visual.merger.ln_q",
                          head="visual.merger", attention="attn", mlp="mlp", block_norms=("norm1", "norm2"),
                          selective=("core_attention", "act"), hidden_size=self.config.vision.hidden_size)

    def parts(self) -> ModelParts:
        """The text decoder's blocks, attention, MLP, embedding and head for backends.common.parallel."""
        return ModelParts(self, blocks="model.layers", embedding="model.embed_tokens", norm="model.norm",
                          head=None if self.config.tie_word_embeddings else "lm_head", attention="self_attn",
                          mlp="mlp", block_norms=("input_layernorm", "post_attention_layernorm"),
                          block_inputs=self.model.rotary, selective=("core_attention", "act"),
                          hidden_size=self.config.text.hidden_size)
