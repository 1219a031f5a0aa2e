"""attention: the reference against a naive softmax(QK^T)V written here, then every available
accelerated implementation against the reference (forward and backward)."""

from __future__ import annotations

import pytest
import torch

import backends.kernels as K
from backends.kernels import reference
from kernel_helpers import devices_with_backend, naive_attention

CASES = [
    # (name, B, Sq, Skv, H, Hkv, causal, window)
    ("causal", 2, 24, 24, 4, 4, True, None),
    ("full", 2, 17, 17, 4, 4, False, None),
    ("gqa", 2, 20, 20, 8, 2, True, None),
    ("mqa", 1, 16, 16, 4, 1, True, None),
    ("window", 2, 32, 32, 4, 2, True, 7),
    ("window_noncausal", 1, 20, 20, 2, 2, False, 5),
    ("kv_longer_causal", 2, 8, 20, 4, 2, True, None),
]


def _qkv(b, sq, skv, h, hkv, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(b, skv, hkv, d, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(b, skv, hkv, d, generator=g, dtype=torch.float32).to(dtype)
    return q, k, v


def _grads(fn, *tensors, seed=1):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    (out.float() * g.float()).sum().backward()
    return out.detach(), [t.grad for t in tensors]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_naive(case):
    _, b, sq, skv, h, hkv, causal, window = case
    q, k, v = _qkv(b, sq, skv, h, hkv)
    out = reference.attention(q, k, v, causal=causal, window=window)
    want, want_lse = naive_attention(q, k, v, causal=causal, window=window)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    out2, lse = reference.attention(q, k, v, causal=causal, window=window, return_lse=True)
    torch.testing.assert_close(out2.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_backward_matches_naive(case):
    _, b, sq, skv, h, hkv, causal, window = case
    q, k, v = _qkv(b, sq, skv, h, hkv)
    _, got = _grads(lambda *t: K.attention(*t, causal=causal, window=window), q, k, v)
    _, want = _grads(lambda *t: naive_attention(*t, causal=causal, window=window)[0], q, k, v)
    for a, w in zip(got, want):
        torch.testing.assert_close(a.double(), w.double(), atol=1e-5, rtol=1e-5)


def test_custom_scale():
    q, k, v = _qkv(1, 10, 10, 2, 2)
    out = K.attention(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, causal=True, scale=0.3)[0], atol=1e-5, rtol=1e-5)


PACKED = [
    ("causal", [0, 5, 12, 12, 20, 31], True, None, 4, 2),
    ("window", [0, 9, 16, 30], True, 4, 4, 4),
    ("noncausal", [0, 3, 11, 18], False, None, 4, 1),
]


def _packed_inputs(cu, h, hkv, d=16, dtype=torch.float32):
    q, k, v = _qkv(1, cu[-1], cu[-1], h, hkv, d, dtype)
    return q[0], k[0], v[0], torch.tensor(cu, dtype=torch.int32)


def _doc_of(cu):
    return torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())


@pytest.mark.parametrize("case", PACKED, ids=[c[0] for c in PACKED])
def test_packed_reference_matches_naive_block_diagonal(case):
    _, cu, causal, window, h, hkv = case
    q, k, v, cu_t = _packed_inputs(cu, h, hkv)
    out, lse = K.attention(q, k, v, causal=causal, window=window, cu_seqlens=cu_t, return_lse=True)
    want, want_lse = naive_attention(q[None], k[None], v[None], causal=causal, window=window, doc=_doc_of(cu))
    torch.testing.assert_close(out.double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse[0], atol=1e-5, rtol=1e-5)
    assert lse.shape == (h, cu[-1])
    plain = K.attention(q, k, v, causal=causal, window=window, cu_seqlens=cu_t)
    torch.testing.assert_close(plain.double(), want[0], atol=1e-5, rtol=1e-5)


def test_packed_documents_do_not_attend_across_boundaries():
    cu = [0, 6, 14]
    q, k, v, cu_t = _packed_inputs(cu, 2, 2)
    out = K.attention(q, k, v, causal=True, cu_seqlens=cu_t)
    k2, v2 = k.clone(), v.clone()
    k2[:6] += 5.0  # change document 0 only
    v2[:6] -= 3.0
    out2 = K.attention(q, k2, v2, causal=True, cu_seqlens=cu_t)
    torch.testing.assert_close(out[6:], out2[6:])
    assert not torch.allclose(out[:6], out2[:6])
    # ... and each document equals running it alone
    alone = K.attention(q[None, 6:], k[None, 6:], v[None, 6:], causal=True)[0]
    torch.testing.assert_close(out[6:], alone, atol=1e-6, rtol=1e-6)


def test_packed_backward_matches_naive():
    cu = [0, 7, 15, 22]
    q, k, v, cu_t = _packed_inputs(cu, 4, 2)
    doc = _doc_of(cu)
    _, got = _grads(lambda *t: K.attention(*t, causal=True, window=5, cu_seqlens=cu_t), q, k, v)
    _, want = _grads(lambda *t: naive_attention(*(x[None] for x in t), causal=True, window=5, doc=doc)[0][0], q, k, v)
    for a, w in zip(got, want):
        torch.testing.assert_close(a.double(), w.double(), atol=1e-5, rtol=1e-5)


def test_lse_path_backward_matches_sdpa_path():
    q, k, v = _qkv(2, 16, 16, 4, 2)
    _, a = _grads(lambda *t: K.attention(*t, causal=True, return_lse=True), q, k, v)
    _, b = _grads(lambda *t: K.attention(*t, causal=True), q, k, v)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_close_to_fp32(dtype, tol):
    q, k, v = _qkv(1, 16, 16, 4, 2, dtype=dtype)
    out = K.attention(q, k, v, causal=True, window=6)
    assert out.dtype == dtype
    want = naive_attention(q, k, v, causal=True, window=6)[0]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    q2, k2, v2, cu = _packed_inputs([0, 5, 16], 4, 2, dtype=dtype)
    out_p, lse = K.attention(q2, k2, v2, causal=True, cu_seqlens=cu, return_lse=True)
    assert out_p.dtype == dtype and lse.dtype == torch.float32


@pytest.mark.parametrize("bad", ["shape", "heads", "cu"])
def test_argument_errors(bad):
    q, k, v = _qkv(1, 8, 8, 4, 2)
    with pytest.raises(ValueError):
        if bad == "shape":
            K.attention(q[0], k[0], v[0], causal=True)
        elif bad == "heads":
            K.attention(q, k[:, :, :1].expand(1, 8, 3, 16), v[:, :, :1].expand(1, 8, 3, 16), causal=True)
        else:
            K.attention(q[0], k[0], v[0], causal=True, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))


