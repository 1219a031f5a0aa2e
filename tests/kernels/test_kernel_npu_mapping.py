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


# ---------------------------------------------------------------- linear attention / SSM


def test_gdn_flags_and_call_mapping():
    assert npu_args.gdn_kernel(False, False) is None  # MindSpeed's torch path: our reference
    assert npu_args.gdn_kernel(True, False) == "flash" and npu_args.gdn_kernel(False, True) == "triton"
    with pytest.raises(ValueError, match="cannot be True at the same time"):
        npu_args.gdn_kernel(True, True)
    rep, kw = npu_args.gated_delta_call(q_shape=(1, 20, 2, 16), v_shape=(1, 20, 6, 8), dtype="torch.bfloat16",
                                        scale=None, chunk_size=64, cu_seqlens=[0, 7, 20])
    assert rep == 3 and kw == {"scale": 0.25, "chunk_size": 64, "cu_seqlens": [0, 7, 20]}
    assert "float32" in npu_args.gated_delta_call(q_shape=(1, 4, 2, 16), v_shape=(1, 4, 2, 8), dtype="torch.float32",
                                                  scale=0.5, chunk_size=64, cu_seqlens=None)
    assert npu_args.rms_norm_gated_groups(16, 4) == (4, 4) and npu_args.rms_norm_gated_groups(16, None) == (1, 16)
    with pytest.raises(ValueError):
        npu_args.rms_norm_gated_groups(16, 5)
    from backends.kernels.varlen import doc_ids

    assert doc_ids(torch.tensor([0, 3, 3, 5])).tolist() == [[0, 0, 0, 2, 2]]


def test_npu_gated_delta_rule_calls_mindspeed_as_its_caller_does(monkeypatch):
    calls = []

    def mindspeed_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, head_first=False):
        # MindSpeed's wrapper checks: equal q/k/v heads after its caller's repeat, bf16, LongTensor cu_seqlens
        assert q.shape[2] == v.shape[2] and q.dtype == torch.bfloat16 and cu_seqlens.dtype == torch.long
        calls.append(cu_seqlens.tolist())
        return reference.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)

    monkeypatch.setattr(npu, "_gdn_function", lambda: mindspeed_gdn)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 20, 2, 8, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 20, 4, 4, generator=g).bfloat16()
    gate, beta = -torch.rand(1, 20, 4, generator=g), torch.rand(1, 20, 4, generator=g)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    kw = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu, output_final_state=True)
    out, state = npu.chunk_gated_delta_rule(q, k, v, gate, beta, **kw)
    want, want_state = reference.chunk_gated_delta_rule(q, k, v, gate, beta, **kw)
    assert calls == [[0, 7, 20]]
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(state, want_state)
    out32, _ = npu.chunk_gated_delta_rule(q.float(), k.float(), v.float(), gate, beta, **kw)  # fp32: reference
    assert len(calls) == 1 and out32.dtype == torch.float32


@pytest.mark.parametrize("group_size,before", [(None, True), (4, False)])
def test_npu_rms_norm_gated(fake_npu, group_size, before):
    g = torch.Generator().manual_seed(3)
    x, z, w = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g), torch.randn(16, generator=g)
    torch.testing.assert_close(npu.rms_norm_gated(x, z, w, 1e-5, group_size, before),
                               reference.rms_norm_gated(x, z, w, 1e-5, group_size, before))
