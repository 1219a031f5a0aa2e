"""Test-only helpers: a naive attention written from the formula, backend discovery, and a CPU
emulation of the torch_npu ops written from their documented semantics (so the NPU argument
mapping and the one-line calls in backends/kernels/npu.py run on the CPU)."""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F


def naive_attention(q, k, v, *, causal, window=None, scale=None, doc=None):
    """softmax(q k^T * scale + mask) v on [B,Sq,H,D] with repeated KV; returns (out, lse [B,H,Sq]).

    doc: optional [Sq] document ids (Sq == Skv) for block-diagonal masks.
    """
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    rep = h // hkv
    kk = k.repeat_interleave(rep, dim=2).double()
    vv = v.repeat_interleave(rep, dim=2).double()
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    keep = torch.ones(sq, skv, dtype=torch.bool)
    for i in range(sq):
        ipos = i + skv - sq
        for j in range(skv):
            if causal and j > ipos:
                keep[i, j] = False
            if window is not None and (j <= ipos - window or (not causal and j >= ipos + window)):
                keep[i, j] = False
            if doc is not None and doc[i] != doc[j]:
                keep[i, j] = False
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return out, lse


def devices_with_backend():
    """(backend, device) pairs for the accelerated backends present here."""
    pairs = []
    if torch.cuda.is_available():
        pairs.append(("cuda", "cuda"))
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            pairs.append(("npu", "npu"))
    except Exception:  # noqa: BLE001
        pass
    return pairs


# ----------------------------------------------------------------- fake torch_npu


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _fusion_one(q, k, v, scale, sparse_mode, pre, nxt, atten_mask):
    """q [S,N,D], k/v [Skv,Nk,D] -> out [S,N,D], max [N,S], sum [N,S] (documented semantics)."""
    sq, n, _ = q.shape
    skv = k.shape[0]
    rep = n // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qnd,knd->nqk", q.float(), kk.float()) * scale
    if atten_mask is not None:
        i = torch.arange(sq)[:, None]
        j = torch.arange(skv)[None, :]
        if sparse_mode == 0:
            drop = torch.zeros(sq, skv, dtype=torch.bool)
        elif sparse_mode == 2:  # left-up causal
            drop = j > i
        elif sparse_mode == 3:  # right-down causal
            drop = j > i + (skv - sq)
        elif sparse_mode == 4:  # band, origin bottom-right
            ipos = i + (skv - sq)
            drop = (j < ipos - pre) | (j > ipos + nxt)
        else:
            raise NotImplementedError(sparse_mode)
        s = s.masked_fill(drop, float("-inf"))
    mx = s.max(dim=-1).values
    ex = torch.exp(s - mx[..., None])
    sm = ex.sum(-1)
    out = torch.einsum("nqk,knd->qnd", ex / sm[..., None], vv.float()).to(q.dtype)
    return out, mx, sm


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False):
    assert keep_prob == 1.0
    if sparse_mode in (2, 3, 4):
        assert atten_mask is not None and tuple(atten_mask.shape) == (2048, 2048) and atten_mask.dtype == torch.bool
        assert bool(atten_mask[0, 1]) and not bool(atten_mask[1, 0])
    assert head_num == query.shape[-2]
    if input_layout == "BSND":
        res = [_fusion_one(query[b], key[b], value[b], scale, sparse_mode, pre_tockens, next_tockens, atten_mask)
               for b in range(query.shape[0])]
        out = torch.stack([r[0] for r in res])
        mx = torch.stack([r[1] for r in res])  # [B,N,S]
        sm = torch.stack([r[2] for r in res])
    elif input_layout == "TND":
        assert isinstance(actual_seq_qlen, list) and actual_seq_qlen[-1] == query.shape[0]
        assert actual_seq_qlen == actual_seq_kvlen
        starts = [0] + actual_seq_qlen[:-1]
        res = [_fusion_one(query[s:e], key[s:e], value[s:e], scale, sparse_mode, pre_tockens, next_tockens, atten_mask)
               for s, e in zip(starts, actual_seq_qlen)]
        out = torch.cat([r[0] for r in res])
        mx = torch.cat([r[1] for r in res], dim=-1).transpose(0, 1)  # [T,N]
        sm = torch.cat([r[2] for r in res], dim=-1).transpose(0, 1)
    else:
        raise NotImplementedError(input_layout)
    rep8 = lambda t: t.unsqueeze(-1).expand(*t.shape, 8)  # noqa: E731
    return out, rep8(mx), rep8(sm), None, 0, 0, 0


def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    assert x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4
    rot = _rotate_half(x) if rotary_mode == "half" else _rotate_pairs(x)
    return x * r1 + rot * r2


def npu_rms_norm(x, gamma, epsilon=1e-6):
    assert gamma.dtype == x.dtype
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_swiglu(x, dim=-1):
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    assert indices.dtype == torch.int32
    topk = indices.shape[1]
    first = torch.argsort(indices.reshape(-1).long(), stable=True)
    sorted_indices = torch.argsort(first)
    out = tokens.new_zeros(indices.numel(), tokens.shape[1])
    out = out.index_copy(0, sorted_indices, tokens.repeat_interleave(topk, dim=0))
    return out, sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    assert probs is not None and probs.dtype == permuted_tokens.dtype
    t, k = probs.shape
    rows = permuted_tokens[sorted_indices.long()].view(t, k, -1)
    return (rows * probs[..., None]).sum(1)


def npu_grouped_matmul(x, weight, *, bias=None, group_list=None, split_item=0, group_type=None, group_list_type=0,
                       **unused):
    assert len(x) == 1 and len(weight) == 1 and group_list_type == 1 and split_item in (2, 3)
    counts = [int(c) for c in group_list.tolist()]
    a, b = x[0], weight[0]
    if group_type == 0:  # split the M axis of a [M,K]; b [E,K,N]
        parts = [ae @ b[e] for e, ae in enumerate(torch.split(a, counts, dim=0))]
        return [torch.cat(parts)]
    if group_type == 2:  # split the shared K axis: a [M,K], b [K,N] -> [E,M,N]
        return [torch.stack([ae @ be for ae, be in zip(torch.split(a, counts, dim=1), torch.split(b, counts, dim=0))])]
    raise NotImplementedError(group_type)


def fake_torch_npu() -> types.ModuleType:
    mod = types.ModuleType("torch_npu")
    for fn in (npu_fusion_attention, npu_rotary_mul, npu_rms_norm, npu_swiglu, npu_moe_token_permute,
               npu_moe_token_unpermute, npu_grouped_matmul):
        setattr(mod, fn.__name__, fn)
    return mod
