"""NPU argument mapping as pure functions, then the one-line torch_npu calls in npu.py run on the
CPU against an emulation of the documented torch_npu semantics (kernel_helpers.fake_torch_npu).

The emulation encodes our reading of the torch_npu docs; it checks that npu.py feeds the ops
consistently with that reading, not the Ascend kernels themselves."""

from __future__ import annotations

import sys

import pytest
import torch

from backends.kernels import npu, npu_args, reference
from backends.kernels.moe import moe_route
from kernel_helpers import fake_torch_npu


# ---------------------------------------------------------------- pure mappings


def test_cumulative_ends():
    assert npu_args.cumulative_ends([0, 3, 7, 12]) == [3, 7, 12]
    assert npu_args.cumulative_ends(torch.tensor([0, 5, 5, 9]).tolist()) == [5, 5, 9]
    assert all(isinstance(x, int) for x in npu_args.cumulative_ends(torch.tensor([0, 2], dtype=torch.int32).tolist()))
    for bad in ([3, 7], [0], [0, 5, 4]):
        with pytest.raises(ValueError):
            npu_args.cumulative_ends(bad)


def test_fusion_attention_causal_bsnd():
    kw, mask = npu_args.fusion_attention_kwargs(q_shape=(2, 128, 8, 64), causal=True)
    assert mask == "compressed_causal"
    assert kw == {"head_num": 8, "input_layout": "BSND", "scale": 0.125, "keep_prob": 1.0, "sparse_mode": 3,
                  "pre_tockens": 2147483647, "next_tockens": 0}


def test_fusion_attention_packed_window_dropout():
    kw, mask = npu_args.fusion_attention_kwargs(q_shape=(20, 4, 16), causal=True, window=5, scale=0.3, dropout=0.1,
                                                cu_seqlens=[0, 8, 20])
    assert mask == "compressed_causal"
    assert kw["input_layout"] == "TND" and kw["head_num"] == 4
    assert kw["actual_seq_qlen"] == [8, 20] and kw["actual_seq_kvlen"] == [8, 20]
    assert kw["sparse_mode"] == 4 and kw["pre_tockens"] == 4 and kw["next_tockens"] == 0
    assert kw["scale"] == 0.3 and kw["keep_prob"] == pytest.approx(0.9)


def test_fusion_attention_noncausal():
    kw, mask = npu_args.fusion_attention_kwargs(q_shape=(1, 10, 2, 4), causal=False)
    assert mask is None and kw["sparse_mode"] == 0
    kw, mask = npu_args.fusion_attention_kwargs(q_shape=(1, 10, 2, 4), causal=False, window=3)
    assert mask == "compressed_causal" and (kw["pre_tockens"], kw["next_tockens"]) == (2, 2)


def test_lse_from_stats_layouts():
    mx = torch.randn(2, 3, 5)
    sm = torch.rand(2, 3, 5) + 0.5
    rep = lambda t: t.unsqueeze(-1).expand(*t.shape, 8)  # noqa: E731
    torch.testing.assert_close(npu_args.lse_from_softmax_stats(rep(mx), rep(sm), "BSND"), mx + sm.log())
    t_mx, t_sm = mx[0].t(), sm[0].t()  # [T, N]
    torch.testing.assert_close(npu_args.lse_from_softmax_stats(rep(t_mx), rep(t_sm), "TND"), mx[0] + sm[0].log())


def test_grouped_matmul_kwargs():
    assert npu_args.grouped_matmul_kwargs("forward") == {"bias": None, "split_item": 2, "group_type": 0,
                                                         "group_list_type": 1}
    assert npu_args.grouped_matmul_kwargs("grad_input") == npu_args.grouped_matmul_kwargs("forward")
    assert npu_args.grouped_matmul_kwargs("grad_weight")["group_type"] == 2
    assert npu_args.grouped_matmul_kwargs("grad_weight")["split_item"] == 3


