"""attention_backward (the backward of one attention block from a given log-sum-exp) and the tiled
lse forward: gradients against PyTorch's own autograd through scaled_dot_product_attention (per
document), the block decomposition the ring relies on, memory that never holds an [H, n, n] tensor,
and the CUDA / NPU argument mappings on CPU emulations of the documented kernels."""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import backends.kernels as K
from backends.kernels import cuda, npu, npu_args, reference, tiled_attention
from kernel_helpers import devices_with_backend, fake_torch_npu

RAGGED = [1, 37, 1100, 256, 5, 300, 1]  # length 1, not multiples of the 256 block, one document over four blocks


def _inputs(cu, h, hkv, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = cu[-1]
    q, k, v, dout = (torch.randn(t, n, d, generator=g).to(dtype) for n in (h, hkv, hkv, h))
    return q, k, v, dout


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _sdpa_truth(q, k, v, dout, cu, causal):
    """Per document: out, lse and dq/dk/dv by autograd through F.scaled_dot_product_attention (fp32)."""
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    qf, kf, vf = leaves
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for s, e in zip(cu[:-1], cu[1:]):
        if e == s:
            continue
        qd, kd, vd = (x[s:e].transpose(0, 1) for x in (qf, kf, vf))
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=True).transpose(0, 1))
        with torch.no_grad():  # the lse the forward would have saved, from the scores written out
            sc = (qd @ kd.repeat_interleave(g, 0).transpose(1, 2)) * q.shape[-1] ** -0.5
            if causal:
                sc = sc.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
            lses.append(torch.logsumexp(sc, -1))
    out = torch.cat(outs)
    (out * dout.float()).sum().backward()
    return out.detach(), torch.cat(lses, -1), [x.grad for x in leaves]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_sdpa_autograd_on_ragged_packed_documents(causal, h, hkv, dtype, tol):
    cu = _cu(RAGGED)
    q, k, v, dout = _inputs(cu, h, hkv, dtype=dtype)
    out, lse, want = _sdpa_truth(q, k, v, dout, cu, causal)
    got = K.attention_backward(q, k, v, out.to(dtype), dout, lse, causal=causal,
                               cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    for name, a, w in zip("qkv", got, want):
        assert a.dtype == torch.float32 and a.shape == w.shape, name
        torch.testing.assert_close(a, w, atol=tol, rtol=tol, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("block", [1, 7, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_small_blocks_and_empty_documents(block, causal):
    cu = _cu([1, 0, 9, 16, 33, 1, 0, 17])
    q, k, v, dout = _inputs(cu, 4, 2, d=8, seed=3)
    out, lse, want = _sdpa_truth(q, k, v, dout, cu, causal)
    got = reference.attention_backward(q, k, v, out, dout, lse, causal=causal,
                                       cu_seqlens=torch.tensor(cu, dtype=torch.int32), block=block)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=2e-5, rtol=2e-5)
    fwd_out, fwd_lse = tiled_attention.forward(q, k, v, cu, causal=causal, window=None, scale=8**-0.5, block=block)
    torch.testing.assert_close(fwd_out, out, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(fwd_lse, lse, atol=2e-6, rtol=2e-5)


def test_blocks_with_the_global_lse_add_up_to_the_whole():
    # The ring's use: queries and keys split in two halves; the four blocks' gradients, each from
    # the *global* out and lse, sum to the gradients of the whole (non-causal) attention.
    n, half = 64, 32
    q, k, v, dout = _inputs([0, n], 4, 2, seed=5)
    out, lse, want = _sdpa_truth(q, k, v, dout, [0, n], causal=False)
    dq, dk, dv = (torch.zeros(x.shape) for x in (q, k, v))
    cu = torch.tensor([0, half], dtype=torch.int32)
    for qs in (slice(0, half), slice(half, n)):
        for ks in (slice(0, half), slice(half, n)):
            gq, gk, gv = K.attention_backward(q[qs], k[ks], v[ks], out[qs], dout[qs], lse[:, qs], causal=False,
                                              cu_seqlens=cu)
            dq[qs] += gq
            dk[ks] += gk
            dv[ks] += gv
    for a, w in zip((dq, dk, dv), want):
        torch.testing.assert_close(a, w, atol=2e-5, rtol=2e-5)


def test_tile_size_follows_short_documents():
    assert tiled_attention.block_for([0, 4096]) == tiled_attention.BLOCK == 256
    assert tiled_attention.block_for(_cu([32] * 128)) == 64
    assert tiled_attention.block_for(_cu([100, 3, 1])) == 128
    assert tiled_attention.block_for([0, 1]) == 64 and tiled_attention.block_for(_cu([257, 5])) == 256


def test_many_short_documents_take_one_tile_pair_per_query_tile():
    cu = _cu([32] * 64)  # 2048 tokens, 8 documents in every 256-row tile
    tiles = tiled_attention.plan(cu, 256, causal=True, window=None)
    assert len(tiles) == 8 and all(len(pairs) == 1 for _, _, pairs in tiles)
    long_doc = tiled_attention.plan([0, 2048], 256, causal=True, window=None)
    assert sum(len(p) for _, _, p in long_doc) == 8 * 9 // 2  # causal: the lower triangle of tiles
    assert all(not needs for _, _, p in long_doc for k0, _, needs in p if k0 < p[-1][0])  # only diagonals masked


# ------------------------------------------------------------------ memory


class AllocationTracer(TorchDispatchMode):
    """Records every tensor storage produced inside the mode: the largest one and the peak of those alive.

    A storage counts from the op that produced it until the last Python tensor on it is collected;
    the storages of `ignore` (the inputs) are not counted.
    """

    def __init__(self, ignore=()):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in ignore}
        self.refs: dict[int, list[int]] = {}
        self.now = self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self.skip:
            return
        if ptr not in self.refs:
            self.refs[ptr] = [nbytes, 0]
            self.now += nbytes
            self.peak = max(self.peak, self.now)
            self.largest = max(self.largest, nbytes)
        self.refs[ptr][1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr):
        entry = self.refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.refs[ptr]
            self.now -= entry[0]


def test_tracer_sees_a_dense_score_matrix():
    # The instrument itself: an explicit [H, n, n] score matrix is seen at its size.
    q = torch.randn(4, 512, 16)
    with AllocationTracer(ignore=[q]) as tr:
        scores = q @ q.transpose(1, 2)
        del scores
    assert tr.largest == 4 * 512 * 512 * 4 and tr.peak >= tr.largest and tr.now == 0


N_LONG, H, HKV, D = 4096, 4, 2, 16
DENSE = H * N_LONG * N_LONG * 4  # one fp32 [H, n, n] matrix: 256 MiB


def test_backward_memory_does_not_grow_with_the_document_squared():
    q, k, v, dout = _inputs([0, N_LONG], H, HKV, d=D, seed=7)
    out = torch.randn(N_LONG, H, D)
    lse = torch.randn(H, N_LONG) + 5
    cu = torch.tensor([0, N_LONG], dtype=torch.int32)
    with AllocationTracer(ignore=[q, k, v, dout, out, lse, cu]) as tr:
        grads = K.attention_backward(q, k, v, out, dout, lse, causal=True, cu_seqlens=cu)
    assert all(torch.isfinite(g).all() for g in grads)
    tile = H * tiled_attention.BLOCK**2 * 4
    grads = (H + 2 * HKV) * N_LONG * D * 4
    # The fp32 gradients it returns plus a few H·block² tiles: far below one dense matrix.
    assert tr.largest <= max(tile, N_LONG * H * D * 4), (tr.largest, tile)
    assert tr.peak <= grads + 4 * tile < DENSE / 32, (tr.peak, grads, tile)


def test_lse_forward_memory_does_not_grow_with_the_document_squared():
    q, k, v, _ = _inputs([0, N_LONG], H, HKV, d=D, seed=8)
    cu = torch.tensor([0, N_LONG], dtype=torch.int32)
    with AllocationTracer(ignore=[q, k, v, cu]) as tr:
        out, lse = K.attention(q, k, v, causal=True, cu_seqlens=cu, return_lse=True)
    assert out.shape == q.shape and lse.shape == (H, N_LONG)
    tile = H * tiled_attention.BLOCK**2 * 4
    assert tr.peak <= out.numel() * 4 + lse.numel() * 4 + 4 * tile < DENSE / 32, (tr.peak, tile)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("bad", ["batched", "lse", "out", "cu", "heads"])
def test_argument_errors(bad):
    q, k, v, dout = _inputs([0, 8], 4, 2)
    out, lse = torch.zeros_like(dout), torch.zeros(4, 8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    args = dict(batched=(q[None], k[None], v[None], out[None], dout[None], lse), lse=(q, k, v, out, dout, lse.t()),
                out=(q, k, v, out[:4], dout, lse), cu=(q, k, v, out, dout, lse),
                heads=(q[:, :3], k, v, out[:, :3], dout[:, :3], lse[:3]))[bad]
    with pytest.raises(ValueError):
        K.attention_backward(*args, causal=True, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)
                             if bad == "cu" else cu)


# ------------------------------------------------------------------ NPU mapping and emulation


def test_npu_grad_kwargs():
    kw, mask = npu_args.fusion_attention_grad_kwargs(q_shape=(20, 4, 16), causal=True, scale=0.3,
                                                     cu_seqlens=[0, 8, 20])
    assert mask == "compressed_causal"
    assert kw == {"head_num": 4, "input_layout": "TND", "scale_value": 0.3, "keep_prob": 1.0, "sparse_mode": 3,
                  "pre_tockens": 2147483647, "next_tockens": 0, "actual_seq_qlen": [8, 20],
                  "actual_seq_kvlen": [8, 20]}
    kw, mask = npu_args.fusion_attention_grad_kwargs(q_shape=(6, 2, 8), causal=False)
    assert mask is None and kw["sparse_mode"] == 0 and kw["actual_seq_qlen"] == [6]
    assert kw["scale_value"] == pytest.approx(8**-0.5)


def test_npu_stats_from_lse_invert_lse_from_stats():
    lse = torch.randn(3, 7)  # [N, T]
    mx, sm = npu_args.softmax_stats_from_lse(lse, "TND")
    assert mx.shape == (7, 3, 8) and torch.equal(sm, torch.ones(7, 3, 8))
    torch.testing.assert_close(npu_args.lse_from_softmax_stats(mx, sm, "TND"), lse)
    with pytest.raises(ValueError):
        npu_args.softmax_stats_from_lse(lse, "SBH")


def _fake_fusion_attention_grad(query, key, value, dy, head_num, input_layout, pse=None, padding_mask=None,
                                atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
                                next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                                actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                                sync=False):
    """The documented semantics in TND: P = exp(scale·QKᵀ (masked) - max) / sum,
    dS = P∘(dP - rowsum(dy∘attention_in))."""
    assert input_layout == "TND" and keep_prob == 1.0 and head_num == query.shape[1]
    assert actual_seq_qlen == actual_seq_kvlen and actual_seq_qlen[-1] == query.shape[0]
    assert dy.dtype == attention_in.dtype == query.dtype and softmax_max.shape == (query.shape[0], head_num, 8)
    if sparse_mode == 3:
        assert atten_mask is not None and tuple(atten_mask.shape) == (2048, 2048) and bool(atten_mask[0, 1])
    else:
        assert sparse_mode == 0
    rep = head_num // key.shape[1]
    dq, dk, dv = torch.zeros(query.shape), torch.zeros(key.shape), torch.zeros(value.shape)
    for s, e in zip([0] + actual_seq_qlen[:-1], actual_seq_qlen):
        qd, dyd, od = (x[s:e].float().transpose(0, 1) for x in (query, dy, attention_in))
        kd, vd = (x[s:e].float().repeat_interleave(rep, 1).transpose(0, 1) for x in (key, value))
        sc = qd @ kd.transpose(1, 2) * scale_value
        if sparse_mode == 3:
            sc = sc.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        mx, sm = (x[s:e, :, 0].t()[..., None] for x in (softmax_max, softmax_sum))
        p = torch.exp(sc - mx) / sm
        ds = p * (dyd @ vd.transpose(1, 2) - (dyd * od).sum(-1, keepdim=True))
        dq[s:e] = (ds @ kd * scale_value).transpose(0, 1)
        dk[s:e] = (ds.transpose(1, 2) @ qd * scale_value).transpose(0, 1).reshape(e - s, -1, rep, qd.shape[-1]).sum(2)
        dv[s:e] = (p.transpose(1, 2) @ dyd).transpose(0, 1).reshape(e - s, -1, rep, vd.shape[-1]).sum(2)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None


@pytest.mark.parametrize("causal", [True, False])
def test_npu_attention_backward_on_emulation(monkeypatch, causal):
    fake = fake_torch_npu()
    fake.npu_fusion_attention_grad = _fake_fusion_attention_grad
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    cu = _cu([5, 1, 12])
    q, k, v, dout = _inputs(cu, 4, 2, d=8, seed=9)
    out, lse, want = _sdpa_truth(q, k, v, dout, cu, causal)
    got = npu.attention_backward(q, k, v, out, dout, lse, causal=causal, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    for a, w in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, w, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------ CUDA mapping and emulation


def _fake_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                         is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    """aten._flash_attention_backward's varlen contract, as torch.nn.attention.varlen uses it."""
    assert query.dim() == 3 and logsumexp.shape == (query.shape[1], query.shape[0])
    assert logsumexp.dtype == torch.float32 and out.dtype == grad_out.dtype == query.dtype
    assert cum_seq_q.dtype == torch.int32 and torch.equal(cum_seq_q, cum_seq_k) and int(cum_seq_q[-1]) == query.shape[0]
    assert max_q == max_k == int(cum_seq_q.diff().max()) and dropout_p == 0.0
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,) and unused.numel() == 0
    grads = reference.attention_backward(query, key, value, out, grad_out, logsumexp, causal=is_causal,
                                         cu_seqlens=cum_seq_q, scale=scale)
    return tuple(g.to(query.dtype) for g in grads)


def test_cuda_attention_backward_mapping_on_emulation(monkeypatch):
    monkeypatch.setattr(cuda, "_flash_backward_ok", lambda q, v: True)
    monkeypatch.setattr(cuda, "_aten_flash_backward", lambda: _fake_flash_backward)
    cu = _cu([7, 1, 20])
    q, k, v, dout = _inputs(cu, 4, 2, d=8, dtype=torch.bfloat16, seed=11)
    out, lse, want = _sdpa_truth(q, k, v, dout, cu, causal=True)
    got = cuda.attention_backward(q, k, v, out, dout, lse, causal=True, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    for a, w in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, w, atol=3e-2, rtol=3e-2)


ACCEL = devices_with_backend()


@pytest.mark.skipif(not ACCEL, reason="no CUDA or NPU device on this machine")
@pytest.mark.parametrize("backend,device", ACCEL or [("none", "cpu")])
@pytest.mark.parametrize("causal", [True, False])
def test_accelerated_backward_matches_reference(backend, device, causal):
    cu = _cu([37, 100, 1, 300])
    q, k, v, dout = _inputs(cu, 8, 2, d=64, dtype=torch.bfloat16, seed=13)
    out, lse, _ = _sdpa_truth(q, k, v, dout, cu, causal)
    want = reference.attention_backward(q, k, v, out.to(q.dtype), dout, lse, causal=causal,
                                        cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    K.configure(overrides={"attention_backward": backend})
    try:
        got = K.attention_backward(*(x.to(device) for x in (q, k, v, out.to(q.dtype), dout, lse)), causal=causal,
                                   cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device))
    finally:
        K.configure()
    for a, w in zip(got, want):
        torch.testing.assert_close(a.cpu(), w, atol=5e-2, rtol=5e-2)
