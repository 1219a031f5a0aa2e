"""Rotary position embedding tables (RoPE, linear / llama3 / yarn scaling, Qwen2-VL M-RoPE) and the reference rotation.

Table convention (the Hugging Face one): cos/sin have last dim = rotary_dim laid out as
cat(freqs, freqs). The interleaved (GPT-J / GLM) rotation reads the first half and repeats each
frequency twice, exactly as transformers' GLM does, so one table serves both layouts.
Tables are per position, so packed sequences whose position ids restart per document just work.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch


def rotary_inv_freq(dim: int, theta: float = 10000.0, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [dim/2] in fp32; `scaling` follows HF rope_parameters (default, linear, llama3, yarn)."""
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3, yarn)")


def rotary_attention_factor(scaling: dict[str, Any] | None = None) -> float:
    """Factor HF multiplies cos/sin by (yarn's attention_factor; 1.0 for the other types)."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (DeepSeek also scales softmax by its square)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    # transformers' _compute_yarn_parameters: blend interpolated (1/factor) and original frequencies
    # over a linear ramp between the dims that rotate beta_fast and beta_slow times in the original context.
    if scaling.get("factor") is None or scaling.get("original_max_position_embeddings") is None:
        # HF derives the missing value from max_position_embeddings, which this table does not know.
        raise ValueError("yarn scaling needs both 'factor' and 'original_max_position_embeddings'")
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_from_inv_freq(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_cos_sin(
    position_ids: torch.Tensor,
    dim: int,
    theta: float = 10000.0,
    scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*position_ids.shape, dim] for rotary dim `dim` (yarn: times its attention factor)."""
    factor = rotary_attention_factor(scaling)
    if factor == 1.0:
        return cos_sin_from_inv_freq(position_ids, rotary_inv_freq(dim, theta, scaling), dtype)
    cos, sin = cos_sin_from_inv_freq(position_ids, rotary_inv_freq(dim, theta, scaling))
    return (cos * factor).to(dtype), (sin * factor).to(dtype)


def mrope_cos_sin(
    position_ids: torch.Tensor,
    dim: int,
    theta: float = 10000.0,
    mrope_section: Sequence[int] = (16, 24, 24),
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL / Qwen2.5-VL multimodal RoPE tables.

    position_ids: [3, ...] (temporal, height, width). The frequency axis (dim/2) is split into
    `mrope_section` chunks; chunk i takes its angles from position row i % 3. Returns cos, sin
    of shape [..., dim] (the same layout as `rotary_cos_sin`).
    """
    if position_ids.shape[0] != 3:
        raise ValueError(f"mrope position_ids must have a leading dim of 3, got {tuple(position_ids.shape)}")
    if sum(mrope_section) != dim // 2:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to dim/2 = {dim // 2}")
    inv_freq = rotary_inv_freq(dim, theta).to(position_ids.device)
    freqs = position_ids[..., None].float() * inv_freq  # [3, ..., dim/2]
    chunks = freqs.split(list(mrope_section), dim=-1)
    merged = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
    emb = torch.cat((merged, merged), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def interleave_table(t: torch.Tensor) -> torch.Tensor:
    """HF half-duplicated table -> per-pair table [f0, f0, f1, f1, ...]."""
    return t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Reference rotation of the full last dim of x (cos/sin already broadcastable)."""
    if interleaved:
        return x * interleave_table(cos) + rotate_pairs(x) * interleave_table(sin)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return x * cos + rotate_half(x) * sin  # gradients for the tables too: plain autograd
    return _RotateHalf.apply(x, cos, sin)


class _RotateHalf(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin, written per half: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2
    (4 half-width products/updates instead of 5 full-width ops, no negated copy and no cat), and its
    backward, the inverse rotation: dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1 (autograd's goes through
    the cat's and slices' backward: zero-filled buffers and copies)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return _rotate_halves(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        dx = _rotate_halves(grad, cos, sin, -1.0)
        if dx.shape != ctx.x_shape:
            dx = dx.sum_to_size(ctx.x_shape)
        return dx.to(ctx.x_dtype), None, None


def _rotate_halves(x, cos, sin, sign: float) -> torch.Tensor:
    """sign 1: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2 (forward);
    sign -1: out1 = x1 c1 + x2 s2, out2 = x2 c2 - x1 s1 (its transpose, for backward)."""
    half = x.shape[-1] // 2
    shape = torch.broadcast_shapes(x.shape, cos.shape, sin.shape)
    out = torch.empty(shape, dtype=torch.promote_types(torch.result_type(x, cos), sin.dtype), device=x.device)
    x1, x2, o1, o2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    c1, c2 = cos[..., :half], cos[..., half:]
    s1, s2 = (sin[..., :half], sin[..., half:]) if sign > 0 else (sin[..., half:], sin[..., :half])
    torch.mul(x1, c1, out=o1).addcmul_(x2, s1, value=-sign)
    torch.mul(x2, c2, out=o2).addcmul_(x1, s2, value=sign)
    return out
