"""rotary tables and rotation against transformers' own implementations (Llama incl. llama3
scaling, GLM interleaved partial rotary, Qwen2-VL M-RoPE)."""

from __future__ import annotations

import pytest
import torch

import backends.kernels as K

transformers = pytest.importorskip("transformers")
from transformers.models.glm import modeling_glm  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl  # noqa: E402


def _llama_rope(head_dim=32, theta=10000.0, rope=None, max_pos=4096):
    params = {"rope_type": "default", "rope_theta": theta}
    params.update(rope or {})
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                                   max_position_embeddings=max_pos, rope_parameters=params)
    return modeling_llama.LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "linear", "factor": 4.0}], ids=["default", "llama3", "linear"])
def test_tables_match_llama_rotary_embedding(rope):
    theta = 500000.0 if rope and rope["rope_type"] == "llama3" else 10000.0
    hf = _llama_rope(32, theta, rope)
    pos = torch.tensor([[0, 1, 2, 3, 100, 1000, 3000], [5, 6, 7, 0, 1, 2, 3]])
    x = torch.zeros(1, dtype=torch.float32)
    want_cos, want_sin = hf(x, pos)
    cos, sin = K.rotary_cos_sin(pos, 32, theta=theta, scaling=rope)
    torch.testing.assert_close(cos, want_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, want_sin, atol=1e-6, rtol=1e-6)


def test_packed_reset_positions_give_per_document_tables():
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1])
    cos, sin = K.rotary_cos_sin(pos, 16)
    doc2_cos, _ = K.rotary_cos_sin(torch.arange(3), 16)
    torch.testing.assert_close(cos[4:7], doc2_cos)
    torch.testing.assert_close(cos[0], cos[4])


def test_apply_rotary_matches_hf_full():
    torch.manual_seed(0)
    b, s, h, hk, d = 2, 9, 4, 2, 32
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, hk, d)
    pos = torch.arange(s)[None].expand(b, -1) + torch.tensor([[0], [3]])
    cos, sin = _llama_rope(d)(q, pos)
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(K.apply_rotary(q, cos, sin), want_q.transpose(1, 2))
    torch.testing.assert_close(K.apply_rotary(k, cos, sin), want_k.transpose(1, 2))
    # HF layout [B,H,S,D] with cos already broadcastable
    torch.testing.assert_close(K.apply_rotary(q.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)), want_q)
    # packed [T,H,D] with per-token tables
    torch.testing.assert_close(K.apply_rotary(q.reshape(b * s, h, d), cos.reshape(b * s, d), sin.reshape(b * s, d)),
                               want_q.transpose(1, 2).reshape(b * s, h, d))


def test_partial_rotary_half_split():
    torch.manual_seed(1)
    q = torch.randn(2, 7, 3, 32)
    rd = 16
    cos, sin = K.rotary_cos_sin(torch.arange(7)[None].expand(2, -1), rd)
    want_rot, _ = modeling_llama.apply_rotary_pos_emb(q[..., :rd], q[..., :rd], cos, sin, unsqueeze_dim=2)
    got = K.apply_rotary(q, cos, sin, rotary_dim=rd)
    torch.testing.assert_close(got[..., :rd], want_rot)
    torch.testing.assert_close(got[..., rd:], q[..., rd:])


def test_interleaved_partial_rotary_matches_glm():
    torch.manual_seed(2)
    q, k = torch.randn(2, 4, 6, 64), torch.randn(2, 2, 6, 64)  # HF layout [B,H,S,D]
    rd = 32  # GLM: partial_rotary_factor 0.5
    cos, sin = K.rotary_cos_sin(torch.arange(6)[None].expand(2, -1), rd)
    want_q, want_k = modeling_glm.apply_rotary_pos_emb(q, k, cos, sin)
    got_q = K.apply_rotary(q, cos.unsqueeze(1), sin.unsqueeze(1), interleaved=True)
    got_k = K.apply_rotary(k.transpose(1, 2), cos, sin, interleaved=True).transpose(1, 2)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def test_mrope_matches_qwen2_vl_rotary_embedding():
    cfg = transformers.Qwen2VLTextConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [16, 8, 8]})
    hf = modeling_qwen2_vl.Qwen2VLRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 50, (3, 2, 11), generator=g)  # distinct t/h/w positions
    want_cos, want_sin = hf(torch.zeros(1), pos)
    cos, sin = K.mrope_cos_sin(pos, 64, theta=10000.0, mrope_section=[16, 8, 8])
    torch.testing.assert_close(cos, want_cos)
    torch.testing.assert_close(sin, want_sin)
    # text-only positions (t = h = w) reduce M-RoPE to plain RoPE
    text = torch.arange(11)[None, None].expand(3, 2, -1)
    torch.testing.assert_close(K.mrope_cos_sin(text, 64, mrope_section=[16, 8, 8])[0], K.rotary_cos_sin(text[0], 64)[0])