def test_rotary_shapes_and_modes():
    assert npu_args.rotary_4d_shape((7, 4, 64)) == (1, 7, 4, 64)
    assert npu_args.rotary_4d_shape((2, 7, 1, 64)) == (2, 7, 1, 64)
    assert npu_args.rotary_mode(False) == "half" and npu_args.rotary_mode(True) == "interleave"
    assert npu_args.rms_norm_kwargs(1e-5) == {"epsilon": 1e-5}


# ---------------------------------------------------------------- npu.py on the emulation


@pytest.fixture
def fake_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu())


def _grad_pair(fn_a, fn_b, *inputs):
    a_in = [x.clone().requires_grad_(True) for x in inputs]
    b_in = [x.clone().requires_grad_(True) for x in inputs]
    a, b = fn_a(*a_in), fn_b(*b_in)
    g = torch.randn_like(a)
    (a * g).sum().backward()
    (b * g).sum().backward()
    return a, b, [x.grad for x in a_in], [x.grad for x in b_in]


@pytest.mark.parametrize("causal,window", [(True, None), (True, 4), (False, None), (False, 3)])
def test_npu_attention_batched(fake_npu, causal, window):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 12, 4, 8, generator=g), torch.randn(2, 12, 2, 8, generator=g), torch.randn(2, 12, 2, 8,
                                                                                                         generator=g)
    out, lse = npu.attention(q, k, v, causal=causal, window=window, return_lse=True)
    want, want_lse = reference.attention(q, k, v, causal=causal, window=window, return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_npu_attention_packed(fake_npu, window):
    cu = torch.tensor([0, 5, 11, 18], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(18, h, 8, generator=g) for h in (4, 2, 2))
    out, lse = npu.attention(q, k, v, causal=True, cu_seqlens=cu, window=window, return_lse=True)
    want, want_lse = reference.attention(q, k, v, causal=True, cu_seqlens=cu, window=window, return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    a, b, ga, gb = _grad_pair(lambda *t: npu.attention(*t, causal=True, cu_seqlens=cu, window=window),
                              lambda *t: reference.attention(*t, causal=True, cu_seqlens=cu, window=window), q, k, v)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_npu_rotary(fake_npu, interleaved):
    from backends.kernels.rotary import rotary_cos_sin

    x = torch.randn(9, 3, 16)  # packed [T,H,D]
    cos, sin = rotary_cos_sin(torch.tensor([0, 1, 2, 0, 1, 2, 3, 0, 1]), 16)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    torch.testing.assert_close(npu.rotate(x, cos, sin, interleaved), reference.rotate(x, cos, sin, interleaved))


def test_npu_rms_norm_and_swiglu(fake_npu):
    x = torch.randn(4, 6, 32)
    w = torch.randn(32)
    torch.testing.assert_close(npu.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(npu.rms_norm(x, None, 1e-6), reference.rms_norm(x, None, 1e-6))
    gu = torch.randn(5, 20)
    torch.testing.assert_close(npu.swiglu(gu), reference.swiglu(gu))
    torch.testing.assert_close(npu.swiglu(gu[:, :10], gu[:, 10:]), reference.swiglu(gu))


def test_npu_moe_pipeline(fake_npu):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(10, 8, generator=g)
    weights, ids = moe_route(torch.randn(10, 4, generator=g), 2)
    w1 = torch.randn(4, 8, 6, generator=g)

    def run(impl):
        def f(h, w1):
            permuted, row_map, counts = impl.moe_permute(h, ids, 4)
            return impl.moe_unpermute(impl.grouped_mm(permuted, w1, counts), row_map, weights)

        return f

    perm_n, map_n, cnt_n = npu.moe_permute(h, ids, 4)
    perm_r, map_r, cnt_r = reference.moe_permute(h, ids, 4)
    torch.testing.assert_close(perm_n, perm_r)
    assert map_n.tolist() == map_r.tolist() and cnt_n.tolist() == cnt_r.tolist()
    a, b, ga, gb = _grad_pair(run(npu), run(reference), h, w1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
