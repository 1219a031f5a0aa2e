"""Packed attention on the reference backend as length-bucketed padded batches (kernels/buckets.py):
the same numbers as one SDPA call per document (outputs and gradients, fp32), padding never seen,
far fewer SDPA calls than documents; the bucket plan itself; the CUDA varlen argument mapping."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import backends.kernels as K
from backends.kernels import buckets, cuda, reference


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _inputs(lengths, h, hkv, d=16, seed=0):
    t = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, d, generator=g), torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g),
            torch.tensor(_cu(lengths), dtype=torch.int32))


def per_document(q, k, v, cu, **kw):
    """The definition: each document alone through the batched reference (one SDPA call each)."""
    bounds = cu.tolist()
    outs = [reference.attention(q[None, a:b], k[None, a:b], v[None, a:b], **kw)[0]
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(outs)


def _out_and_grads(fn, q, k, v):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    return out.detach(), [x.grad for x in leaves]


# Lengths from 1 to 40 with empty documents: several buckets, most documents padded inside theirs.
RAGGED = [1, 40, 7, 0, 13, 2, 33, 9, 9, 21, 0, 5, 38, 17, 3, 26, 11, 4, 30, 6]
CASES = [
    # (name, causal, window, H, Hkv, scale)
    ("causal_gqa", True, None, 8, 2, None),
    ("causal_window_mqa", True, 5, 4, 1, 0.3),
    ("full_gqa", False, None, 4, 2, None),
    ("full_window", False, 3, 4, 4, 0.2),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bucketed_equals_per_document(case):
    _, causal, window, h, hkv, scale = case
    q, k, v, cu = _inputs(RAGGED, h, hkv)
    p = buckets.plan(tuple(cu.diff().tolist()), "cpu")
    assert 1 < len(p.tops) < len(RAGGED) and p.rows > p.total == cu[-1]  # several buckets, real padding inside them
    kw = dict(causal=causal, window=window, scale=scale)
    got, got_g = _out_and_grads(lambda *t: K.attention(*t, cu_seqlens=cu, **kw), q, k, v)
    want, want_g = _out_and_grads(lambda *t: per_document(*t, cu, **kw), q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)


def test_padding_rows_past_the_window_stay_finite():
    # Non-causal window 2 on a 3-token document padded to 12: padding rows 5.. see no real key at all.
    lengths = [3, 12]
    q, k, v, cu = _inputs(lengths, 2, 2)
    assert buckets.plan((3, 12), "cpu").tops == (12,)
    got, got_g = _out_and_grads(lambda *t: K.attention(*t, causal=False, window=2, cu_seqlens=cu), q, k, v)
    want, want_g = _out_and_grads(lambda *t: per_document(*t, cu, causal=False, window=2), q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)
    # The explicit path (return_lse with dropout) would turn such rows into NaN itself.
    kw = dict(causal=False, window=2, scale=None, dropout=0.0)
    got, got_g = _out_and_grads(lambda *t: reference._bucketed(reference.explicit_attention, *t, cu, **kw)[0], q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)


def test_lse_with_dropout_goes_through_buckets():
    # return_lse with dropout keeps the explicit path (bucketed too); lse is taken before dropout.
    q, k, v, cu = _inputs(RAGGED, 4, 2)
    _, tiled_lse = K.attention(q, k, v, causal=True, cu_seqlens=cu, return_lse=True)
    torch.manual_seed(0)
    out, lse = K.attention(q, k, v, causal=True, cu_seqlens=cu, return_lse=True, dropout=0.5)
    torch.testing.assert_close(lse, tiled_lse)
    assert lse.shape == (4, int(cu[-1])) and torch.isfinite(out).all()
    assert not torch.allclose(out, per_document(q, k, v, cu, causal=True))  # dropout did act
    ref, ref_lse = reference._bucketed(reference.explicit_attention, q, k, v, cu, causal=False, window=None, scale=None,
                                       dropout=0.0)
    torch.testing.assert_close(ref, per_document(q, k, v, cu, causal=False))
    torch.testing.assert_close(ref_lse, K.attention(q, k, v, causal=False, cu_seqlens=cu, return_lse=True)[1])


def test_packed_call_runs_a_few_sdpa_calls_not_one_per_document(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    lengths = torch.randint(16, 49, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    q, k, v, cu = _inputs(lengths, 4, 2)
    out = K.attention(q, k, v, causal=True, cu_seqlens=cu)
    assert out.shape == q.shape
    assert 1 <= len(calls) <= 8, calls  # 256 documents
    assert sum(s[0] for s in calls) == 256  # every document in exactly one batch row
    assert "length-bucketed padded batches" in K.describe("cpu")["attention"]
    assert "per document" not in reference.impl_name("attention")


class _Ops(TorchDispatchMode):
    """Names of the aten ops run, forward and backward."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _sdpa_masks(monkeypatch):
    masks = []
    real = F.scaled_dot_product_attention

    def logging(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", logging)
    return masks


@pytest.mark.parametrize("causal", [False, True])
def test_equal_documents_are_one_view_without_gathers(causal, monkeypatch):
    # A vision tower's equal windows (and an empty document): one bucket that is the packed tensor
    # itself, so no token is gathered or scattered and the non-causal call needs no key mask.
    lengths = [16, 16, 0, 16, 16]
    q, k, v, cu = _inputs(lengths, 4, 2)
    p = buckets.plan(tuple(lengths), "cpu")
    assert p.whole and p.tops == (16,) and p.sizes == (4,)
    masks = _sdpa_masks(monkeypatch)
    with _Ops() as ops:
        got, got_g = _out_and_grads(lambda *t: K.attention(*t, causal=causal, cu_seqlens=cu), q, k, v)
    assert not {"index_select", "index_copy_", "index_copy", "index_fill_"} & ops.names, ops.names
    assert masks == [None]
    want, want_g = _out_and_grads(lambda *t: per_document(*t, cu, causal=causal), q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)


def test_unpadded_bucket_takes_no_key_mask(monkeypatch):
    # Non-causal, two buckets: the one of equal 64-token documents has no padding and so no mask; the
    # padded one of 3- and 5-token documents keeps its key mask.
    lengths = [64, 64] + [3, 5] * 20 + [64, 64]
    q, k, v, cu = _inputs(lengths, 2, 2)
    p = buckets.plan(tuple(lengths), "cpu")
    assert p.tops == (5, 64) and not p.whole and p.padded(0) and not p.padded(1)
    masks = _sdpa_masks(monkeypatch)
    got = K.attention(q, k, v, causal=False, cu_seqlens=cu)
    assert [m is None for m in masks] == [False, True]
    torch.testing.assert_close(got, per_document(q, k, v, cu, causal=False))


# ---------------------------------------------------------------- the plan


def _model_cost(lengths, tops):
    cost = 0
    for lo, top in zip([0] + list(tops[:-1]), tops):
        n = sum(1 for x in lengths if lo < x <= top)
        cost += buckets.CALL_COST + n * top * (top + buckets.ROW_COST)
    return cost


@pytest.mark.parametrize("lengths", [RAGGED, [16, 48] * 100, list(range(1, 700, 3)), [5] * 9, [0, 0, 7]])
def test_plan_covers_every_token_once_and_beats_both_extremes(lengths):
    p = buckets.plan(tuple(lengths), "cpu")
    real = [x for x in lengths if x]
    assert sum(p.sizes) == len(real) and max(p.tops) == max(real)
    t = sum(lengths)
    src, dst = torch.cat(p.src), torch.cat(p.dst)
    kept = dst < t
    assert sorted(dst[kept].tolist()) == list(range(t))  # every token's output comes from exactly one row
    assert torch.equal(src[kept], dst[kept])  # ... the row that read that token
    assert (dst[~kept] == t).all() and sum(x.numel() for x in p.pad) == p.rows - t
    for pad, d in zip(p.pad, p.dst):
        assert (d[pad] == t).all()
    assert sorted(torch.cat(p.key_lengths).tolist()) == sorted(real)
    tops = list(p.tops)
    assert _model_cost(real, tops) <= _model_cost(real, [max(real)])  # one padded batch
    assert _model_cost(real, tops) <= _model_cost(real, sorted(set(real)))  # one bucket per distinct length
    assert buckets.plan(tuple(lengths), "cpu") is p  # cached: every layer of a step reuses it


def test_plan_of_no_documents():
    q = torch.zeros(0, 2, 4)
    assert K.attention(q, q, q, causal=True, cu_seqlens=torch.tensor([0, 0], dtype=torch.int32)).shape == (0, 2, 4)


# ---------------------------------------------------------------- CUDA varlen mapping


def test_flash_varlen_args():
    cu_q, cu_k, max_q, max_k = cuda.flash_varlen_args(torch.tensor([0, 5, 5, 12, 13]), "cpu")
    assert cu_q.dtype == torch.int32 and cu_q.tolist() == [0, 5, 5, 12, 13] and cu_k is cu_q
    assert (max_q, max_k) == (7, 7) and isinstance(max_q, int)
    assert cuda.flash_varlen_args(torch.tensor([0]), "cpu")[2] == 0


def test_cuda_packed_call_feeds_flash_attn_varlen(monkeypatch):
    seen = {}

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal, window_size,
               return_attn_probs):
        seen.update(cu=cu_q.tolist(), dtype=cu_q.dtype, max=(max_q, max_k), window=window_size)
        return reference.attention(q.float(), k.float(), v.float(), causal=causal, cu_seqlens=cu_q,
                                   window=None if window_size[0] < 0 else window_size[0] + 1).to(q.dtype)

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_func, fake.flash_attn_varlen_func = None, varlen
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(cuda, "flash_attn_available", lambda: True)
    q, k, v, cu = _inputs([6, 0, 11, 3], 4, 2, d=8)
    out = cuda.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, cu_seqlens=cu, window=4)
    assert seen == {"cu": [0, 6, 6, 17, 20], "dtype": torch.int32, "max": (11, 11), "window": (3, 0)}
    torch.testing.assert_close(out.float(), per_document(q, k, v, cu, causal=True, window=4), atol=3e-2, rtol=3e-2)