# ------------------------------------------------------------- accelerated implementations

ACCEL = devices_with_backend()
accel = pytest.mark.skipif(not ACCEL, reason="no CUDA or NPU device on this machine")


@accel
@pytest.mark.parametrize("backend,device", ACCEL or [("none", "cpu")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES + [("long", 2, 300, 300, 8, 2, True, 64)], ids=[c[0] for c in CASES] + ["long"])
def test_accelerated_matches_reference(backend, device, dtype, case):
    _, b, sq, skv, h, hkv, causal, window = case
    q, k, v = (t.to(device) for t in _qkv(b, sq, skv, h, hkv, d=64, dtype=dtype))
    K.configure(overrides={"attention": backend})
    try:
        out, g = _grads(lambda *t: K.attention(*t, causal=causal, window=window), q, k, v)
        out_l, lse = K.attention(q, k, v, causal=causal, window=window, return_lse=True)
    finally:
        K.configure()
    ref_out, ref_g = _grads(lambda *t: reference.attention(*t, causal=causal, window=window), q.cpu().float(),
                            k.cpu().float(), v.cpu().float())
    _, ref_lse = reference.attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), causal=causal, window=window,
                                     return_lse=True)
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.cpu().float(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(out_l.cpu().float(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu().float(), ref_lse, atol=tol, rtol=tol)
    for a, w in zip(g, ref_g):
        torch.testing.assert_close(a.cpu().float(), w, atol=5 * tol, rtol=5 * tol)


@accel
@pytest.mark.parametrize("backend,device", ACCEL or [("none", "cpu")])
@pytest.mark.parametrize("window", [None, 16])
def test_accelerated_packed_matches_reference(backend, device, window):
    cu = [0, 37, 100, 101, 256]
    q, k, v, cu_t = _packed_inputs(cu, 8, 2, d=64, dtype=torch.bfloat16)
    dev = [t.to(device) for t in (q, k, v)]
    K.configure(overrides={"attention": backend})
    try:
        out, g = _grads(lambda *t: K.attention(*t, causal=True, window=window, cu_seqlens=cu_t.to(device)), *dev)
        _, lse = K.attention(*dev, causal=True, window=window, cu_seqlens=cu_t.to(device), return_lse=True)
    finally:
        K.configure()
    ref, ref_g = _grads(lambda *t: reference.attention(*t, causal=True, window=window, cu_seqlens=cu_t),
                        q.float(), k.float(), v.float())
    _, ref_lse = reference.attention(q.float(), k.float(), v.float(), causal=True, window=window, cu_seqlens=cu_t,
                                     return_lse=True)
    torch.testing.assert_close(out.cpu().float(), ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.cpu().float(), ref_lse, atol=3e-2, rtol=3e-2)
    for a, w in zip(g, ref_g):
        torch.testing.assert_close(a.cpu().float(), w, atol=1e-1, rtol=1e-1)


def test_flash_window_mapping():
    from backends.kernels.cuda import flash_window

    assert flash_window(None, True) == (-1, -1)
    assert flash_window(5, True) == (4, 0)  # itself + 4 before = a window of 5
    assert flash_window(5, False) == (4, 4)
