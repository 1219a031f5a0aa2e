"""Linear-attention / SSM kernels: the chunked gated delta rule against a token-by-token oracle written
here (forward and gradients, fp64) and against transformers' torch paths; causal conv1d, Mamba2's SSD
scan and gated RMSNorm against transformers; packed documents against each document alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNormGated, mamba2_chunk_scan
from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextRMSNormGated, causal_conv1d_fn,
                                                                causal_conv1d_update, torch_chunk_gated_delta_rule,
                                                                torch_recurrent_gated_delta_rule)

import backends.kernels as K

F64 = torch.float64


def gdn_oracle(q, k, v, g, beta, h0, l2norm):
    """One sequence, token by token, from the recurrence: q, k [T,H,K], v [T,HV,V], g, beta [T,HV]."""
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    if l2norm:
        q, k = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt(), k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    q = q * q.shape[-1] ** -0.5
    s, outs = h0, []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        err = v[t] - torch.einsum("hkv,hk->hv", s, k[t])
        s = s + torch.einsum("hk,hv->hkv", k[t], err * beta[t][:, None])
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


def gdn_inputs(t, h=2, hv=4, dk=8, dv=4, n=1, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(q=r(1, t, h, dk), k=r(1, t, h, dk), v=r(1, t, hv, dv),
                g=-torch.rand(1, t, hv, generator=gen, dtype=dtype) * 0.5,
                beta=torch.rand(1, t, hv, generator=gen, dtype=dtype), initial_state=r(n, hv, dk, dv))


def _leaves(inputs):
    return {name: x.clone().requires_grad_(True) for name, x in inputs.items()}


@pytest.mark.parametrize("t", [1, 63, 130])
def test_gated_delta_rule_matches_recurrent_oracle_with_gradients(t):
    ins = gdn_inputs(t)
    ours, ref = _leaves(ins), _leaves(ins)
    o, s = K.chunk_gated_delta_rule(**ours, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ro, rs = gdn_oracle(ref["q"][0], ref["k"][0], ref["v"][0], ref["g"][0], ref["beta"][0], ref["initial_state"][0],
                        True)
    torch.testing.assert_close(o[0], ro, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s[0], rs, rtol=1e-9, atol=1e-9)
    gen = torch.Generator().manual_seed(1)
    w_o, w_s = torch.randn(ro.shape, generator=gen, dtype=F64), torch.randn(rs.shape, generator=gen, dtype=F64)
    ((o[0] * w_o).sum() + (s[0] * w_s).sum()).backward()
    ((ro * w_o).sum() + (rs * w_s).sum()).backward()
    for name in ins:
        torch.testing.assert_close(ours[name].grad, ref[name].grad, rtol=1e-8, atol=1e-9, msg=name)


def test_gated_delta_rule_packed_documents_equal_each_alone():
    lens = [70, 5, 64, 1, 129]
    ins = gdn_inputs(sum(lens), n=len(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    o, s = K.chunk_gated_delta_rule(**ins, output_final_state=True, cu_seqlens=cu)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = {k: v[:, a:b] for k, v in ins.items() if k != "initial_state"}
        ao, as_ = K.chunk_gated_delta_rule(**alone, initial_state=ins["initial_state"][i:i + 1],
                                           output_final_state=True)
        torch.testing.assert_close(o[:, a:b], ao, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s[i], as_[0], rtol=1e-10, atol=1e-10)
        ro, rs = gdn_oracle(*(alone[n][0] for n in ("q", "k", "v", "g", "beta")), ins["initial_state"][i], False)
        torch.testing.assert_close(ao[0], ro, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(as_[0], rs, rtol=1e-9, atol=1e-9)


def test_gated_delta_rule_matches_transformers_torch_paths():
    ins = {k: v.float() for k, v in gdn_inputs(150, n=2).items()}
    ins.update({n: torch.cat((ins[n], ins[n].flip(1))) for n in ("q", "k", "v", "g", "beta")})  # batch 2
    o, s = K.chunk_gated_delta_rule(**ins, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for fn in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        ro, rs = fn(*(ins[n] for n in ("q", "k", "v", "g", "beta")), initial_state=ins["initial_state"],
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- causal conv1d


def test_causal_conv1d_matches_transformers_and_packs():
    gen = torch.Generator().manual_seed(0)
    c, width, lens = 6, 4, [9, 2, 17]
    x = torch.randn(1, sum(lens), c, generator=gen)
    w, bias = torch.randn(c, width, generator=gen), torch.randn(c, generator=gen)
    state = torch.randn(len(lens), c, width - 1, generator=gen)
    y, _ = K.causal_conv1d(x, w, bias, activation="silu")
    torch.testing.assert_close(y, causal_conv1d_fn(x.transpose(1, 2), w, bias, activation="silu").transpose(1, 2))
    cu = torch.tensor([0, 9, 11, 28])
    y, final = K.causal_conv1d(x, w, bias, activation="silu", initial_state=state, output_final_state=True,
                               cu_seqlens=cu)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        # transformers' update step: conv state [C, K] of the last K inputs, rolled in place
        conv_state = torch.cat((torch.zeros(1, c, 1), state[i:i + 1]), -1)
        want = causal_conv1d_update(x[:, a:b].transpose(1, 2), conv_state, w, bias, activation="silu")
        torch.testing.assert_close(y[:, a:b], want.transpose(1, 2))
        torch.testing.assert_close(final[i], conv_state[0, :, 1:])  # the doc of 2 keeps one state column


# ---------------------------------------------------------------- Mamba2 SSD


def ssd_inputs(t, b=1, h=4, p=3, groups=2, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(b, t, h, p), dt=r(b, t, h), A=-torch.rand(h, generator=gen) - 0.1, B=r(b, t, groups, n),
                C=r(b, t, groups, n)), dict(D=r(h), dt_bias=r(h), dt_softplus=True, dt_limit=(0.0, 3.0))


def test_ssd_matches_transformers_chunk_and_recurrent_paths():
    ins, kw = ssd_inputs(96, b=2)  # rows of whole chunks: the layout is a view
    h0 = torch.randn(2, 4, 3, 5)
    y, final = K.ssd_chunk_scan(**ins, **kw, chunk_size=32, initial_states=h0, return_final_states=True)
    ry, rfinal = mamba2_chunk_scan(*ins.values(), 32, **kw, initial_states=h0, return_final_states=True)
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(final, rfinal)
    y256 = K.ssd_chunk_scan(**ins, **kw, chunk_size=256, initial_states=h0)  # computed in smaller blocks
    torch.testing.assert_close(y256, mamba2_chunk_scan(*ins.values(), 256, **kw, initial_states=h0))
    # token by token through transformers' single-step update (its decode path)
    state, outs = h0.clone(), []
    x, dt, B, C = ins["x"], ins["dt"], ins["B"], ins["C"]
    for t in range(x.shape[1]):
        outs.append(mamba2_selective_state_update(
            state, x[:, t], dt[:, t, :, None].expand(-1, -1, 3), ins["A"][:, None, None].expand(-1, 3, 5), B[:, t],
            C[:, t], kw["D"][:, None].expand(-1, 3), dt_bias=kw["dt_bias"][:, None].expand(-1, 3), dt_softplus=True))
    # the single-step update has no dt limit: compare the scan without one
    y_open = K.ssd_chunk_scan(**ins, **{**kw, "dt_limit": (0.0, float("inf"))}, chunk_size=32, initial_states=h0)
    torch.testing.assert_close(y_open, torch.stack(outs, 1), rtol=1e-4, atol=1e-4)


def test_ssd_packed_documents_equal_each_alone_with_gradients():
    lens = [40, 3, 33]
    ins, kw = ssd_inputs(sum(lens))
    h0 = torch.randn(3, 4, 3, 5)
    z = torch.randn_like(ins["x"])
    cu = torch.tensor([0, 40, 43, 76])
    leaves = {k: v.clone().requires_grad_(True) for k, v in ins.items()}
    y, final = K.ssd_chunk_scan(**leaves, **kw, z=z, chunk_size=16, initial_states=h0, return_final_states=True,
                                cu_seqlens=cu)
    y.sum().backward()
    grad_x = torch.zeros_like(ins["x"])
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = {k: (v if k == "A" else v[:, a:b].clone()).requires_grad_(k == "x") for k, v in ins.items()}
        ay, af = mamba2_chunk_scan(*alone.values(), 16, **kw, initial_states=h0[i:i + 1],
                                   return_final_states=True)
        ay = ay * F.silu(z[:, a:b])
        ay.sum().backward()
        grad_x[:, a:b] = alone["x"].grad
        torch.testing.assert_close(y[:, a:b], ay)
        torch.testing.assert_close(final[i], af[0])
    torch.testing.assert_close(leaves["x"].grad, grad_x)


# ---------------------------------------------------------------- gated RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_matches_qwen3_next_and_mamba2(dtype):
    gen = torch.Generator().manual_seed(0)
    x, z = torch.randn(3, 5, 16, generator=gen).to(dtype), torch.randn(3, 5, 16, generator=gen).to(dtype)
    qn = Qwen3NextRMSNormGated(16, eps=1e-6).to(dtype)
    mn = Mamba2RMSNormGated(16, group_size=4, eps=1e-5).to(dtype)
    with torch.no_grad():
        qn.weight.copy_(torch.randn(16, generator=gen))
        mn.weight.copy_(torch.randn(16, generator=gen))
    torch.testing.assert_close(K.rms_norm_gated(x, z, qn.weight, 1e-6), qn(x, z))
    torch.testing.assert_close(K.rms_norm_gated(x, z, mn.weight, 1e-5, group_size=4, norm_before_gate=False),
                               mn(x, z))


def test_linear_ops_refuse_bad_shapes_by_name():
    ins = gdn_inputs(8, n=2)
    with pytest.raises(ValueError, match=r"initial_state must be \(1, 4, 8, 4\)"):
        K.chunk_gated_delta_rule(**ins)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing from 0 to T=8"):
        K.chunk_gated_delta_rule(**{**ins, "initial_state": None}, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="packed inputs .* batch size 1"):
        K.causal_conv1d(torch.randn(2, 4, 3), torch.randn(3, 2), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="group_size 5 does not divide"):
        K.rms_norm_gated(torch.randn(2, 8), None, torch.ones(8), group_size=5)