def test_mrope_matches_legacy_apply_multimodal_formula():
    # transformers < 5 applied M-RoPE inside attention: sections doubled over the duplicated table.
    g = torch.Generator().manual_seed(3)
    pos = torch.randint(0, 30, (3, 1, 5), generator=g)
    section = [4, 6, 6]
    inv = K.rotary_inv_freq(32)
    freqs = pos[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)  # [3,B,S,32]
    legacy = torch.cat([m[i % 3] for i, m in enumerate(emb.cos().split(section * 2, dim=-1))], dim=-1)
    torch.testing.assert_close(K.mrope_cos_sin(pos, 32, mrope_section=section)[0], legacy)


def test_rotary_backward_matches_hf():
    torch.manual_seed(4)
    q = torch.randn(1, 5, 2, 16, requires_grad=True)
    q2 = q.detach().clone().requires_grad_(True)
    cos, sin = K.rotary_cos_sin(torch.arange(5)[None], 16)
    K.apply_rotary(q, cos, sin).pow(2).sum().backward()
    modeling_llama.apply_rotary_pos_emb(q2, q2, cos, sin, unsqueeze_dim=2)[0].pow(2).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)


@pytest.mark.parametrize("layout", ["bshd", "bhsd_view", "partial"])
def test_rotary_per_half_matches_autograd_formula(layout):
    """The per-half rotation and its written-out backward against x*cos + rotate_half(x)*sin under
    autograd: the HF [B,H,S,D] transposed view, partial rotary, fp32 tables on bf16 activations."""
    torch.manual_seed(6)
    b, s, h, d = 2, 7, 3, 16
    cos, sin = K.rotary_cos_sin(torch.arange(s)[None].expand(b, -1), 8 if layout == "partial" else d)
    base = torch.randn(b, h, s, d) if layout == "bhsd_view" else torch.randn(b, s, h, d)
    for dtype in (torch.float32, torch.bfloat16):
        x = base.to(dtype).detach().clone().requires_grad_(True)
        xr = x.transpose(1, 2) if layout == "bhsd_view" else x
        got = K.apply_rotary(xr, cos, sin)
        x2 = base.to(dtype).detach().clone().requires_grad_(True)
        xr2 = x2.transpose(1, 2) if layout == "bhsd_view" else x2
        rd = cos.shape[-1]
        c, sn = cos.unsqueeze(-2), sin.unsqueeze(-2)
        rot = (xr2[..., :rd] * c + modeling_llama.rotate_half(xr2[..., :rd]) * sn).to(dtype)
        want = torch.cat((rot, xr2[..., rd:]), -1)
        tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # fp32: the update may fuse (FMA)
        torch.testing.assert_close(got, want, **tol)
        g = torch.randn(got.shape).to(dtype)
        got.backward(g)
        want.backward(g)
        assert x.grad.dtype == dtype
        torch.testing.assert_close(x.grad, x2.grad, **tol)


def test_rotary_tables_with_grad_get_gradients():
    x = torch.randn(1, 4, 2, 8)
    cos, sin = K.rotary_cos_sin(torch.arange(4)[None], 8)
    cos, sin = cos.clone().requires_grad_(True), sin.clone().requires_grad_(True)
    K.apply_rotary(x, cos, sin).sum().backward()
    assert cos.grad is not None and sin.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_low_precision(dtype):
    torch.manual_seed(5)
    q = torch.randn(2, 6, 2, 32)
    cos, sin = K.rotary_cos_sin(torch.arange(6)[None], 32)
    got = K.apply_rotary(q.to(dtype), cos.to(dtype), sin.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), K.apply_rotary(q, cos, sin), atol=3e-2, rtol=3e-2)


def test_rotary_errors():
    q = torch.randn(1, 4, 2, 16)
    cos, sin = K.rotary_cos_sin(torch.arange(4)[None], 16)
    with pytest.raises(ValueError):
        K.apply_rotary(q, cos, sin, rotary_dim=8)
    with pytest.raises(ValueError):
        K.mrope_cos_sin(torch.zeros(3, 4, dtype=torch.long), 16, mrope_section=[2, 2, 2])
    with pytest.raises(NotImplementedError, match="not supported"):
        K.rotary_cos_sin(torch.arange(4), 16, scaling={"rope_type": "dynamic", "factor": 2.0})
    # yarn is supported (tested against transformers in tests/llm), but needs its original length
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        K.rotary_cos_sin(torch.arange(4), 16, scaling={"rope_type": "yarn", "factor": 2.0})
