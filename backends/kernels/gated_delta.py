"""Gated delta rule (Qwen3-Next's gated DeltaNet), chunked PyTorch: the reference implementation.

Per token t and head: S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,
o_t = S_t^T (q_t * scale). Within a chunk of C tokens the updates are condensed by the WY / UT
transform (one triangular solve per chunk, as transformers' torch_chunk_gated_delta_rule and
flash-linear-attention do); across chunks only the state [K, V] is carried, in one loop over the
chunks of all documents at once. Differences from transformers' path, for speed: one solve for
values and keys together, outputs computed after the loop in one batched product (the loop writes
nothing in place, so autograd keeps no full-size copies per chunk), and packed documents as rows.
"""

from __future__ import annotations

import torch

from . import varlen


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # flash-linear-attention's / transformers' l2norm: x / sqrt(sum(x^2) + eps)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _chunks(q, k, v, g, beta, state):
    """q, k [N,H,n,C,K] (q scaled), v [N,H,n,C,V], g, beta [N,H,n,C], state [N,H,K,V] fp32 ->
    (out [N,H,n,C,V], final state)."""
    c = q.shape[-2]
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    gc = g.cumsum(-1)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [.., i, j]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # solved as unit lower triangular: its diagonal is not read
    rhs = torch.cat((v * beta.unsqueeze(-1), k_beta * gc.exp().unsqueeze(-1)), dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        (v.shape[-1], k.shape[-1]), dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay
    k_out = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    chunk_decay = gc[..., -1].exp()[..., None, None]
    starts, news = [], []
    # unbind, not u[:, :, i]: each indexing's backward would write a full-size zero gradient (O(chunks^2))
    for u_i, w_i, k_i, d_i in zip(u.unbind(2), w.unbind(2), k_out.transpose(-1, -2).unbind(2), chunk_decay.unbind(2)):
        v_new = u_i - w_i @ state
        starts.append(state)
        news.append(v_new)
        state = state * d_i + k_i @ v_new
    starts, news = torch.stack(starts, 2), torch.stack(news, 2)
    out = (q * gc.exp().unsqueeze(-1)) @ starts + attn @ news
    return out, state


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64):
    b, t, h, dk = q.shape
    hv, dv = v.shape[-2:]
    in_dtype = q.dtype
    if hv != h:  # grouped values: each q/k head serves hv // h consecutive value heads
        q, k = q.repeat_interleave(hv // h, dim=2), k.repeat_interleave(hv // h, dim=2)
    work = torch.promote_types(in_dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    q, k, v, g, beta = (x.to(work) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk**-0.5 if scale is None else scale)
    lay = varlen.flat_layout(b, t, cu_seqlens, chunk_size, q.device)
    n, nc = lay.n, lay.padded_len // chunk_size

    def rows(x):  # [B,T,H,*] -> [N,H,n,C,*]
        r = varlen.to_rows(x.reshape(b * t, *x.shape[2:]), lay).reshape(n, nc, chunk_size, *x.shape[2:])
        return r.permute(0, 3, 1, 2, 4) if r.dim() == 5 else r.permute(0, 3, 1, 2)

    state = (torch.zeros(n, hv, dk, dv, device=q.device, dtype=work) if initial_state is None
             else initial_state.to(work))
    out, final = _chunks(rows(q), rows(k), rows(v), rows(g), rows(beta), state)
    out = varlen.from_rows(out.permute(0, 2, 3, 1, 4).reshape(n, lay.padded_len, hv, dv), lay)
    return out.reshape(b, t, hv, dv).to(in_dtype), (
        final if output_final_state else None)
