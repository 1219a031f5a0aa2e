"""State-space pieces in plain PyTorch (reference): causal depthwise conv1d with state, Mamba2's chunked
SSD scan, gated RMSNorm. Packed documents (cu_seqlens) never see each other: each starts from its
own initial state (or zeros)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import varlen


# ---------------------------------------------------------------- causal conv1d


def causal_conv1d(x, weight, bias=None, *, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    """x [B,T,C], weight [C,K] -> (y [B,T,C], final state [N,C,K-1] or None).

    Every document (row, or cu_seqlens span) is laid out after its K-1 tokens of history (its initial
    state, else zeros), so one convolution without padding covers all of them; a document's final
    state is its last K-1 positions of that layout (history included when it is shorter than K-1)."""
    b, t, c = x.shape
    width = weight.shape[-1]
    hist = width - 1
    lens = torch.tensor(varlen.lengths_of(cu_seqlens) if cu_seqlens is not None else [t] * b, device=x.device)
    n = lens.numel()
    xf = x.reshape(b * t, c).to(weight.dtype)
    states = (xf.new_zeros(n * hist, c) if initial_state is None
              else initial_state.to(weight.dtype).transpose(1, 2).reshape(n * hist, c))
    source = torch.cat((xf, states))
    doc = torch.repeat_interleave(torch.arange(n, device=x.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    ext_start = starts + torch.arange(n, device=x.device) * hist  # where document n's history begins
    total = b * t + n * hist
    index = torch.empty(total, dtype=torch.long, device=x.device)
    token = torch.arange(b * t, device=x.device)
    index[token + (doc + 1) * hist] = token
    prefix = ext_start[:, None] + torch.arange(hist, device=x.device)[None, :]
    index[prefix.reshape(-1)] = b * t + torch.arange(n * hist, device=x.device)
    ext = source.index_select(0, index)  # [E, C]
    y = F.conv1d(ext.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=c)[0].t()  # [E - hist, C]
    y = y.index_select(0, token + doc * hist)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d activation must be None, 'silu' or 'swish', got {activation!r}")
    final = None
    if output_final_state:
        last = (ext_start + lens)[:, None] + torch.arange(hist, device=x.device)[None, :]
        final = ext.index_select(0, last.reshape(-1)).reshape(n, hist, c).transpose(1, 2).to(x.dtype)
    return y.reshape(b, t, c).to(x.dtype), final


# ---------------------------------------------------------------- Mamba2 SSD

SSD_BLOCK = 128


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[i, j] = sum(x[j+1 .. i]) for j <= i, -inf above the diagonal
    (cumulative sums of a masked copy, as transformers' / mamba_ssm's stable segsum)."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    x = x.masked_fill(~torch.ones(size, size, dtype=torch.bool, device=x.device).tril(-1), 0)
    out = x.cumsum(-2)
    return out.masked_fill(~torch.ones(size, size, dtype=torch.bool, device=x.device).tril(0), float("-inf"))


def ssd_chunk_scan(x, dt, A, B, C, *, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, float("inf")), initial_states=None, return_final_states=False, cu_seqlens=None):
    """mamba_ssm's mamba_chunk_scan_combined: x [B,T,H,P], dt [B,T,H], A [H], B/C [B,T,G,N],
    D [H] or [H,P], z [B,T,H,P] (out * silu(z)), initial_states [N_docs,H,P,N]."""
    b, t, h, p = x.shape
    groups, dstate = B.shape[-2:]
    in_dtype = x.dtype
    work = torch.promote_types(in_dtype, torch.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt.to(work), min=dt_limit[0], max=dt_limit[1])
    xw = x.to(work)
    # The chunking changes the order of the sums, not the result: blocks of at most SSD_BLOCK tokens
    # (Mamba2's default 256 spends ~1.7x the time on a CPU in the quadratic within-chunk part).
    chunk_size = min(chunk_size, SSD_BLOCK)
    lay = varlen.flat_layout(b, t, cu_seqlens, chunk_size, x.device)
    n, nc = lay.n, lay.padded_len // chunk_size

    def rows(v):  # [B,T,...] -> [N, nc, L, ...]; zero padding is an identity step (dt = 0)
        return varlen.to_rows(v.reshape(b * t, *v.shape[2:]), lay).reshape(n, nc, chunk_size, *v.shape[2:])

    # Head-major layout with heads split as (group, head in group): every product is a batched matmul,
    # and C·B^T is formed once per group rather than per head (B and C are never repeated to heads).
    rep = h // groups
    bm = rows(B.to(work)).permute(0, 3, 1, 2, 4)  # [N,G,c,l,n]
    cm = rows(C.to(work)).permute(0, 3, 1, 2, 4)
    xdt = rows(xw * dt[..., None]).reshape(n, nc, chunk_size, groups, rep, p).permute(0, 3, 4, 1, 2, 5)  # [N,G,R,c,l,P]
    a_cum = rows(A.to(work) * dt).reshape(n, nc, chunk_size, groups, rep).permute(0, 3, 4, 1, 2).cumsum(-1)
    within = (a_cum.unsqueeze(-1) - a_cum.unsqueeze(-2)).masked_fill(
        ~torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril(), float("-inf")).exp()
    y = ((cm @ bm.transpose(-1, -2)).unsqueeze(2) * within) @ xdt  # within chunks
    states = bm.transpose(-1, -2).unsqueeze(2) @ (xdt * (a_cum[..., -1:] - a_cum).exp().unsqueeze(-1))  # [..,c,n,P]
    start = (torch.zeros_like(states[:, :, :, :1]) if initial_states is None
             else initial_states.to(work).reshape(n, groups, rep, 1, p, dstate).transpose(-1, -2))
    states = torch.cat((start, states), dim=3)
    decay_chunk = segment_sum(F.pad(a_cum[..., -1], (1, 0))).exp()  # [N,G,R,c+1,c+1]
    states = (decay_chunk @ states.flatten(-2)).unflatten(-1, (dstate, p))
    states, final = states[:, :, :, :-1], states[:, :, :, -1].transpose(-1, -2).reshape(n, h, p, dstate)
    y = y + (cm.unsqueeze(2) @ states) * a_cum.exp().unsqueeze(-1)  # from the chunk's start state
    y = y.permute(0, 3, 4, 1, 2, 5)
    y = varlen.from_rows(y.reshape(n, lay.padded_len, h, p), lay).reshape(b, t, h, p)
    if D is not None:
        y = y + xw * (D.to(work)[:, None] if D.dim() == 1 else D.to(work))
    if z is not None:
        y = y * F.silu(z.to(work))
    y = y.to(in_dtype)
    return (y, final) if return_final_states else y


# ---------------------------------------------------------------- gated RMSNorm


def rms_norm_gated(x, z, weight, eps=1e-6, group_size=None, norm_before_gate=True):
    """norm_before_gate: weight * norm(x) * silu(z) (Qwen3-Next, FLA); else weight * norm(x * silu(z))
    (Mamba2). The norm runs over groups of group_size channels (None: the whole last dim), in fp32,
    cast back to x's dtype before the weight, as transformers' Qwen3NextRMSNormGated /
    Mamba2RMSNormGated do."""
    in_dtype = x.dtype
    h = x.to(torch.float32) if in_dtype != torch.float64 else x
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.to(h.dtype))
    size = x.shape[-1] if group_size is None else group_size
    hg = h.reshape(*h.shape[:-1], h.shape[-1] // size, size)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * hg.reshape(h.shape).to(in_dtype)
    if z is not None and norm_before_gate:
        out = (out * F.silu(z.to(h.dtype))).to(in_dtype)
    return out
